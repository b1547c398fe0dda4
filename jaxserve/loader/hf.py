"""HF model directories: `config.json` -> ModelConfig, `*.safetensors` (single or sharded with an index) -> numpy
tensors, each read from its file when asked for (`loader.tensors.LazyTensors`).

Only safetensors are read: no pickles, no remote code. Tensor names stay HF's (`model.layers.0.mlp.up_proj.weight`).
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

from jaxserve.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from jaxserve.loader.tensors import LazyTensors, TensorEntry, read_file_array

_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def _architecture(cfg: dict, path: str) -> str:
    classes = cfg.get("architectures") or []
    for c in classes:
        if c in _ARCH_BY_CLASS:
            return _ARCH_BY_CLASS[c]
    model_type = cfg.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES and not classes:
        return model_type
    got = ", ".join(classes) or model_type or "nothing"
    raise ValueError(
        f"{path}: unsupported architecture {got}; jaxserve supports {', '.join(sorted(_ARCH_BY_CLASS))}"
    )


def _rope(cfg: dict) -> tuple[float, RopeScaling | None]:
    # transformers v5 writes `rope_parameters`; older files use `rope_theta` + `rope_scaling`
    # (key `type` or `rope_type`).
    params = cfg.get("rope_parameters") or dict(cfg.get("rope_scaling") or {},
                                                rope_theta=cfg.get("rope_theta", 10000.0))
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in ("llama3", "linear"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: default, llama3, linear")
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def config_from_hf(cfg: dict, path: str = "config.json") -> ModelConfig:
    arch = _architecture(cfg, path)
    if arch == "mistral" and cfg.get("sliding_window") not in (None, 0) and cfg["sliding_window"] < cfg.get(
        "max_position_embeddings", 0
    ):
        raise ValueError(
            f"{path}: sliding-window attention (sliding_window={cfg['sliding_window']}) is not supported yet"
        )
    theta, scaling = _rope(cfg)
    num_heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


_SAFETENSORS_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def safetensors_entries(fp: str) -> dict[str, TensorEntry]:
    """The tensors of a .safetensors file, from its header; each entry reads its tensor when called (bfloat16 via
    ml_dtypes, which numpy alone cannot name)."""
    import ml_dtypes

    dtypes = dict(_SAFETENSORS_DTYPES, BF16=ml_dtypes.bfloat16)
    with open(fp, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{fp}: not a safetensors file ({e})") from e
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in dtypes:
            raise ValueError(f"{fp}: tensor {name} has unsupported dtype {info['dtype']}")
        dtype, shape = np.dtype(dtypes[info["dtype"]]), tuple(info["shape"])
        start, end = info["data_offsets"]
        if end - start != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ValueError(f"{fp}: tensor {name} holds {end - start} bytes, not {shape} of {dtype.name}")
        entries[name] = TensorEntry(shape, functools.partial(read_file_array, fp, 8 + header_len + start, dtype, shape))
    return entries


def read_safetensors(fp: str) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file, read now (for small files, e.g. an EAGLE-3 head)."""
    return {name: e.read() for name, e in safetensors_entries(fp).items()}


def read_hf_config(path: str) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json; expected an HF model directory or a .gguf file")
    with open(cfg_path) as f:
        return config_from_hf(json.load(f), cfg_path)


def read_hf_dir(path: str) -> tuple[ModelConfig, LazyTensors]:
    """(config, the tensors of every *.safetensors file, read on access)."""
    config = read_hf_config(path)

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        pickles = [n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth"))]
        hint = (f" (found {', '.join(pickles)}: pickled weights are not loaded; convert them to safetensors)"
                if pickles else "")
        raise FileNotFoundError(f"{path}: no *.safetensors weights{hint}")
    entries: dict[str, TensorEntry] = {}
    for name in files:
        fp = os.path.join(path, name)
        if not os.path.isfile(fp):
            raise FileNotFoundError(f"{fp}: listed in the safetensors index but missing")
        entries.update(safetensors_entries(fp))
    return config, LazyTensors(entries)
