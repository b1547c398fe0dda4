"""HF-named tensors -> the model's `Weights` pytree (stacked layers, [in, out] linears, chosen dtype).

Both loaders (HF safetensors and GGUF) produce HF names, read on access (`loader.tensors`), so this is the one place
that knows the mapping, checks every shape against the config, and streams the checkpoint into its stored form.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import numpy as np

from jaxserve import quant
from jaxserve.config import ModelConfig
from jaxserve.loader.tensors import LazyTensors, TensorEntry
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


def stack_layers(per_layer: Iterable, count: int):
    """`count` per-layer arrays (or pytrees of them, e.g. QuantizedLinears of one form) -> one with a leading layer
    axis. Filled layer by layer into arrays allocated at the first, so the per-layer pieces (read and converted one
    at a time by the caller's iterator) are never all held at once."""
    out = treedef = None
    for i, tree in enumerate(per_layer):
        leaves, treedef = jax.tree.flatten(tree)
        if out is None:
            out = [np.empty((count, *a.shape), a.dtype) for a in leaves]
        for o, a in zip(out, leaves):
            o[i] = a
    return jax.tree.unflatten(treedef, out)


def _entry(tensors: LazyTensors, name: str, shape: tuple[int, ...], source: str) -> TensorEntry:
    if name not in tensors:
        raise ValueError(f"{source}: missing tensor {name}")
    e = tensors.entry(name)
    if e.shape != shape:
        raise ValueError(f"{source}: tensor {name} has shape {e.shape}, expected {shape} from the model config")
    return e


def _read(tensors: LazyTensors, name: str, shape: tuple[int, ...], source: str):
    """The tensor `name`, read now, after its shape is checked."""
    return _entry(tensors, name, shape, source).read()


def to_weights(cfg: ModelConfig, tensors: Mapping, dtype, source: str = "checkpoint", quantization: str = "none"
               ) -> Weights:
    """Build host (numpy) `Weights` in `dtype`, linear maps stored as `quantization` (`jaxserve.quant`). Linear
    weights are transposed from HF's [out, in] to [in, out]. `tensors`: a `LazyTensors` (what the loaders return)
    or in-memory arrays; under "gguf" quantized tensors are `quant.BlockQuantized` (kept exactly; float ones follow
    `dtype`).

    Tensors are read one at a time and converted straight to their stored form, into stacked arrays allocated once:
    the host peak is about the weights as stored plus one tensor in float32, never the whole model in float32
    (the largest float32 temporary is one layer's tensor, or the embedding)."""
    tensors = LazyTensors.of(tensors)
    shapes = layer_tensor_shapes(cfg)
    quantize = quantization not in ("none", "gguf")

    def stacked(key: str, transpose: bool):
        names = [f"model.layers.{i}.{key}" for i in range(cfg.num_layers)]
        forms = [_entry(tensors, n, shapes[key], source).block for n in names]
        if all(forms):  # every layer's GGUF blocks kept: repacked in the form that holds them all
            form = quant.BlockForm.common(forms)
            return stack_layers((tensors[n].linear(form) for n in names), len(names))

        def as_stored(name: str):  # (a file with some layers' tensors left in F16 dequantizes its few blocks)
            w = _float(tensors[name])
            w = (w.T if transpose else w).astype(dtype)
            return quant.quantize_linear(w, quantization) if transpose and quantize else w

        return stack_layers((as_stored(n) for n in names), len(names))

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
    embed_t = _read(tensors, "model.embed_tokens.weight", (V, D), source)
    embed = _float(embed_t).astype(dtype, copy=False)  # token lookup reads a few rows per step: kept in the model dtype
    # tied checkpoints may omit lm_head.weight (HF ignores it when tied); the logits projection is then embed.T,
    # stored as its own quantized copy when the scheme quantizes (None: read from `embed`)
    if cfg.tie_word_embeddings:
        head_t = embed_t
    else:
        del embed_t
        head_t = _read(tensors, "lm_head.weight", (V, D), source)
    lm_head = None
    if isinstance(head_t, quant.BlockQuantized):
        lm_head = head_t.linear()
    elif quantize:
        # 4-bit schemes keep the logits projection at int8, as llama.cpp's 4-bit files do (a 4-bit one cost SmolLM2
        # +5% perplexity against +0.24% for its Q4_1 file, whose output layer is Q8_0: docs/benchmarks/weight_quant.md)
        head_scheme = "int8" if quantization in quant.INT4_GROUPS else quantization
        lm_head = quant.quantize_linear(_float(head_t).T.astype(dtype, copy=False), head_scheme)
    elif not cfg.tie_word_embeddings:
        lm_head = head_t.T.astype(dtype)
    del head_t
    final_norm = _read(tensors, "model.norm.weight", (D,), source).astype(dtype)
    return Weights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def _float(t) -> np.ndarray:
    return t.dequantize() if isinstance(t, quant.BlockQuantized) else t
