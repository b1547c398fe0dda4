"""Llama-family forward pass (Llama 2/3.x, Mistral, Qwen2, Qwen3) over a paged KV cache, as a pure function.

The variants differ only in data the config carries: GQA/MQA head counts, an explicit head_dim, RoPE scaling,
tied embeddings, q/k/v biases (Qwen2) and per-head q/k RMSNorm (Qwen3).
Layers are stacked on a leading axis and run with `lax.scan`, or, given per-layer weights (`unstack_layers`, the
CPU default), unrolled; either way the KV cache rides in the carry so that each layer's write is an in-place
scatter into the donated buffer. Unrolled f32 weights can also be packed for the native CPU matmul
(`pack_linear_weights`, the CPU default); every linear map goes through `layers.linear`, which takes either form.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import attention, ops, sharding
from jaxserve.batch import StepInputs
from jaxserve.config import ModelConfig
from jaxserve.kv_cache import KVCache, write_kv
from jaxserve.model.layers import apply_rope, gated_mlp, linear, linears, rms_norm, rope_inv_freq, rope_tables
from jaxserve.quant import QuantizedLinear


@jax.tree_util.register_dataclass
@dataclass
class LayerWeights:
    """One array per parameter, stacked over layers (leading axis L). Linear weights are [in, out], stored in the
    model dtype, as bfloat16, or as a `quant.QuantizedLinear` (the engine's `quantization` scheme).

    Per-layer copies (`unstack_layers`) drop the L axis; `pack_linear_weights` then replaces the seven linear
    weights with `PackedLinear`s."""

    attn_norm: jax.Array  # f[L, D]
    wq: jax.Array  # f[L, D, N*H]
    wk: jax.Array  # f[L, D, K*H]
    wv: jax.Array  # f[L, D, K*H]
    wo: jax.Array  # f[L, N*H, D]
    mlp_norm: jax.Array  # f[L, D]
    w_gate: jax.Array  # f[L, D, F]
    w_up: jax.Array  # f[L, D, F]
    w_down: jax.Array  # f[L, F, D]
    bq: Optional[jax.Array] = None  # f[L, N*H]   (Qwen2)
    bk: Optional[jax.Array] = None  # f[L, K*H]
    bv: Optional[jax.Array] = None  # f[L, K*H]
    q_norm: Optional[jax.Array] = None  # f[L, H]  (Qwen3)
    k_norm: Optional[jax.Array] = None  # f[L, H]


@jax.tree_util.register_dataclass
@dataclass
class Weights:
    """A whole model, or one pipeline stage's part of it (`stage_weights`): the first stage has no input hidden
    state and looks tokens up in `embed`; only the last has `final_norm` and the logits projection."""

    embed: Optional[jax.Array]  # f[V, D]; None on stages after the first (unless the last needs it, tied)
    layers: LayerWeights
    final_norm: Optional[jax.Array]  # f[D]; None on stages before the last
    # f[D, V]; None when tied to `embed` and stored as it (a PackedLinear once packed, or a quantized copy of
    # embed.T under a quantization scheme, tied or not)
    lm_head: Optional[jax.Array] = None


# Logical axes of every weight, declared once here (`jaxserve.sharding` maps them onto a mesh): one layer's arrays;
# stacked layers add "layers" in front.
LAYER_AXES = dict(
    attn_norm=("embed",), wq=("embed", "heads"), wk=("embed", "kv_heads"), wv=("embed", "kv_heads"),
    wo=("heads", "embed"), mlp_norm=("embed",), w_gate=("embed", "mlp"), w_up=("embed", "mlp"),
    w_down=("mlp", "embed"), bq=("heads",), bk=("kv_heads",), bv=("kv_heads",), q_norm=("head_dim",),
    k_norm=("head_dim",),
)
WEIGHT_AXES = dict(embed=("vocab", "embed"), final_norm=("embed",), lm_head=("embed", "vocab"))


def weight_axes(weights: Weights) -> Weights:
    """A tree shaped like `weights` (stacked or unstacked layers, unpacked) whose leaves are logical-axes tuples. A
    `QuantizedLinear`'s arrays take its weight's axes; per-channel scales (one group) are never split."""
    def axes_of(w, axes):
        if not isinstance(w, QuantizedLinear):
            return axes
        per_channel = w.scales.shape[-2] == 1
        scale_axes = axes[:-2] + (None, axes[-1]) if per_channel else axes
        return dataclasses.replace(w, q=axes, scales=scale_axes, zeros=None if w.zeros is None else scale_axes)

    def layer(lw: LayerWeights, stacked: bool) -> LayerWeights:
        return LayerWeights(**{
            f.name: None if getattr(lw, f.name) is None
            else axes_of(getattr(lw, f.name), (("layers",) if stacked else ()) + LAYER_AXES[f.name])
            for f in dataclasses.fields(LayerWeights)
        })

    layers = (tuple(layer(lw, False) for lw in weights.layers) if isinstance(weights.layers, tuple)
              else layer(weights.layers, True))
    return Weights(
        embed=None if weights.embed is None else WEIGHT_AXES["embed"], layers=layers,
        final_norm=None if weights.final_norm is None else WEIGHT_AXES["final_norm"],
        lm_head=None if weights.lm_head is None else axes_of(weights.lm_head, WEIGHT_AXES["lm_head"]),
    )


def stage_layer_bounds(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges [start, end) of `num_stages` pipeline stages, as even as the count allows (earlier
    stages take the remainder: the last stage also runs the logits and the sampler)."""
    if num_stages > num_layers:
        raise ValueError(f"mesh.pp={num_stages} exceeds the model's {num_layers} layers (a stage needs one)")
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (s < extra) for s in range(num_stages)]
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [(a, a + n) for a, n in zip(starts, sizes)]


def stage_weights(weights: Weights, start: int, end: int, first: bool, last: bool) -> Weights:
    """Stacked host weights -> the part one pipeline stage holds: layers [start, end), the embedding if it is the
    first stage (or the last, with tied embeddings), the final norm and logits projection if it is the last."""
    tied = weights.lm_head is None
    return Weights(
        embed=weights.embed if first or (last and tied) else None,
        layers=jax.tree.map(lambda a: a[start:end], weights.layers),
        final_norm=weights.final_norm if last else None,
        lm_head=weights.lm_head if last else None,
    )


def repeat_kv_heads(cfg: ModelConfig, weights: Weights, r: int) -> tuple[ModelConfig, Weights]:
    """The same model with every KV head stored `r` times (K -> K * r, consecutive copies), so tensor parallelism
    over K * r shards gives each shard whole heads; query head i still reads a copy of KV head i // (N / K).
    Host-side, on stacked unpacked weights, before placement."""
    if r == 1:
        return cfg, weights
    K, H = cfg.num_kv_heads, cfg.head_dim

    def repeat(a):  # [..., K * H] -> [..., K * r * H]; a QuantizedLinear's arrays all end in the output axis
        if a is None:
            return None
        if isinstance(a, QuantizedLinear):
            return jax.tree.map(repeat, a)
        a = np.asarray(a)
        return np.repeat(a.reshape(*a.shape[:-1], K, H), r, axis=-2).reshape(*a.shape[:-1], K * r * H)

    lw = weights.layers
    layers = dataclasses.replace(lw, wk=repeat(lw.wk), wv=repeat(lw.wv), bk=repeat(lw.bk), bv=repeat(lw.bv))
    return dataclasses.replace(cfg, num_kv_heads=K * r), dataclasses.replace(weights, layers=layers)


def unstack_layers(weights: Weights) -> Weights:
    """The same weights with `layers` as a tuple of per-layer `LayerWeights` (views of the stacked arrays).

    `forward` then unrolls the layer loop. Why: under `lax.scan` XLA:CPU copies every layer's weight slice out of
    the stacked array before each dot (a `dynamic-slice` fusion), which streams all the weights through memory twice
    per step -- measured ~1/3 of a SmolLM2 decode step on 2 cores. Unrolled, each dot reads its own buffer.
    """
    L = weights.layers.attn_norm.shape[0]
    layers = tuple(jax.tree.map(lambda a: a[i], weights.layers) for i in range(L))
    return dataclasses.replace(weights, layers=layers)


LINEAR_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
FUSED_FIELDS = (("wq", "wk", "wv"), ("w_gate", "w_up"))  # maps of one input: packed side by side when they can be


def pack_linear_weights(weights: Weights) -> Weights:
    """Unrolled weights (`unstack_layers`) with every linear weight packed for the native CPU matmul, each in its
    stored form (float32, bfloat16, or a `QuantizedLinear`). The maps that read the same input (q, k, v; gate, up)
    are packed side by side as one `ops.FusedLinear` in the first field, None in the others, where their forms
    agree: 4 matmul calls per layer instead of 7.

    The logits projection is packed too: `lm_head`, or for tied embeddings a packed copy of `embed.T` (one more
    V x D matrix in memory; `embed` itself stays for the token lookup). Host-side, once, before `device_put`.
    """
    if isinstance(weights.layers, LayerWeights):
        raise ValueError("pack_linear_weights needs per-layer weights: call unstack_layers first")
    def pack(w: LayerWeights) -> LayerWeights:
        out = {f: ops.pack_linear(getattr(w, f)) for f in LINEAR_FIELDS if not any(f in g for g in FUSED_FIELDS)}
        for fields in FUSED_FIELDS:
            out.update(zip(fields, ops.pack_linears([getattr(w, f) for f in fields])))
        return dataclasses.replace(w, **out)

    layers = tuple(pack(w) for w in weights.layers)
    if weights.final_norm is None:  # a pipeline stage before the last: no logits here
        return dataclasses.replace(weights, layers=layers)
    head = weights.lm_head if weights.lm_head is not None else np.asarray(weights.embed).T
    return dataclasses.replace(weights, layers=layers, lm_head=ops.pack_linear(head))


def _attention_block(cfg: ModelConfig, w: LayerWeights, x, rope, invariant: bool = False):
    """Pre-norm projections and RoPE (`rope`: the step's `rope_tables`). x: f[T, D] -> q f[T, N, H], k/v f[T, K, H].
    `invariant`: see `rms_norm`."""
    T = x.shape[0]
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = rms_norm(x, w.attn_norm, cfg.rms_norm_eps, invariant)
    q, k, v = linears(h, w.wq, w.wk, w.wv)
    if w.bq is not None:
        q, k, v = q + w.bq, k + w.bk, v + w.bv
    q, k, v = q.reshape(T, N, H), k.reshape(T, K, H), v.reshape(T, K, H)
    if w.q_norm is not None:
        q = rms_norm(q, w.q_norm, cfg.rms_norm_eps, invariant)
        k = rms_norm(k, w.k_norm, cfg.rms_norm_eps, invariant)
    return apply_rope(q, rope), apply_rope(k, rope), v


def forward(
    cfg: ModelConfig,
    weights: Weights,
    kv: KVCache,
    inputs: StepInputs,
    x: jax.Array | None = None,
    *,
    hidden_layer_ids: tuple[int, ...] = (),
    backends: ops.Backends | None = None,
) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """One ragged step: write the new tokens' KV, attend, and return the final-normed hidden states.

    A pipeline stage (`stage_weights`) after the first takes the residual stream `x` f[T, D] from the one before
    instead of looking tokens up; one before the last (no `final_norm`) returns its residual stream un-normed.

    Returns (h f[T, D], updated cache, hidden f[len(hidden_layer_ids), T, D] or None), where hidden[j] is the
    residual stream *entering* layer hidden_layer_ids[j] (id == num_layers means the final, pre-norm output).
    Callers take logits only at the rows they need: `compute_logits(weights, h[rows])`.
    `backends`: the kernels, resolved once by the engine (`ops.resolve_backends`); None (training, tests) =
    `ops.Backends.default` for these weights, resolved when traced. Linear maps follow the weights' form.
    """
    if backends is None:
        backends = ops.Backends.default(packed_weights=isinstance(weights.lm_head, ops.PackedLinear))
    rope = rope_tables(inputs.positions, jnp.asarray(rope_inv_freq(cfg)),  # once for every layer
                       materialize=jax.default_backend() == "cpu")
    sm_scale = 1.0 / math.sqrt(cfg.head_dim)
    # The native CPU step is batch-invariant bit for bit (README, *Batch invariance*): its norms too. Not under a
    # tensor-parallel mesh, whose partitioner would have to place the custom call.
    invariant = backends.native_single_device
    if x is None:
        x = sharding.vocab_lookup(backends.mesh, weights.embed, inputs.token_ids)  # [T, D]
    meta = attention.token_metadata(inputs)

    ids = jnp.asarray(hidden_layer_ids, jnp.int32)  # [n]

    def layer(carry, xs):
        x, kv, hidden = carry
        w, i = xs
        if hidden is not None:  # scanned: keep only the chosen layers' inputs, [n, T, D], not every layer's
            hidden = jnp.where((ids == i)[:, None, None], x[None], hidden)
        with jax.named_scope("attention"):
            q, k, v = _attention_block(cfg, w, x, rope, invariant)
            kv = write_kv(kv, i, k, v, inputs.slot_mapping, native=invariant)
            o = attention.ragged_paged_attention(q, kv, i, inputs, meta, sm_scale=sm_scale, backends=backends)
            h = x + linear(o.reshape(x.shape[0], -1), w.wo)
        with jax.named_scope("mlp"):
            out = h + gated_mlp(rms_norm(h, w.mlp_norm, cfg.rms_norm_eps, invariant), w.w_gate, w.w_up, w.w_down)
        return (out, kv, hidden), None

    if isinstance(weights.layers, LayerWeights):  # stacked [L, ...]: one scanned layer body
        hidden = jnp.zeros((len(hidden_layer_ids), *x.shape), x.dtype) if hidden_layer_ids else None
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, kv, hidden), _ = jax.lax.scan(layer, (x, kv, hidden), (weights.layers, layer_ids))
        if hidden_layer_ids:
            hidden = jnp.where((ids == cfg.num_layers)[:, None, None], x[None], hidden)  # id L: the final output
    else:  # a tuple of per-layer weights (`unstack_layers`): unrolled, each dot reads its weight in place
        # The chosen layers' inputs are taken as they are and stacked once: a select per layer (the scanned form)
        # cost a batch-1 SmolLM2 decode step ~0.28 ms of ~3 on the CPU, 30 small thunks.
        captured = {}
        for i, w in enumerate(weights.layers):
            captured[i] = x
            (x, kv, _), _ = layer((x, kv, None), (w, i))
        captured[cfg.num_layers] = x  # id L: the final output
        hidden = jnp.stack([captured[i] for i in hidden_layer_ids]) if hidden_layer_ids else None

    if weights.final_norm is None:  # a pipeline stage before the last
        return x, kv, hidden
    h = rms_norm(x, weights.final_norm, cfg.rms_norm_eps, invariant)  # [T, D]
    return h, kv, hidden


def compute_logits(weights: Weights, h: jax.Array) -> jax.Array:
    """h: f[R, D] (already final-normed) -> f32[R, V]."""
    if weights.lm_head is None:
        out = jnp.einsum("rd,vd->rv", h, weights.embed, preferred_element_type=jnp.float32)
    elif isinstance(weights.lm_head, (ops.PackedLinear, QuantizedLinear)) or weights.lm_head.dtype != h.dtype:
        out = linear(h, weights.lm_head)  # packed, quantized, or stored narrower than the activations (bf16)
    else:
        out = jnp.einsum("rd,dv->rv", h, weights.lm_head, preferred_element_type=jnp.float32)
    return out.astype(jnp.float32)
