"""Attention dispatch: the model's only door to the ragged paged attention implementations.

On a GPU the Pallas kernel runs (`pallas_kernels/ragged_paged_attention`, which itself falls back to the reference,
and logs why, for shapes it does not cover); elsewhere the XLA reference runs, with per-token metadata computed once
per step. The model hands over the whole stacked cache plus a layer index; layer i's pages are addressed as pool
pages `i * P + p` so no layer slice is ever copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from jaxserve.batch import StepInputs
from jaxserve.kv_cache import KVCache, layer_pages
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels.ragged_paged_attention import reference


@jax.tree_util.register_dataclass
@dataclass
class TokenMetadata:
    """Per-token facts of a ragged batch, computed once per step and shared by every layer."""

    seq: jax.Array  # i32[T]  sequence index of each token
    pos: jax.Array  # i32[T]  absolute position
    is_real: jax.Array  # bool[T]


def token_metadata(inputs: StepInputs) -> TokenMetadata:
    seq, pos, is_real = reference.token_metadata(
        inputs.cu_q_lens, inputs.seq_lens, inputs.num_seqs, inputs.token_ids.shape[0]
    )
    return TokenMetadata(seq, pos, is_real)


def ragged_paged_attention(
    q: jax.Array,  # f[T, N, H]
    kv: KVCache,  # [L, P, page_size, K, H] values (+ f32[L, P, page_size, K] scales when quantized)
    layer: jax.Array,  # i32[]
    inputs: StepInputs,
    meta: TokenMetadata,
    *,
    sm_scale: float,
) -> jax.Array:  # f[T, N, H]
    num_pages = kv.k.shape[1]
    k_pages, v_pages = layer_pages(kv.k), layer_pages(kv.v)
    k_scales = None if kv.k_scale is None else layer_pages(kv.k_scale)
    v_scales = None if kv.v_scale is None else layer_pages(kv.v_scale)
    if rpa.select_impl(q, k_pages) == "kernel":
        return rpa.ragged_paged_attention(
            q, k_pages, v_pages, inputs.block_tables + layer * num_pages, inputs.seq_lens, inputs.cu_q_lens,
            inputs.num_seqs, k_scales, v_scales, sm_scale=sm_scale, impl="kernel",
        )
    return reference.attend(
        q,
        k_pages,
        v_pages,
        inputs.block_tables + layer * num_pages,
        meta.seq,
        meta.pos,
        meta.is_real,
        k_scales,
        v_scales,
        sm_scale=sm_scale,
    )
