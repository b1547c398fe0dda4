"""Speculative verification: the validated public entry, choosing the Pallas GPU kernel or the XLA reference.

`rejection_sample(...)` and `verify_one_hot(...)` have the semantics of the same functions in `reference.py`
(the maths is in its module docstring), plus `impl=` ('auto' | 'kernel' | 'reference'), `interpret=` and an
optional `block_sizes=` override. On a GPU (or in interpret mode) they run `kernel.py` when it covers the inputs
(`unsupported_reason` says when it does not) and the reference everywhere else, logging once per reason when they
fall back on a GPU.

Block sizes come from `BLOCK_TABLE`, keyed by the target kind ('probs': p, q and the noise are streamed; 'logits':
the logits and the noise); `block_sizes_for` adds the vocabulary split for launches with too few rows to fill
the GPU. The table is a judgement, not a GPU measurement yet (see bench.py).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from pallas_kernels.spec_verify import reference
from pallas_kernels.spec_verify.kernel import BlockSizes, spec_verify_kernel
from pallas_kernels.spec_verify.reference import NO_DRAFT, accepted_length

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = ("float32",)
MAX_VOCAB = 1 << 22  # i32 index arithmetic with headroom; real vocabularies are <= ~260k

# H100/H200 have 132 SMs: aim for about two programs per SM before splitting rows' vocabularies.
_TARGET_PROGRAMS = 256
_MAX_SPLITS = 32
_MIN_BLOCKS_PER_SPLIT = 4


@dataclasses.dataclass(frozen=True)
class TableEntry:
    block_v: int  # vocabulary elements per streamed block
    num_warps: int
    num_stages: int


# A pure stream with a few flops per element: 8 warps (256 threads) x 8-16 f32 per thread per streamed array, so
# each block is a handful of 128-bit loads per thread per array and the reductions stay cheap. 'probs' streams 3
# arrays (p, q, noise), 'logits' 2, hence the smaller block for 'probs'.
BLOCK_TABLE: dict[str, TableEntry] = {
    "probs": TableEntry(block_v=2048, num_warps=8, num_stages=2),
    "logits": TableEntry(block_v=4096, num_warps=8, num_stages=2),
}


def block_sizes_for(*, num_rows: int, vocab: int, target_kind: str) -> BlockSizes:
    """The table entry for this kind, with the vocabulary split in 2^k parts while rows x splits cannot fill the
    GPU and every split keeps at least `_MIN_BLOCKS_PER_SPLIT` blocks."""
    entry = BLOCK_TABLE[target_kind]
    num_blocks = -(-vocab // entry.block_v)
    splits = 1
    while (splits < _MAX_SPLITS and num_rows * splits < _TARGET_PROGRAMS
           and num_blocks >= 2 * splits * _MIN_BLOCKS_PER_SPLIT):
        splits *= 2
    return BlockSizes(block_v=entry.block_v, num_splits=splits, num_warps=entry.num_warps,
                      num_stages=entry.num_stages)


def unsupported_reason(*arrays: jax.Array | None) -> str | None:
    """Why the kernel does not cover these [R, V] float arrays, or None when it does."""
    for a in arrays:
        if a is not None and jnp.dtype(a.dtype).name not in SUPPORTED_DTYPES:
            return f"dtype {jnp.dtype(a.dtype).name} not in {SUPPORTED_DTYPES}"
    R, V = arrays[0].shape
    if R == 0 or V == 0:
        return f"empty input [{R}, {V}]"
    if V > MAX_VOCAB:
        return f"vocabulary {V} > {MAX_VOCAB}"
    return None


_logged: set[str] = set()


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


def select_impl(*arrays: jax.Array | None, impl: str = "auto", interpret: bool = False) -> str:
    """'kernel' or 'reference' for these inputs. impl: 'auto' (kernel on GPU, or in interpret mode, when it covers
    the inputs), 'kernel' (raise if it does not), 'reference'."""
    if impl not in ("auto", "kernel", "reference"):
        raise ValueError(f"impl must be 'auto', 'kernel' or 'reference' (got {impl!r})")
    if impl == "reference":
        return "reference"
    reason = unsupported_reason(*arrays)
    if impl == "kernel":
        if reason is not None:
            raise ValueError(f"the spec_verify kernel does not cover this call: {reason}; use impl='auto'")
        return "kernel"
    if not (jax.default_backend() == "gpu" or interpret):
        _log_once(logging.INFO, f"spec_verify: no GPU ({jax.default_backend()}), using the XLA reference")
        return "reference"
    if reason is not None:
        _log_once(logging.WARNING, f"spec_verify: falling back to the XLA reference: {reason}")
        return "reference"
    return "kernel"


def _validate(target, draft_probs, draft_ids, uniform, gumbel, name):
    if target.ndim != 2:
        raise ValueError(f"{name} must be [R, V] (got shape {target.shape})")
    R, V = target.shape
    if gumbel.shape != (R, V) or (draft_probs is not None and draft_probs.shape != (R, V)):
        raise ValueError(f"gumbel and draft_probs must have {name}'s shape {(R, V)} (got {gumbel.shape}, "
                         f"{None if draft_probs is None else draft_probs.shape})")
    if draft_ids.shape != (R,) or uniform.shape != (R,):
        raise ValueError(f"draft_ids and uniform must be [R] = {(R,)} (got {draft_ids.shape}, {uniform.shape})")
    if not jnp.issubdtype(draft_ids.dtype, jnp.integer):
        raise ValueError(f"draft_ids must be integers, -1 for no draft (got {draft_ids.dtype})")


def _check_block_sizes(block_sizes: BlockSizes) -> None:
    bv = block_sizes.block_v
    if bv < 16 or bv & (bv - 1) or block_sizes.num_splits < 1:
        raise ValueError(f"block_v must be a power of two >= 16 and num_splits >= 1 (got {block_sizes})")


def rejection_sample(
    target_probs: jax.Array,  # f32[R, V]
    draft_probs: jax.Array | None,  # f32[R, V], or None: one-hot drafts
    draft_ids: jax.Array,  # i32[R]  d, or NO_DRAFT
    uniform: jax.Array,  # f32[R]
    gumbel: jax.Array,  # f32[R, V]
    *,
    impl: str = "auto",
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:  # (i32[R] token, bool[R] accepted)
    """`reference.rejection_sample` on the kernel where it applies (see the module docstring)."""
    _validate(target_probs, draft_probs, draft_ids, uniform, gumbel, "target_probs")
    if select_impl(target_probs, draft_probs, gumbel, impl=impl, interpret=interpret) == "reference":
        return reference.rejection_sample(target_probs, draft_probs, draft_ids, uniform, gumbel)
    R, V = target_probs.shape
    block_sizes = block_sizes or block_sizes_for(num_rows=R, vocab=V, target_kind="probs")
    _check_block_sizes(block_sizes)
    zeros = jnp.zeros((R,), jnp.int32)
    return spec_verify_kernel(target_probs, draft_probs, draft_ids, uniform, gumbel, zeros, zeros,
                              target_kind="probs", block_sizes=block_sizes, interpret=interpret)


def verify_one_hot(
    scaled: jax.Array,  # f32[R, V]  tempered, truncated logits
    greedy: jax.Array,  # i32[R]
    is_random: jax.Array,  # bool[R]
    draft_ids: jax.Array,  # i32[R]
    uniform: jax.Array,  # f32[R]
    gumbel: jax.Array,  # f32[R, V]
    *,
    impl: str = "auto",
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:  # (i32[R] token, bool[R] accepted)
    """`reference.verify_one_hot` on the kernel where it applies (see the module docstring)."""
    _validate(scaled, None, draft_ids, uniform, gumbel, "scaled")
    if greedy.shape != draft_ids.shape or is_random.shape != draft_ids.shape:
        raise ValueError(f"greedy and is_random must be [R] = {draft_ids.shape} (got {greedy.shape}, "
                         f"{is_random.shape})")
    if select_impl(scaled, gumbel, impl=impl, interpret=interpret) == "reference":
        return reference.verify_one_hot(scaled, greedy, is_random, draft_ids, uniform, gumbel)
    R, V = scaled.shape
    block_sizes = block_sizes or block_sizes_for(num_rows=R, vocab=V, target_kind="logits")
    _check_block_sizes(block_sizes)
    return spec_verify_kernel(scaled, None, draft_ids, uniform, gumbel, greedy, is_random,
                              target_kind="logits", block_sizes=block_sizes, interpret=interpret)


__all__ = [
    "BLOCK_TABLE",
    "NO_DRAFT",
    "BlockSizes",
    "accepted_length",
    "block_sizes_for",
    "rejection_sample",
    "select_impl",
    "unsupported_reason",
    "verify_one_hot",
]
