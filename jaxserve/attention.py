"""Attention for the model: one layer's view of the paged KV cache, handed to the kernel `jaxserve.ops` chose.

The model hands over the whole stacked cache plus a layer index; layer i's pages are addressed as pool pages
`i * P + p` so no layer slice is ever copied (the native CPU kernel receives the cache as a free reshape of the scan
carry). Which kernel runs is the resolved `ops.Backends.attention`, a static argument: "pallas" on a GPU (the
Pallas kernel, which falls back to the reference, and logs why, for shapes it does not cover), "native" (the C++
kernel, the CPU default when it builds) or "xla" (the reference everywhere). The per-token metadata the CPU paths
take is computed once per step (`token_metadata`) and shared by every layer.
"""

from __future__ import annotations

import jax

from jaxserve import ops
from jaxserve.batch import StepInputs
from jaxserve.kv_cache import KVCache, layer_pages
from jaxserve.ops import TokenMetadata


def token_metadata(inputs: StepInputs) -> TokenMetadata:
    return ops.token_metadata(inputs.cu_q_lens, inputs.seq_lens, inputs.num_seqs, inputs.token_ids.shape[0])


def ragged_paged_attention(
    q: jax.Array,  # f[T, N, H]
    kv: KVCache,  # [L, P, page_size, K, H] values (+ f32[L, P, page_size, K] scales when quantized)
    layer: jax.Array,  # i32[]
    inputs: StepInputs,
    meta: TokenMetadata,
    *,
    sm_scale: float,
    backends: ops.Backends | None = None,  # None: ops.Backends.default(), resolved at trace time
) -> jax.Array:  # f[T, N, H]
    backends = backends or ops.Backends.default()
    num_pages = kv.k.shape[1]
    return ops.attend(
        q,
        layer_pages(kv.k),
        layer_pages(kv.v),
        inputs.block_tables + layer * num_pages,
        inputs.seq_lens,
        inputs.cu_q_lens,
        inputs.num_seqs,
        meta,
        None if kv.k_scale is None else layer_pages(kv.k_scale),
        None if kv.v_scale is None else layer_pages(kv.v_scale),
        sm_scale=sm_scale,
        backends=backends,
    )
