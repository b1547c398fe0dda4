"""The sampler's native row statistics (`cpu_kernels/row_stats`): max, first argmax, log-sum-exp and the non-finite
flag per row against float64 numpy (ties, -inf, +inf, NaN, lengths that are not a multiple of the vector width),
batch invariance, the XLA fallback, and `sample(native_stats=True)` against the XLA sampler."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import build
from cpu_kernels import row_stats as native
from jaxserve.sampler import SamplingInputs, sample
from native_builds import build_for, cpu_flags

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler (g++) to build the native kernel"
)


def _rows(V: int, seed: int = 0) -> np.ndarray:
    """Eight rows: random ones (one wide, one narrow), a tie for the maximum (first index wins), banned tokens
    (-inf), all -inf, a +inf, a NaN, and a maximum in the last (partial-vector) position."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((8, V)) * np.array([[1], [8], [2], [2], [2], [2], [2], [2]])).astype(np.float32)
    if V >= 3:
        x[2, [1, V - 1]] = x[2].max() + 1  # tie
        x[3, ::2] = -np.inf  # banned
        x[5, 1] = np.inf
        x[6, V // 2] = np.nan
    x[4] = -np.inf
    x[7, V - 1] = x[7].max() + 3
    return x


@pytest.mark.parametrize("V", (1, 7, 16, 17, 100, 49153))
def test_matches_float64(V):
    _check_rows(jax.jit(native.row_stats), V)


@pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="needs an x86-64 CPU with AVX2 and FMA")
@pytest.mark.parametrize("march", ("x86-64", "x86-64-v3"))
def test_every_build_matches_float64(march, tmp_path):
    """The kernel built for plain x86-64 (the portable loops) and for x86-64-v3 (AVX2 + FMA: the 8-lane exp and
    sums), whatever the library in use here is built for."""
    target = f"row_stats_{march}_test"
    lib = build_for(native.SOURCE, march, str(tmp_path))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.JaxserveRowStats), platform="cpu")

    def stats(x):
        R = x.shape[0]
        out = (jax.ShapeDtypeStruct((R,), jnp.float32), jax.ShapeDtypeStruct((R,), jnp.int32),
               jax.ShapeDtypeStruct((R,), jnp.float32), jax.ShapeDtypeStruct((R,), jnp.bool_))
        return tuple(jax.ffi.ffi_call(target, out)(x))

    for V in (1, 7, 16, 17, 100, 49153):
        _check_rows(jax.jit(stats), V)


def _check_rows(row_stats, V: int) -> None:
    x = _rows(V)
    m, first, log_z, nonfinite = (np.asarray(a) for a in row_stats(jnp.asarray(x)))
    finite_max = ~np.isnan(x).any(1) & ~np.isposinf(x).any(1) & ~np.isneginf(x).all(1)
    np.testing.assert_array_equal(nonfinite, np.isnan(x).any(1) | np.isposinf(x).any(1))
    np.testing.assert_array_equal(m[~np.isnan(x).any(1)], x.max(1)[~np.isnan(x).any(1)])
    np.testing.assert_array_equal(first[~np.isnan(x).any(1)], x.argmax(1)[~np.isnan(x).any(1)])
    ref = np.log(np.exp(x[finite_max].astype(np.float64) - x[finite_max].max(1, keepdims=True)).sum(1))
    np.testing.assert_allclose(log_z[finite_max], ref, rtol=0, atol=2e-7 * max(1.0, np.abs(ref).max()))
    assert np.isnan(log_z[~finite_max]).all()  # -inf - -inf, inf - inf, NaN: as XLA's normaliser
    if V >= 3:
        assert first[2] == 1 and np.isnan(m[6]) and first[6] == V  # a NaN row: flagged, no argmax


def test_rows_are_batch_invariant_and_the_fallback_agrees(monkeypatch):
    x = _rows(1001, seed=1)
    full = [np.asarray(a) for a in jax.jit(native.row_stats)(jnp.asarray(x))]
    for i in (0, 3, 7):
        alone = [np.asarray(a) for a in jax.jit(native.row_stats)(jnp.asarray(x[i : i + 1]))]
        for a, b in zip(alone, full):
            np.testing.assert_array_equal(a, b[i : i + 1])

    def no_build(source):
        raise build.BuildError("no C++ compiler: 'g++' is not on PATH")

    monkeypatch.setattr(native, "build_library", no_build)
    native.load.cache_clear()
    jax.clear_caches()  # the traces above hold the custom call
    try:
        assert not native.load()
        f = jax.jit(native.row_stats)
        assert "custom_call" not in f.lower(jnp.asarray(x)).as_text()
        xla = [np.asarray(a) for a in f(jnp.asarray(x))]
        ok = ~np.isnan(x).any(1)  # a NaN row's max and argmax are unspecified (XLA's max skips NaNs)
        np.testing.assert_array_equal(xla[0][ok], full[0][ok])
        np.testing.assert_array_equal(xla[1][ok], full[1][ok])
        np.testing.assert_allclose(xla[2][ok], full[2][ok], atol=1e-6)
        np.testing.assert_array_equal(xla[3], full[3])
    finally:
        monkeypatch.undo()
        native.load.cache_clear()
        jax.clear_caches()
    assert native.load()


def test_sampler_with_native_stats_equals_the_xla_sampler():
    """Greedy, seeded random, banned and penalised rows, and a NaN row: the same tokens, flags, ranks and top
    logprobs, logprobs equal to float rounding; with and without draft tokens (speculative verification)."""
    S, V = 12, 3000
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    logits[5, 17] = np.nan
    s = SamplingInputs.neutral(S, 4)
    s.temperature[6:] = 0.8
    s.top_p[8:] = 0.9
    s.seeds[:] = np.arange(S) * 7919 + 1
    s.banned[1, :2] = [int(logits[1].argmax()), 3]
    s.repetition_penalty[2] = 1.3
    s.history[2, :2] = [int(logits[2].argmax()), 9]
    s.wants_logprobs[::2] = True
    s = jax.tree.map(jnp.asarray, s)
    drafts = jnp.asarray(np.where(np.arange(S) % 3 == 0, rng.integers(0, V, S), -1).astype(np.int32))
    for draft_ids in (None, drafts):
        out = [jax.jit(lambda x, s, n=n: sample(x, s, max_logprobs=4, draft_ids=draft_ids, native_stats=n))(
            jnp.asarray(logits), s) for n in (False, True)]
        ok = ~np.asarray(out[0].nonfinite)
        assert not ok[5] and ok.sum() == S - 1
        native_out, xla_out = ({f: np.asarray(getattr(o, f))[ok] for f in o.__dataclass_fields__} for o in out[::-1])
        for field in ("token_ids", "accepted", "nonfinite", "ranks", "top_ids"):
            np.testing.assert_array_equal(native_out[field], xla_out[field], err_msg=field)
        for field in ("logprobs", "top_logprobs"):
            np.testing.assert_allclose(native_out[field], xla_out[field], atol=2e-6, err_msg=field)
        assert int(out[1].token_ids[1]) != int(logits[1].argmax())  # the ban took effect


@pytest.mark.parametrize("D", [1, 15, 16, 64, 576, 1000])
def test_sum_squares_is_exact_enough_and_batch_invariant(D):
    """RMSNorm's reduction (`sum_squares`): within float rounding of the float64 sum, and each row's bits the same
    alone and inside batches of any size and position -- what XLA's own `sum(x * x)` does not give once the row
    count reaches 8 (checked below, so the kernel keeps a reason to exist)."""
    assert native.load_sum_squares()
    x = np.random.default_rng(D).standard_normal((40, D)).astype(np.float32) * 3
    f = jax.jit(native.sum_squares)
    full = np.asarray(f(jnp.asarray(x)))
    np.testing.assert_allclose(full, (x.astype(np.float64) ** 2).sum(-1), rtol=2e-6)
    for lo, hi in [(0, 1), (3, 4), (0, 8), (5, 21), (39, 40)]:
        assert np.array_equal(np.asarray(f(jnp.asarray(x[lo:hi]))), full[lo:hi]), (lo, hi)
    if D == 576:
        xla = jax.jit(lambda a: jnp.sum(a * a, axis=-1))
        alone = np.stack([np.asarray(xla(jnp.asarray(x[i:i + 1])))[0] for i in range(40)])
        assert not np.array_equal(alone, np.asarray(xla(jnp.asarray(x))))
