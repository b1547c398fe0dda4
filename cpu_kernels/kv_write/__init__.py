"""WIP (stop 44): the KV write as a native in-place copy (`kernel.cc`), for caches XLA:CPU cannot scatter in place."""

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
    return load_cpu_target(build_library, SOURCE, "JaxserveKvWrite", TARGET, "native CPU KV write unavailable")


def kv_write(cache: jax.Array, rows: jax.Array, layer: jax.Array, slots: jax.Array) -> jax.Array:
    """cache [L, P, ps, K, H], rows [T, K, H] (the cache's dtype), layer i32[], slots i32[T] -> the written cache."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(cache.shape, cache.dtype), input_output_aliases={0: 0})
    return call(cache, rows.astype(cache.dtype), jnp.asarray(layer, jnp.int32), slots.astype(jnp.int32))
