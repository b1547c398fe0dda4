"""Row statistics of logits on CPU for the sampler: the native FFI kernel (`kernel.cc`) and its XLA twin.

`row_stats(x)` for x f32[R, V] returns (m f32[R], first i32[R], log_z f32[R], nonfinite bool[R]): each row's maximum
(NaN if it holds a NaN), the lowest index holding it (V for a NaN row), log(sum(exp(x - m))), and whether the row
holds a NaN or +inf. That is one kernel call where XLA:CPU makes about six passes over the logits (`kernel.cc`
says why it matters). `reference(x)` is the same in XLA, and what `row_stats` runs when the library cannot be built
(one warning); the two agree to float rounding (the exp and the order of the sum differ), and exactly on m, first
and nonfinite.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from cpu_kernels.build import build_library, load_cpu_target

TARGET = "jaxserve_row_stats"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel.cc")


@functools.cache
def load() -> bool:
    """Build (or find in the cache), load and register the native library; False, with one warning, on failure."""
    return load_cpu_target(build_library, SOURCE, "JaxserveRowStats", TARGET,
                           "native CPU row statistics unavailable, using XLA")


def reference(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`row_stats` in XLA. Traceable."""
    V = x.shape[-1]
    m = jnp.max(x, axis=-1)
    first = jnp.min(jnp.where(x == m[:, None], jnp.arange(V, dtype=jnp.int32), V), axis=-1)
    log_z = jnp.log(jnp.sum(jnp.exp(x - m[:, None]), axis=-1))
    nonfinite = jnp.any(jnp.isnan(x) | (x == jnp.inf), axis=-1)
    return m, first, log_z, nonfinite


def row_stats(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """x f32[R, V] -> (m, first, log_z, nonfinite), each [R] (module docstring). Traceable."""
    if x.ndim != 2 or x.dtype != jnp.float32 or x.shape[1] < 1:
        raise ValueError(f"row_stats takes x f32[R, V] with V >= 1 (got {x.shape} {x.dtype})")
    if not load():
        return reference(x)
    R = x.shape[0]
    out = (jax.ShapeDtypeStruct((R,), jnp.float32), jax.ShapeDtypeStruct((R,), jnp.int32),
           jax.ShapeDtypeStruct((R,), jnp.float32), jax.ShapeDtypeStruct((R,), jnp.bool_))
    return tuple(jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x))


SUM_SQUARES_TARGET = "jaxserve_row_sum_squares"


@functools.cache
def load_sum_squares() -> bool:
    """`load` for the sum-of-squares target (the same library)."""
    return load_cpu_target(build_library, SOURCE, "JaxserveRowSumSquares", SUM_SQUARES_TARGET,
                           "native CPU row sums of squares unavailable, using XLA (RMSNorm is not batch-invariant)")


def sum_squares(x: jax.Array) -> jax.Array:
    """x f32[R, D] -> f32[R]: each row's sum of squares in one fixed order whatever R (`kernel.cc`), so a row's
    result never depends on the other rows; XLA's `jnp.sum(x * x, -1)` (the fallback when the library cannot be
    built) picks its order by shape. Traceable."""
    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"sum_squares takes x f32[R, D] (got {x.shape} {x.dtype})")
    if not load_sum_squares():
        return jnp.sum(x * x, axis=-1)
    return jax.ffi.ffi_call(SUM_SQUARES_TARGET, jax.ShapeDtypeStruct((x.shape[0],), jnp.float32),
                            vmap_method="sequential")(x)
