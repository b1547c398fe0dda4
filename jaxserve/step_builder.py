"""From the scheduler's decision to the step's device inputs: `ScheduledWork` -> (`Bucket`, `StepBatch`).

Host numpy only. The ragged token layout is `batch.build_step_inputs`; this module adds what depends on the
requests: one sampling row per sequence that completes this step (a prefill chunk that does not reach the end of
its prompt samples nothing and gets a neutral row), and with speculation 1 + num_draft rows per verifying sequence,
row j set up as if drafts[:j] had already been generated (penalties, min_tokens and seeds see them). A request
whose row cannot be built fails alone (`RowBuildError`), before anything reaches the device.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxserve.batch import FED_DRAFT, Bucket, ScheduledSeq, StepBatch, build_step_inputs, choose_bucket, row_offsets
from jaxserve.config import EngineConfig
from jaxserve.sampler import SamplingInputs
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import ScheduledWork
from jaxserve.sequence import Sequence
from jaxserve.spec_decode.rejection import NO_DRAFT


class RowBuildError(Exception):
    """Building one request's sampling row raised: that request fails, the step goes on without it."""

    def __init__(self, request_id: str, reason: str):
        super().__init__(reason)
        self.request_id, self.reason = request_id, reason


def mix32(*values: int) -> int:
    """A deterministic 32-bit hash of integers (per-row sampling key material)."""
    h = 0x9E3779B9
    for v in values:
        h = (h ^ (v & 0xFFFFFFFF)) * 0x85EBCA6B & 0xFFFFFFFF
        h ^= h >> 13
        h = h * 0xC2B2AE35 & 0xFFFFFFFF
        h ^= h >> 16
    return h


class StepBuilder:
    def __init__(self, cfg: EngineConfig, stop_ids: Callable[[SamplingParams], list[int]],
                 draft_feed: bool = False):
        """`stop_ids(params)`: the token ids that end generation for a request (suppressed under min_tokens).
        `draft_feed`: steps carry `StepBatch.draft_feed` (the runner takes drafts from the device,
        `ModelRunner.drafts`)."""
        self.cfg = cfg
        self.stop_ids = stop_ids
        self.rng = np.random.default_rng(cfg.seed)  # seeds of unseeded requests
        self.speculative = cfg.speculative_config is not None
        self.async_scheduling = bool(cfg.async_scheduling)
        self.draft_feed = draft_feed

    def build(self, work: list[ScheduledWork]) -> tuple[Bucket, StepBatch]:
        seqs = [self.scheduled_seq(w) for w in work]
        cfg = self.cfg
        bucket = choose_bucket(
            sum(w.num_tokens for w in work),
            max(len(s.page_ids) for s in seqs),
            cfg.token_buckets,
            cfg.page_buckets,
            cfg.max_num_seqs,
            1 + cfg.num_speculative_tokens,
            num_rows=len(work) + sum(w.num_draft for w in work),
        )
        sampling = SamplingInputs.neutral(bucket.rows, bucket.max_pages * cfg.page_size)
        draft_ids = np.full(bucket.rows, NO_DRAFT, np.int32) if self.speculative else None
        for w, sq, row0 in zip(work, seqs, row_offsets(seqs)):
            if not w.completes_sequence:
                continue  # a prefill chunk that samples nothing: neutral row
            drafts = w.seq.spec_token_ids[: w.num_draft]
            # drafts on the device: placeholders here (never for a request with penalties, whose rows' token history
            # holds them: the head fetches those)
            on_device = sq.draft_slot >= 0
            try:
                for j in range(w.num_draft + 1):  # verify position j has drafts[:j] as its newest output tokens
                    self.fill_row(sampling, row0 + j, w.seq, drafts[:j])
                    if j < w.num_draft:
                        draft_ids[row0 + j] = FED_DRAFT if on_device else drafts[j]
            except Exception as e:  # noqa: BLE001 -- this request's data; the others must not pay for it
                raise RowBuildError(w.seq.request_id, f"building its sampling row raised {e!r}") from e
        inputs = build_step_inputs(seqs, bucket, cfg.page_size)
        feed = token_feed(seqs, bucket.num_tokens) if self.async_scheduling else None
        dfeed = draft_feed(seqs, bucket.num_tokens) if self.draft_feed else None
        return bucket, StepBatch(inputs, sampling, draft_ids, prompt_targets(work, bucket.num_tokens), feed, dfeed)

    def scheduled_seq(self, w: ScheduledWork) -> ScheduledSeq:
        """What `w` computes. Under async scheduling its last token may still be in flight (sampled by the step
        before, `seq.pending_row`): it goes in as 0 and the device takes it from that step's output."""
        seq, start = w.seq, w.seq.num_computed_tokens
        end = start + w.num_tokens - w.num_draft
        tokens = seq.token_ids[start:end]
        feed_row = -1
        if end > seq.num_known_tokens:
            if not self.async_scheduling or end - seq.num_known_tokens != 1 or seq.num_pending_tokens != 1:
                raise AssertionError(f"sequence {seq.seq_id}: tokens {seq.num_known_tokens}..{end} are not known")
            tokens.append(0)
            feed_row = seq.pending_row
        slot = seq.spec_draft_slot if w.num_draft else -1
        if slot >= 0 and not self.draft_feed:
            raise AssertionError(f"sequence {seq.seq_id}: drafts on the device, and steps without a draft feed")
        # placeholders whose device drafts were replaced (a step retried in parts) go in as token 0: their rows
        # verify no draft
        drafts = [max(t, 0) for t in seq.spec_token_ids[: w.num_draft]]
        return ScheduledSeq(tokens + drafts, start, seq.page_ids, w.num_draft, feed_row, slot)

    def fill_row(self, sampling: SamplingInputs, row: int, seq: Sequence, extra: list[int]) -> None:
        """Sampling settings of one row: `seq` as if `extra` (verified drafts) had already been generated."""
        p = seq.params
        num_out = seq.num_output_tokens + len(extra)
        sampling.temperature[row] = p.temperature
        sampling.top_k[row] = p.top_k
        sampling.top_p[row] = p.top_p
        sampling.min_p[row] = p.min_p
        sampling.wants_logprobs[row] = p.logprobs is not None
        if p.seed is not None:  # same seed -> same draws, whatever shares the batch
            sampling.seeds[row] = mix32(p.seed, seq.index, num_out)
        else:
            sampling.seeds[row] = self.rng.integers(0, 2**32, dtype=np.uint32)
        if p.has_penalties:
            sampling.repetition_penalty[row] = p.repetition_penalty
            sampling.frequency_penalty[row] = p.frequency_penalty
            sampling.presence_penalty[row] = p.presence_penalty
            tokens = seq.token_ids + extra
            sampling.history[row, : len(tokens)] = tokens
            sampling.history_is_output[row, seq.num_prompt_tokens : len(tokens)] = True
        if num_out < p.min_tokens:
            banned = self.stop_ids(p)
            sampling.banned[row, : len(banned)] = banned


def prompt_targets(work: list[ScheduledWork], num_tokens: int) -> np.ndarray | None:
    """Next-token targets for prompt chunks of requests that asked for prompt_logprobs (None if none did)."""
    targets, t = None, 0
    for w in work:
        seq, start = w.seq, w.seq.num_computed_tokens
        if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens:
            if targets is None:
                targets = np.full(num_tokens, -1, np.int32)
            end = min(start + w.num_tokens, seq.num_prompt_tokens - 1)  # the last prompt token has no target
            targets[t : t + max(0, end - start)] = seq.prompt_token_ids[start + 1 : end + 1]
        t += w.num_tokens
    return targets


def token_feed(seqs: list[ScheduledSeq], num_tokens: int) -> np.ndarray:
    """i32[T]: for each token position, the row of the previous step's sampled tokens it takes (async scheduling:
    a sequence's newest token, still on the device), -1 = the host's token id."""
    feed = np.full(num_tokens, -1, np.int32)
    t = 0
    for sq in seqs:
        t += len(sq.token_ids)
        if sq.feed_row >= 0:
            feed[t - 1 - sq.num_draft] = sq.feed_row
    return feed


def draft_feed(seqs: list[ScheduledSeq], num_tokens: int) -> np.ndarray:
    """i32[T]: for each token position, the index of the device draft array it takes (drafts an EAGLE-3 head left
    on the device), -1 = the host's token id."""
    feed = np.full(num_tokens, -1, np.int32)
    t = 0
    for sq in seqs:
        t += len(sq.token_ids)
        if sq.draft_slot >= 0:
            feed[t - sq.num_draft : t] = np.arange(sq.draft_slot, sq.draft_slot + sq.num_draft)
    return feed
