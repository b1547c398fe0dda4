"""Ragged paged attention as one Pallas GPU kernel (Triton lowering); semantics are those of `reference.py`.

One launch serves a ragged batch: decodes (1 query token), speculative verifies (1+K) and prefill chunks (many),
each attending causally to its own paged KV history, with GQA/MQA, optional sliding window and logit soft-cap, and
float (f32/bf16/f16) or quantized (int8 / fp8 e4m3 with per-token-per-head f32 scales) keys and values.

Work decomposition
  * A *tile* is `block_q` consecutive query tokens of ONE sequence. Sequence s contributes
    ceil(q_len_s / block_q) tiles, so a decode is one tile and a 300-token prefill chunk is several. The tile list
    is computed in XLA before the launch (`tile_metadata`); its length is bounded statically by
    min(T, (T + S * (block_q - 1)) // block_q), and grid points past the real tiles do no work.
  * GQA: a program owns one tile and one kv head, and its query rows are the tile's tokens x the `group` query
    heads sharing that kv head (rows = block_q * group, group padded to a power of two). Every key/value page is
    therefore read once per kv head per tile and feeds all of its query heads: decode is a matrix product with
    group (or 16/group tokens x group) rows instead of a matrix-vector product per head.
  * Keys are walked `chunk_pages` pages at a time (block_k = chunk_pages * page_size keys): the block table row
    gives the page ids, the pages are gathered with one vector load, and an online float32 softmax folds the
    chunk in. The walk stops at the chunk holding the tile's last query position (causal) and starts at the first
    chunk inside the sliding window.
  * Optional KV split (flash-decoding): grid axis 3 splits each tile's chunk range into `num_kv_splits` parts that
    write normalised partial outputs and log-sum-exps; XLA combines them. Used when tiles x kv heads is too small
    to fill the GPU (few long decodes).
  * Quantized KV: the kernel loads int8/fp8 values, converts them to the compute dtype for the matrix units, and
    applies the per-key scales to the products instead of the values: s = (q . k_int) * k_scale[key] and
    o += (p * v_scale[key]) . v_int — one multiply per score instead of one per value element.
  * Key slots past a sequence's length (the rest of its last page, pages of padded block-table columns — page 0,
    the padding sink) are masked in the scores AND zeroed in V / the V scales, so stale or NaN memory can never
    leak into the output (0 * NaN = NaN in a matrix product).

Layout: pages f[P, page_size, K, H] and scales f32[P, page_size, K] are read in place (the kv-head axis is
selected by the BlockSpec, no copy); queries are gathered into tiles [tiles, block_q, K, group, H] and outputs
scattered back to tokens by XLA (T x N x H elements: negligible next to the KV bytes a step reads).

Status: checked against the reference in Pallas interpret mode on CPU (tests/test_rpa_kernel.py) and compiled for
sm_90 without a GPU (deviceless AOT, tests/test_rpa_compile_sm90.py). It has NOT yet been run on a GPU; its speed
is measured by `bench.py` when a GPU is available.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Pallas' Triton matmul (moved from `pl.dot` to `pallas.triton.dot`; both exist in JAX 0.10-0.11).
_dot = getattr(pltriton, "dot", None) or pl.dot
_MASKED = -1e30  # finite "minus infinity": exp(_MASKED - m) underflows to 0 without inf - inf = NaN


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tiling of one launch (see the module docstring); all sizes are powers of two."""

    block_q: int  # query tokens per tile; rows per program = block_q * padded group >= 16 (Triton dot minimum)
    chunk_pages: int  # pages per inner step: block_k = chunk_pages * page_size keys
    num_kv_splits: int = 1  # flash-decoding split of each tile's key range
    num_warps: int = 4
    num_stages: int = 2


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def padded_group(num_q_heads: int, num_kv_heads: int) -> int:
    return _pow2_at_least(num_q_heads // num_kv_heads)


def num_tiles_bound(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Static upper bound of sum_s ceil(q_len_s / block_q) given sum_s q_len_s <= T over <= S sequences."""
    return max(1, min(num_tokens, (num_tokens + min(num_seqs, num_tokens) * (block_q - 1)) // block_q))


def tile_metadata(
    cu_q_lens: jax.Array,  # i32[S+1]
    seq_lens: jax.Array,  # i32[S]
    num_seqs: jax.Array,  # i32[]
    *,
    block_q: int,
    num_tiles: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-tile facts for the kernel, i32[num_tiles, 4] = (sequence, position of the tile's first query, real
    query rows, kv length); the token index of each tile's first query, i32[num_tiles]; and the first tile of each
    sequence, i32[S+1]. Tiles past the real ones have 0 rows."""
    S = seq_lens.shape[0]
    q_lens = jnp.where(jnp.arange(S) < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    cu_tiles = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum((q_lens + block_q - 1) // block_q)])
    cu_tiles = cu_tiles.astype(jnp.int32)
    i = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu_tiles[1:], i, side="right"), S - 1).astype(jnp.int32)
    first = (i - cu_tiles[seq]) * block_q  # index of the tile's first query within its sequence
    rows = jnp.where(i < cu_tiles[S], jnp.clip(q_lens[seq] - first, 0, block_q), 0)
    pos0 = seq_lens[seq] - q_lens[seq] + first
    meta = jnp.stack([seq, pos0, rows, seq_lens[seq]], axis=1).astype(jnp.int32)
    return meta, (cu_q_lens[seq] + first).astype(jnp.int32), cu_tiles


def _rpa_kernel(
    meta_ref,  # i32[4]                  (sequence, first query position, real rows, kv length) of this tile
    tables_ref,  # i32[S, W]             block tables, W a multiple of chunk_pages (padding -> page 0)
    q_ref,  # [block_q, group, H]       this tile's queries for this kv head's query heads
    k_ref,  # [P, page_size, H]         this kv head's keys (whole pool, gathered by page id)
    v_ref,  # [P, page_size, H]
    *refs,  # (k_scales_ref, v_scales_ref: f32[P, page_size]) if quantized, then o_ref f32[rows, H], lse_ref f32[rows]
    sm_scale: float,
    chunk_pages: int,
    num_kv_splits: int,
    sliding_window: int | None,
    soft_cap: float | None,
    quantized: bool,
    compute_dtype,
    precision,
):
    if quantized:
        ks_ref, vs_ref, o_ref, lse_ref = refs
    else:
        o_ref, lse_ref = refs
    block_q, group, H = q_ref.shape
    page_size = k_ref.shape[1]
    num_rows = block_q * group
    block_k = chunk_pages * page_size
    split = pl.program_id(2)

    seq, pos0, real_rows, kv_len = meta_ref[0], meta_ref[1], meta_ref[2], meta_ref[3]
    q = q_ref[...].reshape(num_rows, H).astype(compute_dtype)
    row_tok = lax.div(jnp.arange(num_rows, dtype=jnp.int32), jnp.int32(group))  # token of each row in the tile
    q_pos = pos0 + row_tok  # i32[rows] absolute position of each row's query
    row_real = row_tok < real_rows

    # Chunk range of this tile (and of this split of it): up to the chunk holding its last query's position.
    end = jnp.where(real_rows > 0, (pos0 + real_rows - 1) // block_k + 1, 0)
    start = jnp.int32(0) if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0) // block_k
    per_split = (jnp.maximum(end - start, 0) + num_kv_splits - 1) // num_kv_splits
    lo = start + split * per_split
    hi = jnp.minimum(lo + per_split, end)

    def body(c, carry):
        m, l, acc = carry  # f32[rows], f32[rows], f32[rows, H]
        pages = tables_ref[seq, pl.ds(c * chunk_pages, chunk_pages)]  # i32[chunk_pages]
        k_pos = c * block_k + jnp.arange(block_k, dtype=jnp.int32)  # i32[block_k]
        k_real = k_pos < kv_len
        k = k_ref[pages].reshape(block_k, H).astype(compute_dtype)
        s = _dot(q, k, trans_b=True, precision=precision)  # f32[rows, block_k]
        if quantized:
            s = s * ks_ref[pages].reshape(1, block_k)
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        visible = (k_pos[None, :] <= q_pos[:, None]) & row_real[:, None]
        if sliding_window is not None:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = jnp.where(visible, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(axis=1)
        if quantized:
            p = p * jnp.where(k_real, vs_ref[pages].reshape(block_k), 0.0)[None, :]
        v = v_ref[pages].reshape(block_k, H).astype(compute_dtype)
        v = jnp.where(k_real[:, None], v, jnp.zeros_like(v))  # stale / NaN slots: 0 * NaN would poison p @ v
        acc = acc * alpha[:, None] + _dot(p.astype(compute_dtype), v, precision=precision)
        return m_new, l, acc

    init = (
        jnp.full((num_rows,), _MASKED, jnp.float32),
        jnp.zeros((num_rows,), jnp.float32),
        jnp.zeros((num_rows, H), jnp.float32),
    )
    m, l, acc = lax.fori_loop(lo, hi, body, init)
    seen = l > 0.0
    o_ref[...] = acc / jnp.where(seen, l, 1.0)[:, None]
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), _MASKED)


def _compute_dtype(q_dtype, kv_dtype, quantized: bool):
    if quantized:
        return jnp.dtype(q_dtype)
    return jnp.promote_types(q_dtype, kv_dtype)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "block_sizes", "sliding_window", "soft_cap", "interpret", "debug")
)
def ragged_paged_attention_kernel(
    q: jax.Array,  # f[T, N, H]
    k_pages: jax.Array,  # [P, page_size, K, H]  f32 / bf16 / f16 / int8 / float8_e4m3fn
    v_pages: jax.Array,  # [P, page_size, K, H]
    block_tables: jax.Array,  # i32[S, max_pages]
    seq_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    k_scales: jax.Array | None = None,  # f32[P, page_size, K]  (quantized caches only)
    v_scales: jax.Array | None = None,  # f32[P, page_size, K]
    *,
    sm_scale: float,
    block_sizes: BlockSizes,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    debug: bool = False,
) -> jax.Array:  # f[T, N, H]
    """The wrapper: tile metadata and query tiles (XLA), the launch, split combine and the scatter back to tokens
    (XLA). Inputs are assumed valid; `__init__.ragged_paged_attention` validates and chooses block sizes."""
    T, N, H = q.shape
    P, page_size, K, _ = k_pages.shape
    S, max_pages = block_tables.shape
    G = N // K
    Gp = _pow2_at_least(G)
    bq, cp, splits = block_sizes.block_q, block_sizes.chunk_pages, block_sizes.num_kv_splits
    rows = bq * Gp
    quantized = k_scales is not None
    num_tiles = num_tiles_bound(T, S, bq)

    meta, first_tok, cu_tiles = tile_metadata(cu_q_lens, seq_lens, num_seqs, block_q=bq, num_tiles=num_tiles)
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, -max_pages % cp)))  # padding -> page 0, masked

    # Query tiles [tiles, block_q, K, Gp, H]: tile i row r is token cu_q_lens[seq] + first + r (zero if not real).
    qg = q.reshape(T, K, G, H)
    if Gp != G:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
    r = jnp.arange(bq, dtype=jnp.int32)
    tok = first_tok[:, None] + r[None, :]  # i32[tiles, block_q]
    real = r[None, :] < meta[:, 2:3]
    q_tiles = jnp.where(real[..., None, None, None], qg[jnp.clip(tok, 0, T - 1)], 0)

    kernel = functools.partial(
        _rpa_kernel,
        sm_scale=sm_scale,
        chunk_pages=cp,
        num_kv_splits=splits,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        quantized=quantized,
        compute_dtype=_compute_dtype(q.dtype, k_pages.dtype, quantized),
        precision=lax.Precision.HIGHEST if jnp.dtype(q.dtype) == jnp.float32 else None,
    )
    grid = (num_tiles, K, splits)
    pages_spec = pl.BlockSpec((P, page_size, None, H), lambda i, h, sp: (0, 0, h, 0))
    scales_spec = pl.BlockSpec((P, page_size, None), lambda i, h, sp: (0, 0, h))
    in_specs = [
        pl.BlockSpec((None, 4), lambda i, h, sp: (i, 0)),
        pl.BlockSpec(tables.shape, lambda i, h, sp: (0, 0)),
        pl.BlockSpec((None, bq, None, Gp, H), lambda i, h, sp: (i, 0, h, 0, 0)),
        pages_spec,
        pages_spec,
    ]
    args = [meta, tables, q_tiles, k_pages, v_pages]
    if quantized:
        in_specs += [scales_spec, scales_spec]
        args += [k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)]
    o, lse = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, rows, H), lambda i, h, sp: (sp, i, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, h, sp: (sp, i, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, num_tiles, K, rows, H), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_tiles, K, rows), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
        interpret=interpret,
        debug=debug,
        name="ragged_paged_attention",
    )(*args)

    if splits == 1:
        out = o[0]
    else:  # combine normalised partials by their log-sum-exps
        w = jnp.exp(lse - lse.max(axis=0, keepdims=True))  # f32[splits, tiles, K, rows]
        out = (w[..., None] * o).sum(0) / w.sum(0)[..., None]

    # Back to tokens: token t of sequence s is row (t - cu_q_lens[s]) % block_q of tile
    # cu_tiles[s] + (t - cu_q_lens[s]) // block_q.
    out = out.reshape(num_tiles, K, bq, Gp, H)
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], t, side="right"), S - 1).astype(jnp.int32)
    off = t - cu_q_lens[seq]
    tile = jnp.clip(cu_tiles[seq] + off // bq, 0, num_tiles - 1)
    out = out[tile, :, off % bq, :G]  # [T, K, G, H]
    is_real = t < cu_q_lens[num_seqs]
    return jnp.where(is_real[:, None, None, None], out, 0.0).reshape(T, N, H).astype(q.dtype)
