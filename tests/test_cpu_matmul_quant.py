"""The native CPU matmul's bf16, int8 and 4-bit formats (`cpu_kernels/matmul`): numerics against a float64 product
of the dequantized weight and what the kernel multiplies (`activations`: x rounded to bf16, or quantized per block
for int8 and int4), the activation rounding and quantization bit for bit, batch invariance, the packed layout and
`unpack`, validation, the portable C++ path, and the XLA fallback."""

from __future__ import annotations

import os
import shutil
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cpu_kernels import build
from cpu_kernels import matmul as native
from native_builds import build_for, cpu_flags

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler (g++) to build the native kernel"
)

FORMATS = ("bf16", "int8", "int4")


def _weight(fmt: str, K: int, N: int, group: int = 32, zeros: bool = True, seed: int = 0, f16: bool = False,
            scale_dtype=None):
    """A random weight of `fmt` -> (PackedLinear, its dequantization f32[K, N] computed in numpy). Scales and zeros
    differ per group and column, so a scale from the wrong group or column shows. `f16`: scales and zeros rounded to
    f16 values (some negative, some f16 subnormals), so they pack as f16 unless `scale_dtype` says otherwise."""
    rng = np.random.default_rng(seed)
    if fmt == "bf16":
        w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(ml_dtypes.bfloat16)
        return native.pack(w), w.astype(np.float32)
    bits = 8 if fmt == "int8" else 4
    q = rng.integers(-128, 128, (K, N)).astype(np.int8) if bits == 8 else rng.integers(0, 16, (K, N)).astype(np.uint8)
    levels = 128 if bits == 8 else 8
    s = (rng.uniform(0.5, 1.5, (K // group, N)) / (levels * np.sqrt(K))).astype(np.float32)
    z = (rng.standard_normal((K // group, N)) / np.sqrt(K)).astype(np.float32) if zeros else None
    if f16:
        s[:, ::3] *= -1
        s[0, :5] = np.float32(2.0**-20) * np.arange(1, 6)  # f16 subnormals
        s = s.astype(np.float16).astype(np.float32)
        if zeros:
            z[-1, :3] = np.float32(2.0**-24) * np.arange(1, 4)
            z = z.astype(np.float16).astype(np.float32)
    w = q.astype(np.float32) * np.repeat(s, group, axis=0)  # f32 product, rounded ...
    if zeros:
        w = w + np.repeat(z, group, axis=0)  # ... then the f32 sum, rounded
    return native.pack_quantized(q, s, z, bits=bits, scale_dtype=scale_dtype), w


CASES = [(fmt, K, G, z) for fmt in ("int8", "int4") for K, G in ((128, 32), (128, 64), (128, 128), (96, 32), (96, 48))
         for z in (True, False)] + [("int8", 128, 16, z) for z in (True, False)] + [("bf16", 128, 0, False),
                                                                               ("bf16", 7, 0, False)]


_activations = jax.jit(native.activations, static_argnums=1)  # one compile per shape, not one per op


def _reference(x: np.ndarray, fmt: str, w: np.ndarray) -> np.ndarray:
    """float64 product of what the kernel multiplies: x rounded to bf16 (bf16), or quantized per block (int8, int4),
    times the dequantized weight. Row by row: rows [:M] of the reference for x are the reference for x[:M]."""
    return np.asarray(_activations(jnp.asarray(x), fmt)).astype(np.float64) @ w.astype(np.float64)


@pytest.mark.parametrize("fmt,K,G,zeros", CASES)
def test_matches_float64(fmt, K, G, zeros):
    """Every row count 1..40 (every row-block size, balanced splits) against a float64 product of the dequantized
    weight and (int8, int4) the quantized activations, with a partial last panel (N = 70) and several groups along K
    (G = 16, 32, 48 (sub-blocks of 16), 64, K). The two differ only by float rounding: one activation off by one
    level (~1e-3 here) or a scale from the wrong group shows."""
    packed, w = _weight(fmt, K, 70, G or K, zeros)
    f = jax.jit(native.matmul)
    x_all = np.random.default_rng(1).standard_normal((40, K)).astype(np.float32)
    ref = _reference(x_all, fmt, w)
    for M in range(1, 41):
        out = np.asarray(f(jnp.asarray(x_all[:M]), packed))
        assert out.shape == (M, 70) and out.dtype == np.float32
        np.testing.assert_allclose(out, ref[:M], rtol=1e-5, atol=2e-6 * np.sqrt(K), err_msg=f"M={M}")


def _quantize_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The activation quantization in numpy f32: per row and block of 32, d = max|x| / 127, xq = round-half-even(x *
    (1 / d)) clipped to [-127, 127], 0 where d = 0."""
    M, K = x.shape
    xb = x.reshape(M, K // 32, 32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    xq = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int8)
    return xq.reshape(M, K), d


def _activations_with_ties(M: int, K: int, seed: int) -> np.ndarray:
    """Random rows, with blocks made to hit exact ties (x * (1 / d) = n + 0.5: max|x| = 127 * 2^e, so 1 / d = 2^-e
    exactly), all-zero blocks, and a block of one nonzero (tiny and huge magnitudes)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32) * rng.uniform(0.01, 100, (M, 1)).astype(np.float32)
    for m in range(M):
        b = 32 * (m % (K // 32))
        e = np.float32(2.0 ** rng.integers(-6, 6))
        x[m, b : b + 32] = (rng.integers(-127, 127, 32) + 0.5).astype(np.float32) * e
        x[m, b] = 127 * e * (1 if m % 2 else -1)
        if K >= 64:
            z = (b + 32) % K
            x[m, z : z + 32] = 0
    x[0, -32:] = 0
    x[0, -1] = 3e-30
    if M > 1:
        x[1, -32:] = 0
        x[1, -2] = -3e30
    return x


def test_quantize_activations_matches_numpy():
    """Bit for bit, ties (exact n + 0.5, half to even) and all-zero blocks (d = 0, xq = 0) included, jitted or not;
    fake_quant_activations is xq * d."""
    M, K = 64, 256
    x = _activations_with_ties(M, K, seed=10)
    xq_ref, d_ref = _quantize_numpy(x)
    with np.errstate(divide="ignore"):
        scaled = x.reshape(M, K // 32, 32) * np.where(d_ref > 0, 1 / d_ref, 0)[..., None]
    ties = scaled[np.abs(scaled % 1 - 0.5) == 0]
    assert ties.size > 500 and (np.rint(ties) % 2 == 0).all()  # the tie cases round to even
    for fn in (native.quantize_activations, jax.jit(native.quantize_activations)):
        xq, d = fn(jnp.asarray(x))
        assert xq.dtype == jnp.int8 and d.dtype == jnp.float32 and d.shape == (M, K // 32)
        np.testing.assert_array_equal(np.asarray(xq), xq_ref)
        np.testing.assert_array_equal(np.asarray(d), d_ref)
    assert (d_ref == 0).any() and (xq_ref.reshape(M, K // 32, 32)[d_ref == 0] == 0).all()
    fq = np.asarray(jax.jit(native.fake_quant_activations)(jnp.asarray(x)))
    np.testing.assert_array_equal(fq, (xq_ref.reshape(M, K // 32, 32) * d_ref[..., None]).reshape(M, K))


@pytest.mark.parametrize("bits", (8, 4))
def test_kernel_quantizes_activations_like_fake_quant(bits):
    """The kernel's own quantization, bit for bit: against the identity weight (q = 1 on the diagonal, scale 1, one
    group) y[m, n] = float(xq[m, n]) * d[m, n // 32], which is fake_quant_activations(x) exactly."""
    K = 128
    x = _activations_with_ties(23, K, seed=11)
    q = np.eye(K, dtype=np.int8 if bits == 8 else np.uint8)
    packed = native.pack_quantized(q, np.ones((1, K), np.float32), None, bits=bits)
    out = np.asarray(jax.jit(native.matmul)(jnp.asarray(x), packed))
    np.testing.assert_array_equal(out, np.asarray(native.fake_quant_activations(jnp.asarray(x))))


@pytest.mark.parametrize("fmt", ("int8", "int4"))
def test_activation_rounding_is_the_only_change(fmt):
    """Against the product with unquantized activations, the relative error is small (~0.5%): quantizing x per block
    of 32 to 8 bits is all that changed."""
    packed, w = _weight(fmt, 576, 200, 32, seed=12)
    x = np.random.default_rng(13).standard_normal((16, 576)).astype(np.float32)
    out = np.asarray(jax.jit(native.matmul)(jnp.asarray(x), packed))
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < 1e-2


@pytest.mark.parametrize("fmt,K,G,zeros", CASES)
def test_fallback_equals_kernel(fmt, K, G, zeros):
    """The XLA expression of the semantics (`activations(x, fmt) @ unpack()`, what the fallback computes) within
    float rounding."""
    packed, _ = _weight(fmt, K, 70, G or K, zeros, seed=2)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((13, K)).astype(np.float32))
    xla = jax.jit(lambda x, w: native.activations(x, w.format) @ w.unpack())(x, packed)
    np.testing.assert_allclose(np.asarray(jax.jit(native.matmul)(x, packed)), np.asarray(xla), rtol=1e-5,
                               atol=2e-6 * np.sqrt(K))


@pytest.mark.parametrize("K", (6, 7, 64))
def test_bf16_rounds_activations_to_bf16(K):
    """Against the identity weight (every product exact, every sum with zeros exact) the bf16 kernel returns x
    rounded to bf16, as `round_to_bf16` computes it: to nearest even (ties included), subnormals flushed to a signed
    zero. Odd K: the last, unpaired row too."""
    rng = np.random.default_rng(20)
    x = rng.standard_normal((5, K)).astype(np.float32) * np.float32(100)
    x[0, :6] = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3e38, 1e-40, -1e-41]  # two ties, a big one, subnormals
    x[1, -1] = -(1 + 2**-8)
    out = np.asarray(jax.jit(native.matmul)(jnp.asarray(x), native.pack(np.eye(K, dtype=ml_dtypes.bfloat16))))
    np.testing.assert_array_equal(out, np.asarray(native.round_to_bf16(jnp.asarray(x))))
    np.testing.assert_array_equal(out[0, :6], np.array([1, 1 + 4 * 2**-8, -1, 3e38, 0, 0], ml_dtypes.bfloat16))
    assert out[1, -1] == -1


def test_round_to_bf16():
    """Nearest even as ml_dtypes rounds normal values; NaN stays NaN, inf inf, overflow becomes inf, and subnormals
    (which vdpbf16ps reads as zero) a signed zero."""
    x = np.random.default_rng(21).standard_normal(4096).astype(np.float32) * np.float32(1e3)
    x[:8] = [np.nan, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40, -1e-40, np.finfo(np.float32).tiny]
    out = np.asarray(jax.jit(native.round_to_bf16)(jnp.asarray(x)))
    np.testing.assert_array_equal(out[8:], x[8:].astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.isnan(out[0]) and list(out[1:5]) == [np.inf, -np.inf, np.inf, -np.inf]
    assert out[5] == 0 and out[6] == 0 and np.signbit(out[6]) and out[7] == x[7]


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


@pytest.mark.parametrize("fmt", FORMATS + ("f32",))
def test_chains_of_decode_products_from_concurrent_callers(fmt):
    """Decode-sized products (1 and 4 rows) back to back, as a step runs them, each split over the threads whatever
    its size (1 to 31 panels here). Two Python threads run the chain at once (their products' tasks share the
    thread pool) many times; every result equals the chain's products run one at a time, bit for bit, and the
    float64 reference."""
    shapes = [(128, 224), (224, 64), (64, 992), (992, 128), (128, 32), (32, 128)]  # 7, 2, 31, 4, 1, 4 panels
    weights = []
    for i, (K, N) in enumerate(shapes * 3):
        if fmt == "f32":
            w = (np.random.default_rng(i).standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
            weights.append((native.pack(w), w))
        else:
            weights.append(_weight(fmt, K, N, group=32, seed=i))

    def chain(ws, x):
        for w in ws:
            x = jnp.tanh(native.matmul(x, w))
        return x

    step = jax.jit(lambda x, w: jnp.tanh(native.matmul(x, w)))

    def one_at_a_time(x):
        ref = x.astype(np.float64)
        for packed, w in weights:
            x = np.asarray(step(jnp.asarray(x), packed))
            ref = np.tanh((np.asarray(_activations(jnp.asarray(ref.astype(np.float32)), fmt)).astype(np.float64)
                           if fmt != "f32" else ref) @ w.astype(np.float64))
        return x, ref

    f = jax.jit(chain)
    packed = [w for w, _ in weights]
    inputs = [np.random.default_rng(100 + m).standard_normal((m, 128)).astype(np.float32) for m in (1, 4)]
    expected = [one_at_a_time(x) for x in inputs]
    for (want, ref) in expected:
        np.testing.assert_allclose(want, ref, rtol=2e-2 if fmt != "f32" else 1e-4, atol=2e-2 if fmt != "f32" else 1e-5)
    failures = []

    def run(x, want):
        for _ in range(20):
            got = np.asarray(f(packed, jnp.asarray(x)))
            if not np.array_equal(got, want):
                failures.append(np.abs(got - want).max())

    threads = [threading.Thread(target=run, args=(x, want)) for x, (want, _) in zip(inputs, expected)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


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
    wb = np.arange(K * N).reshape(K, N).astype(ml_dtypes.bfloat16)  # k pairs per column: [P, K / 2, 32, 2 k]
    pairs = np.asarray(native.pack(wb).panels).reshape(3, K // 2, 32, 2)
    np.testing.assert_array_equal(pairs[1, 5, 7], [wb[10, 39], wb[11, 39]])
    odd = np.asarray(native.pack(wb[:7]).panels)  # an odd K: three pairs, then the last row alone
    np.testing.assert_array_equal(odd[0, 6], wb[6, :32])
    np.testing.assert_array_equal(odd[0, :6].reshape(3, 32, 2)[2, 4], wb[4:6, 4])
    q8 = np.random.default_rng(14).integers(-128, 128, (K, N)).astype(np.int8)
    s8 = np.arange(1, 2 * N + 1, dtype=np.float32).reshape(2, N) / 8  # exact in f16
    z8 = -s8 / 4
    int8 = native.pack_quantized(q8, s8, z8)
    # per panel and group of 32 k: 32 f16 scales, 32 f16 zeros, then 8 x 128 bytes of quants
    assert int8.format == "int8" and int8.panels.shape == (3, 2, 64 + 64 + 8 * 128) and int8.group == 32
    assert int8.scale_bytes == 2 and int8.has_zeros and int8.panels.dtype == jnp.int8
    assert int8.shape == (K, N) and int8.scales.shape == int8.zeros.shape == (3, 2, 32)
    raw = np.asarray(int8.panels).view(np.uint8)
    heads = raw[..., :128].copy().view(np.float16).astype(np.float32)  # [panel, group, 64]
    np.testing.assert_array_equal(heads[1, :, :32], s8[:, 32:64])
    np.testing.assert_array_equal(heads[1, :, 32:], z8[:, 32:64])
    np.testing.assert_array_equal(heads[2, :, 6:32], 0)  # padding columns: scale and zero 0
    np.testing.assert_array_equal(heads[2, :, 38:], 0)
    np.testing.assert_array_equal(np.asarray(int8.scales)[:, :, :].transpose(1, 0, 2).reshape(2, 96)[:, :N], s8)
    u8 = raw[..., 128:].reshape(3, K // 4, 32, 4)  # [panel, k // 4, column, k % 4]
    np.testing.assert_array_equal(u8[1, 5, 7, 2], int(q8[4 * 5 + 2, 32 + 7]) + 128)
    np.testing.assert_array_equal(u8[1].transpose(0, 2, 1).reshape(K, 32), q8[:, 32:64].astype(np.int32) + 128)
    np.testing.assert_array_equal(u8[2, :, 6:], 128)  # padding columns are q = 0
    assert int8.nbytes == 3 * 2 * 1152
    q = np.arange(K * N).reshape(K, N).astype(np.uint8) % 16
    s = np.full((1, N), 0.1, np.float32)  # not an f16: stored as f32
    int4 = native.pack_quantized(q, s, None, bits=4)
    assert int4.format == "int4" and int4.panels.shape == (3, 1, 128 + K // 4 * 64) and int4.group == K
    assert int4.zeros is None and not int4.has_zeros and int4.scale_bytes == 4
    np.testing.assert_array_equal(np.asarray(int4.panels)[0, 0, :128].copy().view(np.float32), s[0, :32])
    panels = np.asarray(int4.panels)[..., 128:].reshape(3, K // 4, 16, 4)  # [panel, k // 4, j, k % 4]
    byk = panels[1].transpose(0, 2, 1).reshape(K, 16)
    np.testing.assert_array_equal(byk & 15, q[:, 32:48])  # byte [j, i]: column j in the low nibble,
    np.testing.assert_array_equal(byk >> 4, q[:, 48:64])  # column j + 16 in the high one
    assert int4.nbytes == 3 * K * 16 + 3 * 32 * 4 and int4.shape == (K, N)
    f32 = native.pack(np.zeros((K, N), np.float32))
    assert f32.format == "f32" and f32.group == 0


def test_is_a_pytree_with_static_metadata():
    packed, w = _weight("int4", 64, 70, 32)
    leaves, treedef = jax.tree_util.tree_flatten(packed)
    assert len(leaves) == 1  # panels (scales and zeros inside); n, group, scale_bytes and has_zeros are static
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert rebuilt.group == 32 and rebuilt.n == 70 and rebuilt.format == "int4" and rebuilt.has_zeros
    x = jnp.ones((2, 64), jnp.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(native.matmul)(x, rebuilt)), np.ones((2, 64)) @ w, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("fmt,zeros,f16", [(fmt, z, f16) for fmt in ("f32", "bf16", "int8", "int4")
                                           for z in (True, False) for f16 in (True, False)
                                           if fmt in ("int8", "int4") or not (z or f16)])
def test_one_leaf_per_packed_linear(fmt, zeros, f16):
    """Every format is one array: the jitted step's host dispatch costs per leaf."""
    if fmt == "f32":
        packed = native.pack(np.ones((64, 40), np.float32))
    else:
        packed, _ = _weight(fmt, 64, 40, 32, zeros, f16=f16)
    assert len(jax.tree.leaves(packed)) == 1
    assert len(jax.tree.leaves({"a": [packed, packed]})) == 2


def test_scale_dtype_selection():
    """Scales and zeros pack as f16 exactly when every one of them is an f16 value (no rounding, no overflow)."""
    K, N = 64, 40
    rng = np.random.default_rng(15)
    q4 = rng.integers(0, 16, (K, N)).astype(np.uint8)
    # Q4_1-like: f16 scale d and minimum m per block of 32, zeros = m
    d = rng.uniform(1e-3, 1e-2, (2, N)).astype(np.float16).astype(np.float32)
    m = -8 * d
    m16 = m.astype(np.float16).astype(np.float32)
    assert native.pack_quantized(q4, d, m16, bits=4).scale_bytes == 2
    assert native.pack_quantized(q4, d, None, bits=4).scale_bytes == 2
    inexact = d.copy()
    inexact[1, 7] = np.float32(0.1)
    assert native.pack_quantized(q4, inexact, m16, bits=4).scale_bytes == 4  # one inexact scale
    z_inexact = m16.copy()
    z_inexact[0, 3] = np.float32(1 / 3)
    assert native.pack_quantized(q4, d, z_inexact, bits=4).scale_bytes == 4  # one inexact zero
    big = d.copy()
    big[0, 0] = 65536.0  # 2^16: exact in f16's precision, but past its largest finite (65504)
    assert native.pack_quantized(q4, big, None, bits=4).scale_bytes == 4
    big[0, 0] = 65504.0
    assert native.pack_quantized(q4, big, None, bits=4).scale_bytes == 2
    tiny = d.copy()
    tiny[0, 0] = np.float32(2.0**-25)  # below f16's smallest subnormal
    assert native.pack_quantized(q4, tiny, None, bits=4).scale_bytes == 4
    nan = d.copy()
    nan[0, 0] = np.nan
    assert native.pack_quantized(q4, nan, None, bits=4).scale_bytes == 4
    assert native.pack_quantized(q4, d, None, bits=4, scale_dtype=np.float32).scale_bytes == 4
    with pytest.raises(ValueError, match="scale_dtype"):
        native.pack_quantized(q4, inexact, None, bits=4, scale_dtype=np.float16)
    # the f16 copy streams fewer bytes: 32 x (2 + 2) per group instead of 32 x (4 + 4)
    f16 = native.pack_quantized(q4, d, m16, bits=4)
    f32 = native.pack_quantized(q4, d, m16, bits=4, scale_dtype=np.float32)
    assert f32.nbytes - f16.nbytes == 2 * 2 * 32 * 4  # panels x groups x 32 x (2 + 2) bytes


@pytest.mark.parametrize("fmt,K,G,zeros", [c for c in CASES if c[0] != "bf16"])
def test_f16_scales_are_bit_identical_to_f32_scales(fmt, K, G, zeros):
    """An f16-exact weight packed with f16 scales and zeros (negative and subnormal ones included) and packed with
    f32 ones: the same results bit for bit (the kernel widens exactly, then the same f32 arithmetic), and the same
    `unpack`."""
    f16, w = _weight(fmt, K, 70, G or K, zeros, seed=16, f16=True)
    f32, w32 = _weight(fmt, K, 70, G or K, zeros, seed=16, f16=True, scale_dtype=np.float32)
    assert f16.scale_bytes == 2 and f32.scale_bytes == 4 and f16.nbytes < f32.nbytes
    np.testing.assert_array_equal(w, w32)
    np.testing.assert_array_equal(np.asarray(f16.unpack()), w)
    np.testing.assert_array_equal(np.asarray(f32.unpack()), w)
    f = jax.jit(native.matmul)
    x_all = np.random.default_rng(17).standard_normal((20, K)).astype(np.float32)
    ref = _reference(x_all, fmt, w)
    for M in (1, 2, 7, 20):
        x = jnp.asarray(x_all[:M])
        out = np.asarray(f(x, f16))
        np.testing.assert_array_equal(out, np.asarray(f(x, f32)), err_msg=f"M={M}")
        np.testing.assert_allclose(out, ref[:M], rtol=1e-5, atol=2e-6 * np.sqrt(K))


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
    with pytest.raises(ValueError, match="multiple of 32"):
        native.pack_quantized(np.zeros((48, N), np.int8), np.ones((1, N), np.float32))
    with pytest.raises(ValueError, match="multiple of 16"):
        native.pack_quantized(np.zeros((96, N), np.int8), np.ones((12, N), np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        native.quantize_activations(jnp.zeros((2, 48), jnp.float32))


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
        np.testing.assert_allclose(out, _reference(x, fmt, w), rtol=1e-5, atol=1e-5 * 8)
        xla = jax.jit(lambda a, b: native.activations(a, fmt) @ b)
        np.testing.assert_array_equal(out, np.asarray(xla(jnp.asarray(x), jnp.asarray(w))))
        assert "custom_call" not in f.lower(jnp.asarray(x), packed).as_text()
    finally:
        monkeypatch.undo()
        native.load.cache_clear()
    assert native.load()


@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags(), reason="needs an x86-64 CPU with AVX2 and FMA")
def test_every_build_gives_the_same_bits(tmp_path):
    """kernel.cc built for plain x86-64 (SSE2: the portable C++ loops) and for x86-64-v3 (AVX2 + FMA + F16C, no
    AVX-512: the AVX2 integer blocks, vpmaddubsw / vpmaddwd) gives the same bits as the library in use (AVX-512 +
    VNNI on such a CPU, else the AVX2 build itself), for every format: exact integer sums, then the same float
    epilogue in the same order, whatever the instruction set."""
    def build(march: str):
        lib = build_for(native.SOURCE, march, str(tmp_path))
        for target, symbol in native.TARGETS.values():
            jax.ffi.register_ffi_target(f"{target}_{march}_test", jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")

        def matmul(x, w):
            call = jax.ffi.ffi_call(f"{native.TARGETS[w.format][0]}_{march}_test",
                                    jax.ShapeDtypeStruct((x.shape[0], w.n), jnp.float32))
            if not w.quantized:
                return call(x, w.panels)
            return call(x, w.panels, scale_bytes=np.int32(w.scale_bytes), has_zeros=w.has_zeros)

        return jax.jit(matmul)

    builds = {march: build(march) for march in ("x86-64", "x86-64-v3")}
    cases = CASES + [(fmt, K, G, zeros, True) for fmt, K, G, zeros in CASES if fmt != "bf16"]
    for fmt, K, G, zeros, *f16 in cases + [("f32", 96, 0, False)]:
        if fmt == "f32":
            packed = native.pack(np.random.default_rng(9).standard_normal((K, 70)).astype(np.float32))
        else:
            packed, _ = _weight(fmt, K, 70, G or K, zeros, seed=9, f16=bool(f16))
            assert fmt == "bf16" or packed.scale_bytes == (2 if f16 else 4)
        for M in (1, 2, 3, 13, 40):
            x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)).astype(np.float32))
            want = np.asarray(jax.jit(native.matmul)(x, packed))
            for march, matmul in builds.items():
                np.testing.assert_array_equal(np.asarray(matmul(x, packed)), want,
                                              err_msg=f"{march}: {fmt} K={K} G={G} zeros={zeros} f16={f16} M={M}")
    # The extremes of the 16-bit pair sums: every activation at +-127 after quantization, every weight at the end
    # of its range (int4 15, whose sub-block sums in s16 lanes reach 30,480; int8 -128, i.e. |q| = 128).
    x = jnp.asarray(np.array([[1.0] * 128, [-1.0] * 128, [1.0, -1.0] * 64], np.float32))
    for bits, fill in ((4, 15), (8, -128), (8, 127)):
        q = np.full((128, 40), fill, np.int8 if bits == 8 else np.uint8)
        s = np.full((4, 40), 0.25, np.float32)
        packed = native.pack_quantized(q, s, None, bits=bits)
        want = np.asarray(jax.jit(native.matmul)(x, packed))
        np.testing.assert_allclose(want[:2, 0], [0.25 * fill * 127 * 128 / 127, -0.25 * fill * 127 * 128 / 127],
                                   rtol=1e-6)
        for march, matmul in builds.items():
            np.testing.assert_array_equal(np.asarray(matmul(x, packed)), want, err_msg=f"{march}: int{bits} {fill}")


_BF16_PATH_SCRIPT = """
import sys
import jax, jax.numpy as jnp, ml_dtypes, numpy as np
from cpu_kernels import matmul as native
out = {}
for K in (7, 128, 576):
    w = (np.random.default_rng(K).standard_normal((K, 70)) / np.sqrt(K)).astype(ml_dtypes.bfloat16)
    packed = native.pack(w)
    for M in (1, 2, 4, 5, 13, 16, 40):
        x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)).astype(np.float32))
        out[f"{K},{M}"] = np.asarray(jax.jit(native.matmul)(x, packed))
np.savez(sys.argv[1], **out)
"""


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="needs AVX512_BF16: the two bf16 paths")
def test_bf16_fma_path_equals_dpbf16_path(tmp_path):
    """The bf16 format's two ways to multiply (`Bf16AsFma` in kernel.cc: vdpbf16ps, or two FMAs per k pair on
    widened weights, chosen per CPU and row count) give the same bits at every row count and K, odd K included: so
    a row's result does not depend on which one its batch's size picked. Each path forced for a whole process with
    JAXSERVE_MATMUL_BF16, then the default choice."""
    import subprocess
    import sys

    script = tmp_path / "bf16_paths.py"
    script.write_text(_BF16_PATH_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outs = {}
    for choice in ("fma", "dpbf16", ""):
        path = tmp_path / f"out_{choice or 'default'}.npz"
        env = dict(os.environ, JAXSERVE_MATMUL_BF16=choice, PYTHONPATH=root, JAX_PLATFORMS="cpu")
        subprocess.run([sys.executable, str(script), str(path)], check=True, env=env, cwd=root, timeout=600)
        outs[choice] = dict(np.load(path))
    assert len(outs["fma"]) == 21
    for key, ref in outs["dpbf16"].items():
        np.testing.assert_array_equal(outs["fma"][key], ref, err_msg=f"fma vs dpbf16, K,M = {key}")
        np.testing.assert_array_equal(outs[""][key], ref, err_msg=f"default vs dpbf16, K,M = {key}")


def test_an_unknown_bf16_path_is_refused(monkeypatch):
    """JAXSERVE_MATMUL_BF16 names a path (fma, dpbf16) or is unset; anything else is a clear error at load."""
    for ok in ("", "fma", "dpbf16"):
        monkeypatch.setenv("JAXSERVE_MATMUL_BF16", ok)
        native.check_env()
    monkeypatch.setenv("JAXSERVE_MATMUL_BF16", "vdpbf16ps")
    with pytest.raises(ValueError, match="JAXSERVE_MATMUL_BF16='vdpbf16ps': expected one of fma, dpbf16"):
        native.check_env()
