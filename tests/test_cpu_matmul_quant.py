"""The native CPU matmul's bf16, int8 and 4-bit formats (`cpu_kernels/matmul`): numerics against a float64 product
of the dequantized weight, bit-equality with the f32 kernel on the unpacked weight, batch invariance, the packed
layout and `unpack`, validation, and the XLA fallback."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cpu_kernels import build
from cpu_kernels import matmul as native

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler (g++) to build the native kernel"
)

FORMATS = ("bf16", "int8", "int4")


def _weight(fmt: str, K: int, N: int, group: int = 32, zeros: bool = True, seed: int = 0):
    """A random weight of `fmt` -> (PackedLinear, its dequantization f32[K, N] computed in numpy). Scales and zeros
    differ per group and column, so a scale from the wrong group or column shows."""
    rng = np.random.default_rng(seed)
    if fmt == "bf16":
        w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(ml_dtypes.bfloat16)
        return native.pack(w), w.astype(np.float32)
    bits = 8 if fmt == "int8" else 4
    q = rng.integers(-128, 128, (K, N)).astype(np.int8) if bits == 8 else rng.integers(0, 16, (K, N)).astype(np.uint8)
    levels = 128 if bits == 8 else 8
    s = (rng.uniform(0.5, 1.5, (K // group, N)) / (levels * np.sqrt(K))).astype(np.float32)
    z = (rng.standard_normal((K // group, N)) / np.sqrt(K)).astype(np.float32) if zeros else None
    w = q.astype(np.float32) * np.repeat(s, group, axis=0)  # f32 product, rounded ...
    if zeros:
        w = w + np.repeat(z, group, axis=0)  # ... then the f32 sum, rounded
    return native.pack_quantized(q, s, z, bits=bits), w


CASES = [(fmt, K, G, z) for fmt in ("int8", "int4") for K, G in ((128, 32), (128, 64), (128, 128), (96, 32))
         for z in (True, False)] + [("bf16", 128, 0, False), ("bf16", 7, 0, False)]


@pytest.mark.parametrize("fmt,K,G,zeros", CASES)
def test_matches_float64(fmt, K, G, zeros):
    """Every row count 1..40 (every row-block size, balanced splits past kMr) against a float64 product of the
    dequantized weight, with a partial last panel (N = 70) and several groups along K (G = 32, 64, K)."""
    packed, w = _weight(fmt, K, 70, G or K, zeros)
    f = jax.jit(native.matmul)
    x_all = np.random.default_rng(1).standard_normal((40, K)).astype(np.float32)
    for M in range(1, 41):
        x = x_all[:M]
        out = np.asarray(f(jnp.asarray(x), packed))
        ref = x.astype(np.float64) @ w.astype(np.float64)
        assert out.shape == (M, 70) and out.dtype == np.float32
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.sqrt(K), err_msg=f"M={M}")


@pytest.mark.parametrize("fmt,K,G,zeros", CASES)
def test_equals_f32_kernel_on_unpacked_weight(fmt, K, G, zeros):
    """Bit for bit: the kernel dequantizes exactly as `unpack` (product rounded, then sum) and then runs the f32
    kernel's FMA chain, so a wrong nibble, group or rounding shows as an inequality."""
    packed, _ = _weight(fmt, K, 70, G or K, zeros, seed=2)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((13, K)).astype(np.float32))
    f = jax.jit(native.matmul)
    dense = native.pack(np.asarray(packed.unpack()))
    np.testing.assert_array_equal(np.asarray(f(x, packed)), np.asarray(f(x, dense)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_are_batch_invariant(fmt):
    """A row's output is bit-identical alone and inside batches of any size and position."""
    packed, _ = _weight(fmt, 576, 200, 64, seed=4)
    x = np.random.default_rng(5).standard_normal((37, 576)).astype(np.float32)
    f = jax.jit(native.matmul)
    full = np.asarray(f(jnp.asarray(x), packed))
    for m in (1, 5, 12, 16, 24):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[-m:]), packed)), full[-m:])
    for i in (0, 13, 36):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[i : i + 1]), packed)), full[i : i + 1])


@pytest.mark.parametrize("fmt,K,G,zeros", CASES)
def test_unpack_equals_numpy_dequantization(fmt, K, G, zeros):
    """`unpack` (the reference and the fallback), jitted or not, is exactly the numpy dequantization: the f32 product
    rounded, then the sum (XLA would otherwise contract the two into one FMA)."""
    packed, w = _weight(fmt, K, 70, G or K, zeros, seed=6)
    np.testing.assert_array_equal(np.asarray(jax.jit(native.PackedLinear.unpack)(packed)), w)
    np.testing.assert_array_equal(np.asarray(packed.unpack()), w)


def test_layouts():
    K, N = 64, 70
    bf16, _ = _weight("bf16", K, N)
    assert bf16.format == "bf16" and bf16.panels.shape == (3, K, 32) and bf16.panels.dtype == jnp.bfloat16
    assert bf16.scales is None and bf16.group == 0 and bf16.shape == (K, N)
    int8, _ = _weight("int8", K, N, group=32)
    assert int8.format == "int8" and int8.panels.shape == (3, K, 32) and int8.group == 32
    assert int8.scales.shape == int8.zeros.shape == (3, 2, 32)
    np.testing.assert_array_equal(np.asarray(int8.panels)[2, :, 6:], 0)  # padding columns are zero
    np.testing.assert_array_equal(np.asarray(int8.scales)[2, :, 6:], 0)
    q = np.arange(K * N).reshape(K, N).astype(np.uint8) % 16
    s = np.ones((1, N), np.float32)
    int4 = native.pack_quantized(q, s, None, bits=4)
    assert int4.format == "int4" and int4.panels.shape == (3, K, 16) and int4.zeros is None and int4.group == K
    panels = np.asarray(int4.panels)
    np.testing.assert_array_equal(panels[1, :, :] & 15, q[:, 32:48])  # byte j: column j in the low nibble,
    np.testing.assert_array_equal(panels[1, :, :] >> 4, q[:, 48:64])  # column j + 16 in the high one
    assert int4.nbytes == 3 * K * 16 + 3 * 32 * 4
    f32 = native.pack(np.zeros((K, N), np.float32))
    assert f32.format == "f32" and f32.group == 0


def test_is_a_pytree_with_static_metadata():
    packed, w = _weight("int4", 64, 70, 32)
    leaves, treedef = jax.tree_util.tree_flatten(packed)
    assert len(leaves) == 3  # panels, scales, zeros; n and group are static
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert rebuilt.group == 32 and rebuilt.n == 70 and rebuilt.format == "int4"
    x = jnp.ones((2, 64), jnp.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(native.matmul)(x, rebuilt)), np.ones((2, 64)) @ w, rtol=1e-5,
                               atol=1e-5)


def test_validation():
    K, N = 64, 40
    q8, q4 = np.zeros((K, N), np.int8), np.zeros((K, N), np.uint8)
    s = np.ones((2, N), np.float32)
    with pytest.raises(ValueError, match="bf16\\[K, N\\]"):
        native.pack(np.zeros((K, N), np.float16))
    with pytest.raises(ValueError, match="int8\\[K, N\\]"):
        native.pack_quantized(q4, s)
    with pytest.raises(ValueError, match="uint8\\[K, N\\]"):
        native.pack_quantized(q8, s, bits=4)
    with pytest.raises(ValueError, match="0..15"):
        native.pack_quantized(q4 + 16, s, bits=4)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        native.pack_quantized(q8, s, bits=2)
    with pytest.raises(ValueError, match="G dividing K"):
        native.pack_quantized(q8, np.ones((3, N), np.float32))
    with pytest.raises(ValueError, match="G dividing K"):
        native.pack_quantized(q8, s.astype(np.float64))
    with pytest.raises(ValueError, match="like scales"):
        native.pack_quantized(q8, s, np.zeros((1, N), np.float32))
    with pytest.raises(ValueError, match="f32\\[M, 64\\]"):
        native.matmul(jnp.zeros((2, 64), jnp.bfloat16), native.pack_quantized(q8, s))


@pytest.mark.parametrize("fmt", FORMATS)
def test_falls_back_to_xla_when_the_library_cannot_be_built(fmt, monkeypatch):
    def no_build(source):
        raise build.BuildError("no C++ compiler: 'g++' is not on PATH")

    monkeypatch.setattr(native, "build_library", no_build)
    native.load.cache_clear()
    try:
        assert not native.load()
        packed, w = _weight(fmt, 64, 50, 32, seed=7)
        x = np.random.default_rng(8).standard_normal((5, 64)).astype(np.float32)
        f = jax.jit(native.matmul)
        out = np.asarray(f(jnp.asarray(x), packed))
        np.testing.assert_allclose(out, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5 * 8)
        np.testing.assert_array_equal(out, np.asarray(jax.jit(lambda a, b: a @ b)(jnp.asarray(x), jnp.asarray(w))))
        assert "custom_call" not in f.lower(jnp.asarray(x), packed).as_text()
    finally:
        monkeypatch.undo()
        native.load.cache_clear()
    assert native.load()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))
    except OSError:
        return set()


@pytest.mark.skipif(not {"avx2", "fma"} <= _cpu_flags(), reason="needs an x86-64 CPU with AVX2 and FMA")
def test_portable_path_equals_avx512_path(tmp_path):
    """kernel.cc built for x86-64-v3 (AVX2 + FMA, no AVX-512: the portable C++ loop, where the compiler may contract
    a multiply and an add) gives the same bits as the library in use, for every format."""
    import ctypes
    import subprocess

    flags = [f for f in build.FLAGS if not f.startswith("-march")] + ["-march=x86-64-v3"]
    lib_path = str(tmp_path / "portable.so")
    subprocess.run([build.compiler(), *flags, "-I", jax.ffi.include_dir(), native.SOURCE, "-o", lib_path], check=True,
                   capture_output=True)
    lib = ctypes.CDLL(lib_path)
    for target, symbol in native.TARGETS.values():
        jax.ffi.register_ffi_target(f"{target}_portable_test", jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")

    def portable(x, w):
        call = jax.ffi.ffi_call(f"{native.TARGETS[w.format][0]}_portable_test",
                                jax.ShapeDtypeStruct((x.shape[0], w.n), jnp.float32))
        if w.scales is None:
            return call(x, w.panels)
        return call(x, w.panels, w.scales, jnp.zeros((0,), jnp.float32) if w.zeros is None else w.zeros)

    for fmt, K, G, zeros in CASES + [("f32", 96, 0, False)]:
        if fmt == "f32":
            packed = native.pack(np.random.default_rng(9).standard_normal((K, 70)).astype(np.float32))
        else:
            packed, _ = _weight(fmt, K, 70, G or K, zeros, seed=9)
        for M in (1, 13, 40):
            x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)).astype(np.float32))
            np.testing.assert_array_equal(np.asarray(jax.jit(portable)(x, packed)),
                                          np.asarray(jax.jit(native.matmul)(x, packed)), err_msg=f"{fmt} K={K} M={M}")
