"""Speculative verification (lossless rejection sampling) as one Pallas GPU kernel (Triton lowering); semantics,
maths and tie-breaking are those of `reference.py`.

Two target kinds, one kernel body (static `target_kind`):
  * "probs":  p given as probabilities f32[R, V]; the draft as probabilities q f32[R, V] (draft models, EAGLE
    heads) or one-hot (q absent: q = [x == d], computed in registers, never loaded).
    Residual key  a(x) = log max(p(x) - q(x), 0) + g(x)   (-inf where the residual is 0)
    Plain key     b(x) = log p(x) + g(x)                   (rows without a draft; rows whose residual is all 0)
  * "logits": p = softmax(scaled) given as the sampler's tempered, truncated logits, one-hot drafts only; the
    residual key is scaled(x) + g(x) with x = d masked to -inf (log p differs from scaled by a per-row constant),
    and p(d) comes from an online softmax (running max m and sum l) over the same stream. Greedy rows
    (is_random = 0) accept iff d == greedy and emit greedy.

Work decomposition
  * Grid (R, num_splits). Program (r, s) streams its contiguous share of row r's vocabulary in `block_v`-element
    blocks (masked loads past V; never the whole row at once), keeping per-key running (max, first index of the
    max) — the streamed Gumbel-max draw — plus "any residual mass" and, for logits, the online softmax (m, l).
  * num_splits == 1 (enough rows to fill the GPU): the program also loads p(d), q(d) (or scaled(d), g(d)) by
    index, runs the accept test and writes (token, accepted) — one pass, one launch.
  * num_splits > 1 (few rows, long vocabularies): programs write their partial statistics; a tiny XLA epilogue
    combines them over splits (max and first split holding it; m, l rescaled; flags or-ed) and runs the same
    `_finalize` on the gathered p(d), q(d). Splits cover increasing index ranges, so "first split holding the
    max, then its first index" is the global first index: bit-identical to the one-shot argmax.

Bytes moved per row: V x 4 x (2 or 3) (p or logits, Gumbel noise, q if probabilistic; q is not read for rows
without a draft) — the kernel is a single streaming pass at HBM bandwidth; the reference materialises the
residual, the keys and the softmax in between.

Status: checked against the reference in Pallas interpret mode on CPU (tests/test_spec_verify_kernel.py) and
compiled for sm_90 without a GPU (deviceless AOT, tests/test_spec_verify_compile_sm90.py). It has NOT yet been run
on a GPU; `bench.py` measures it when one is available.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_NEG_INF = float("-inf")
_NUM_F = 4  # f32 partial statistics per (row, split): (max a, max b, softmax m, softmax l)
_NUM_I = 4  # i32 partial statistics per (row, split): (argmax a, argmax b, any residual mass, unused)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tiling of one launch."""

    block_v: int  # vocabulary elements per streamed block (a power of two)
    num_splits: int = 1  # programs per row, each streaming a contiguous share of the vocabulary
    num_warps: int = 8
    num_stages: int = 2


def blocks_per_split(vocab: int, block_sizes: BlockSizes) -> int:
    return -(-(-(-vocab // block_sizes.block_v)) // block_sizes.num_splits)


def _first_max(key, idx, best, best_idx):
    """Fold one block of keys into a running (max, first index of the max). Earlier blocks win ties (strict >)."""
    block_best = jnp.max(key)
    block_idx = jnp.min(jnp.where(key == block_best, idx, jnp.iinfo(jnp.int32).max))
    better = block_best > best
    return jnp.where(better, block_best, best), jnp.where(better, block_idx, best_idx)


def _safe(m):
    return jnp.where(m == _NEG_INF, 0.0, m)


def finalize(
    target_kind: str,
    *,
    idx_a, idx_b, any_mass, m, l,  # streamed statistics (scalars in the kernel, [R] in XLA)
    draft_id, greedy, is_random, uniform,  # per-row inputs
    t_d, q_d, g_d,  # target(d) (p(d) or scaled(d)), q(d) (probs kind), g(d) (logits kind)
):
    """(token, accepted) from the streamed statistics: the last lines of `reference.rejection_sample` /
    `reference.verify_one_hot`. Works on scalars (inside the kernel) and on [R] arrays (split epilogue)."""
    has_draft = draft_id >= 0
    d = jnp.maximum(draft_id, 0)
    if target_kind == "probs":
        accepted = has_draft & (uniform * q_d < t_d)  # u < p(d) / q(d)
        token = jnp.where(has_draft & (any_mass > 0), idx_a, idx_b)  # the residual unless it has no mass
        return token, accepted
    # logits: p(d) = exp(scaled(d) - m) / l. With no mass left once d is masked (p(d) == 1, or only d allowed),
    # the reference draws argmax(scaled + g) over the unmasked row, which is d unless d is -inf too (then 0).
    p_d = jnp.where(l > 0, jnp.exp(t_d - _safe(m)) / jnp.where(l > 0, l, 1.0), 0.0)
    fallback = jnp.where(t_d + g_d > _NEG_INF, d, 0)
    drawn = jnp.where(any_mass > 0, idx_a, fallback)
    token = jnp.where(is_random > 0, drawn, greedy)
    accepted = has_draft & jnp.where(is_random > 0, uniform < p_d, greedy == d)
    return token, accepted


def _verify_kernel(
    meta_ref,  # i32[4]          (draft id or -1, greedy token, is_random, unused) of this row
    uniform_ref,  # f32[1]       U(0, 1) of this row
    target_ref,  # f32[V]        p (probs) or scaled logits (logits) of this row
    *refs,  # draft_ref f32[V] if probabilistic drafts; gumbel_ref f32[V]; then outputs:
    #         splits == 1: out_ref i32[2] (token, accepted); else f_ref f32[_NUM_F], i_ref i32[_NUM_I]
    target_kind: str,
    has_q: bool,
    vocab: int,
    block_v: int,
    num_blocks: int,  # blocks per split
    num_splits: int,
):
    if has_q:
        draft_ref, gumbel_ref, *out_refs = refs
    else:
        gumbel_ref, *out_refs = refs
    split = pl.program_id(1)
    draft_id = meta_ref[0]
    has_draft = draft_id >= 0
    d = jnp.clip(draft_id, 0, vocab - 1)
    lo = split * (num_blocks * block_v)
    hi = jnp.minimum(lo + num_blocks * block_v, vocab)
    lanes = jnp.arange(block_v, dtype=jnp.int32)
    neg_inf = jnp.float32(_NEG_INF)

    def load(ref, start, mask, other):
        return pltriton.load(ref.at[pl.ds(start, block_v)], mask=mask, other=other)

    def body(b, carry):
        max_a, idx_a, max_b, idx_b, any_mass, m, l = carry
        start = pl.multiple_of(lo + b * block_v, block_v)
        idx = start + lanes
        valid = idx < hi
        g = load(gumbel_ref, start, valid, 0.0)
        if target_kind == "probs":
            p = load(target_ref, start, valid, 0.0)
            if has_q:  # rows without a draft never read q (their residual is p itself)
                q = load(draft_ref, start, valid & has_draft, 0.0)
            else:
                q = jnp.where(has_draft & (idx == d), 1.0, 0.0)
            r = jnp.maximum(p - q, 0.0)
            key_a = jnp.where(valid & (r > 0), jnp.log(r), neg_inf) + g
            key_b = jnp.where(valid & (p > 0), jnp.log(p), neg_inf) + g
            max_a, idx_a = _first_max(key_a, idx, max_a, idx_a)
            max_b, idx_b = _first_max(key_b, idx, max_b, idx_b)
            any_mass = jnp.maximum(any_mass, jnp.max(jnp.where(valid & (r > 0), 1, 0)))
        else:
            s = load(target_ref, start, valid, _NEG_INF)
            masked = jnp.where(has_draft & (idx == d), neg_inf, s)
            key_a = jnp.where(valid, masked + g, neg_inf)
            max_a, idx_a = _first_max(key_a, idx, max_a, idx_a)
            any_mass = jnp.maximum(any_mass, jnp.max(jnp.where(valid & (masked > neg_inf), 1, 0)))
            m_new = jnp.maximum(m, jnp.max(s))  # online softmax; -inf-safe (no inf - inf)
            l = l * jnp.exp(m - _safe(m_new)) + jnp.sum(jnp.exp(s - _safe(m_new)))
            m = m_new
        return max_a, idx_a, max_b, idx_b, any_mass, m, l

    zero_i = jnp.int32(0)
    init = (neg_inf, zero_i, neg_inf, zero_i, zero_i, neg_inf, jnp.float32(0.0))
    max_a, idx_a, max_b, idx_b, any_mass, m, l = lax.fori_loop(0, num_blocks, body, init)

    if num_splits == 1:
        t_d = target_ref[d]
        q_d = (draft_ref[d] if has_q else jnp.float32(1.0)) if target_kind == "probs" else jnp.float32(0.0)
        g_d = gumbel_ref[d] if target_kind == "logits" else jnp.float32(0.0)
        token, accepted = finalize(
            target_kind, idx_a=idx_a, idx_b=idx_b, any_mass=any_mass, m=m, l=l, draft_id=draft_id, greedy=meta_ref[1],
            is_random=meta_ref[2], uniform=uniform_ref[0],
            t_d=t_d, q_d=q_d, g_d=g_d,
        )
        (out_ref,) = out_refs
        out_ref[...] = jnp.where(jnp.arange(2, dtype=jnp.int32) == 0, token, accepted.astype(jnp.int32))
    else:
        f_ref, i_ref = out_refs
        k = jnp.arange(_NUM_F, dtype=jnp.int32)
        f_ref[...] = jnp.where(k == 0, max_a, jnp.where(k == 1, max_b, jnp.where(k == 2, m, l)))
        i_ref[...] = jnp.where(k == 0, idx_a, jnp.where(k == 1, idx_b, jnp.where(k == 2, any_mass, 0)))


def _combine_first_max(vals, idx):
    """Over splits (axis 1, increasing index ranges): the index held by the first split reaching the max."""
    best = jnp.max(vals, axis=1)
    num_splits = vals.shape[1]
    first = jnp.min(jnp.where(vals == best[:, None], jnp.arange(num_splits), num_splits), axis=1)
    return jnp.take_along_axis(idx, first[:, None], axis=1)[:, 0]


@functools.partial(jax.jit, static_argnames=("target_kind", "block_sizes", "interpret", "debug"))
def spec_verify_kernel(
    target: jax.Array,  # f32[R, V]  p (probs) or scaled logits (logits)
    draft_probs: jax.Array | None,  # f32[R, V] q, or None: one-hot drafts
    draft_ids: jax.Array,  # i32[R]    d, or -1 (no draft)
    uniform: jax.Array,  # f32[R]
    gumbel: jax.Array,  # f32[R, V]
    greedy: jax.Array,  # i32[R]      (logits kind; ignored for probs)
    is_random: jax.Array,  # bool[R]  (logits kind; ignored for probs)
    *,
    target_kind: str,
    block_sizes: BlockSizes,
    interpret: bool = False,
    debug: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (i32[R] token, bool[R] accepted)
    """The launch and (with splits) the XLA epilogue. Inputs are assumed valid: `__init__` validates them."""
    R, V = target.shape
    has_q = draft_probs is not None
    splits = block_sizes.num_splits
    nb = blocks_per_split(V, block_sizes)
    meta = jnp.stack(
        [draft_ids.astype(jnp.int32), greedy.astype(jnp.int32), is_random.astype(jnp.int32),
         jnp.zeros((R,), jnp.int32)], axis=1)
    kernel = functools.partial(
        _verify_kernel, target_kind=target_kind, has_q=has_q, vocab=V, block_v=block_sizes.block_v,
        num_blocks=nb, num_splits=splits,
    )
    row_spec = pl.BlockSpec((None, V), lambda r, s: (r, 0))
    in_specs = [
        pl.BlockSpec((None, 4), lambda r, s: (r, 0)),
        pl.BlockSpec((None, 1), lambda r, s: (r, 0)),
        row_spec,
    ]
    args = [meta, uniform.astype(jnp.float32).reshape(R, 1), target]
    if has_q:
        in_specs.append(row_spec)
        args.append(draft_probs)
    in_specs.append(row_spec)
    args.append(gumbel)
    if splits == 1:
        out_specs = pl.BlockSpec((None, 2), lambda r, s: (r, 0))
        out_shape = jax.ShapeDtypeStruct((R, 2), jnp.int32)
    else:
        out_specs = [pl.BlockSpec((None, None, _NUM_F), lambda r, s: (r, s, 0)),
                     pl.BlockSpec((None, None, _NUM_I), lambda r, s: (r, s, 0))]
        out_shape = [jax.ShapeDtypeStruct((R, splits, _NUM_F), jnp.float32),
                     jax.ShapeDtypeStruct((R, splits, _NUM_I), jnp.int32)]
    out = pl.pallas_call(
        kernel,
        grid=(R, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
        interpret=interpret,
        debug=debug,
        name=f"spec_verify_{target_kind}",
    )(*args)
    if splits == 1:
        return out[:, 0], out[:, 1] > 0

    f, i = out
    idx_a = _combine_first_max(f[..., 0], i[..., 0])
    idx_b = _combine_first_max(f[..., 1], i[..., 1])
    any_mass = jnp.max(i[..., 2], axis=1)
    m = jnp.max(f[..., 2], axis=1)
    l = jnp.sum(f[..., 3] * jnp.exp(f[..., 2] - _safe(m)[:, None]), axis=1)
    d = jnp.clip(draft_ids, 0, V - 1)[:, None]
    t_d = jnp.take_along_axis(target, d, axis=1)[:, 0]
    q_d = jnp.take_along_axis(draft_probs, d, axis=1)[:, 0] if has_q else jnp.ones((R,), jnp.float32)
    g_d = jnp.take_along_axis(gumbel, d, axis=1)[:, 0]
    return finalize(
        target_kind, idx_a=idx_a, idx_b=idx_b, any_mass=any_mass, m=m, l=l, draft_id=draft_ids, greedy=greedy,
        is_random=is_random.astype(jnp.int32), uniform=uniform,
        t_d=t_d, q_d=q_d, g_d=g_d,
    )
