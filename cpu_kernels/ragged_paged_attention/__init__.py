"""Ragged paged attention on CPU: the native FFI kernel (`kernel.cc`) behind the signature of `reference.attend`.

`attend(...)` computes what `pallas_kernels.ragged_paged_attention.reference.attend` computes (read its docstring:
ragged batch of prefill chunks, decodes and verifies over a paged, optionally int8/fp8-quantized KV cache, sliding
window, soft cap; padding tokens output zero). It validates its inputs, then emits one `jax.ffi.ffi_call` to the
C++ handler, which reads each visible key and value once per (query block, kv head) instead of gathering padded f32
chunks as the XLA reference does (`kernel.cc` narrates the algorithm).

The library is built on first use (`cpu_kernels.build`, cached per source / jaxlib / compiler / CPU) and registered
as the CPU target `TARGET`. `load()` says whether that worked; when it did not (no g++, a failed build), `attend`
logs one warning and runs the XLA reference instead, so serving never depends on the native kernel.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import build_library, load_cpu_target
from pallas_kernels.ragged_paged_attention import reference

TARGET = "jaxserve_ragged_paged_attention"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel.cc")
SUPPORTED_Q_DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_KV_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn")
QUANTIZED_KV_DTYPES = ("int8", "float8_e4m3fn")


@functools.cache
def load() -> bool:
    """Build (or find in the cache), load and register the native library; False, with one warning, on failure."""
    return load_cpu_target(build_library, SOURCE, "JaxserveRaggedPagedAttention", TARGET,
                           "native CPU attention unavailable, using the XLA reference")


def _validate(q, k_pages, v_pages, block_tables, seq, pos, is_real, k_scales, v_scales, sliding_window, soft_cap):
    if q.ndim != 3:
        raise ValueError(f"q must be [T, N, H] (got shape {q.shape})")
    T, N, H = q.shape
    if k_pages.ndim != 4 or k_pages.shape[3] != H:
        raise ValueError(f"k_pages must be [P, page_size, K, H={H}] (got shape {k_pages.shape})")
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages must match k_pages {k_pages.shape} {k_pages.dtype} "
                         f"(got {v_pages.shape} {v_pages.dtype})")
    P, page_size, K, _ = k_pages.shape
    if K == 0 or N % K:
        raise ValueError(f"query heads ({N}) must be a multiple of kv heads ({K})")
    if q.dtype.name not in SUPPORTED_Q_DTYPES:
        raise ValueError(f"q dtype must be one of {SUPPORTED_Q_DTYPES} (got {q.dtype})")
    if k_pages.dtype.name not in SUPPORTED_KV_DTYPES:
        raise ValueError(f"KV dtype must be one of {SUPPORTED_KV_DTYPES} (got {k_pages.dtype})")
    quantized = k_pages.dtype.name in QUANTIZED_KV_DTYPES
    if quantized:
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if s is None or s.shape != (P, page_size, K) or s.dtype != jnp.float32:
                got = None if s is None else f"{s.shape} {s.dtype}"
                raise ValueError(f"{k_pages.dtype} KV needs {name} f32{[P, page_size, K]} (got {got})")
    elif k_scales is not None or v_scales is not None:
        raise ValueError(f"float KV ({k_pages.dtype}) takes no k_scales / v_scales; pass None")
    if block_tables.ndim != 2 or block_tables.shape[0] < 1 or block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be i32[S >= 1, max_pages] (got {block_tables.shape} {block_tables.dtype})")
    for name, x, dtype in (("seq", seq, jnp.int32), ("pos", pos, jnp.int32), ("is_real", is_real, jnp.bool_)):
        if x.shape != (T,) or x.dtype != dtype:
            raise ValueError(f"{name} must be {jnp.dtype(dtype).name}[T={T}] (got {x.shape} {x.dtype})")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None (got {sliding_window})")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0 or None (got {soft_cap})")


def attend(
    q: jax.Array,  # f[T, N, H]
    k_pages: jax.Array,  # f[P, page_size, K, H]  (or int8 / float8_e4m3fn with scales)
    v_pages: jax.Array,  # f[P, page_size, K, H]
    block_tables: jax.Array,  # i32[S, max_pages]
    seq: jax.Array,  # i32[T]   sequence of each token
    pos: jax.Array,  # i32[T]   absolute position of each token
    is_real: jax.Array,  # bool[T]
    k_scales: jax.Array | None = None,  # f32[P, page_size, K]  (quantized caches only)
    v_scales: jax.Array | None = None,  # f32[P, page_size, K]
    *,
    sm_scale: float,
    block_q: int = 32,
    chunk_pages: int = 8,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # f[T, N, H]
    """`reference.attend` on the native kernel (the reference itself when the kernel is unavailable).

    `block_q` and `chunk_pages` are the reference's tiling knobs; they do not change the result, and the native
    kernel picks its own blocking. Traceable: call it under `jit` / `scan` like the reference.
    """
    _validate(q, k_pages, v_pages, block_tables, seq, pos, is_real, k_scales, v_scales, sliding_window, soft_cap)
    if not load():
        return reference.attend(
            q, k_pages, v_pages, block_tables, seq, pos, is_real, k_scales, v_scales, sm_scale=sm_scale,
            block_q=block_q, chunk_pages=chunk_pages, sliding_window=sliding_window, soft_cap=soft_cap,
        )
    if k_scales is None:  # float cache: the handler takes (and ignores) empty scale operands
        k_scales = v_scales = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
    return call(
        q, k_pages, v_pages, k_scales, v_scales, block_tables, seq, pos, is_real,
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int32(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )
