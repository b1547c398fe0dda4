"""Incremental detokenization on the SmolLM2 tokenizer: deltas concatenate to the full decode, no broken UTF-8."""

import pytest

from jaxserve.tokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    from jaxserve.loader.gguf import default_model_path, read_gguf
    from jaxserve.tokenizer import Tokenizer

    _, _, gt = read_gguf(default_model_path())
    return Tokenizer.from_gguf(gt)


@pytest.mark.parametrize("text", ["héllo 世界 🎉 naïve", "plain ascii, with 123 digits", "emoji🎉🎉 and ß∑"])
def test_deltas_reassemble_text(tok, text):
    prompt = tok.encode("Say:")
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, prompt)
    deltas = [d.add(t) for t in ids]
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in x for x in deltas)
