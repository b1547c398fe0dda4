"""One step's inputs as data: the ragged batch, built in host numpy and padded to a compile bucket.

A step runs `num_seqs` sequences. Sequence s contributes `q_len[s]` new tokens (a prefill chunk or one decode
token), laid out contiguously: tokens `cu_q_lens[s]:cu_q_lens[s+1]`. Everything past the real tokens/sequences is
padding: padding tokens write their KV into page 0 (the sink), padding sequences have length 0 and an all-zero
block table, and padding logits rows read token 0 and are ignored by the host.

Sampling rows: each sequence samples at its last new token; a sequence verifying `num_draft` speculative tokens
samples at its last 1 + num_draft tokens (one row per verify position). Rows are laid out in sequence order, so
sequence s owns rows `cu_rows[s]:cu_rows[s+1]` (`row_offsets`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import numpy as np

if TYPE_CHECKING:  # batch.py stays below the sampler and the kernel door in the import order
    from jaxserve.sampler import SamplingInputs


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    token_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    slot_mapping: jax.Array  # i32[T]
    block_tables: jax.Array  # i32[S, max_pages]
    seq_lens: jax.Array  # i32[S]  kv length of each sequence after this step
    cu_q_lens: jax.Array  # i32[S+1]
    num_seqs: jax.Array  # i32[]
    logits_indices: jax.Array  # i32[R]  token whose logits each sampling row needs


@jax.tree_util.register_dataclass
@dataclass
class StepBatch:
    """Everything one target step sends to the device, as one pytree: the runner packs it into one buffer
    (`packing.Layout.of` derives the layout from these fields) and the step function unpacks the same dataclass."""

    inputs: StepInputs
    sampling: SamplingInputs  # one row per sampling row (R)
    draft_ids: jax.Array | None = None  # i32[R]  the draft each verify row checks, NO_DRAFT elsewhere (speculation)
    prompt_targets: jax.Array | None = None  # i32[T]  next prompt token per position, -1 = none (prompt_logprobs)
    # i32[T]  async scheduling: the previous step's sampled-token row each position takes, -1 = token_ids' own
    token_feed: jax.Array | None = None
    # i32[T]  drafts on the device (an EAGLE-3 head's, not fetched): the index into the head's draft array that
    # each draft position takes, -1 = token_ids' own; a verify row whose draft is fed has draft_ids FED_DRAFT
    draft_feed: jax.Array | None = None


FED_DRAFT = -2  # `StepBatch.draft_ids` of a verify row whose draft is on the device (`draft_feed`); < 0: no draft


@dataclass(frozen=True)
class Bucket:
    num_tokens: int  # T
    num_seqs: int  # S
    max_pages: int  # pages per block-table row
    num_rows: int = 0  # R sampling rows (0 = S; more with speculative verify rows)

    @property
    def rows(self) -> int:
        return self.num_rows or self.num_seqs


@dataclass(frozen=True)
class ScheduledSeq:
    """What one sequence contributes to a step: `token_ids` at positions `start .. start+len-1`."""

    token_ids: list[int]
    start: int  # position of token_ids[0]
    page_ids: list[int]  # the sequence's pages, covering at least start + len(token_ids) tokens
    num_draft: int = 0  # the last num_draft of token_ids are speculative drafts to verify
    feed_row: int = -1  # >= 0: the last non-draft token is still on the device, row feed_row of the previous step
    draft_slot: int = -1  # >= 0: the drafts are on the device, at draft_slot .. + num_draft of the head's array


def smallest_at_least(buckets: tuple[int, ...], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def choose_bucket(
    num_tokens: int,
    num_pages: int,
    token_buckets: tuple[int, ...],
    page_buckets: tuple[int, ...],
    max_num_seqs: int,
    max_rows_per_seq: int = 1,
    num_rows: int = 0,
) -> Bucket:
    """The bucket for a step. With speculation (`max_rows_per_seq` = 1 + K) a bucket has two sampling-row variants:
    one row per sequence for steps without drafts, and room for every verify row; `num_rows` picks the smaller one
    that fits, so steps without drafts never pay for K extra logits rows per sequence."""
    T = smallest_at_least(token_buckets, num_tokens)
    S = min(T, max_num_seqs)
    R = min(T, max_num_seqs * max_rows_per_seq) if max_rows_per_seq > 1 and num_rows > S else 0
    return Bucket(num_tokens=T, num_seqs=S, max_pages=smallest_at_least(page_buckets, num_pages), num_rows=R)


def row_offsets(seqs: list[ScheduledSeq]) -> list[int]:
    """cu_rows: sequence s samples at rows cu_rows[s]:cu_rows[s+1]."""
    out = [0]
    for sq in seqs:
        out.append(out[-1] + 1 + sq.num_draft)
    return out


def slot_of(pages, positions, page_size: int):
    """KV slot of each position: `pages[i]` is the page holding `positions[i]` (the sequence's page
    `positions[i] // page_size`). numpy or traced arrays alike: the host's step build and the EAGLE-3 head's draft
    passes address the cache through this one formula (kv_cache.py inverts it)."""
    return pages * page_size + positions % page_size


def build_step_inputs(seqs: list[ScheduledSeq], bucket: Bucket, page_size: int) -> StepInputs:
    """Host numpy arrays for one step, padded to `bucket` (the runner does the single device transfer)."""
    T, S, max_pages = bucket.num_tokens, bucket.num_seqs, bucket.max_pages
    if len(seqs) > S:
        raise ValueError(f"{len(seqs)} sequences exceed the bucket's {S}")
    token_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.zeros(T, np.int32)  # padding -> slot 0 of page 0
    block_tables = np.zeros((S, max_pages), np.int32)
    seq_lens = np.zeros(S, np.int32)
    cu_q_lens = np.zeros(S + 1, np.int32)
    logits_indices = np.zeros(bucket.rows, np.int32)
    rows = row_offsets(seqs)
    if rows[-1] > bucket.rows:
        raise ValueError(f"{rows[-1]} sampling rows exceed the bucket's {bucket.rows}")
    t = 0
    for s, sq in enumerate(seqs):
        n = len(sq.token_ids)
        pos = np.arange(sq.start, sq.start + n, dtype=np.int32)
        pages = np.asarray(sq.page_ids, np.int32)
        token_ids[t : t + n] = sq.token_ids
        positions[t : t + n] = pos
        slot_mapping[t : t + n] = slot_of(pages[pos // page_size], pos, page_size)
        block_tables[s, : len(pages)] = pages
        seq_lens[s] = sq.start + n
        t += n
        cu_q_lens[s + 1] = t
        logits_indices[rows[s] : rows[s + 1]] = np.arange(t - 1 - sq.num_draft, t)
    if t > T:
        raise ValueError(f"{t} tokens exceed the bucket's {T}")
    cu_q_lens[len(seqs) + 1 :] = t
    return StepInputs(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens,
        cu_q_lens=cu_q_lens,
        num_seqs=np.asarray(len(seqs), np.int32),
        logits_indices=logits_indices,
    )
