"""`SpecController` chooses K for each step (and each request may cap it, 0 = no speculation): it keeps the measured
cost of each step size (the target's step plus the proposer's device work for it -- draft-model passes, the EAGLE-3
head; unmeasured sizes interpolated linearly in tokens), apart for steps built after the one before landed and
for steps built while it ran (async scheduling: K = 0 is priced as the latter, K > 0 as the former, since a step
that verifies drafts cannot have the next one built behind it) and the measured acceptance rate per draft
position (optimistic until 20 drafts were seen there, so each position gets tried). Given how many drafts each
decoding sequence can have this step (what a host proposer such as n-gram actually found -- often nothing -- or
the request's cap for a model proposer), it picks the K that maximises expected tokens per second,
`sum_s (1 + sum_{i <= min(K, L_s)} prod_{j<=i} a_j) / cost(tokens + sum_s min(K, L_s))`, and speculates only if
that beats K = 0 by `MIN_GAIN` (measurements are noisy; a marginal gain is not worth the risk of a loss), so with
honest measurements speculation does not make a loaded server slower than no speculation. Drafts only fill the
budget that the step's prompt tokens leave (`room`, `Speculator._step_tokens`): a draft that displaced a prompt token
would cost that prompt's first token, which no step time shows.

The controller's acceptance estimate forgets (each draft verified at a position decays the older ones there by
`ACCEPT_DECAY`: a window of ~100 drafts), so it follows the workload, and every `EXPLORE_EVERY`-th decision it
tries the runner-up K if that is estimated to cost at most `EXPLORE_MAX_LOSS` of the best: an estimate that
stopped being measured (K = 0 after a bad first request, one noisy sample of a step size) is measured again, at a
bounded price (<= 1.25% of throughput), and never when the alternative is clearly worse (verify under load on a
compute-bound device) -- except no speculation itself: when its step size was not measured for `STALE_AFTER`
decisions, that exploring decision chooses K = 0, and the new period replaces the stale average. A server's step
times drift (shared cores, other processes); one slow spike while K = 0 was last measured (72 and 104 ms for a
~32 ms step) had priced it out for good, and the server verified drafts at 0.8x of no speculation.
The reported metrics (`SpecMetrics`) stay cumulative.
"""

from __future__ import annotations

import bisect

from jaxserve.config import SpeculativeConfig


class SpecMetrics:
    """Acceptance per draft position, aggregated over all requests."""

    def __init__(self, k: int):
        self.num_drafts = [0] * k  # drafts verified at position i (0-based)
        self.num_accepted = [0] * k  # of which accepted
        self.num_steps = 0  # sequence-steps that verified at least one draft
        self.num_emitted = 0  # tokens emitted by those sequence-steps (accepted + 1)

    def record(self, num_draft: int, num_accepted: int) -> None:
        for i in range(num_draft):
            self.num_drafts[i] += 1
            self.num_accepted[i] += i < num_accepted
        self.num_steps += 1
        self.num_emitted += num_accepted + 1

    def acceptance_rates(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.num_accepted, self.num_drafts)]

    @property
    def acceptance_rate(self) -> float:
        d = sum(self.num_drafts)
        return sum(self.num_accepted) / d if d else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verifying sequence-step (1 = nothing accepted)."""
        return self.num_emitted / self.num_steps if self.num_steps else 0.0

    def as_dict(self) -> dict:
        return dict(
            acceptance_rate=self.acceptance_rate,
            acceptance_rate_per_position=self.acceptance_rates(),
            mean_acceptance_length=self.mean_acceptance_length,
            num_draft_tokens=sum(self.num_drafts),
            num_accepted_tokens=sum(self.num_accepted),
        )


MIN_GAIN = 1.05  # speculate only when the expected tokens per second beat no speculation by 5%
ACCEPT_DECAY = 0.99  # per draft verified at a position: the controller's estimate there spans ~100 recent drafts
EXPLORE_EVERY = 16  # every 16th decision may try the runner-up K ...
EXPLORE_MAX_LOSS = 0.2  # ... if its estimated tokens/s is within 20% of the best
STALE_AFTER = 128  # decisions after which a step size's measured cost is stale (see `record_step`, `choose_k`)
MIN_MEASURED = 20  # drafts seen at a position before its acceptance estimate replaces the optimistic prior
WAIT_DECAY = 0.95  # per wait for a step in flight: the share of waits that speculated spans ~20 recent ones ...
MIN_WAITS = 10  # ... and is used once that many (decayed) were seen


class SpecController:
    """Chooses K per step from measured step costs and acceptance (see the module docstring)."""

    def __init__(self, cfg: SpeculativeConfig, token_buckets: tuple[int, ...], ema: float = 0.2):
        self.k_max = cfg.num_speculative_tokens
        self.adaptive = cfg.adaptive
        self.buckets = token_buckets
        self.ema = ema
        # token bucket -> EMA seconds per step, in two tables: steps built after the step before them landed (every
        # step that verifies drafts), and steps built while it still ran (async scheduling: the host's work hidden)
        self.cost: dict[int, float] = {}
        self.cost_overlapped: dict[int, float] = {}
        self.metrics = SpecMetrics(self.k_max)  # cumulative, reported
        self.recent_drafts = [0.0] * self.k_max  # decayed counts behind the controller's acceptance estimate
        self.recent_accepted = [0.0] * self.k_max
        self.num_decisions = 0  # choose_k calls that decided a step (not optimistic hints)
        self._measured_at: dict[tuple[bool, int], int] = {}  # (overlapped, bucket) -> num_decisions when last timed
        self._k0_until = 0  # decisions up to this one choose K = 0 (re-measuring its stale cost)
        self.exploring = False  # the last choose_k's K is one it explores, not the one its estimates prefer
        self.recent_waits = 0.0  # decayed counts: waits for a step in flight (`wait_for`) ...
        self.recent_waits_speculated = 0.0  # ... and those whose decision then speculated

    def _bucket(self, n: int) -> int:
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def record(self, num_draft: int, num_accepted: int) -> None:
        """One sequence-step's verify result: `num_draft` drafts, the first `num_accepted` of them accepted."""
        self.metrics.record(num_draft, num_accepted)
        for i in range(num_draft):  # a position's estimate changes only when it is measured
            self.recent_drafts[i] = ACCEPT_DECAY * self.recent_drafts[i] + 1
            self.recent_accepted[i] = ACCEPT_DECAY * self.recent_accepted[i] + (i < num_accepted)

    def record_step(self, num_tokens: int, seconds: float, overlapped: bool = False) -> None:
        """A step's period; `overlapped`: the step was built while the one before it ran (async scheduling). A
        size not measured for `STALE_AFTER` decisions takes the new period as it is (the machine may have changed
        speed since: the old average is no baseline)."""
        table = self.cost_overlapped if overlapped else self.cost
        b = self._bucket(num_tokens)
        old = None if self._stale(overlapped, b, self.num_decisions) else table.get(b)
        table[b] = seconds if old is None else (1 - self.ema) * old + self.ema * seconds
        self._measured_at[overlapped, b] = self.num_decisions

    def _stale(self, overlapped: bool, bucket: int, decision: int) -> bool:
        """Whether a step size's cost (in the table `overlapped` names) was not measured in the `STALE_AFTER`
        decisions before `decision`, or never."""
        at = self._measured_at.get((overlapped, bucket))
        return at is None or decision - at > STALE_AFTER

    def _cost(self, num_tokens: int, overlapped: bool = False) -> float | None:
        """Seconds per step of `num_tokens` tokens, built after the step before it landed or, `overlapped`, while
        it ran (from that table if it can tell, else from the other; an overlapped size is priced at most what it was
        measured to cost built after). None if neither can tell."""
        b = self._bucket(num_tokens)
        tables = (self.cost_overlapped, self.cost) if overlapped else (self.cost, self.cost_overlapped)
        c = next((c for t in tables if (c := _estimate(t, b)) is not None), None)
        if overlapped and b in self.cost:
            c = min(c, self.cost[b])  # built behind the step before, a step costs no more than built after it landed
        return c

    def choose_k(self, base_tokens: int, draft_lens: list[int], optimistic: bool = False,
                 room: int | None = None) -> int:
        """K for this step, given `base_tokens` scheduled without drafts and, per decoding sequence that may
        speculate, the most drafts it can have (`draft_lens`). `room`: the most drafts the step can take in all
        (None: no limit); a K whose drafts do not fit is not a candidate (adaptive K only: a fixed K is the user's).
        While a candidate step size is unmeasured the smallest such K is tried (to measure it); `optimistic`: the
        largest candidate instead -- for a proposer that drafts ahead and turns itself off at 0, so that exploring
        K = 0 does not switch it off; an optimistic call is a hint for the *next* decision (it does not count as
        one, and predicts that decision's exploring)."""
        decision = self.num_decisions + 1
        if not optimistic:
            self.num_decisions = decision
        self.exploring = False
        if not self.adaptive or not draft_lens:
            return self.k_max
        if decision <= self._k0_until:
            self.exploring = True
            return 0  # measuring no speculation again (below)
        k_top = min(self.k_max, max(draft_lens))
        if room is not None:
            while k_top > 0 and sum(min(k_top, L) for L in draft_lens) > room:
                k_top -= 1
        values = self._values(base_tokens, draft_lens, k_top)
        if isinstance(values, int):  # a size nothing can be estimated from yet: try it
            return k_top if optimistic else values
        best_k = max(range(len(values)), key=lambda k: values[k] / (MIN_GAIN if k else 1.0))  # K > 0 must clear the bar
        if decision % EXPLORE_EVERY == 0 and best_k > 0 and self._stale(bool(self.cost_overlapped),
                                                                        self._bucket(base_tokens), decision):
            # no speculation's cost is stale: measure it again, whatever it is estimated to lose; after a verify
            # step it cannot be built behind the one before, so the next decision is K = 0 as well (built behind)
            if not optimistic:
                self._k0_until = decision + 1
            self.exploring = True
            return 0
        if decision % EXPLORE_EVERY == 0 and len(values) > 1:
            runner_up = max((k for k in range(len(values)) if k != best_k), key=lambda k: values[k])
            if values[runner_up] >= (1 - EXPLORE_MAX_LOSS) * values[best_k]:
                self.exploring = True
                return runner_up
        return best_k

    def _values(self, base_tokens: int, draft_lens: list[int], k_top: int,
                overlapped: bool = True) -> list[float] | int:
        """Expected tokens per second of each K in 0 .. k_top (K = 0 priced as built behind the step before unless
        not `overlapped`), or the smallest K whose step size nothing can be estimated from yet."""
        # gain[m] = expected accepted drafts of a sequence with m drafts: sum_{i<=m} prod_{j<=i} a_j
        gain, survive = [0.0], 1.0
        for d, a in zip(self.recent_drafts, self.recent_accepted):
            # unmeasured position: optimistic prior, so every K gets tried and then measured
            survive *= a / d if d >= MIN_MEASURED else 1.0
            gain.append(gain[-1] + survive)
        values = []
        for k in range(k_top + 1):  # a step without drafts overlaps with the next one; one with drafts cannot
            cost = self._cost(base_tokens + sum(min(k, L) for L in draft_lens), overlapped=overlapped and k == 0)
            if cost is None:
                return k
            values.append((len(draft_lens) + sum(gain[min(k, L)] for L in draft_lens)) / cost)
        return values

    def wait_for(self, base_tokens: int, draft_lens: list[int], room: int | None = None) -> int:
        """Async scheduling, a step in flight: the K worth waiting for it to land for (its tokens are needed to
        propose), or 0: build the next step behind it now, without drafts. `draft_lens`: the drafts each decoding
        sequence is expected to have. The hint (`choose_k`, optimistic) may be overruled by the decision made once
        the step landed and the real drafts are known; waiting is worth it only if, with p the recent share of
        waits whose decision speculated, p x (the hint's tokens/s) + (1 - p) x (K = 0 built after the step before
        landed) beats K = 0 built behind it. Every `EXPLORE_EVERY`-th decision waits whatever p says, so p keeps
        being measured."""
        hint = self.choose_k(base_tokens, draft_lens, optimistic=True, room=room)
        if hint == 0 or self.recent_waits < MIN_WAITS or (self.num_decisions + 1) % EXPLORE_EVERY == 0:
            return hint
        p = self.recent_waits_speculated / self.recent_waits
        values = self._values(base_tokens, draft_lens, hint)
        sync = self._values(base_tokens, draft_lens, 0, overlapped=False)
        if isinstance(values, int) or isinstance(sync, int):
            return hint
        return hint if p * values[hint] + (1 - p) * sync[0] > values[0] else 0

    def record_wait(self, speculated: bool) -> None:
        """The decision after a wait for `wait_for`'s K: whether it speculated (K > 0)."""
        self.recent_waits = WAIT_DECAY * self.recent_waits + 1
        self.recent_waits_speculated = WAIT_DECAY * self.recent_waits_speculated + speculated


def _estimate(cost: dict[int, float], bucket: int) -> float | None:
    """A bucket's step time from a cost table: measured, else linear in tokens between the nearest measured buckets
    below and above it (prefill steps measure large buckets for free); past the largest measured, linear through
    the two largest (at least the largest's time); below the smallest, the smallest's time. None if fewer than two
    are known. Never extrapolated from two buckets on one side when one on each side is known: a server's warm-up
    measured only 1- and 2-token steps built behind the one before, and the line through them priced a 16-decode
    step at 56 ms instead of the ~30 it takes, so a loaded n-gram server verified drafts (K >= 1) in most steps."""
    if bucket in cost:
        return cost[bucket]
    if len(cost) < 2:
        return None
    below = [b for b in cost if b < bucket]
    above = [b for b in cost if b > bucket]
    if not below:
        return cost[min(above)]
    if above:
        b0, b1 = max(below), min(above)
    else:
        b0, b1 = sorted(below)[-2:]
    c0, c1 = cost[b0], cost[b1]
    return max(c0 + (c1 - c0) * (bucket - b0) / (b1 - b0), min(c0, c1))
