"""Reference SmolLM2 model and tokenizer: HF transformers' own conversion of the bundled GGUF (offline).

Importing this module is cheap; torch/transformers load on first call. Callers should
`pytest.importorskip("transformers")` (and "torch", "accelerate") first.
"""

from __future__ import annotations

import functools
import os

from jaxserve.loader.gguf import default_model_path


def _split_path() -> tuple[str, str]:
    path = default_model_path()
    return os.path.dirname(path), os.path.basename(path)


@functools.lru_cache(maxsize=1)
def hf_smollm2_model():
    """`transformers` LlamaForCausalLM (float32, eval mode) dequantized from the SmolLM2 Q4_1 GGUF."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    directory, fname = _split_path()
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=fname, dtype=torch.float32)
    return model.eval()


@functools.lru_cache(maxsize=1)
def hf_smollm2_tokenizer():
    """`transformers` fast tokenizer converted from the SmolLM2 GGUF's metadata."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    directory, fname = _split_path()
    return AutoTokenizer.from_pretrained(directory, gguf_file=fname)
