"""Ragged paged attention: the Pallas kernel (interpret mode on CPU) against the XLA reference, the reference
against dense attention in float64 numpy, the public entry's validation and fallback, and the quantized KV write.

Every case scatters its pages over a permuted pool and fills every unused page, every slot past a sequence's
length and the padding sink (page 0) with NaN (quantized pools: NaN scales and garbage values), so any read
outside a sequence's keys shows up in the output.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels.ragged_paged_attention import reference
from pallas_kernels.ragged_paged_attention.kernel import BlockSizes, ragged_paged_attention_kernel

# Max |kernel - reference| by KV dtype (queries in f32 except for the 16-bit float caches, whose matrix products
# run in that dtype with f32 accumulation, as on the GPU). Outputs are O(1).
TOLERANCE = {
    "float32": 2e-5,
    "bfloat16": 3e-2,
    "float16": 4e-3,
    "int8": 2e-5,  # both sides dequantize the same stored values exactly; only summation order differs
    "float8_e4m3fn": 2e-5,
}
QUANTIZED = ("int8", "float8_e4m3fn")


def make_case(
    q_lens, kv_lens, *, N=4, K=2, H=64, page_size=8, kv_dtype="float32", pad_tokens=3, seed=0, max_pages=None
):
    """A ragged batch with one padding sequence row and `pad_tokens` padding tokens. Returns (args, dense) where
    args are the entry's positional inputs and dense[s] = (q f64[q_len, N, H], k f64[L, K, H], v f64[L, K, H])
    holding the values the cache actually stores (dequantized for int8/fp8)."""
    rng = np.random.default_rng(seed)
    S = len(q_lens)
    max_pages = max_pages or max(-(-L // page_size) for L in kv_lens) + 1  # one spare column, padded with page 0
    num_pages = 1 + S * max_pages + 2  # + 2 pages nobody owns
    quantized = kv_dtype in QUANTIZED
    store = np.float32 if quantized else jnp.dtype(kv_dtype)
    k_pages = np.full((num_pages, page_size, K, H), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    block_tables = np.zeros((S + 1, max_pages), np.int32)
    perm = rng.permutation(np.arange(1, num_pages))
    dense = []
    for s, L in enumerate(kv_lens):
        n = -(-L // page_size)
        pages = perm[s * max_pages : s * max_pages + n]
        block_tables[s, :n] = pages
        k = rng.normal(size=(L, K, H)).astype(store).astype(np.float32)
        v = rng.normal(size=(L, K, H)).astype(store).astype(np.float32)
        for p in range(L):
            k_pages[pages[p // page_size], p % page_size] = k[p]
            v_pages[pages[p // page_size], p % page_size] = v[p]
        dense.append([k.astype(np.float64), v.astype(np.float64)])
    q_dtype = kv_dtype if kv_dtype in ("bfloat16", "float16") else "float32"
    T = sum(q_lens) + pad_tokens
    q = rng.normal(size=(T, N, H)).astype(jnp.dtype(q_dtype))
    cu = np.array([0, *np.cumsum(q_lens), sum(q_lens)], np.int32)
    seq_lens = np.array([*kv_lens, 0], np.int32)
    k_scales = v_scales = None
    if quantized:  # quantize every slot; NaN slots get NaN scales and garbage values
        qk, sk = reference.quantize_kv(jnp.asarray(k_pages.reshape(-1, K, H)), kv_dtype)
        qv, sv = reference.quantize_kv(jnp.asarray(v_pages.reshape(-1, K, H)), kv_dtype)
        k_pages, v_pages = (np.asarray(x).reshape(num_pages, page_size, K, H) for x in (qk, qv))
        k_scales, v_scales = (np.asarray(x).reshape(num_pages, page_size, K) for x in (sk, sv))
        for s, L in enumerate(kv_lens):  # what the cache really holds, in float64
            for p in range(L):
                page, off = block_tables[s, p // page_size], p % page_size
                dense[s][0][p] = k_pages[page, off].astype(np.float64) * k_scales[page, off][:, None]
                dense[s][1][p] = v_pages[page, off].astype(np.float64) * v_scales[page, off][:, None]
    t = 0
    for s, n in enumerate(q_lens):
        dense[s].insert(0, q[t : t + n].astype(np.float64))
        t += n
    args = [q, k_pages, v_pages, block_tables, seq_lens, cu, np.int32(S), k_scales, v_scales]
    return [None if a is None else jnp.asarray(a) for a in args], dense


def dense_f64(q, k, v, *, sm_scale, sliding_window=None, soft_cap=None):
    """Textbook causal attention in float64: q [T, N, H] are the last T of the L positions of k, v [L, K, H]."""
    T, N, H = q.shape
    L, K, _ = k.shape
    kk, vv = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)  # query head n uses kv head n // G
    s = np.einsum("tnh,lnh->ntl", q, kk) * sm_scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    qpos, kpos = L - T + np.arange(T), np.arange(L)
    visible = kpos[None, :] <= qpos[:, None]
    if sliding_window is not None:
        visible &= kpos[None, :] > qpos[:, None] - sliding_window
    s = np.where(visible[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("ntl,lnh->tnh", p, vv)


def run_kernel(args, *, block_sizes=None, **kw):
    if block_sizes is None:
        return rpa.ragged_paged_attention(*args, interpret=True, impl="kernel", **kw)
    return ragged_paged_attention_kernel(*args, block_sizes=block_sizes, interpret=True, **kw)


def check_against_reference(args, kv_dtype, q_lens, **kw):
    out = np.asarray(run_kernel(args, **kw).astype(jnp.float32))
    extra = {k: v for k, v in kw.items() if k != "block_sizes"}
    ref = np.asarray(reference.ragged_paged_attention(*args, **extra).astype(jnp.float32))
    assert np.isfinite(out).all(), "NaN/inf in the kernel output: a padded or unused slot was read"
    np.testing.assert_allclose(out, ref, atol=TOLERANCE[kv_dtype], rtol=0)
    assert np.all(out[sum(q_lens) :] == 0), "padding tokens must produce zeros"
    return out


MIXES = {
    "decode": ([1, 1, 1, 1, 1], [1, 7, 8, 17, 40]),  # incl. lengths ending exactly on a page boundary
    "prefill": ([23], [23]),
    "prefill_chunk": ([16], [41]),  # a later chunk of a long prompt
    "mixed": ([6, 1, 3, 1, 9], [6, 20, 11, 1, 33]),
    "verify_k1_to_7": ([2, 3, 4, 5, 6, 7, 8], [9, 16, 4, 30, 17, 7, 24]),  # 1 + K queries, K = 1..7
    "verify_and_decode": ([4, 1, 8, 1], [12, 5, 40, 33]),
}


@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("mix", list(MIXES))
def test_kernel_matches_reference_q_len_mixes(mix, page_size):
    q_lens, kv_lens = MIXES[mix]
    args, _ = make_case(q_lens, kv_lens, page_size=page_size)
    check_against_reference(args, "float32", q_lens, sm_scale=0.125)


@pytest.mark.parametrize("page_size", [32, 128])  # pages larger than a key step: one page per step
def test_kernel_matches_reference_large_pages(page_size):
    q_lens, kv_lens = [20, 1, 1, 4], [150, 129, 32, 260]
    args, _ = make_case(q_lens, kv_lens, page_size=page_size, seed=10)
    check_against_reference(args, "float32", q_lens, sm_scale=0.125)


@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (8, 1), (6, 2), (16, 2)])  # MHA, GQA 2, MQA, G=3 (padded), G=8
def test_kernel_matches_reference_gqa(N, K):
    q_lens, kv_lens = MIXES["mixed"]
    args, _ = make_case(q_lens, kv_lens, N=N, K=K, seed=1)
    check_against_reference(args, "float32", q_lens, sm_scale=0.125)


@pytest.mark.parametrize("kv_dtype", list(TOLERANCE))
def test_kernel_matches_reference_kv_dtypes(kv_dtype):
    q_lens, kv_lens = MIXES["mixed"]
    args, _ = make_case(q_lens, kv_lens, kv_dtype=kv_dtype, seed=2)
    check_against_reference(args, kv_dtype, q_lens, sm_scale=0.125)


@pytest.mark.parametrize(
    "block_sizes",
    [
        BlockSizes(block_q=1, chunk_pages=1),  # one query token per tile, one page per step
        BlockSizes(block_q=2, chunk_pages=2, num_kv_splits=2),
        BlockSizes(block_q=8, chunk_pages=4, num_kv_splits=4),  # splits with no keys at all for short sequences
        BlockSizes(block_q=16, chunk_pages=8),  # one tile covers a whole prefill chunk
    ],
    ids=lambda b: f"bq{b.block_q}-cp{b.chunk_pages}-split{b.num_kv_splits}",
)
def test_kernel_matches_reference_block_sizes(block_sizes):
    q_lens, kv_lens = MIXES["verify_and_decode"]
    args, _ = make_case(q_lens, kv_lens, seed=3)
    check_against_reference(args, "float32", q_lens, sm_scale=0.125, block_sizes=block_sizes)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_kernel_sliding_window_and_soft_cap(kv_dtype):
    q_lens, kv_lens = MIXES["mixed"]
    args, _ = make_case(q_lens, kv_lens, kv_dtype=kv_dtype, seed=4)
    check_against_reference(args, kv_dtype, q_lens, sm_scale=0.5, sliding_window=5)
    check_against_reference(args, kv_dtype, q_lens, sm_scale=0.5, soft_cap=2.0)
    check_against_reference(  # window starts mid-chunk and mid-split
        args, kv_dtype, q_lens, sm_scale=0.5, sliding_window=13, soft_cap=3.0,
        block_sizes=BlockSizes(block_q=4, chunk_pages=1, num_kv_splits=2),
    )


def test_kernel_head_dim_128_bf16():
    q_lens, kv_lens = MIXES["verify_and_decode"]
    args, _ = make_case(q_lens, kv_lens, N=8, K=2, H=128, page_size=16, kv_dtype="bfloat16", seed=5)
    check_against_reference(args, "bfloat16", q_lens, sm_scale=128**-0.5)


@pytest.mark.parametrize(
    "mix,kv_dtype,window,cap",
    [
        ("decode", "float32", None, None),
        ("mixed", "float32", None, None),
        ("verify_k1_to_7", "float32", None, None),
        ("mixed", "float32", 7, 2.5),
        ("mixed", "int8", None, None),
        ("verify_and_decode", "float8_e4m3fn", None, None),
        ("mixed", "float8_e4m3fn", 9, None),
    ],
)
def test_reference_matches_float64_dense(mix, kv_dtype, window, cap):
    q_lens, kv_lens = MIXES[mix]
    args, dense = make_case(q_lens, kv_lens, kv_dtype=kv_dtype, seed=6)
    out = np.asarray(reference.ragged_paged_attention(*args, sm_scale=0.25, sliding_window=window, soft_cap=cap))
    t = 0
    for n, (q, k, v) in zip(q_lens, dense):
        want = dense_f64(q, k, v, sm_scale=0.25, sliding_window=window, soft_cap=cap)
        np.testing.assert_allclose(out[t : t + n], want, atol=2e-5, rtol=0)
        t += n
    assert np.all(out[t:] == 0)


def test_kernel_matches_float64_dense_quantized():
    """The kernel on an int8 cache equals float64 attention over the dequantized values."""
    q_lens, kv_lens = MIXES["mixed"]
    args, dense = make_case(q_lens, kv_lens, kv_dtype="int8", seed=7)
    out = np.asarray(run_kernel(args, sm_scale=0.25))
    t = 0
    for n, (q, k, v) in zip(q_lens, dense):
        np.testing.assert_allclose(out[t : t + n], dense_f64(q, k, v, sm_scale=0.25), atol=2e-5, rtol=0)
        t += n


# --- the public entry ----------------------------------------------------------------------------------------


def test_entry_uses_reference_on_cpu_and_kernel_when_interpreting():
    args, _ = make_case([1], [5])
    q, k_pages = args[0], args[1]
    assert jax.default_backend() == "cpu"
    assert rpa.select_impl(q, k_pages) == "reference"
    assert rpa.select_impl(q, k_pages, interpret=True) == "kernel"
    assert rpa.select_impl(q, k_pages, impl="reference", interpret=True) == "reference"


def test_entry_falls_back_and_says_so(caplog):
    q_lens, kv_lens = [2, 1], [9, 4]
    args, _ = make_case(q_lens, kv_lens, H=32)  # head dim outside the kernel's table
    assert rpa.unsupported_reason(args[0], args[1]) == "head_dim 32 not in (64, 128)"
    with caplog.at_level(logging.WARNING, logger=rpa.__name__):
        out = rpa.ragged_paged_attention(*args, sm_scale=0.2, interpret=True)
    assert "falling back to the XLA reference: head_dim 32" in caplog.text
    ref = reference.ragged_paged_attention(*args, sm_scale=0.2)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    with pytest.raises(ValueError, match="does not cover this call: head_dim 32"):
        rpa.ragged_paged_attention(*args, sm_scale=0.2, impl="kernel")


def test_entry_validates():
    args, _ = make_case([1], [5], kv_dtype="int8")
    with pytest.raises(ValueError, match="scales are required exactly for quantized KV"):
        rpa.ragged_paged_attention(*args[:7], sm_scale=1.0)
    with pytest.raises(ValueError, match="v_pages must match k_pages"):
        rpa.ragged_paged_attention(args[0], args[1], args[2][:-1], *args[3:], sm_scale=1.0)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        rpa.ragged_paged_attention(*args, sm_scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="cu_q_lens \\[S\\+1\\]"):
        rpa.ragged_paged_attention(*args[:5], args[5][:-1], *args[6:], sm_scale=1.0)


def test_block_table_entries():
    """Every table entry gives power-of-two tiles with >= 16 rows (Triton's dot minimum)."""
    for (mode, head_dim), entry in rpa.BLOCK_TABLE.items():
        assert entry.rows >= 16 and entry.rows & (entry.rows - 1) == 0, (mode, head_dim)
    bs = rpa.block_sizes_for(num_tokens=32, num_seqs=32, num_q_heads=32, num_kv_heads=8, head_dim=128,
                             page_size=16, max_pages=128)
    assert (bs.block_q, bs.chunk_pages) == (4, 4)  # 4 tokens x 4 heads = 16 rows, 4 pages x 16 = 64 keys
    assert bs.num_kv_splits == 2  # 32 tiles x 8 kv heads = 256 programs < 2 per SM: split keys in two
    bs = rpa.block_sizes_for(num_tokens=4, num_seqs=4, num_q_heads=32, num_kv_heads=8, head_dim=128,
                             page_size=16, max_pages=256)
    assert bs.num_kv_splits == 8  # 32 programs: split each sequence's keys 8 ways
    bs = rpa.block_sizes_for(num_tokens=2048, num_seqs=8, num_q_heads=32, num_kv_heads=8, head_dim=128,
                             page_size=64, max_pages=64)
    assert (bs.block_q, bs.chunk_pages, bs.num_kv_splits) == (16, 1, 1)


# --- KV write path: quantization on the way in, exact ------------------------------------------------------


def _quantize_numpy(x: np.ndarray, dtype: str):
    """The cache format, restated in numpy: per token and head, scale = max|x| / qmax (f32)."""
    qmax = np.float32(reference.QUANT_MAX[dtype])
    scale = np.abs(x).max(-1) / qmax
    y = x / np.where(scale > 0, scale, np.float32(1))[..., None]
    if dtype == "int8":
        return np.clip(np.round(y), -qmax, qmax).astype(np.int8), scale
    return np.clip(y, -qmax, qmax).astype(ml_dtypes.float8_e4m3fn), scale


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_quantized_write_is_exact(dtype):
    from jaxserve.kv_cache import KVCache, write_kv

    rng = np.random.default_rng(8)
    L, P, page_size, K, H, T = 2, 6, 4, 2, 64, 7
    sentinel = np.asarray(jnp.asarray(np.full((L, P, page_size, K, H), 3.0, np.float32)).astype(dtype))
    kv = KVCache(
        k=jnp.asarray(sentinel), v=jnp.asarray(sentinel),
        k_scale=jnp.full((L, P, page_size, K), jnp.nan), v_scale=jnp.full((L, P, page_size, K), jnp.nan),
    )
    k = (rng.normal(size=(T, K, H)) * rng.uniform(0.01, 10, size=(T, K, 1))).astype(np.float32)
    v = rng.normal(size=(T, K, H)).astype(np.float32)
    k[3, 1] = 0.0  # an all-zero head: scale 0, values 0
    slots = np.array([5, 6, 7, 8, 13, 21, 22], np.int32)
    out = jax.jit(write_kv)(kv, jnp.int32(1), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    page, off = slots // page_size, slots % page_size
    for got, got_scale, x in ((out.k, out.k_scale, k), (out.v, out.v_scale, v)):
        # Bit-exact: the cache holds exactly what the format function produces.
        want, want_scale = (np.asarray(a) for a in jax.jit(reference.quantize_kv, static_argnums=1)(x, dtype))
        got, got_scale = np.asarray(got), np.asarray(got_scale)
        np.testing.assert_array_equal(got[1, page, off].view(np.uint8), want.view(np.uint8))
        np.testing.assert_array_equal(got_scale[1, page, off], want_scale)
        # The format restated in numpy: XLA turns x / 127 into x * (1 / 127), so scales may differ by an ulp
        # and a value sitting on a rounding boundary by one step.
        np_q, np_scale = _quantize_numpy(x, dtype)
        np.testing.assert_allclose(want_scale, np_scale, rtol=3e-7, atol=0)
        if dtype == "int8":
            diff = np.abs(want.astype(np.int32) - np_q.astype(np.int32))
            assert diff.max() <= 1 and (diff > 0).mean() < 0.01, f"int8 values differ by up to {diff.max()}"
        else:  # at most one e4m3 step (3 mantissa bits: 12.5%)
            np.testing.assert_allclose(want.astype(np.float32), np_q.astype(np.float32), rtol=0.125, atol=0)
        untouched = np.ones((L, P, page_size), bool)
        untouched[1, page, off] = False
        untouched[1, 0, 0] = False  # the padding sink slot the write path also touches
        np.testing.assert_array_equal(got[untouched].view(np.uint8), sentinel[untouched].view(np.uint8))
        assert np.isnan(got_scale[untouched]).all()


# --- the model through jaxserve/attention.py and jaxserve/ops.py ------------------------------------------


def test_model_step_through_kernel_matches_reference(tmp_path, monkeypatch):
    """A tiny Llama (head dim 64, GQA 4/2, 2 layers) run through the engine's attention dispatch with the kernel in
    interpret mode gives the reference path's logits: checks the wiring (layer i's pages at pool offset i * P)."""
    from jaxserve import ops
    from paged_harness import PagedModel
    from tiny_models import VARIANTS, make_tiny_model

    monkeypatch.setitem(VARIANTS, "llama_h64", dict(arch="llama", num_attention_heads=4, num_key_value_heads=2,
                                                    head_dim=64))
    make_tiny_model("llama_h64", str(tmp_path))
    rng = np.random.default_rng(9)
    prompts = {0: rng.integers(3, 300, 13).tolist(), 1: rng.integers(3, 300, 4).tolist()}
    steps = [prompts, {0: [5], 1: [7, 8, 9]}, {0: [11], 1: [12]}]  # prefill, verify-like + decode, decodes

    def run():
        model = PagedModel(str(tmp_path), num_seqs=2, page_size=8, pages_per_seq=4)
        return [model.step(chunks) for chunks in steps]

    want = run()
    # What a GPU resolves to (the harness runs the model with `ops.Backends.default()`), with the kernel forced.
    gpu = ops.Backends(attention="pallas", matmul="xla")
    monkeypatch.setattr(ops.Backends, "default", classmethod(lambda cls, *a, **k: gpu))
    monkeypatch.setattr(rpa, "select_impl", lambda *a, **k: "kernel")
    calls = []
    entry = rpa.ragged_paged_attention

    def interpreted(*args, **kwargs):
        calls.append(kwargs["impl"])
        return entry(*args, interpret=True, **kwargs)

    monkeypatch.setattr(rpa, "ragged_paged_attention", interpreted)
    got = run()
    assert calls and set(calls) == {"kernel"}, "the model did not reach the kernel"
    for step_want, step_got in zip(want, got):
        for i in step_want:
            np.testing.assert_allclose(step_got[i], step_want[i], atol=1e-4, rtol=0)
