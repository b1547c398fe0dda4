"""Attention dispatch: the model's only door to the ragged paged attention implementations.

On a GPU the Pallas kernel runs (`pallas_kernels/ragged_paged_attention`, which itself falls back to the reference,
and logs why, for shapes it does not cover). On the CPU the native FFI kernel runs
(`cpu_kernels/ragged_paged_attention`, built with g++ on first use); if it cannot be built, the XLA reference runs
instead, with one warning. Both CPU paths take per-token metadata computed once per step. The model hands over the
whole stacked cache plus a layer index; layer i's pages are addressed as pool pages `i * P + p` so no layer slice is
ever copied (the native kernel receives the cache as a free reshape of the scan carry).

`JAXSERVE_ATTENTION_BACKEND` (read when the step is traced) overrides the choice: `auto` (the default, as above),
`xla` (the XLA reference on every backend), `native` (the CPU kernel; an error if it cannot be loaded or the backend
is not the CPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax

from cpu_kernels import ragged_paged_attention as cpu_rpa
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


BACKEND_ENV = "JAXSERVE_ATTENTION_BACKEND"
BACKENDS = ("auto", "xla", "native")


def attention_backend() -> str:
    """The validated `JAXSERVE_ATTENTION_BACKEND`: 'auto', 'xla' or 'native' ('native' raises here, at trace time,
    if the backend is not the CPU or the native library cannot be loaded)."""
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS} (got {choice!r})")
    if choice == "native":
        platform = jax.default_backend()
        if platform != "cpu":
            raise ValueError(f"{BACKEND_ENV}=native needs the CPU backend (running on {platform}); use auto or xla")
        if not cpu_rpa.load():
            raise RuntimeError(f"{BACKEND_ENV}=native but the native CPU attention library could not be built or "
                               "loaded (see the warning above); install g++ or use auto / xla")
    return choice


def uses_native_kernel(backend: str) -> bool:
    """Whether a non-Pallas step under `backend` runs the native CPU kernel (else the XLA reference)."""
    return backend == "native" or (backend == "auto" and jax.default_backend() == "cpu" and cpu_rpa.load())


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
    backend = attention_backend()
    if backend == "auto" and rpa.select_impl(q, k_pages) == "kernel":  # a GPU, shapes the Pallas kernel covers
        return rpa.ragged_paged_attention(
            q, k_pages, v_pages, inputs.block_tables + layer * num_pages, inputs.seq_lens, inputs.cu_q_lens,
            inputs.num_seqs, k_scales, v_scales, sm_scale=sm_scale, impl="kernel",
        )
    attend = cpu_rpa.attend if uses_native_kernel(backend) else reference.attend
    return attend(
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
