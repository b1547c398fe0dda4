"""Attention dispatch: the model's only door to the ragged paged attention implementations.

Today every backend runs the XLA reference (`pallas_kernels/ragged_paged_attention/reference.py`); the Pallas GPU
kernel joins behind this same function. The model hands over the whole stacked cache plus a layer index; layer i's
pages are addressed as pool pages `i * P + p` so no layer slice is ever copied.
"""

from __future__ import annotations

import jax

from jaxserve.batch import StepInputs
from jaxserve.kv_cache import layer_pages
from pallas_kernels.ragged_paged_attention import reference


def ragged_paged_attention(
    q: jax.Array,  # f[T, N, H]
    k_cache: jax.Array,  # f[L, P, page_size, K, H]
    v_cache: jax.Array,  # f[L, P, page_size, K, H]
    layer: jax.Array,  # i32[]
    inputs: StepInputs,
    *,
    sm_scale: float,
) -> jax.Array:  # f[T, N, H]
    num_pages = k_cache.shape[1]
    return reference.ragged_paged_attention(
        q,
        layer_pages(k_cache),
        layer_pages(v_cache),
        inputs.block_tables + layer * num_pages,
        inputs.seq_lens,
        inputs.cu_q_lens,
        inputs.num_seqs,
        sm_scale=sm_scale,
    )
