"""HF-named numpy tensors -> the model's `Weights` pytree (stacked layers, [in, out] linears, chosen dtype).

Both loaders (HF safetensors and GGUF) produce HF names, so this is the one place that knows the mapping and
checks every shape against the config.
"""

from __future__ import annotations

import numpy as np

from jaxserve import quant
from jaxserve.config import ModelConfig
from jaxserve.model.llama import LayerWeights, Weights


def layer_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name suffix (after `model.layers.{i}.`) -> shape, for every per-layer tensor this config needs."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = {
        "input_layernorm.weight": (D,),
        "self_attn.q_proj.weight": (N * H, D),
        "self_attn.k_proj.weight": (K * H, D),
        "self_attn.v_proj.weight": (K * H, D),
        "self_attn.o_proj.weight": (D, N * H),
        "post_attention_layernorm.weight": (D,),
        "mlp.gate_proj.weight": (F, D),
        "mlp.up_proj.weight": (F, D),
        "mlp.down_proj.weight": (D, F),
    }
    if cfg.attention_bias:
        shapes |= {"self_attn.q_proj.bias": (N * H,), "self_attn.k_proj.bias": (K * H,),
                   "self_attn.v_proj.bias": (K * H,)}
    if cfg.qk_norm:
        shapes |= {"self_attn.q_norm.weight": (H,), "self_attn.k_norm.weight": (H,)}
    return shapes


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Full HF tensor name -> shape for every tensor a checkpoint of this config must hold."""
    D, V = cfg.hidden_size, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg.num_layers):
        shapes |= {f"model.layers.{i}.{k}": v for k, v in layer_tensor_shapes(cfg).items()}
    return shapes


def _take(tensors: dict[str, np.ndarray], name: str, shape: tuple[int, ...], source: str) -> np.ndarray:
    if name not in tensors:
        raise ValueError(f"{source}: missing tensor {name}")
    t = tensors[name]
    if tuple(t.shape) != shape:
        raise ValueError(f"{source}: tensor {name} has shape {tuple(t.shape)}, expected {shape} from the model config")
    return t


def to_weights(cfg: ModelConfig, tensors: dict, dtype, source: str = "checkpoint", quantization: str = "none"
               ) -> Weights:
    """Build host (numpy) `Weights` in `dtype`, linear maps stored as `quantization` (`jaxserve.quant`). Linear
    weights are transposed from HF's [out, in] to [in, out]. `tensors` holds numpy arrays, and under "gguf" the
    GGUF loader's `quant.BlockQuantized` for quantized tensors (kept exactly; float ones follow `dtype`)."""
    shapes = layer_tensor_shapes(cfg)

    def stacked(key: str, transpose: bool):
        per_layer = [
            _take(tensors, f"model.layers.{i}.{key}", shapes[key], source) for i in range(cfg.num_layers)
        ]
        blocks = [isinstance(t, quant.BlockQuantized) for t in per_layer]
        if all(blocks):
            return quant.stack_linears(per_layer)
        if any(blocks):  # e.g. a file with some layers' tensors left in F16: dequantize the few to float
            per_layer = [t.dequantize() if b else t for t, b in zip(per_layer, blocks)]
        arr = np.stack([t.T if transpose else t for t in per_layer]).astype(dtype)
        if transpose and quantization not in ("none", "gguf"):
            return quant.quantize_linear(arr, quantization)
        return arr

    layers = LayerWeights(
        attn_norm=stacked("input_layernorm.weight", False),
        wq=stacked("self_attn.q_proj.weight", True),
        wk=stacked("self_attn.k_proj.weight", True),
        wv=stacked("self_attn.v_proj.weight", True),
        wo=stacked("self_attn.o_proj.weight", True),
        mlp_norm=stacked("post_attention_layernorm.weight", False),
        w_gate=stacked("mlp.gate_proj.weight", True),
        w_up=stacked("mlp.up_proj.weight", True),
        w_down=stacked("mlp.down_proj.weight", True),
    )
    if cfg.attention_bias:
        layers.bq = stacked("self_attn.q_proj.bias", False)
        layers.bk = stacked("self_attn.k_proj.bias", False)
        layers.bv = stacked("self_attn.v_proj.bias", False)
    if cfg.qk_norm:
        layers.q_norm = stacked("self_attn.q_norm.weight", False)
        layers.k_norm = stacked("self_attn.k_norm.weight", False)

    D, V = cfg.hidden_size, cfg.vocab_size
    embed_t = _take(tensors, "model.embed_tokens.weight", (V, D), source)
    embed = _float(embed_t).astype(dtype)  # token lookup reads a few rows per step: kept in the model dtype
    # tied checkpoints may omit lm_head.weight (HF ignores it when tied); the logits projection is then embed.T,
    # stored as its own quantized copy when the scheme quantizes (None: read from `embed`)
    head_t = embed_t if cfg.tie_word_embeddings else _take(tensors, "lm_head.weight", (V, D), source)
    lm_head = None
    if isinstance(head_t, quant.BlockQuantized):
        lm_head = head_t.linear()
    elif quantization not in ("none", "gguf"):
        # 4-bit schemes keep the logits projection at int8, as llama.cpp's 4-bit files do (a 4-bit one cost SmolLM2
        # +5% perplexity against +0.24% for its Q4_1 file, whose output layer is Q8_0: docs/benchmarks/weight_quant.md)
        head_scheme = "int8" if quantization in quant.INT4_GROUPS else quantization
        lm_head = quant.quantize_linear(_float(head_t).T.astype(dtype), head_scheme)
    elif not cfg.tie_word_embeddings:
        lm_head = head_t.T.astype(dtype)
    return Weights(
        embed=embed,
        layers=layers,
        final_norm=_take(tensors, "model.norm.weight", (D,), source).astype(dtype),
        lm_head=lm_head,
    )


def _float(t) -> np.ndarray:
    return t.dequantize() if isinstance(t, quant.BlockQuantized) else t

