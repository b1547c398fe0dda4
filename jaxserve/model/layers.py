"""Stateless building blocks of a Llama-family block: linear maps, RMSNorm, rotary embedding, gated MLP.

Linear maps are `jaxserve.ops.linear` (re-exported here), which runs the kernel the weight's form asks for.

Norms and rotary maths run in float32 whatever the weight dtype; results are cast back to the input dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import ops
from jaxserve.config import ModelConfig
from jaxserve.ops import linear, linears  # x @ w for any weight form: the model's only matmuls


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, invariant: bool = False) -> jax.Array:
    """x: f[..., D], weight: f[D] -> f[..., D]. `invariant` (the engine's native CPU step): each row's sum of squares
    is computed by one fixed sequence of operations (`ops.row_sum_squares`), so a row's result depends on that row
    only, bit for bit. XLA's own reduction picks its order by shape: a row's norm then changed in its last bit with
    the number of tokens in the step (from 8 rows on), and under a quantized scheme that bit can move an
    activation's int8 rounding and flip a greedy near-tie -- the same request answered differently alone and in a
    busy batch, or with and without speculative decoding. (A chain of 16-lane slices in jnp fixes the order too, but
    XLA:CPU ran it ~7x slower than the plain mean; a column-sum formulation was invariant alone but not once fused.)"""
    x32 = x.astype(jnp.float32)
    if invariant:
        D = x32.shape[-1]
        ms = (ops.row_sum_squares(x32.reshape(-1, D)) / D).reshape(*x32.shape[:-1], 1)
    else:
        ms = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    x32 = x32 * jax.lax.rsqrt(ms + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies f32[H/2] for HF's rotate-half RoPE, with llama3 / linear scaling applied."""
    H = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H))
    sc = cfg.rope_scaling
    if sc is None:
        return inv.astype(np.float32)
    if sc.rope_type == "linear":
        return (inv / sc.factor).astype(np.float32)
    if sc.rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
        old = sc.original_max_position_embeddings
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
        blended = (1 - smooth) * inv / sc.factor + smooth * inv
        out = np.where(
            wavelen > old / sc.low_freq_factor, inv / sc.factor,
            np.where(wavelen < old / sc.high_freq_factor, inv, blended)
        )
        return out.astype(np.float32)
    raise ValueError(f"unsupported rope scaling type {sc.rope_type!r}; supported: llama3, linear")


def rope_tables(positions: jax.Array, inv_freq: jax.Array, *, materialize: bool = False
                ) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32[T, 1, H/2] of the rotary angles at `positions` (i32[T]), for `apply_rope`.

    A step computes them once for all its layers; `materialize` (the CPU backend) makes XLA keep them that way.
    XLA:CPU otherwise fuses the cos and sin into every layer's RoPE fusions and evaluates them per element of q and
    k, every head again (the default model's decode step at batch 16: 30 q fusions took ~2.3 ms of ~58, the k ones
    ~1.0; 60 sincos a step in the optimized HLO). An optimization barrier does not stop it (XLA:CPU strips barriers
    before fusing); a conditional's results are buffers no fusion reaches into, so the tables come out of one, both
    branches the same computation (whatever the predicate). Not on GPU, where a conditional would read its
    predicate on the host. Measured (2026-12-06, AMD EPYC 2-core VM, gguf default model, the step's executable
    replayed 300 times, fresh processes alternating, 2 pairs): batch 16 p10 42.2 / 41.3 -> 33.7 / 32.6 ms, batch 1
    unchanged within the noise (6.0-6.7 -> 6.2-7.2 ms)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]

    def tables(a: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jnp.cos(a), jnp.sin(a)

    cos, sin = jax.lax.cond(positions[0] >= 0, tables, tables, angles) if materialize else tables(angles)
    return cos[:, None, :], sin[:, None, :]


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate-half RoPE (HF convention: the head dim splits into two halves).

    x: f[T, heads, H], rope: `rope_tables(positions, inv_freq)` -> f[T, heads, H]
    """
    cos, sin = rope
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def gated_mlp(x: jax.Array, w_gate, w_up, w_down) -> jax.Array:
    """SwiGLU MLP. x: f[T, D], w_gate/w_up: [D, F], w_down: [F, D] (arrays or packed, see `linear`; gate and up
    may be fused, `ops.pack_linears`) -> f[T, D]."""
    gate, up = linears(x, w_gate, w_up)
    return linear(jax.nn.silu(gate) * up, w_down)


def argmax(x: jax.Array) -> jax.Array:
    """First index of the maximum along the last axis: f32[S, V] -> i32[S].

    Same result as jnp.argmax, ~4x faster on XLA:CPU, whose variadic (value, index) reduction is slow.
    """
    V = x.shape[-1]
    is_max = x == jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(is_max, jnp.arange(V, dtype=jnp.int32), V), axis=-1)
