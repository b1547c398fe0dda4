"""Ragged paged attention: the validated public entry, choosing the Pallas GPU kernel or the XLA reference.

`ragged_paged_attention(...)` has the semantics documented in `reference.py` (ragged batch of prefill chunks,
decodes and verifies over a paged, optionally int8/fp8-quantized KV cache) plus optional sliding window and logit
soft-cap. It runs `kernel.py` on a GPU for the shapes the kernel covers (`unsupported_reason` says which) and the
XLA reference everywhere else, logging once per reason when it falls back on a GPU.

Block sizes come from `BLOCK_TABLE`, keyed by the step's shape class (decode / verify / prefill, from the average
query tokens per sequence of the static bucket) and head dim; `block_sizes_for` turns an entry into the launch's
`BlockSizes` for a concrete group size, page size and batch.

The KV write path has no kernel of its own: `jaxserve.kv_cache.write_kv` quantizes the step's new keys and values
(per token and kv head, `reference.quantize_kv`) and scatters them into the donated cache; XLA fuses the
quantization into the scatter's operand and updates in place, so a Pallas write kernel would move the same
T x K x H bytes. (A judgement, not a GPU measurement.)
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import reference
from pallas_kernels.ragged_paged_attention.kernel import (
    BlockSizes,
    num_tiles_bound,
    padded_group,
    ragged_paged_attention_kernel,
)

logger = logging.getLogger(__name__)

SUPPORTED_PAGE_SIZES = (8, 16, 32, 64, 128)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_Q_DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_KV_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn")
MAX_GROUP = 64  # query heads per kv head (padded to a power of two) the kernel holds in one program

# H100/H200 have 132 SMs; a decode launch with fewer programs than this splits each sequence's keys.
_TARGET_PROGRAMS = 2 * 132
_MAX_KV_SPLITS = 8


@dataclasses.dataclass(frozen=True)
class TableEntry:
    rows: int  # query rows per program = block_q tokens x padded group (>= 16: Triton's dot minimum)
    block_k: int  # keys per inner step (a whole number of pages; a larger page is one step)
    num_warps: int
    num_stages: int


# Decode is a stream over the KV bytes: few rows, keys in 16 KB (bf16) steps, deeper pipelining.
# Prefill is compute-bound: 64 rows so every loaded key block feeds 4x more MMA work.
BLOCK_TABLE: dict[tuple[str, int], TableEntry] = {
    ("decode", 64): TableEntry(rows=16, block_k=128, num_warps=4, num_stages=3),
    ("decode", 128): TableEntry(rows=16, block_k=64, num_warps=4, num_stages=3),
    ("verify", 64): TableEntry(rows=32, block_k=128, num_warps=4, num_stages=2),
    ("verify", 128): TableEntry(rows=32, block_k=64, num_warps=4, num_stages=2),
    ("prefill", 64): TableEntry(rows=64, block_k=64, num_warps=4, num_stages=2),
    ("prefill", 128): TableEntry(rows=64, block_k=64, num_warps=8, num_stages=2),
}


def shape_class(num_tokens: int, num_seqs: int) -> str:
    """decode (<= 2 query tokens per sequence on average), verify (<= 8: 1+K speculative queries), prefill."""
    if num_tokens <= 2 * num_seqs:
        return "decode"
    if num_tokens <= 8 * num_seqs:
        return "verify"
    return "prefill"


def block_sizes_for(
    *, num_tokens: int, num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
    max_pages: int,
) -> BlockSizes:
    mode = shape_class(num_tokens, num_seqs)
    entry = BLOCK_TABLE[(mode, head_dim)]
    group = padded_group(num_q_heads, num_kv_heads)
    block_q = max(1, entry.rows // group)
    chunk_pages = max(1, entry.block_k // page_size)
    splits = 1
    if mode == "decode":  # flash-decoding split when tiles x kv heads cannot fill the GPU and contexts are long
        programs = num_tiles_bound(num_tokens, num_seqs, block_q) * num_kv_heads
        key_steps = -(-max_pages // chunk_pages)
        while splits < _MAX_KV_SPLITS and programs * splits < _TARGET_PROGRAMS and key_steps >= 8 * splits:
            splits *= 2
    return BlockSizes(
        block_q=block_q, chunk_pages=chunk_pages, num_kv_splits=splits, num_warps=entry.num_warps,
        num_stages=entry.num_stages,
    )


def unsupported_reason(q: jax.Array, k_pages: jax.Array) -> str | None:
    """Why the kernel does not cover these shapes/dtypes, or None when it does."""
    _, N, H = q.shape
    _, page_size, K, _ = k_pages.shape
    if H not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {H} not in {SUPPORTED_HEAD_DIMS}"
    if page_size not in SUPPORTED_PAGE_SIZES:
        return f"page_size {page_size} not in {SUPPORTED_PAGE_SIZES}"
    if jnp.dtype(q.dtype).name not in SUPPORTED_Q_DTYPES:
        return f"query dtype {jnp.dtype(q.dtype).name} not in {SUPPORTED_Q_DTYPES}"
    if jnp.dtype(k_pages.dtype).name not in SUPPORTED_KV_DTYPES:
        return f"KV dtype {jnp.dtype(k_pages.dtype).name} not in {SUPPORTED_KV_DTYPES}"
    if padded_group(N, K) > MAX_GROUP:
        return f"{N // K} query heads per kv head (max {MAX_GROUP})"
    return None


_logged: set[str] = set()


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


def select_impl(q: jax.Array, k_pages: jax.Array, *, impl: str = "auto", interpret: bool = False) -> str:
    """'kernel' or 'reference' for these inputs. impl: 'auto' (kernel on GPU, or in interpret mode, when it covers
    the shapes), 'kernel' (raise if it does not), 'reference'."""
    if impl not in ("auto", "kernel", "reference"):
        raise ValueError(f"impl must be 'auto', 'kernel' or 'reference' (got {impl!r})")
    if impl == "reference":
        return "reference"
    reason = unsupported_reason(q, k_pages)
    if impl == "kernel":
        if reason is not None:
            raise ValueError(f"the ragged paged attention kernel does not cover this call: {reason}; use impl='auto'")
        return "kernel"
    on_gpu = jax.default_backend() == "gpu"
    if not (on_gpu or interpret):
        return "reference"  # not a GPU: the caller picks its own non-Pallas path (jaxserve/attention.py)
    if reason is not None:
        _log_once(logging.WARNING, f"ragged paged attention: falling back to the XLA reference: {reason}")
        return "reference"
    return "kernel"


def _validate(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, k_scales, v_scales, sliding_window, soft_cap):
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(f"q must be [T, N, H] and k_pages [P, page_size, K, H] (got {q.shape}, {k_pages.shape})")
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages must match k_pages (got {v_pages.shape} {v_pages.dtype} vs "
                         f"{k_pages.shape} {k_pages.dtype})")
    _, N, H = q.shape
    P, page_size, K, Hk = k_pages.shape
    if Hk != H or N % K:
        raise ValueError(f"need the same head dim and query heads a multiple of kv heads (got q {q.shape}, "
                         f"pages {k_pages.shape})")
    if (block_tables.ndim != 2 or seq_lens.shape != block_tables.shape[:1]
            or cu_q_lens.shape != (seq_lens.shape[0] + 1,)):
        raise ValueError(f"expected block_tables [S, max_pages], seq_lens [S], cu_q_lens [S+1] (got "
                         f"{block_tables.shape}, {seq_lens.shape}, {cu_q_lens.shape})")
    quantized = jnp.dtype(k_pages.dtype).name in reference.QUANT_MAX
    if quantized != (k_scales is not None) or (k_scales is None) != (v_scales is None):
        raise ValueError(f"k_scales and v_scales are required exactly for quantized KV (dtype {k_pages.dtype}, "
                         f"scales given: {k_scales is not None}, {v_scales is not None})")
    if quantized and (k_scales.shape != (P, page_size, K) or v_scales.shape != (P, page_size, K)):
        raise ValueError(f"scales must be f32[P, page_size, K] = {(P, page_size, K)} (got {k_scales.shape}, "
                         f"{v_scales.shape})")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None (got {sliding_window})")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0 or None (got {soft_cap})")


def ragged_paged_attention(
    q: jax.Array,  # f[T, N, H]
    k_pages: jax.Array,  # [P, page_size, K, H]
    v_pages: jax.Array,  # [P, page_size, K, H]
    block_tables: jax.Array,  # i32[S, max_pages]
    seq_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    k_scales: jax.Array | None = None,  # f32[P, page_size, K]  (quantized caches only)
    v_scales: jax.Array | None = None,  # f32[P, page_size, K]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    impl: str = "auto",
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
) -> jax.Array:  # f[T, N, H]
    """Ragged paged attention (see the module docstring). `interpret=True` runs the kernel in Pallas interpret
    mode (any backend; for tests). `block_sizes` overrides the table."""
    _validate(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, k_scales, v_scales, sliding_window, soft_cap)
    if select_impl(q, k_pages, impl=impl, interpret=interpret) == "reference":
        return reference.ragged_paged_attention(
            q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs, k_scales, v_scales,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        )
    T, N, H = q.shape
    _, page_size, K, _ = k_pages.shape
    if block_sizes is None:
        block_sizes = block_sizes_for(
            num_tokens=T, num_seqs=block_tables.shape[0], num_q_heads=N, num_kv_heads=K, head_dim=H,
            page_size=page_size, max_pages=block_tables.shape[1],
        )
    return ragged_paged_attention_kernel(
        q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs, k_scales, v_scales,
        sm_scale=sm_scale, block_sizes=block_sizes, sliding_window=sliding_window, soft_cap=soft_cap,
        interpret=interpret,
    )


__all__ = [
    "BLOCK_TABLE",
    "BlockSizes",
    "block_sizes_for",
    "ragged_paged_attention",
    "select_impl",
    "unsupported_reason",
]
