"""Ragged paged attention: the specification, in plain XLA. Runs on every backend.

One call serves a ragged batch of sequences. Sequence s owns query tokens `cu_q_lens[s]:cu_q_lens[s+1]` of `q`
(a prefill chunk, a single decode token, or 1+K speculative verify tokens). Its keys and values live in the pages
listed by `block_tables[s]`; it has `seq_lens[s]` of them, and these already include the new tokens' own keys.
The new tokens are the *last* `q_len` positions of the sequence, so query i of sequence s sits at position
`seq_lens[s] - q_len + i` and attends causally to keys at positions `<= ` its own.

Tokens at index >= `cu_q_lens[num_seqs]` are padding: their output is zero. Block-table entries past a sequence's
length may point anywhere (the engine uses page 0, the padding sink); they are masked.

Algorithm (kept simple on purpose; the Pallas kernel must match it): tokens are processed in tiles of `block_q`;
each token gathers the pages of its own sequence, scores them, masks non-causal and out-of-range positions, and
takes a float32 softmax. Cost is O(T * max_pages * page_size) per call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_MASKED = -1e30


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


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q"))
def ragged_paged_attention(
    q: jax.Array,  # f[T, N, H]
    k_pages: jax.Array,  # f[P, page_size, K, H]
    v_pages: jax.Array,  # f[P, page_size, K, H]
    block_tables: jax.Array,  # i32[S, max_pages]
    seq_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    *,
    sm_scale: float,
    block_q: int = 16,
) -> jax.Array:  # f[T, N, H]
    T, N, H = q.shape
    _, page_size, K, _ = k_pages.shape
    S, max_pages = block_tables.shape
    if N % K:
        raise ValueError(f"query heads ({N}) must be a multiple of kv heads ({K})")
    G = N // K
    ctx = max_pages * page_size

    seq, pos, is_real = token_metadata(cu_q_lens, seq_lens, num_seqs, T)
    block_q = min(block_q, T)
    num_tiles = -(-T // block_q)
    pad = num_tiles * block_q - T

    def tiles(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num_tiles, block_q, *x.shape[1:])

    def one_tile(args):
        q_t, seq_t, pos_t, real_t = args  # [B, N, H], [B], [B], [B]
        pages = block_tables[seq_t]  # [B, max_pages]
        k = k_pages[pages].reshape(block_q, ctx, K, H)
        v = v_pages[pages].reshape(block_q, ctx, K, H)
        qg = q_t.reshape(block_q, K, G, H)
        s = jnp.einsum("bkgh,bckh->bkgc", qg, k, preferred_element_type=jnp.float32) * sm_scale
        visible = (jnp.arange(ctx)[None, :] <= pos_t[:, None]) & real_t[:, None]  # [B, ctx]
        s = jnp.where(visible[:, None, None, :], s, _MASKED)
        p = jax.nn.softmax(s, axis=-1)
        v = jnp.where(visible[:, :, None, None], v, 0)  # stale or NaN values in unused slots must not leak (0 * NaN)
        o = jnp.einsum("bkgc,bckh->bkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        o = jnp.where(real_t[:, None, None, None], o, 0.0)
        return o.reshape(block_q, N, H).astype(q.dtype)

    out = jax.lax.map(one_tile, (tiles(q), tiles(seq), tiles(pos), tiles(is_real)))
    return out.reshape(num_tiles * block_q, N, H)[:T]


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float) -> jax.Array:
    """Contiguous single-sequence causal attention, the textbook definition the paged version must equal.

    q: f[T, N, H] (the last T positions), k/v: f[L, K, H] (all L positions) -> f[T, N, H]
    """
    T, N, H = q.shape
    L, K, _ = k.shape
    qg = q.reshape(T, K, N // K, H)
    s = jnp.einsum("tkgh,lkh->tkgl", qg, k, preferred_element_type=jnp.float32) * sm_scale
    qpos = L - T + jnp.arange(T)
    s = jnp.where(jnp.arange(L)[None, None, None, :] <= qpos[:, None, None, None], s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("tkgl,lkh->tkgh", p, v.astype(jnp.float32)).reshape(T, N, H).astype(q.dtype)
