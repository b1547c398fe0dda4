"""The native CPU matmul (`cpu_kernels/matmul`) against numpy, its batch invariance, packing, the backend switch,
the fallback when it cannot be built, and an engine run with it on and off."""

from __future__ import annotations

import logging
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import build
from cpu_kernels import matmul as native

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler (g++) to build the native kernel"
)


def _case(M, K, N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((K, N)) / np.sqrt(max(K, 1))).astype(np.float32)
    return x, w


@pytest.mark.parametrize("K,N", [(1, 1), (7, 31), (64, 32), (64, 33), (100, 70), (576, 192), (300, 1000)])
@pytest.mark.parametrize("M", [1, 3, 12, 13, 16, 25, 40])
def test_matches_numpy(M, K, N):
    """Every row-block size (1..12, balanced splits past 12) and every partial last panel (N % 32 != 0)."""
    x, w = _case(M, K, N)
    out = np.asarray(jax.jit(native.matmul)(jnp.asarray(x), native.pack(w)))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert out.shape == (M, N) and out.dtype == np.float32
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.sqrt(K))


def test_rows_are_batch_invariant():
    """A row's output is bit-identical alone and inside batches of any size and position."""
    x, w = _case(37, 576, 200, seed=1)
    packed, f = native.pack(w), jax.jit(native.matmul)
    full = np.asarray(f(jnp.asarray(x), packed))
    for m in (1, 5, 12, 16, 24):
        part = np.asarray(f(jnp.asarray(x[-m:]), packed))
        np.testing.assert_array_equal(part, full[-m:])
    for i in (0, 13, 36):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[i : i + 1]), packed)), full[i : i + 1])


def test_pack_layout_and_validation():
    x, w = _case(2, 40, 70)
    p = native.pack(w)
    assert p.panels.shape == (3, 40, 32) and p.shape == (40, 70)
    np.testing.assert_array_equal(np.asarray(p.unpack()), w)
    np.testing.assert_array_equal(np.asarray(p.panels)[2, :, 6:], 0)  # padding columns are zero
    with pytest.raises(ValueError, match="f32\\[K, N\\]"):
        native.pack(w.astype(np.float16))
    with pytest.raises(ValueError, match="f32\\[M, 40\\]"):
        native.matmul(jnp.zeros((2, 41), jnp.float32), p)
    with pytest.raises(ValueError, match="f32\\[M, 40\\]"):
        native.matmul(jnp.zeros((2, 40), jnp.bfloat16), p)


def test_falls_back_to_xla_when_the_library_cannot_be_built(monkeypatch, caplog):
    def no_build(source):
        raise build.BuildError("no C++ compiler: 'g++' is not on PATH")

    monkeypatch.setattr(native, "build_library", no_build)
    native.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert not native.load() and not native.load()
        assert sum("native CPU matmul unavailable" in r.message for r in caplog.records) == 1
        x, w = _case(5, 64, 50)
        f = jax.jit(native.matmul)
        np.testing.assert_allclose(np.asarray(f(jnp.asarray(x), native.pack(w))), x @ w, rtol=1e-5, atol=1e-5)
        assert "custom_call" not in f.lower(jnp.asarray(x), native.pack(w)).as_text()
        from jaxserve import ops
        from jaxserve.config import BACKEND_ENV, EngineConfig

        monkeypatch.delenv(BACKEND_ENV["matmul_backend"], raising=False)
        assert ops.resolve_backends(EngineConfig(), "float32", scan_layers=False).matmul == "xla"  # auto: XLA dots
        with pytest.raises(RuntimeError, match="could not be built"):
            ops.resolve_matmul_backend(EngineConfig(matmul_backend="native").matmul_backend, "float32", False)
        monkeypatch.setenv(BACKEND_ENV["matmul_backend"], "native")
        with pytest.raises(RuntimeError, match="could not be built"):
            ops.resolve_matmul_backend(EngineConfig().matmul_backend, "float32", scan_layers=False)
    finally:
        monkeypatch.undo()
        native.load.cache_clear()
    assert native.load()


def test_backend_variable(monkeypatch):
    """$JAXSERVE_MATMUL_BACKEND is the default of EngineConfig.matmul_backend; resolution checks the conditions."""
    from jaxserve import ops
    from jaxserve.config import BACKEND_ENV, EngineConfig

    env = BACKEND_ENV["matmul_backend"]

    def resolve(dtype="float32", scan_layers=False):
        return ops.resolve_backends(EngineConfig(), dtype, scan_layers=scan_layers).matmul

    for value, expected in (("auto", "native"), ("", "native"), ("Native", "native"), ("xla", "xla")):
        monkeypatch.setenv(env, value)
        assert resolve() == expected
    monkeypatch.setenv(env, "auto")
    assert resolve("bfloat16") == "xla"  # the kernel is f32 only
    assert resolve(scan_layers=True) == "xla"  # packing is per layer
    monkeypatch.setenv(env, "native")
    with pytest.raises(ValueError, match="dtype is bfloat16"):
        resolve("bfloat16")
    with pytest.raises(ValueError, match="scan_layers"):
        resolve(scan_layers=True)
    monkeypatch.setenv(env, "onednn")
    with pytest.raises(ValueError, match="must be one of"):
        resolve()


def test_llm_greedy_tokens_native_equal_xla(tmp_path, monkeypatch):
    """A tiny model with tied embeddings decodes the same greedy tokens with the native matmul and with XLA dots,
    and the native step really calls the kernel for every linear map: per layer q/k/v fused, o, gate/up fused and down
    (`ops.pack_linears`: 4 calls, not 7), plus the logits."""
    from jaxserve import LLM, SamplingParams
    from tiny_models import make_tiny_model

    path = str(tmp_path / "tiny")
    make_tiny_model("llama_tied", path)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 300, int(n)).tolist()} for n in (5, 40, 17, 23)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    engine = dict(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32), page_size=4, max_model_len=128,
                  precompile=False)
    outs = {}
    for backend in ("native", "xla"):
        monkeypatch.setenv("JAXSERVE_MATMUL_BACKEND", backend)
        llm = LLM(path, **engine)
        runner = llm.llm_engine.runner
        assert runner.native_matmul == (backend == "native")
        outs[backend] = llm.generate(prompts, params, use_tqdm=False)
        bucket = next(iter(runner._executables))
        hlo = runner._executables[bucket].as_text()
        calls = len(re.findall(r"custom_call_target=\"jaxserve_matmul\"", hlo))
        L = llm.llm_engine.model_config.num_layers
        assert calls == (4 * L + 1 if backend == "native" else 0), calls
    for a, b in zip(outs["native"], outs["xla"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 12
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert abs(la[t].logprob - lb[t].logprob) < 1e-4
