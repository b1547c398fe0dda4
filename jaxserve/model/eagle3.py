"""The EAGLE-3 draft head as one pure function, shared by serving (`spec_decode/eagle3.py`) and training.

Architecture (EAGLE-3, Li et al. 2025; the same in EAGLE's reference code, vLLM's speculators and SpecForge):

  features  f[T, 3D]  the target's residual stream entering three layers, concatenated (low, mid, high)
  fuse      h = fc(norm?(features))            3D -> D; optional RMSNorm over all 3D (`norm_before_fc`) or one
                                               RMSNorm per D-wide chunk (`fc_norm`); never both
  layer     x = concat[input_layernorm(embed(token)), hidden_norm(h)]      2D wide
            residual = hidden_norm(h) if norm_before_residual else h
            h1 = residual + o_proj(attention(q/k/v_proj(x)))               q/k/v take 2D inputs
            out = h1 + mlp(post_attention_layernorm(h1))
  output    logits = lm_head(norm(out)) over the draft vocabulary; token = argmax + d2t[argmax]
  next      the feature for the following draft step is `out` (or `norm(out)` with `norm_output`), which
            replaces fc(features): drafts 2..K are fed the head's own hidden state and its own last token.

The embedding is the target's (shared, not stored in the head). Attention runs over the head's own one-layer paged
KV cache through `jaxserve.attention`, exactly like the target model, so ragged batches (catch-up chunks next to
single-token draft steps) work unchanged. The caller chooses positions: serving pairs the target feature at
position p with the token at p + 1 and runs the pair at position p (vLLM's convention; see spec_decode/eagle3.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import attention, ops, quant
from jaxserve.batch import StepInputs
from jaxserve.config import ModelConfig
from jaxserve.kv_cache import KVCache, write_kv
from jaxserve.model.layers import apply_rope, argmax, gated_mlp, rms_norm, rope_inv_freq, rope_tables
from jaxserve.quant import QuantizedLinear


@dataclass(frozen=True, kw_only=True)
class Eagle3Config:
    """What an EAGLE-3 head is. Hashable, so jitted functions close over it as static data.

    `aux_layer_ids` follow ONE convention everywhere in jaxserve: id i captures the residual stream *entering*
    target layer i (id == num_layers: the final, pre-norm output). This is EAGLE's reference code, vLLM's and
    speculators' convention (default [2, N//2, N-3]). SpecForge / SGLang write *output* indices (the output of
    layer j is the input of layer j + 1), so their ids map here as j + 1 (`loader/eagle3.py` does it).
    """

    layer: ModelConfig  # the single decoder layer: dims, eps, RoPE; vocab_size = the target's vocabulary
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # three target layer ids, input convention (see above)
    norm_before_fc: bool = False  # RMSNorm over the concatenated 3D features before fc
    fc_norm: bool = False  # RMSNorm per D-wide feature chunk before fc ("EAGLE 3.1")
    norm_before_residual: bool = False  # the residual is hidden_norm(h) rather than h
    norm_output: bool = False  # the next step's feature is norm(out) rather than out

    def __post_init__(self):
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are mutually exclusive (an EAGLE-3 head has at most one)")
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"an EAGLE-3 head reads exactly 3 target layers (got ids {self.aux_layer_ids})")


@jax.tree_util.register_dataclass
@dataclass
class Eagle3Weights:
    """Linear weights are [in, out]."""

    fc: jax.Array  # f[3D, D]
    embed_norm: jax.Array  # f[D]      input_layernorm (on the token embedding)
    hidden_norm: jax.Array  # f[D]
    wq: jax.Array  # f[2D, N*H]
    wk: jax.Array  # f[2D, K*H]
    wv: jax.Array  # f[2D, K*H]
    wo: jax.Array  # f[N*H, D]
    mlp_norm: jax.Array  # f[D]      post_attention_layernorm
    w_gate: jax.Array  # f[D, F]
    w_up: jax.Array  # f[D, F]
    w_down: jax.Array  # f[F, D]
    final_norm: jax.Array  # f[D]
    lm_head: jax.Array  # f[D, Vd]
    d2t: jax.Array  # i32[Vd]   target id = draft id + d2t[draft id]
    fc_in_norm: Optional[jax.Array] = None  # f[3D]     norm_before_fc
    fc_chunk_norm: Optional[jax.Array] = None  # f[3, D]  fc_norm


def fuse_features(cfg: Eagle3Config, w: Eagle3Weights, features: jax.Array) -> jax.Array:
    """Target features f[T, 3D] -> the head's input hidden state f[T, D]."""
    eps = cfg.layer.rms_norm_eps
    if w.fc_in_norm is not None:
        features = rms_norm(features, w.fc_in_norm, eps)
    elif w.fc_chunk_norm is not None:
        T, D = features.shape[0], cfg.layer.hidden_size
        features = rms_norm(features.reshape(T, 3, D), w.fc_chunk_norm, eps).reshape(T, 3 * D)
    return _mm(features, w.fc)


def _mm(x: jax.Array, w) -> jax.Array:
    """x @ w: `ops.linear` for a weight stored for serving (`store_head`: packed for the native CPU matmul, or
    integers with scales), else the plain product (training multiplies the arrays as they are)."""
    return ops.linear(x, w) if isinstance(w, (ops.PackedLinear, QuantizedLinear)) else x @ w


_LINEARS = ("fc", "wo", "w_down", "lm_head")  # the head's linear maps stored alone ...
_FUSED = (("wq", "wk", "wv"), ("w_gate", "w_up"))  # ... and those of one input, side by side when packed


def store_head(w: Eagle3Weights, scheme: str = "none", kernel: str = "native") -> Eagle3Weights:
    """Host-side, once: the head's linear maps in weight scheme `scheme` for `kernel`.

    `scheme` is one of the target's (`quant.SCHEMES` but "gguf"): "none" keeps the values as loaded (in bfloat16
    for the native kernel when every value of a map is one: a head exported in bfloat16, as the shipped one is,
    loaded into float32, in half the bytes); "bf16", "int8" (a scale per output channel), "int4" / "int4-g64"
    (group-wise) store them so. `kernel` "native": packed for the native CPU matmul (q, k, v and gate, up side by
    side, as the target's), the target's kernels; else the `QuantizedLinear.kernel` that multiplies the integer
    maps ("xla", "xla-q8", "pallas"), float maps staying arrays. Measured on the shipped head at batch 1 (native,
    2-vCPU Xeon, catch-up + 2 draft passes): bf16 1.55 ms, int8 0.94 ms, int4 0.92 ms (p10 of 60 calls each)."""
    if scheme == "none" and kernel != "native":
        return w  # as loaded: the XLA path multiplies the arrays as they are

    def stored(a):
        a = np.asarray(a, np.float32)
        if scheme != "none":
            return quant.quantize_linear(a, scheme)
        b = a.astype(jnp.bfloat16)
        return b if np.array_equal(b.astype(np.float32), a) else a

    maps = {f: stored(getattr(w, f)) for f in _LINEARS + sum(_FUSED, ())}
    if kernel != "native":
        return dataclasses.replace(w, **quant.with_kernel(maps, kernel))
    out = {f: ops.pack_linear(maps[f]) for f in _LINEARS}
    for fields in _FUSED:
        out.update(zip(fields, ops.pack_linears([maps[f] for f in fields])))
    return dataclasses.replace(w, **out)


def head_qkv(cfg: Eagle3Config, w: Eagle3Weights, embed: jax.Array, h: jax.Array, tokens: jax.Array,
             positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The layer up to attention. h f[M, D] (fused features or the previous step's hidden), tokens i32[M],
    positions i32[M] -> (q f[M, N, H], k f[M, K, H], v f[M, K, H], residual f[M, D]). Shared with training."""
    c = cfg.layer
    eps, M = c.rms_norm_eps, h.shape[0]
    N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
    h_normed = rms_norm(h, w.hidden_norm, eps)
    x = jnp.concatenate([rms_norm(embed[tokens].astype(h.dtype), w.embed_norm, eps), h_normed], axis=-1)  # [M, 2D]
    residual = h_normed if cfg.norm_before_residual else h
    rope = rope_tables(positions, jnp.asarray(rope_inv_freq(c)))
    if isinstance(w.wq, (ops.PackedLinear, ops.FusedLinear, QuantizedLinear)):  # stored (`store_head`)
        q, k, v = ops.linears(x, w.wq, w.wk, w.wv)
    else:
        q, k, v = x @ w.wq, x @ w.wk, x @ w.wv
    q = apply_rope(q.reshape(M, N, H), rope)
    k = apply_rope(k.reshape(M, K, H), rope)
    return q, k, v.reshape(M, K, H), residual


def head_output(cfg: Eagle3Config, w: Eagle3Weights, residual: jax.Array, o: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The layer after attention. residual f[M, D], attention output o f[M, N*H] -> (next_hidden f[M, D],
    normed f[M, D]). Shared with training."""
    eps = cfg.layer.rms_norm_eps
    h1 = residual + _mm(o, w.wo)
    with jax.named_scope("eagle3_mlp"):
        out = h1 + gated_mlp(rms_norm(h1, w.mlp_norm, eps), w.w_gate, w.w_up, w.w_down)
    normed = rms_norm(out, w.final_norm, eps)
    return (normed if cfg.norm_output else out), normed


def eagle3_forward(
    cfg: Eagle3Config,
    w: Eagle3Weights,
    embed: jax.Array,  # f[V, D]  the target's token embedding
    kv: KVCache,  # [1, P, page_size, K, H]  the head's own paged cache
    inputs: StepInputs,  # token_ids: the token paired with each hidden state; positions, slots, block tables
    hidden: jax.Array,  # f[T, 3D] target features (from_target) | f[T, D] the head's previous `next_hidden`
    *,
    from_target: bool,
    backends: ops.Backends | None = None,
    last_only: bool = False,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """One ragged step of the head. Returns (next_hidden f[T, D], normed f[T, D], kv): `next_hidden` feeds the next
    draft step, `draft_logits(w, normed[rows])` gives the draft-vocabulary logits. `backends`: the target's (see
    `llama.forward`); None = `ops.Backends.default()`, resolved when traced.

    `last_only`: every token's KV is written, but attention, the output projection and the MLP run only for each
    sequence slot's last token (`inputs.logits_indices[:S]`, S = the step's sequence slots), and next_hidden /
    normed are f[S, D], one row per slot. That is all a catch-up pass uses; over a prompt it skips most of the
    layer's work. The rows it keeps are computed as in the full pass (bit for bit where the kernels are
    batch-invariant, as the native CPU ones are)."""
    T = inputs.token_ids.shape[0]
    h = fuse_features(cfg, w, hidden) if from_target else hidden
    with jax.named_scope("eagle3_attention"):
        q, k, v, residual = head_qkv(cfg, w, embed, h, inputs.token_ids, inputs.positions)
        layer = jnp.zeros((), jnp.int32)
        native = backends is not None and backends.native_single_device  # see `write_kv`
        kv = write_kv(kv, layer, k, v, inputs.slot_mapping, native=native)
        if last_only:  # one query per sequence slot: its last token, at position seq_len - 1
            S = inputs.seq_lens.shape[0]
            rows = inputs.logits_indices[:S]
            q, residual, T = q[rows], residual[rows], S
            inputs = StepInputs(
                token_ids=inputs.token_ids[rows], positions=inputs.positions[rows],
                slot_mapping=inputs.slot_mapping[rows], block_tables=inputs.block_tables, seq_lens=inputs.seq_lens,
                cu_q_lens=jnp.arange(S + 1, dtype=jnp.int32), num_seqs=inputs.num_seqs,
                logits_indices=jnp.arange(S, dtype=jnp.int32))
        meta = attention.token_metadata(inputs)
        o = attention.ragged_paged_attention(q, kv, layer, inputs, meta, sm_scale=1.0 / math.sqrt(cfg.layer.head_dim),
                                             backends=backends)
    next_hidden, normed = head_output(cfg, w, residual, o.reshape(T, -1))
    return next_hidden, normed, kv


def draft_logits(w: Eagle3Weights, normed: jax.Array) -> jax.Array:
    """normed: f[R, D] -> f32[R, Vd] over the draft vocabulary."""
    if isinstance(w.lm_head, (ops.PackedLinear, QuantizedLinear)):
        return ops.linear(normed, w.lm_head).astype(jnp.float32)
    return jnp.einsum("rd,dv->rv", normed, w.lm_head, preferred_element_type=jnp.float32)


def greedy_target_ids(w: Eagle3Weights, logits: jax.Array) -> jax.Array:
    """f32[R, Vd] -> i32[R]: the greedy draft token, mapped into the target vocabulary through d2t."""
    d = argmax(logits)
    return d + w.d2t[d]
