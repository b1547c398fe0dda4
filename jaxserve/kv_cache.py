"""The paged KV cache: layout, allocation and slot-mapping writes.

Layout: `k`, `v`: [L, P, page_size, K, H] — every layer's pages stacked, so one donated pytree holds the whole
cache and the layer loop can carry it. A token's *slot* is `page * page_size + offset`. Page 0 is the padding sink:
padding tokens write there and padded block-table entries point there; it is never handed to a sequence.

Quantized caches (int8, fp8 e4m3) also hold `k_scale`, `v_scale`: f32[L, P, page_size, K], one scale per token and
kv head, written with the values (format: `ops.quantize_kv`, the attention reference's). Float caches have no
scales (None).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.ops import QUANT_MAX, native_kv_write, quantize_kv


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: jax.Array  # [L, P, page_size, K, H]  float or quantized values
    v: jax.Array  # [L, P, page_size, K, H]
    k_scale: jax.Array | None = None  # f32[L, P, page_size, K]  (quantized caches only)
    v_scale: jax.Array | None = None  # f32[L, P, page_size, K]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype).name in QUANT_MAX


# Logical axes of the cache arrays (`jaxserve.sharding`): values [L, P, page_size, K, H], scales [L, P, page_size, K].
KV_AXES = ("layers", None, None, "kv_heads", "head_dim")
KV_SCALE_AXES = KV_AXES[:-1]


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    return (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)


def kv_cache_bytes(cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> int:
    """Bytes of K and V (values plus scales for quantized dtypes) for `num_pages` pages."""
    tokens = cfg.num_layers * num_pages * page_size * cfg.num_kv_heads
    per_head = cfg.head_dim * jnp.dtype(dtype).itemsize + (4 if is_quantized(dtype) else 0)
    return 2 * tokens * per_head


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> KVCache:
    shape = kv_cache_shape(cfg, num_pages, page_size)
    if not is_quantized(dtype):
        return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        k_scale=jnp.zeros(shape[:-1], jnp.float32),
        v_scale=jnp.zeros(shape[:-1], jnp.float32),
    )


def layer_pages(cache: jax.Array) -> jax.Array:
    """All layers' pages as one page pool: f[L, P, page_size, K, H] -> f[L*P, page_size, K, H] (a free reshape).

    Layer i's page p is pool page `i * P + p`, so attention can read one layer without slicing the cache.
    """
    L, P = cache.shape[:2]
    return cache.reshape(L * P, *cache.shape[2:])


def write_kv(
    kv: KVCache,
    layer: jax.Array,  # i32[]
    k: jax.Array,  # f[T, K, H]
    v: jax.Array,  # f[T, K, H]
    slot_mapping: jax.Array,  # i32[T]
    *,
    native: bool = False,
) -> KVCache:
    """Scatter one layer's new keys/values (quantized on the way in, if the cache is) into their slots, in place
    when the cache is donated. `native` (`backends.native_single_device`: the engine's native CPU step on one
    device): bf16 / f16 / fp8 slots are written by the native in-place copy (`cpu_kernels.kv_write`), because XLA:CPU
    scatters those dtypes by converting the whole cache to f32 and back around every layer (a bf16 cache made a
    SmolLM2 decode step ~3.7 s instead of ~5 ms)."""
    page_size = kv.k.shape[2]
    # One extra write into the sink slot (page 0, offset 0) keeps this a scatter even for a single token. XLA
    # turns a one-element scatter into a dynamic-update-slice, and for that form XLA:CPU copied the whole cache
    # around the attention loops that read it (tests/test_engine.py::test_kv_cache_is_never_copied).
    slot_mapping = jnp.concatenate([slot_mapping, jnp.zeros((1,), slot_mapping.dtype)])
    k = jnp.concatenate([k, jnp.zeros((1, *k.shape[1:]), k.dtype)])
    v = jnp.concatenate([v, jnp.zeros((1, *v.shape[1:]), v.dtype)])
    page, offset = slot_mapping // page_size, slot_mapping % page_size

    def put(cache, x):
        if native and jnp.issubdtype(cache.dtype, jnp.floating) and cache.dtype.itemsize < 4:
            written = native_kv_write(cache, x, layer, slot_mapping)
            if written is not None:
                return written
        return cache.at[layer, page, offset].set(x.astype(cache.dtype), mode="promise_in_bounds")

    if not kv.quantized:
        return KVCache(k=put(kv.k, k), v=put(kv.v, v))
    (qk, sk), (qv, sv) = quantize_kv(k, kv.k.dtype), quantize_kv(v, kv.v.dtype)
    return KVCache(k=put(kv.k, qk), v=put(kv.v, qv), k_scale=put(kv.k_scale, sk), v_scale=put(kv.v_scale, sv))
