"""The EAGLE-3 head jaxserve ships for its default model (jaxserve/spec_decode/heads/): `{"method": "eagle3"}` without
a `model` finds it, it serves losslessly, and serving the card's held-out chat prompts again gives the acceptance the
card records, within noise (another CPU's kernels may round differently and flip a few greedy choices)."""

import json
import os

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.spec_decode.heads import HEADS, HERE, shipped_head
from training.eagle3.ship import chat_prompts, served_acceptance

DEFAULT = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def card():
    head = shipped_head(None)
    assert head == os.path.join(HERE, HEADS[DEFAULT]), "no head shipped for the default model"
    with open(os.path.join(head, "card.json")) as f:
        return json.load(f)


def test_the_default_model_drafts_with_its_shipped_head_at_the_recorded_acceptance(card):
    s = card["served"]
    assert card["target"] == DEFAULT and card["dtype"] == "bfloat16"
    with open(os.path.join(shipped_head(None), "config.json")) as f:
        assert json.load(f)["speculators_config"]["verifier"]["name_or_path"] == DEFAULT  # a hub id, not a path
    llm = LLM(max_num_seqs=s["max_num_seqs"], quantization=s["quantization"], precompile=False, speculative_config={
        "method": "eagle3", "num_speculative_tokens": s["num_speculative_tokens"], "adaptive": False})
    assert llm.llm_engine.config.speculative_config.model == shipped_head(None)
    prompts = chat_prompts(llm.get_tokenizer(), s["num_prompts"])
    got, replies = served_acceptance(llm, prompts, s["max_tokens"])
    assert got["num_draft_tokens"] == pytest.approx(s["num_draft_tokens"], rel=0.05)
    assert got["acceptance_rate_per_position"] == pytest.approx(s["acceptance_rate_per_position"], abs=0.03)
    assert got["mean_acceptance_length"] == pytest.approx(s["mean_acceptance_length"], abs=0.08)

    plain = LLM(max_num_seqs=s["max_num_seqs"], quantization=s["quantization"], precompile=False)
    want = plain.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0, max_tokens=s["max_tokens"]), use_tqdm=False)
    assert replies == [list(o.outputs[0].token_ids) for o in want]  # lossless
