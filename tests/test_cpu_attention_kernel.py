"""The native CPU attention kernel (`cpu_kernels/ragged_paged_attention`) against the XLA reference it replaces.

Sweeps decode / prefill / mixed ragged batches with padding tokens, GQA groups 1/3/4, page sizes 8/16, every KV
dtype (quantized ones with scales), sliding window and soft cap. Unused pages and stale slots are NaN-filled and
block-table entries past a sequence's length point at garbage pages, so any leak shows up as NaN. Also: the fallback
when the library cannot be built, the build cache, and greedy decoding of a tiny model with the native and the XLA
backend.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels.ragged_paged_attention as native
from cpu_kernels import build
from native_builds import build_for, cpu_flags
from pallas_kernels.ragged_paged_attention import reference

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler (g++) to build the native kernel"
)

AVX2 = {"avx2", "fma"} <= cpu_flags()
DECODE_PATH = "avx512f" in cpu_flags() or AVX2  # the builds with the batch-invariant decode path


@functools.cache
def _avx2_target(lib_dir: str) -> str:
    """The kernel built for x86-64-v3 (AVX2 + FMA), registered once per process: its FFI target's name."""
    lib = build_for(native.SOURCE, "x86-64-v3", lib_dir)
    target = f"{native.TARGET}_avx2_test"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.JaxserveRaggedPagedAttention), platform="cpu")
    return target


@pytest.fixture(params=["native", "x86-64-v3"])
def decode_build(request, tmp_path_factory, monkeypatch):
    """The library in use, or the kernel built for x86-64-v3 (AVX2 + FMA: the decode path on pairs of 8-lane
    registers) and called through `native.attend` in its place, so an AVX-512 machine tests the AVX2 build too."""
    if request.param == "native":
        return
    if not AVX2:
        pytest.skip("needs an x86-64 CPU with AVX2 and FMA")
    assert native.load()  # registers the library in use under its own name first (`load` is cached)
    target = _avx2_target(str(tmp_path_factory.getbasetemp()))
    monkeypatch.setattr(native, "TARGET", target)

TOL = {  # (atol, rtol) of native vs reference, by query dtype: both compute in f32; low-precision outputs may
    "float32": (1e-5, 1e-5),  # differ by one rounding step
    "bfloat16": (2e-2, 2e-2),
    "float16": (2e-3, 2e-3),
}


def make_case(q_lens, kv_lens, *, num_tokens=None, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
              kv_dtype="float32", q_dtype="float32", seed=0):
    """Inputs of `attend` for a ragged batch; sequence s's query tokens are its last q_lens[s] positions."""
    rng = np.random.default_rng(seed)
    S, K, H, N, ps = len(q_lens), num_kv_heads, head_dim, num_q_heads, page_size
    max_pages = max(-(-L // ps) for L in kv_lens) + 2
    num_garbage = 3
    P = 1 + num_garbage + sum(-(-L // ps) for L in kv_lens)
    k = rng.standard_normal((P, ps, K, H), np.float32)
    v = rng.standard_normal((P, ps, K, H), np.float32)
    garbage = list(range(0, 1 + num_garbage))  # page 0 (the padding sink) and a few unused pages
    k[garbage] = np.nan
    v[garbage] = np.nan
    tables = rng.choice(garbage, size=(S, max_pages)).astype(np.int32)  # past the length: garbage pages
    nxt = 1 + num_garbage
    for s, L in enumerate(kv_lens):
        n = -(-L // ps)
        pages = rng.permutation(np.arange(nxt, nxt + n))  # a sequence's pages are not contiguous in the pool
        tables[s, :n] = pages
        nxt += n
        last, used = pages[-1], L - (n - 1) * ps
        k[last, used:] = np.nan  # stale slots after the sequence's last key
        v[last, used:] = np.nan
    T = num_tokens or sum(q_lens)
    q = jnp.asarray(rng.standard_normal((T, N, H), np.float32), q_dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq, pos, is_real = reference.token_metadata(jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32), jnp.int32(S), T)
    if kv_dtype in native.QUANTIZED_KV_DTYPES:
        kq, ks = reference.quantize_kv(jnp.asarray(np.nan_to_num(k)).reshape(-1, K, H), kv_dtype)
        vq, vs = reference.quantize_kv(jnp.asarray(np.nan_to_num(v)).reshape(-1, K, H), kv_dtype)
        ks, vs = np.array(ks.reshape(P, ps, K)), np.array(vs.reshape(P, ps, K))
        ks[np.isnan(k[..., 0])] = np.nan  # quantized garbage: NaN scales
        vs[np.isnan(v[..., 0])] = np.nan
        kv = (kq.reshape(k.shape), vq.reshape(v.shape), jnp.asarray(ks), jnp.asarray(vs))
    else:
        kv = (jnp.asarray(k, kv_dtype), jnp.asarray(v, kv_dtype), None, None)
    return (q, kv[0], kv[1], jnp.asarray(tables), seq, pos, is_real, kv[2], kv[3]), 1.0 / np.sqrt(H)


def run_both(args, sm_scale, **kw):
    out = jax.jit(lambda *a: native.attend(*a, sm_scale=sm_scale, **kw))(*args)
    ref = jax.jit(lambda *a: reference.attend(*a, sm_scale=sm_scale, **kw))(*args)
    return out, ref


def assert_matches(out, ref, q_dtype):
    atol, rtol = TOL[q_dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out).all(), "NaN/inf leaked into the native output"
    np.testing.assert_allclose(out, ref, atol=atol, rtol=rtol)


@pytest.fixture(scope="module", autouse=True)
def library():
    assert native.load(), "g++ is present but the native kernel failed to build (see the warning)"


BATCHES = {
    "decode": ((1, 1, 1, 1, 1), (1, 17, 33, 64, 100), 8),  # 3 padding tokens
    "prefill": ((45,), (45,), None),
    "prefill_continued": ((70,), (150,), 72),  # a long chunk (several 32-token blocks) after cached context
    "mixed": ((13, 1, 4, 1, 30), (13, 50, 20, 3, 95), 64),  # prefill, decode, verify, decode, chunk + padding
}


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)], ids=["G1", "G3", "G4"])
@pytest.mark.parametrize("page_size", [8, 16])
def test_matches_reference_float32(batch, heads, page_size):
    q_lens, kv_lens, T = BATCHES[batch]
    args, sm_scale = make_case(q_lens, kv_lens, num_tokens=T, num_q_heads=heads[0], num_kv_heads=heads[1],
                               page_size=page_size)
    assert_matches(*run_both(args, sm_scale), "float32")


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_matches_reference_every_kv_dtype(kv_dtype, batch):
    q_lens, kv_lens, T = BATCHES[batch]
    args, sm_scale = make_case(q_lens, kv_lens, num_tokens=T, num_q_heads=9, num_kv_heads=3, kv_dtype=kv_dtype)
    assert_matches(*run_both(args, sm_scale), "float32")


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_head_dim_not_a_multiple_of_8(kv_dtype):
    q_lens, kv_lens, T = BATCHES["mixed"]
    args, sm_scale = make_case(q_lens, kv_lens, num_tokens=T, num_q_heads=6, num_kv_heads=2, head_dim=20,
                               page_size=8, kv_dtype=kv_dtype)
    assert_matches(*run_both(args, sm_scale), "float32")


@pytest.mark.parametrize("q_dtype", ["bfloat16", "float16"])
def test_low_precision_queries(q_dtype):
    q_lens, kv_lens, T = BATCHES["mixed"]
    args, sm_scale = make_case(q_lens, kv_lens, num_tokens=T, kv_dtype="bfloat16", q_dtype=q_dtype)
    assert_matches(*run_both(args, sm_scale), q_dtype)


@pytest.mark.parametrize("kw", [dict(sliding_window=1), dict(sliding_window=7), dict(sliding_window=40),
                                dict(soft_cap=2.0), dict(sliding_window=20, soft_cap=5.0)],
                         ids=["window1", "window7", "window40", "softcap", "window+softcap"])
@pytest.mark.parametrize("batch", ["mixed", "prefill_continued"])
def test_window_and_soft_cap(kw, batch):
    q_lens, kv_lens, T = BATCHES[batch]
    args, sm_scale = make_case(q_lens, kv_lens, num_tokens=T, num_q_heads=9, num_kv_heads=3, page_size=8)
    assert_matches(*run_both(args, sm_scale, **kw), "float32")


def test_padding_tokens_are_zero_and_all_padding_works():
    args, sm_scale = make_case((3, 1), (10, 40), num_tokens=16)
    out = np.asarray(jax.jit(lambda *a: native.attend(*a, sm_scale=sm_scale))(*args))
    assert (out[4:] == 0).all() and np.abs(out[:4]).min() > 0
    q, k, v, tables, seq, pos, is_real, ks, vs = args
    out = native.attend(q, k, v, tables, seq, pos, jnp.zeros_like(is_real), sm_scale=sm_scale)
    assert (np.asarray(out) == 0).all()


@pytest.mark.parametrize("kw", [{}, dict(sliding_window=9), dict(soft_cap=3.0)], ids=["plain", "window", "softcap"])
@pytest.mark.parametrize("q_len", [1, 20, 50])
def test_single_sequence_equals_dense_attention(q_len, kw):
    """One contiguous sequence, paged: equals the textbook dense causal attention."""
    L, K, H, N, ps = 50, 2, 32, 6, 8
    rng = np.random.default_rng(1)
    k = rng.standard_normal((L, K, H), np.float32)
    v = rng.standard_normal((L, K, H), np.float32)
    q = jnp.asarray(rng.standard_normal((q_len, N, H), np.float32))
    n = -(-L // ps)
    pad = n * ps - L
    k_pages = np.concatenate([np.full((1, ps, K, H), np.nan, np.float32),
                              np.pad(k, ((0, pad), (0, 0), (0, 0)), constant_values=np.nan).reshape(n, ps, K, H)])
    v_pages = np.concatenate([np.full((1, ps, K, H), np.nan, np.float32),
                              np.pad(v, ((0, pad), (0, 0), (0, 0)), constant_values=np.nan).reshape(n, ps, K, H)])
    tables = jnp.asarray(np.arange(1, n + 1, dtype=np.int32)[None])
    pos = jnp.arange(L - q_len, L, dtype=jnp.int32)
    seq, is_real = jnp.zeros(q_len, jnp.int32), jnp.ones(q_len, bool)
    sm_scale = 1.0 / np.sqrt(H)
    out = native.attend(q, jnp.asarray(k_pages), jnp.asarray(v_pages), tables, seq, pos, is_real,
                        sm_scale=sm_scale, **kw)
    dense = reference.dense_causal_attention(q, jnp.asarray(k), jnp.asarray(v), sm_scale=sm_scale, **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not DECODE_PATH, reason="the batch-invariant decode path needs AVX-512 or AVX2")
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])  # the decode path's KV dtypes
@pytest.mark.parametrize("window", [2, 4, 16])
@pytest.mark.parametrize("kw", [{}, dict(sliding_window=21)], ids=["plain", "window"])
def test_a_verify_window_is_computed_bit_for_bit_as_decode_steps(kv_dtype, window, kw, decode_build):
    """Speculative decoding's losslessness and batch invariance, at the kernel: each token of a sequence's verify
    window (K + 1 tokens, in a batch beside a prefill chunk and a decode) and of the prefill chunk gets exactly the
    bits it gets alone as a decode token at its position. A last-bit difference would be enough to flip a greedy
    near-tie under a quantized weight scheme."""
    args, sm_scale = make_case((40, window, 1), (90, 70, 33), num_tokens=64, num_q_heads=9, num_kv_heads=3,
                               kv_dtype=kv_dtype)
    q, k, v, tables, seq, pos, is_real, ks, vs = args
    attend = jax.jit(lambda *a: native.attend(*a, sm_scale=sm_scale, **kw))
    batch = np.asarray(attend(*args))
    for t in range(40 + window):  # a prompt's bits do not depend on how the scheduler chunked it either
        alone = attend(q[t:t + 1], k, v, tables, seq[t:t + 1], pos[t:t + 1], is_real[t:t + 1], ks, vs)
        what = f"verify token {t - 40}" if t >= 40 else f"prefill token {t}"
        assert np.array_equal(np.asarray(alone)[0], batch[t]), f"{what} differs from its decode step"
    assert_matches(batch, reference.attend(*args, sm_scale=sm_scale, **kw), "float32")


@pytest.mark.skipif(not DECODE_PATH, reason="the batch-invariant decode path needs AVX-512 or AVX2")
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)], ids=["G1", "G3", "G4"])
def test_a_lone_decode_split_over_kv_heads_equals_it_in_a_batch(kv_dtype, heads, decode_build):
    """A step with fewer tokens than threads runs each kv head of a decode token as a task of its own (`MakeTasks`);
    the token's bits are those it gets among other decodes (one task per token), and match the reference."""
    args, sm_scale = make_case((1,) * 6, (200, 17, 33, 64, 100, 5), num_q_heads=heads[0], num_kv_heads=heads[1],
                               kv_dtype=kv_dtype)
    q, k, v, tables, seq, pos, is_real, ks, vs = args
    attend = jax.jit(lambda *a: native.attend(*a, sm_scale=sm_scale))
    batch = np.asarray(attend(*args))
    for t in range(6):
        alone = attend(q[t:t + 1], k, v, tables, seq[t:t + 1], pos[t:t + 1], is_real[t:t + 1], ks, vs)
        assert np.array_equal(np.asarray(alone)[0], batch[t]), f"decode token {t} alone differs from the batch's"
    assert_matches(batch, reference.attend(*args, sm_scale=sm_scale), "float32")


def test_runs_inside_scan_over_a_stacked_cache():
    """As the model calls it: one pool of L*P pages, block tables offset by layer * P, inside lax.scan."""
    args, sm_scale = make_case((5, 1, 1), (40, 33, 8), num_tokens=8, num_q_heads=9, num_kv_heads=3)
    q, k, v, tables, seq, pos, is_real, _, _ = args
    L, P = 3, k.shape[0]
    rng = np.random.default_rng(2)
    ks = jnp.asarray(rng.standard_normal((L, *k.shape), np.float32)).at[1].set(k)
    vs = jnp.asarray(rng.standard_normal((L, *v.shape), np.float32)).at[1].set(v)

    def step(attend, ks, vs):
        def layer(carry, i):
            o = attend(q, ks.reshape(L * P, *k.shape[1:]), vs.reshape(L * P, *v.shape[1:]), tables + i * P, seq,
                       pos, is_real, sm_scale=sm_scale)
            return carry, o

        return jax.lax.scan(layer, 0, jnp.arange(L, dtype=jnp.int32))[1]

    out = jax.jit(lambda a, b: step(native.attend, a, b))(ks, vs)
    ref = jax.jit(lambda a, b: step(reference.attend, a, b))(ks, vs)
    assert_matches(out, ref, "float32")
    assert_matches(out[1], reference.attend(*args, sm_scale=sm_scale), "float32")


def test_invalid_inputs_raise_clear_errors():
    args, sm_scale = make_case((2,), (2,), num_q_heads=4, num_kv_heads=2)
    q, k, v, tables, seq, pos, is_real, _, _ = args
    with pytest.raises(ValueError, match="multiple of kv heads"):
        native.attend(q[:, :3], k, v, tables, seq, pos, is_real, sm_scale=sm_scale)
    with pytest.raises(ValueError, match="needs k_scales"):
        native.attend(q, k.astype(jnp.int8), v.astype(jnp.int8), tables, seq, pos, is_real, sm_scale=sm_scale)
    with pytest.raises(ValueError, match="takes no k_scales"):
        native.attend(q, k, v, tables, seq, pos, is_real, k[..., 0], v[..., 0], sm_scale=sm_scale)
    with pytest.raises(ValueError, match="pos must be int32"):
        native.attend(q, k, v, tables, seq, pos[:1], is_real, sm_scale=sm_scale)
    with pytest.raises(ValueError, match="sliding_window"):
        native.attend(q, k, v, tables, seq, pos, is_real, sm_scale=sm_scale, sliding_window=0)


def test_falls_back_to_reference_when_the_library_cannot_be_built(monkeypatch, caplog):
    from jaxserve import ops
    from jaxserve.config import BACKEND_ENV, EngineConfig

    def no_build(source):
        raise build.BuildError("no C++ compiler: 'g++' is not on PATH")

    monkeypatch.setattr(native, "build_library", no_build)
    native.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert not native.load()
            assert not native.load()  # cached: one warning
        assert sum("native CPU attention unavailable" in r.message for r in caplog.records) == 1
        args, sm_scale = make_case((3, 1), (10, 40), num_tokens=8)
        out = jax.jit(lambda *a: native.attend(*a, sm_scale=sm_scale))(*args)
        ref = jax.jit(lambda *a: reference.attend(*a, sm_scale=sm_scale))(*args)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
        assert "custom_call" not in jax.jit(lambda *a: native.attend(*a, sm_scale=sm_scale)).lower(*args).as_text()
        monkeypatch.delenv(BACKEND_ENV["attention_backend"], raising=False)
        assert ops.resolve_attention_backend(EngineConfig().attention_backend) == "xla"  # auto: the reference
        with pytest.raises(RuntimeError, match="could not be built"):
            ops.resolve_attention_backend(EngineConfig(attention_backend="native").attention_backend)
        monkeypatch.setenv(BACKEND_ENV["attention_backend"], "native")
        with pytest.raises(RuntimeError, match="could not be built"):
            ops.resolve_attention_backend(EngineConfig().attention_backend)
    finally:
        monkeypatch.undo()
        native.load.cache_clear()
    assert native.load()


def test_backend_variable(monkeypatch):
    """$JAXSERVE_ATTENTION_BACKEND is the default of EngineConfig.attention_backend; on the CPU, auto and native
    resolve to the native kernel."""
    from jaxserve import ops
    from jaxserve.config import BACKEND_ENV, EngineConfig

    env = BACKEND_ENV["attention_backend"]
    for value, expected, resolved in (("auto", "auto", "native"), ("Native", "native", "native"), ("xla", "xla", "xla"),
                                      ("", "auto", "native")):
        monkeypatch.setenv(env, value)
        assert EngineConfig().attention_backend == expected
        assert ops.resolve_attention_backend(expected) == resolved
    monkeypatch.setenv(env, "triton")
    with pytest.raises(ValueError, match="must be one of"):
        EngineConfig()


def test_build_cache_and_missing_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    path = build.build_library(native.SOURCE)
    assert path.startswith(str(tmp_path / "cpu_kernels")) and os.path.exists(path)
    mtime = os.stat(path).st_mtime_ns
    assert build.build_library(native.SOURCE) == path and os.stat(path).st_mtime_ns == mtime  # cached, not rebuilt
    assert not [f for f in os.listdir(os.path.dirname(path)) if f.startswith(".")]  # no temporary left behind
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(build.BuildError, match="not on PATH"):
        build.build_library(native.SOURCE)


def test_llm_greedy_tokens_native_equal_xla(tmp_path, monkeypatch):
    """A tiny random Llama decodes the same greedy tokens with the native kernel and with the XLA reference."""
    from jaxserve import LLM, SamplingParams
    from tiny_models import make_tiny_model

    path = str(tmp_path / "tiny")
    make_tiny_model("llama_gqa", path)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 300, int(n)).tolist()} for n in (5, 40, 17, 23)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = dict(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32), page_size=4, max_model_len=128,
                  precompile=False)
    calls = []
    attend = native.attend
    monkeypatch.setattr(native, "attend", lambda *a, **kw: calls.append(1) or attend(*a, **kw))
    outs = {}
    for backend in ("native", "xla"):
        monkeypatch.setenv("JAXSERVE_ATTENTION_BACKEND", backend)
        llm = LLM(path, **engine)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if backend == "native":
            assert calls, "the native kernel was not traced"
            calls.clear()
    assert not calls, "JAXSERVE_ATTENTION_BACKEND=xla still traced the native kernel"
    assert all(len(t) == 12 for t in outs["native"])
    assert outs["native"] == outs["xla"]
