"""The engine's one handle on speculation: a `Proposer` (any method) plus the `SpecController` that picks K.

The engine calls the same four hooks whatever the method, so it has no per-method branches:
  1. `propose(running, waiting)` before scheduling: each decoding sequence gets up to K drafts in `seq.spec_token_ids`
     (K chosen by the controller for the step as a whole; the scheduler then fits as many as its budget allows);
  2. `after_schedule(work)`: a proposer that needs the step's pages fills its drafts now (the draft model);
  3. `verified(seq, ...)` per sequence once the target has verified its drafts;
  4. `after_step(work, starts, ends, hidden)` before finished sequences free their pages: a proposer that drafts
     from the target's features makes the next step's drafts now (EAGLE-3).
The engine times each step's whole period (proposing, scheduling, building, the device step, processing its
outputs, an EAGLE-3 head's drafting; or, for a step that overlapped the one before, the time between their
landings) and hands it to `record_step`, so the controller weighs a step size by what it really costs; a period
that saw a compile is not handed over. The controller prices the two kinds of step apart: a step that verifies
drafts is always built after the one before it landed, while one without drafts can have the next built behind it
(async scheduling), which hides the host's work; pricing both alike undercharged speculation under load.
"""

from __future__ import annotations

import itertools
import time

from jaxserve.config import EngineConfig
from jaxserve.scheduler import ScheduledWork
from jaxserve.sequence import Sequence
from jaxserve.spec_decode.controller import SpecController
from jaxserve.spec_decode.proposer import Proposer
from jaxserve.spec_decode.rejection import NO_DRAFT


def _no_drafts(seq: Sequence) -> int:
    return 0


class Speculator:
    def __init__(self, cfg: EngineConfig, proposer: Proposer):
        self.cfg = cfg
        self.proposer = proposer
        self.controller = SpecController(cfg.speculative_config, cfg.token_buckets)
        self._timed_buckets: set = set()  # buckets whose step time the controller has seen once
        self.last_k: int | None = None  # the K `propose` chose last (the step trace records it per step)
        self.last_hint: int | None = None  # the K of the hint that last made the engine wait (`skip_proposal`)
        self.proposer_seconds = 0.0  # the proposer's `after_step` time since the engine last took it

    @property
    def metrics(self):
        return self.controller.metrics

    def stats(self) -> dict[str, float | list[int]]:
        """Cumulative speculation metrics under their /metrics names (vLLM's spec_decode_* family)."""
        m = self.controller.metrics
        return {
            "spec_decode_acceptance_rate": m.acceptance_rate,
            "spec_decode_mean_acceptance_length": m.mean_acceptance_length,
            "spec_decode_num_draft_tokens": sum(m.num_drafts),
            "spec_decode_num_accepted_tokens": sum(m.num_accepted),
            "spec_decode_num_draft_tokens_per_pos": list(m.num_drafts),
            "spec_decode_num_accepted_tokens_per_pos": list(m.num_accepted),
        }

    def draft_cap(self, seq: Sequence) -> int:
        """The most drafts `seq` may verify next step: the engine's K, the request's cap, and never past the
        request's end (at most k drafts + 1 token may still be emitted)."""
        p = seq.params
        if seq.spec_disabled:
            return 0
        k_max = self.controller.k_max
        k = k_max if p.num_speculative_tokens is None else min(k_max, p.num_speculative_tokens)
        return max(0, min(k, seq.max_tokens - len(seq.output_token_ids) - 1,
                          self.cfg.max_model_len - seq.num_tokens - 1))

    def propose(self, running: list[Sequence], waiting: list[Sequence] = ()) -> None:
        """Drafts for every decoding sequence (the scheduler decides how many of them it can verify). `waiting`:
        the scheduler's waiting queue, whose prompts the step may admit (drafts must not take their budget)."""
        decoding = [s for s in running if s.num_uncomputed_tokens == 1]
        base, room = self._step_tokens(running, waiting)
        caps = [self.draft_cap(seq) for seq in decoding]
        drafts = [self.proposer.draft(seq, k) if k else [] for seq, k in zip(decoding, caps)]
        caps = [k if d is None else len(d) for k, d in zip(caps, drafts)]
        for seq in running:
            seq.spec_token_ids = []
        k_step = self.last_k = self.controller.choose_k(base, caps, room=room)
        if self.last_hint is not None:  # the engine waited for the step before to land for this decision
            self.controller.record_wait(k_step > 0)
        for seq, d, cap in zip(decoding, drafts, caps):
            k = min(k_step, cap)
            if d is not None:
                seq.spec_token_ids = d[:k]
            elif k > 0:
                seq.spec_token_ids = [NO_DRAFT] * k  # placeholders: the scheduler only counts them

    def _step_tokens(self, running: list[Sequence], waiting: list[Sequence]) -> tuple[int, int]:
        """The next step's tokens without drafts and the budget left for drafts after them.

        Drafts are scheduled with their sequence's decode, before prompt chunks further down the running list and
        before waiting prompts, so drafts past the budget's free room would displace prompt tokens: a verify step
        that is also slower for not overlapping with the next (async scheduling), and later first tokens for the
        displaced prompts, a cost the controller's per-step timing does not see. So drafts only fill the room the
        step's prompt tokens leave: the running sequences' chunks and the waiting prompts that have a free seat
        (their whole prompts, as if nothing were cached: a cache hit only frees more room next step)."""
        budget = self.cfg.max_num_batched_tokens
        running = [s for s in running if not s.is_finished]
        tokens = sum(min(s.num_uncomputed_tokens, budget) for s in running)
        seats = max(0, self.cfg.max_num_seqs - len(running))
        tokens += sum(s.num_uncomputed_tokens for s in itertools.islice(waiting, seats))
        base = min(tokens, budget)
        return base, budget - base

    def skip_proposal(self, running: list[Sequence], waiting: list[Sequence] = ()) -> bool:
        """Async scheduling, with a step in flight: True if the next step will not speculate, so it can be built
        now, without drafts (`running` holds tokens still being sampled, which a proposer cannot see). The
        controller decides as if every decoding sequence had the drafts the proposer expects from the tokens known
        (`Proposer.expected_drafts`: a model proposer its full cap, the most speculation could gain; n-gram what a
        lookup finds now): if even that loses to no speculation (a loaded server), real drafts would too; and if
        the decisions after recent waits mostly chose no speculation, waiting is not worth its price either
        (`SpecController.wait_for`: a loaded n-gram server waited for 376 of 771 steps, and 310 of those then
        verified nothing). A skipped step counts as the controller's decision (its exploring goes on while steps
        overlap); otherwise `propose` decides."""
        base, room, caps = self._next_step(running, waiting, expected=True)
        if caps and (hint := self.controller.wait_for(base, caps, room=room)) > 0:
            self.last_hint = hint
            return False
        self.controller.num_decisions += 1
        for seq in running:
            seq.spec_token_ids = []
        return True

    def after_schedule(self, work: list[ScheduledWork]) -> None:
        self.proposer.after_schedule(work)

    def verified(self, seq: Sequence, num_tokens_before: int, num_draft: int, num_accepted: int) -> None:
        self.controller.record(num_draft, num_accepted)
        seq.spec_num_verified += num_draft
        seq.spec_num_accepted += num_accepted
        self.proposer.verified(seq, num_tokens_before, num_draft, num_accepted)

    def after_step(self, work: list[ScheduledWork], starts: list[int], ends: list[int], running: list[Sequence],
                   hidden, draft: bool = True, waiting: list[Sequence] = ()) -> None:
        """work[i] kept the tokens starts[i] .. ends[i] - 1. `draft=False`: the next step is already built without
        drafts (async scheduling, `skip_proposal`), so a proposer that drafts ahead makes none (it still follows
        the step, e.g. an EAGLE-3 head's catch-up, unless the controller would not speculate)."""
        if type(self.proposer).after_step is Proposer.after_step:
            return  # the no-op hook: skip the controller's next-step hint too (a pass over the running sequences)
        t0 = time.perf_counter()
        k_hint = self._k_hint(running, waiting)
        draft_cap = self.draft_cap if draft or not k_hint else _no_drafts
        if k_hint == 0 and self.controller.exploring:
            # a K = 0 the controller only explores (or re-measures): the head follows the step but drafts nothing.
            # Off (k_hint = 0) ends speculation for good for every running sequence (`spec_disabled`), so each
            # exploring decision that tried K = 0 used to switch an EAGLE-3 head off for the requests in flight.
            draft_cap, k_hint = _no_drafts, 1
        self.proposer.after_step(work, starts, ends, hidden, draft_cap, k_hint)
        self.proposer_seconds += time.perf_counter() - t0

    def take_proposer_seconds(self) -> float:
        """The proposer's `after_step` time since the last call (the engine splits it off a step's period)."""
        seconds, self.proposer_seconds = self.proposer_seconds, 0.0
        return seconds

    def _k_hint(self, running: list[Sequence], waiting: list[Sequence]) -> int:
        """The K the controller would choose for a next step made of the running sequences as they are now, each
        decoding one that may speculate with its full cap of drafts: how many drafts a proposer that drafts ahead
        (EAGLE-3) should make; 0 = the next step would not speculate."""
        base, room, caps = self._next_step(running, waiting)
        return self.controller.choose_k(base, caps, optimistic=True, room=room)

    def _next_step(self, running: list[Sequence], waiting: list[Sequence],
                   expected: bool = False) -> tuple[int, int, list[int]]:
        """A next step made of the running sequences as they are now: its tokens without drafts and the room left
        for drafts (`_step_tokens`), and the draft cap of each decoding sequence that may speculate (`expected`:
        capped by the drafts the proposer expects it to have)."""
        running = [s for s in running if not s.is_finished]
        decoding = [(s, c) for s in running if s.num_uncomputed_tokens == 1 and (c := self.draft_cap(s)) > 0]
        if expected:
            caps = [e for s, c in decoding if (e := self.proposer.expected_drafts(s, c)) > 0]
        else:
            caps = [c for _, c in decoding]
        return (*self._step_tokens(running, waiting), caps)

    def record_step(self, bucket, num_tokens: int, seconds: float, overlapped: bool = False, num_drafts: int = 0,
                    proposer_seconds: float = 0.0) -> None:
        """A step's period (the engine's timing: see the module docstring), for the controller's cost model;
        `overlapped`: the step was built while the one before it ran; `num_drafts`: the drafts it verified;
        `proposer_seconds`: the part of the period a drafting-ahead proposer ran (`after_step`).

        A step that verified no drafts is priced without the proposer's run: K = 0 is the alternative in which the
        proposer does not run (the K = 0 the controller prefers turns an EAGLE-3 head off), but the K = 0 steps it
        measures are mostly ones it explores with the head kept on, catching up. Priced with the head's run, no
        speculation looked as dear as speculating: at batch 1 a K = 0 step with the head on took ~10 ms against
        ~4.5 ms for a plain one, and the controller verified one draft per step at ~11 ms for 1.45 tokens (0.6x of
        no speculation)."""
        if not num_drafts:
            seconds = max(seconds - proposer_seconds, 0.0)
        if bucket in self._timed_buckets:
            self.controller.record_step(num_tokens, seconds, overlapped)
        else:  # a bucket's first run is an outlier (one-time allocations), and a pessimistic first sample would
            self._timed_buckets.add(bucket)  # never be revisited: the controller would avoid that size
