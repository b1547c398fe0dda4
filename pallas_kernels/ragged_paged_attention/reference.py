"""Ragged paged attention: the specification, in plain XLA. Runs on every backend.

One call serves a ragged batch of sequences. Sequence s owns query tokens `cu_q_lens[s]:cu_q_lens[s+1]` of `q`
(a prefill chunk, a single decode token, or 1+K speculative verify tokens). Its keys and values live in the pages
listed by `block_tables[s]`; it has `seq_lens[s]` of them, and these already include the new tokens' own keys.
The new tokens are the *last* `q_len` positions of the sequence, so query i of sequence s sits at position
`seq_lens[s] - q_len + i` and attends causally to keys at positions `<= ` its own.

Tokens at index >= `cu_q_lens[num_seqs]` are padding: their output is zero. Block-table entries past a sequence's
length may point anywhere (the engine uses page 0, the padding sink); they are masked.

Quantized KV (int8 / fp8 e4m3): pages hold the quantized values and `k_scales` / `v_scales` f32[P, page_size, K]
hold one scale per token and kv head, so a key is `k_pages[p, o, k, :].astype(f32) * k_scales[p, o, k]`
(`quantize_kv` below defines the format: scale = max|x| / the type's largest value). Float caches pass no scales.

Algorithm (the Pallas kernel computes the same thing): tokens are processed in tiles of `block_q`; each tile walks
the pages of its tokens' sequences chunk by chunk with an online float32 softmax, masking non-causal and
out-of-range positions, and stops at the last chunk any of its tokens can see.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_MASKED = -1e30
GATHER_MODE = 'fill'

# The largest finite value of each quantized KV type: a token's scale maps its largest |x| onto it.
QUANT_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Per-token, per-head symmetric quantization of new keys or values.

    x: f[T, K, H] -> (q[T, K, H] of `dtype`, f32[T, K] scales) with x ~= q * scale[..., None].
    """
    dtype = jnp.dtype(dtype)
    qmax = QUANT_MAX[dtype.name]
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / qmax  # [T, K]
    y = x / jnp.where(scale > 0, scale, 1.0)[..., None]
    if dtype == jnp.int8:
        y = jnp.round(y)
    return jnp.clip(y, -qmax, qmax).astype(dtype), scale


def dequantize(x: jax.Array, scale: jax.Array | None) -> jax.Array:
    """f32 values of gathered pages: x[..., K, H] (any KV dtype), scale f32[..., K] or None (float cache)."""
    x = x.astype(jnp.float32)
    return x if scale is None else x * scale[..., None]


def token_metadata(cu_q_lens: jax.Array, seq_lens: jax.Array, num_seqs: jax.Array, num_tokens: int):
    """Per-token (sequence index, absolute position, is-real) for a ragged batch.

    cu_q_lens: i32[S+1], seq_lens: i32[S], num_seqs: i32[] -> (i32[T], i32[T], bool[T])
    """
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, seq_lens.shape[0] - 1)
    is_real = t < cu_q_lens[num_seqs]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = seq_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, pos, is_real


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "chunk_pages", "sliding_window", "soft_cap"))
def ragged_paged_attention(
    q: jax.Array,  # f[T, N, H]
    k_pages: jax.Array,  # f[P, page_size, K, H]
    v_pages: jax.Array,  # f[P, page_size, K, H]
    block_tables: jax.Array,  # i32[S, max_pages]
    seq_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    k_scales: jax.Array | None = None,  # f32[P, page_size, K]  (quantized caches only)
    v_scales: jax.Array | None = None,  # f32[P, page_size, K]
    *,
    sm_scale: float,
    block_q: int = 32,
    chunk_pages: int = 8,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # f[T, N, H]
    seq, pos, is_real = token_metadata(cu_q_lens, seq_lens, num_seqs, q.shape[0])
    return attend(
        q, k_pages, v_pages, block_tables, seq, pos, is_real, k_scales, v_scales,
        sm_scale=sm_scale, block_q=block_q, chunk_pages=chunk_pages, sliding_window=sliding_window, soft_cap=soft_cap,
    )


def attend(
    q: jax.Array,  # f[T, N, H]
    k_pages: jax.Array,  # f[P, page_size, K, H]
    v_pages: jax.Array,  # f[P, page_size, K, H]
    block_tables: jax.Array,  # i32[S, max_pages]
    seq: jax.Array,  # i32[T]   sequence of each token
    pos: jax.Array,  # i32[T]   absolute position of each token
    is_real: jax.Array,  # bool[T]
    k_scales: jax.Array | None = None,  # f32[P, page_size, K]  (quantized caches only)
    v_scales: jax.Array | None = None,  # f32[P, page_size, K]
    *,
    sm_scale: float,
    block_q: int = 32,
    chunk_pages: int = 8,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # f[T, N, H]
    """The body of `ragged_paged_attention`, given per-token metadata (callers running many layers over one batch
    compute the metadata once).

    Tokens go in tiles of `block_q`; each tile walks its keys in chunks of `chunk_pages` pages with an online
    (flash) softmax, and stops after the chunk holding its last token's position, so no work is spent on padded
    block-table columns or on keys in every query's future. A tile whose real tokens all belong to one sequence
    (a prefill chunk) gathers that sequence's pages once per chunk instead of once per token.

    Optional: `sliding_window` w (a query at position p sees keys p-w+1..p) and `soft_cap` c (scores become
    c * tanh(score / c) before the softmax).
    """
    T, N, H = q.shape
    _, page_size, K, _ = k_pages.shape
    S, max_pages = block_tables.shape
    if N % K:
        raise ValueError(f"query heads ({N}) must be a multiple of kv heads ({K})")
    G = N // K
    block_q = min(block_q, T)
    # Few query rows (decode) -> longer key chunks, so the chunk loop runs few iterations; the gathered chunk
    # (block_q x C keys) stays about the same size either way.
    chunk_pages = min(max(chunk_pages, chunk_pages * 32 // block_q), max_pages)
    C = chunk_pages * page_size  # keys per chunk
    num_chunks = -(-max_pages // chunk_pages)
    tables = jnp.pad(block_tables, ((0, 0), (0, num_chunks * chunk_pages - max_pages)))  # padding -> page 0, masked
    num_tiles = -(-T // block_q)
    pad = num_tiles * block_q - T

    def gather(pages_, scales, idx):  # f32 keys or values of the listed pages
        return dequantize(
            pages_.at[idx].get(mode=GATHER_MODE), None if scales is None else scales.at[idx].get(mode=GATHER_MODE)
        )

    def tiles(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num_tiles, block_q, *x.shape[1:])

    def one_tile(args):
        q_t, seq_t, pos_t, real_t = args  # [B, N, H], [B], [B], [B]
        qg = q_t.reshape(block_q, K, G, H).astype(jnp.float32) * sm_scale
        last = jnp.where(real_t, pos_t, -1)  # last visible key position per token (-1: none)
        single = jnp.all((seq_t == seq_t[0]) | ~real_t)
        tables_t = tables[seq_t]  # [B, num_chunks * chunk_pages]

        def chunk(j, carry):
            m, l, acc = carry  # running max f32[B, K, G], sum f32[B, K, G], output f32[B, K, G, H]
            pages = jax.lax.dynamic_slice_in_dim(tables_t, j * chunk_pages, chunk_pages, axis=1)  # [B, chunk_pages]
            visible = (j * C + jnp.arange(C))[None, :] <= last[:, None]  # [B, C]
            if sliding_window is not None:
                visible = visible & ((j * C + jnp.arange(C))[None, :] > last[:, None] - sliding_window)

            def scores_one():  # the whole tile is one sequence: one gather for all its tokens
                k = gather(k_pages, k_scales, pages[0]).reshape(C, K, H)
                v = gather(v_pages, v_scales, pages[0]).reshape(C, K, H)
                v = jnp.where(jnp.any(visible, 0)[:, None, None], v, 0)  # stale/NaN slots must not leak (0 * NaN)
                return jnp.einsum("bkgh,ckh->bkgc", qg, k), v

            def scores_each():
                k = gather(k_pages, k_scales, pages).reshape(block_q, C, K, H)
                v = gather(v_pages, v_scales, pages).reshape(block_q, C, K, H)
                v = jnp.where(visible[:, :, None, None], v, 0)
                return jnp.einsum("bkgh,bckh->bkgc", qg, k), v

            def update(s, v, pv_spec):
                if soft_cap is not None:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                s = jnp.where(visible[:, None, None, :], s, _MASKED)
                m_new = jnp.maximum(m, s.max(-1))
                # Weights below e^-80 are flushed to exactly 0 (their share of the softmax is < 1e-34): their exp
                # would be a subnormal float, and subnormal operands make x86 arithmetic ~100x slower.
                z = s - m_new[..., None]
                p = jnp.where(visible[:, None, None, :] & (z > -80.0), jnp.exp(z), 0.0)
                scale = jnp.where(m - m_new > -80.0, jnp.exp(m - m_new), 0.0)  # same flush for the rescale
                pv = jnp.einsum(pv_spec, p, v, preferred_element_type=jnp.float32)
                return m_new, l * scale + p.sum(-1), acc * scale[..., None] + pv

            return jax.lax.cond(
                single,
                lambda: update(*scores_one(), "bkgc,ckh->bkgh"),
                lambda: update(*scores_each(), "bkgc,bckh->bkgh"),
            )

        init = (
            jnp.full((block_q, K, G), _MASKED, jnp.float32),
            jnp.zeros((block_q, K, G), jnp.float32),
            jnp.zeros((block_q, K, G, H), jnp.float32),
        )
        if num_chunks == 1:  # no loop at all: its per-layer overhead is ~10% of a batch-1 decode step on CPU
            _, l, acc = chunk(0, init)
        else:
            needed = jnp.minimum((jnp.max(last) + C) // C, num_chunks)  # chunks up to the tile's last visible key
            _, l, acc = jax.lax.fori_loop(0, needed, chunk, init)
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]
        o = jnp.where(real_t[:, None, None, None], o, 0.0)
        return o.reshape(block_q, N, H).astype(q.dtype)

    out = jax.lax.map(one_tile, (tiles(q), tiles(seq), tiles(pos), tiles(is_real)))
    return out.reshape(num_tiles * block_q, N, H)[:T]


def dense_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float, sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Contiguous single-sequence causal attention, the textbook definition the paged version must equal.

    q: f[T, N, H] (the last T positions), k/v: f[L, K, H] (all L positions) -> f[T, N, H]
    """
    T, N, H = q.shape
    L, K, _ = k.shape
    qg = q.reshape(T, K, N // K, H)
    s = jnp.einsum("tkgh,lkh->tkgl", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    qpos = L - T + jnp.arange(T)
    visible = jnp.arange(L)[None, None, None, :] <= qpos[:, None, None, None]
    if sliding_window is not None:
        visible = visible & (jnp.arange(L)[None, None, None, :] > qpos[:, None, None, None] - sliding_window)
    s = jnp.where(visible, s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("tkgl,lkh->tkgh", p, v.astype(jnp.float32)).reshape(T, N, H).astype(q.dtype)
