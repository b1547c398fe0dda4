"""The `Proposer` protocol: the hooks through which the engine (`speculator.Speculator`) drives every
speculative method, in the order one step calls them."""

from __future__ import annotations

from typing import Callable, Protocol

from jaxserve.scheduler import ScheduledWork
from jaxserve.sequence import Sequence


class Proposer(Protocol):
    """What every speculative method implements (n-gram, draft model, EAGLE-3). The methods subclass it and
    inherit a no-op for each hook they do not need; `draft` they all implement."""

    # Executables the proposer has compiled (the engine does not time a step whose period saw a compile).
    num_compiles: int = 0

    def warmup(self) -> None:
        """Compile what the proposer runs, before serving."""

    def reusable_prefix(self, seq: Sequence, hit: int) -> int:
        """Of the `hit` tokens (whole pages) a new sequence found in the prefix cache, how many it may reuse; it
        recomputes the rest (an EAGLE-3 head's state in the last cached page may pair it with a token the new
        sequence does not share)."""
        return hit

    def draft(self, seq: Sequence, k: int) -> list[int] | None:
        """Before scheduling: up to `k` drafts for decoding `seq` (host lookups, or drafts made after the last
        step), or None: `k` placeholders that `after_schedule` fills once the step's pages are reserved."""
        raise NotImplementedError

    def expected_drafts(self, seq: Sequence, k: int) -> int:
        """While the step before is still in flight (its tokens unknown): how many of up to `k` drafts `seq` will
        likely have next step, for the controller's decision to build that step without drafts. A host lookup can
        tell from the tokens known so far; a model proposer always drafts `k`."""
        return k

    def after_schedule(self, work: list[ScheduledWork]) -> None:
        """Fill the placeholder drafts of the scheduled sequences (`seq.spec_token_ids[:w.num_draft]`)."""

    def verified(self, seq: Sequence, num_tokens_before: int, num_draft: int, num_accepted: int) -> None:
        """`seq` verified `num_draft` drafts, the first `num_accepted` kept: roll the proposer's state back."""

    def after_step(self, work: list[ScheduledWork], starts: list[int], ends: list[int], hidden,
                   draft_cap: Callable[[Sequence], int], k_hint: int) -> None:
        """After the target step (work[i] computed and kept its tokens starts[i] .. ends[i] - 1; `hidden`: the
        step's target features on device, or None): draft for the next step, at most `draft_cap(seq)` per sequence
        and `k_hint` (the K the controller expects to choose next; 0 = it will not speculate)."""
