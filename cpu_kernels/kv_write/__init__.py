"""One layer's new KV rows written into the paged cache in place by a native copy (`kernel.cc`).

XLA:CPU scatters bf16, f16 and fp8 arrays by converting the whole operand to f32 and back, so `KVCache` writes of
those dtypes (`jaxserve.kv_cache.write_kv`) cost two passes over the whole cache per layer. This custom call takes
the cache as an operand aliased to its result and copies each new row's bytes into its slot. `load()` says whether
the library built; `write_kv` scatters as before when it did not.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from cpu_kernels.build import build_library, load_cpu_target

TARGET = "jaxserve_kv_write"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel.cc")


@functools.cache
def load() -> bool:
    """Build (or find in the cache), load and register the native library; False, with one warning, on failure."""
    return load_cpu_target(build_library, SOURCE, "JaxserveKvWrite", TARGET,
                           "native CPU KV write unavailable, scattering with XLA")


def kv_write(cache: jax.Array, rows: jax.Array, layer: jax.Array, slots: jax.Array) -> jax.Array:
    """cache [L, P, ps, K, H], rows [T, K, H] (cast to the cache's dtype), layer i32[], slots i32[T] (flat slot
    page * ps + offset within the layer; out of range: not written) -> the cache with rows[t] at (layer, slots[t]).
    Traceable; in place when the cache is donated."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(cache.shape, cache.dtype), input_output_aliases={0: 0})
    return call(cache, rows.astype(cache.dtype), jnp.asarray(layer, jnp.int32), slots.astype(jnp.int32))
