"""Continuous-batching scheduler: which sequences run this step, and how many tokens each. Plain Python.

Each step has a token budget (`max_num_batched_tokens`) and a seat limit (`max_num_seqs`). Running sequences go
first, oldest first: a decode costs one token, an unfinished prompt takes the next chunk that fits the budget
(chunked prefill), so prefills and decodes share a step. Waiting sequences are then admitted first-come
first-served while seats, budget and KV pages last. When a running sequence cannot get a page, the newest running
sequence is preempted: its pages are freed and it returns to the front of the waiting queue to be recomputed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from jaxserve.block_manager import BlockManager
from jaxserve.config import EngineConfig
from jaxserve.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledWork:
    seq: Sequence
    num_tokens: int  # new tokens computed this step, starting at seq.num_computed_tokens

    @property
    def completes_sequence(self) -> bool:
        """True if after this step every token of the sequence is computed, so a new token gets sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, cfg: EngineConfig, block_manager: BlockManager):
        self.cfg = cfg
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledWork]:
        budget = self.cfg.max_num_batched_tokens
        work: list[ScheduledWork] = []
        scheduled: set[int] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, n, scheduled):
                continue  # `seq` itself was preempted; running[i] is now the next one
            work.append(ScheduledWork(seq, n))
            scheduled.add(seq.seq_id)
            budget -= n
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                break  # FCFS: nobody jumps the queue
            self.waiting.popleft()
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            work.append(ScheduledWork(seq, n))
            scheduled.add(seq.seq_id)
            budget -= n
        return work

    def _reserve(self, seq: Sequence, n: int, scheduled: set[int]) -> bool:
        """Allocate pages for `n` more tokens of `seq`, preempting newer unscheduled sequences if needed."""
        while not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled and s is not seq), None)
            if victim is None:
                self._preempt(seq)
                return False
            self._preempt(victim)
        self.block_manager.allocate(seq, seq.num_computed_tokens + n)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
