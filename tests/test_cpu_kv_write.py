"""The native in-place KV write (`cpu_kernels/kv_write`) against XLA's scatter, and an engine with a 16-bit float
cache compiled without converting or copying the cache."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import kv_write

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler (g++) to build the native kernel"
)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn", "float32", "int8"])
def test_rows_land_where_the_scatter_puts_them(dtype):
    assert kv_write.load()
    L, P, ps, K, H, T = 3, 5, 4, 2, 8, 6
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.standard_normal((L, P, ps, K, H)) * 4, dtype)
    rows = jnp.asarray(rng.standard_normal((T, K, H)) * 4, jnp.float32)
    slots = jnp.asarray([0, 7, 19, 3, 0, P * ps + 2], jnp.int32)  # the sink twice, and one outside the layer
    for layer in range(L):
        got = jax.jit(kv_write.kv_write, donate_argnums=0)(jnp.array(cache), rows, jnp.int32(layer), slots)
        keep = slots < P * ps
        want = cache.at[layer, slots[keep] // ps, slots[keep] % ps].set(rows[keep].astype(dtype))
        assert got.dtype == cache.dtype
        # the sink's two writes: the scatter and the copy both keep one of them; the test's rows 0 and 4 differ,
        # so compare everything but slot 0, then slot 0 against the last row written there
        g, w = np.array(got.astype(jnp.float32)), np.array(want.astype(jnp.float32))
        g[layer, 0, 0], w[layer, 0, 0] = 0, 0
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(np.asarray(got[layer, 0, 0].astype(jnp.float32)),
                                      np.asarray(rows[4].astype(dtype).astype(jnp.float32)))
