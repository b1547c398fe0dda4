"""Continuous-batching scheduler: which sequences run this step, and how many tokens each. Plain Python.

Order. Every sequence has a rank: (effective priority, arrival time). Effective priority is the request's
`priority` (lower runs first, as in vLLM) minus one for every `priority_aging_steps` steps it has existed, so a
low-priority request cannot starve. FCFS is the tie-break, and preempted sequences keep their arrival time, so
they resume ahead of later arrivals.

Each step has a token budget (`max_num_batched_tokens`) and a seat limit (`max_num_seqs`):
  1. If the best waiting sequence outranks (strictly better effective priority) the worst running one and cannot
     get a seat or its pages, the worst running one is preempted to make room.
  2. Running sequences, best rank first: a decode costs one token; an unfinished prompt takes the next chunk that
     fits the budget (chunked prefill), so prefill chunks and decodes share a step. A sequence that cannot get a
     page preempts the worst-ranked running sequence not yet scheduled this step (or itself, if it is the worst).
  3. Waiting sequences, best rank first, while seats, budget and pages last. Cached prefix pages are attached
     first, so only the uncached rest of a prompt costs budget. Nobody jumps a waiting sequence that doesn't fit.
Preemption is by recompute: pages are released (full ones stay in the prefix cache), the tokens are kept.

Async scheduling (`engine.py`): a sequence may hold a pending token, sampled by the step still in flight and not
known here yet; it counts in `num_tokens`, so a decode is planned past it. A sequence whose pending token is its
last (max_tokens, max_model_len) is not scheduled again.

Speculative decoding: a decoding sequence may carry draft tokens (`seq.spec_token_ids`, set by the engine's
proposer before `schedule`). Its step then computes 1 + K tokens (its last token and the K drafts, verified in the
same ragged batch as everything else), K cut to fit the budget, and pages are reserved for all of them; the engine
rolls back the rejected ones (`advance`). A proposer may ask that a prefix-cache hit reuse fewer pages
(`prefix_reuse`: EAGLE-3's head may need its last cached page recomputed; spec_decode/eagle3.py says when).

The engine reaches pages only through the scheduler: `advance` after a step, `finish` and `fail` at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from jaxserve.block_manager import BlockManager
from jaxserve.config import EngineConfig
from jaxserve.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledWork:
    seq: Sequence
    num_tokens: int  # new tokens computed this step, starting at seq.num_computed_tokens (drafts included)
    num_draft: int = 0  # of which speculative drafts (the sequence's first num_draft spec_token_ids)

    @property
    def completes_sequence(self) -> bool:
        """True if after this step every token of the sequence is computed, so a new token gets sampled."""
        return self.seq.num_computed_tokens + self.num_tokens - self.num_draft == self.seq.num_tokens


class Scheduler:
    def __init__(self, cfg: EngineConfig, block_manager: BlockManager,
                 prefix_reuse: Callable[[Sequence, int], int] | None = None):
        self.cfg = cfg
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_steps = 0
        self.num_preemptions = 0
        # (seq, cached tokens found) -> tokens it may reuse (a proposer's `reusable_prefix`); None: all of them
        self.prefix_reuse = prefix_reuse

    def add(self, seq: Sequence) -> None:
        seq.arrival_step = self.num_steps
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def effective_priority(self, seq: Sequence) -> int:
        return seq.priority - (self.num_steps - seq.arrival_step) // self.cfg.priority_aging_steps

    def _rank(self, seq: Sequence) -> tuple[int, float, int]:
        return (self.effective_priority(seq), seq.arrival_time, seq.seq_id)

    # ---- the step -------------------------------------------------------------------------------------------

    def schedule(self) -> list[ScheduledWork]:
        self.waiting.sort(key=self._rank)
        self.running.sort(key=self._rank)
        self._preempt_for_priority()

        budget = self.cfg.max_num_batched_tokens
        work: list[ScheduledWork] = []
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._ends_when_pending_lands(seq):
                i += 1  # async scheduling: its token in flight is its last, a step past it would be wasted
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            drafts = min(len(seq.spec_token_ids), budget - 1) if seq.num_uncomputed_tokens == 1 else 0
            if not self._reserve(seq, n + drafts, scheduled):
                continue  # `seq` itself was preempted; running[i] is now the next one
            work.append(ScheduledWork(seq, n + drafts, drafts))
            scheduled.add(seq.seq_id)
            budget -= n + drafts
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            hit = self.block_manager.reuse_prefix(seq)
            # the proposer's state in the last cached pages may not be reusable
            if hit and self.prefix_reuse is not None:
                kept = self.prefix_reuse(seq, hit)
                if kept < hit:
                    hit = kept
                    self.block_manager.trim(seq, hit)
                    seq.num_computed_tokens = hit
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                self.block_manager.free(seq)  # the prefix pages go back to the cache untouched
                seq.num_computed_tokens = 0
                break
            self.block_manager.count_prefix_lookup(seq.num_tokens, hit)
            self.waiting.pop(0)
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            work.append(ScheduledWork(seq, n))
            scheduled.add(seq.seq_id)
            budget -= n
        self.num_steps += 1
        return work

    def _ends_when_pending_lands(self, seq: Sequence) -> bool:
        """The token `seq` is still being sampled (async scheduling) reaches max_tokens or max_model_len, so the
        sequence ends when it lands whatever the token is."""
        return seq.num_pending_tokens > 0 and (
            seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.cfg.max_model_len)

    def _preempt_for_priority(self) -> None:
        """Make room for a waiting sequence that outranks running ones (priority scheduling)."""
        while self.waiting and self.running:
            best, worst = self.waiting[0], self.running[-1]
            if self.effective_priority(best) >= self.effective_priority(worst):
                return
            first_chunk = min(best.num_uncomputed_tokens, self.cfg.max_num_batched_tokens)
            has_seat = len(self.running) < self.cfg.max_num_seqs
            if has_seat and self.block_manager.can_allocate(best, best.num_computed_tokens + first_chunk):
                return
            self._preempt(worst)
            self.waiting.sort(key=self._rank)

    def _reserve(self, seq: Sequence, n: int, scheduled: set[int]) -> bool:
        """Allocate pages for `n` more tokens of `seq`, preempting worse-ranked unscheduled sequences if needed."""
        while not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled and s is not seq), None)
            if victim is None or self._rank(victim) < self._rank(seq):
                self._preempt(seq)
                return False
            self._preempt(victim)
        self.block_manager.allocate(seq, seq.num_computed_tokens + n)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop the KV (full pages stay cached), keep the tokens, requeue."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_num_computed = 0  # a draft model's KV lives in the same pages
        seq.spec_disabled = False  # ... and an EAGLE-3 head's, rebuilt along the recomputed prefill
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)
        self.waiting.sort(key=self._rank)

    def advance(self, seq: Sequence, num_computed: int, verified_drafts: bool = False) -> None:
        """After a step: `num_computed` more of `seq`'s tokens have valid KV (full pages join the prefix cache).
        `verified_drafts`: the step verified drafts, so pages that only held rejected ones are freed."""
        seq.num_computed_tokens += num_computed
        if verified_drafts:
            self.block_manager.trim(seq, seq.num_tokens)
        seq.spec_token_ids = []
        self.block_manager.register_computed(seq)

    def roll_back(self, seq: Sequence, num_computed: int) -> None:
        """Undo an `advance` whose step failed (async scheduling): `seq` has `num_computed` valid tokens again."""
        seq.num_computed_tokens = num_computed
        self.block_manager.forget(seq, num_computed)

    def fail(self, seq: Sequence) -> None:
        """Release a sequence whose KV may be garbage: pages only it holds leave the prefix cache too."""
        self.block_manager.discard(seq)
        self.finish(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
