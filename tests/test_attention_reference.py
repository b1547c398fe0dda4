"""The ragged paged attention reference equals dense causal attention, sequence by sequence.

Unused pages and slots hold NaN so that any read of padding shows up in the output.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention.reference import dense_causal_attention, ragged_paged_attention


def _case(rng, q_lens, kv_lens, *, N=4, K=2, H=16, page_size=4, max_pages=8, pad_tokens=3):
    S = len(q_lens)
    num_pages = 1 + S * max_pages
    k_pages = np.full((num_pages, page_size, K, H), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    block_tables = np.zeros((S + 1, max_pages), np.int32)  # one padding sequence row
    perm = rng.permutation(np.arange(1, num_pages))  # pages scattered, not contiguous
    dense = []
    for s, L in enumerate(kv_lens):
        pages = perm[s * max_pages : (s + 1) * max_pages]
        block_tables[s, : -(-L // page_size)] = pages[: -(-L // page_size)]
        k, v = rng.normal(size=(L, K, H)).astype(np.float32), rng.normal(size=(L, K, H)).astype(np.float32)
        for p in range(L):
            k_pages[pages[p // page_size], p % page_size] = k[p]
            v_pages[pages[p // page_size], p % page_size] = v[p]
        dense.append((k, v))
    T = sum(q_lens) + pad_tokens
    q = rng.normal(size=(T, N, H)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)]]).astype(np.int32)
    seq_lens = np.array(list(kv_lens) + [0], np.int32)
    return q, k_pages, v_pages, block_tables, seq_lens, cu, dense


@pytest.mark.parametrize(
    "q_lens,kv_lens",
    [
        ([1, 1, 1], [5, 17, 32]),  # decodes
        ([9], [9]),  # one prefill
        ([6, 1, 3, 1], [6, 20, 11, 1]),  # mixed prefill chunks and decodes
        ([4, 2], [4 * 3, 4]),  # chunk ending exactly on a page boundary
    ],
)
@pytest.mark.parametrize("block_q,chunk_pages", [(1, 1), (4, 2), (16, 3), (32, 16)])
def test_matches_dense(q_lens, kv_lens, block_q, chunk_pages):
    rng = np.random.default_rng(0)
    q, kp, vp, bt, sl, cu, dense = _case(rng, q_lens, kv_lens)
    out = np.asarray(
        ragged_paged_attention(
            jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(bt), jnp.asarray(sl), jnp.asarray(cu),
            jnp.asarray(len(q_lens), jnp.int32), sm_scale=0.25, block_q=block_q, chunk_pages=chunk_pages,
        )
    )
    t = 0
    for n, (k, v) in zip(q_lens, dense):
        ref = np.asarray(dense_causal_attention(jnp.asarray(q[t : t + n]), jnp.asarray(k), jnp.asarray(v),
                                                sm_scale=0.25))
        np.testing.assert_allclose(out[t : t + n], ref, atol=1e-5, rtol=1e-5)
        t += n
    assert np.all(out[t:] == 0), "padding tokens must produce zeros"
    assert np.isfinite(out).all()
