"""The paged KV cache: layout, allocation and slot-mapping writes.

Layout: `k`, `v`: f[L, P, page_size, K, H] — every layer's pages stacked, so one donated pytree holds the whole
cache and the layer loop can carry it. A token's *slot* is `page * page_size + offset`. Page 0 is the padding sink:
padding tokens write there and padded block-table entries point there; it is never handed to a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: jax.Array  # f[L, P, page_size, K, H]
    v: jax.Array  # f[L, P, page_size, K, H]


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    return (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)


def kv_cache_bytes(cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> int:
    n = 1
    for d in kv_cache_shape(cfg, num_pages, page_size):
        n *= d
    return 2 * n * jnp.dtype(dtype).itemsize


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> KVCache:
    shape = kv_cache_shape(cfg, num_pages, page_size)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def layer_pages(cache: jax.Array) -> jax.Array:
    """All layers' pages as one page pool: f[L, P, page_size, K, H] -> f[L*P, page_size, K, H] (a free reshape).

    Layer i's page p is pool page `i * P + p`, so attention can read one layer without slicing the cache.
    """
    L, P = cache.shape[:2]
    return cache.reshape(L * P, *cache.shape[2:])


def write_kv(
    k_cache: jax.Array,  # f[L, P, page_size, K, H]
    v_cache: jax.Array,  # f[L, P, page_size, K, H]
    layer: jax.Array,  # i32[]
    k: jax.Array,  # f[T, K, H]
    v: jax.Array,  # f[T, K, H]
    slot_mapping: jax.Array,  # i32[T]
) -> tuple[jax.Array, jax.Array]:
    """Scatter one layer's new keys/values into their slots (in place when the cache is donated)."""
    page_size = k_cache.shape[2]
    # One extra write into the sink slot (page 0, offset 0) keeps this a scatter even for a single token. XLA
    # turns a one-element scatter into a dynamic-update-slice, and for that form XLA:CPU copied the whole cache
    # around the attention loops that read it (tests/test_engine.py::test_kv_cache_is_never_copied).
    slot_mapping = jnp.concatenate([slot_mapping, jnp.zeros((1,), slot_mapping.dtype)])
    k = jnp.concatenate([k, jnp.zeros((1, *k.shape[1:]), k.dtype)])
    v = jnp.concatenate([v, jnp.zeros((1, *v.shape[1:]), v.dtype)])
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    k_cache = k_cache.at[layer, page, offset].set(k.astype(k_cache.dtype), mode="promise_in_bounds")
    v_cache = v_cache.at[layer, page, offset].set(v.astype(v_cache.dtype), mode="promise_in_bounds")
    return k_cache, v_cache
