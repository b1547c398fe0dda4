"""The Pallas dequantizing matmul (`pallas_kernels.quant_matmul`) in interpret mode on CPU against a float64 numpy
product of the dequantized weights: 4-bit (the group-halves byte layout of `jaxserve.quant.QuantizedLinear`) and
int8 in groups of 32 and 64, with and without zeros, row counts across the padding to block_m, f32 and bf16
activations; the shapes it refuses."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import quant
from pallas_kernels.quant_matmul import quant_matmul, reference, unsupported_reason

K, N = 128, 128


def _weight(bits, group, zeros, seed=0):
    rng = np.random.default_rng(seed)
    hi = 16 if bits == 4 else 128
    values = rng.integers(0 if bits == 4 else -hi, hi, (K, N))
    scales = rng.uniform(0.005, 0.02, (K // group, N)).astype(np.float32)
    z = rng.normal(0, 0.05, (K // group, N)).astype(np.float32) if zeros else None
    return quant.from_values(values, scales, z, bits)


@pytest.mark.parametrize("bits,group,zeros", [(4, 32, True), (4, 64, True), (4, 32, False), (8, 32, False),
                                               (8, 64, True)])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40])
def test_kernel_matches_float64_product(bits, group, zeros, rows):
    w = _weight(bits, group, zeros, seed=rows)
    x = np.random.default_rng(rows).normal(0, 1, (rows, K)).astype(np.float32)
    args = (jnp.asarray(w.q), jnp.asarray(w.scales), None if w.zeros is None else jnp.asarray(w.zeros))
    y = np.asarray(quant_matmul(jnp.asarray(x), *args, bits=bits, interpret=True))
    want = x.astype(np.float64) @ w.dequantize().astype(np.float64)
    assert y.shape == (rows, N)
    np.testing.assert_allclose(y, want, atol=2e-5 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(reference(jnp.asarray(x), *args, bits=bits)), want,
                               atol=2e-5 * np.abs(want).max())


def test_kernel_in_bfloat16():
    w = _weight(4, 32, True)
    x = np.random.default_rng(0).normal(0, 1, (5, K)).astype(np.float32)
    xb = jnp.asarray(x, jnp.bfloat16)
    y = quant_matmul(xb, jnp.asarray(w.q), jnp.asarray(w.scales), jnp.asarray(w.zeros), bits=4, interpret=True)
    assert y.dtype == jnp.bfloat16
    want = np.asarray(xb, np.float64) @ w.dequantize().astype(np.float64)
    np.testing.assert_allclose(np.asarray(y, np.float32), want, atol=0.02 * np.abs(want).max())


def test_refused_shapes_say_why():
    w = _weight(8, 32, False)
    x = jnp.zeros((2, K), jnp.float32)
    assert unsupported_reason(x, w.q[:, :100], w.scales[:, :100], bits=8) == "N = 100 is not a multiple of block_n = 64"
    small = quant.from_values(np.zeros((K, N)), np.ones((K // 16, N)), None, 8)
    assert "group 16" in unsupported_reason(x, small.q, small.scales, bits=8)
    with pytest.raises(ValueError, match="quant_matmul: group 16"):
        quant_matmul(x, jnp.asarray(small.q), jnp.asarray(small.scales), bits=8, interpret=True)
