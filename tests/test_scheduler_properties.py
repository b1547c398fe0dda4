"""Property-based fuzzing of the scheduler + block manager as a state machine (hypothesis; no jax, no model).

`SchedulerMachine` drives `Scheduler` and `BlockManager` exactly as `LLMEngine.step` / `abort_request` do: propose
speculative drafts for decoding sequences, `schedule()`, "run" the step (a shadow KV cache records, for every slot
written, the tokens that slot's KV was computed from), then postprocess (advance computed tokens, append a sampled
token to sequences whose work completes them, accept a random number of drafts and `trim`, `register_computed`,
finish on EOS / length and `scheduler.finish`). Requests arrive with random lengths and priorities, some with `n > 1`
siblings, many sharing a prefix with an earlier prompt or output so that prefix-cache hits happen; configurations
have so few KV pages (one max_model_len sequence plus 0-3) that preemption is frequent. Every schedule is checked
(`check_schedule`: budget, seats, pages for the work, rank-order admission, progress); the state invariants
(`check_state`: page accounting, ref counts = owners, sharing only through the prefix cache, page 0 never handed out,
queues, recompute from scratch after preemption, shadow-KV content of computed tokens and of every cached page) hold
after every rule, every step, and between schedule and postprocess. At teardown the machine drains (steps with no
new arrivals, within a bound) and then no page may be in use.

The planted-bug tests at the end break the code under test with monkeypatch and require the machine to notice, so
the checker can never rot into one that cannot fail.
"""

from __future__ import annotations

import functools
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from jaxserve.block_manager import BlockManager, pages_for
from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler
from jaxserve.sequence import Sequence, SequenceStatus

VOCAB = 4  # a tiny vocabulary: unrelated prompts share prefixes too, so hash chains and exact matching get exercised
EOS = 0
MAX_LIVE_SEQS = 8
CORPUS_SIZE = 16  # recent prompts / finished token lists that new prompts may share a prefix with

FUZZ_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=60,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class InvariantViolation(AssertionError):
    """Raised by the machine's own checks (so a planted-bug test can tell the checker caught it, not a crash)."""


def expect(ok: bool, msg: str) -> None:
    if not ok:
        raise InvariantViolation(msg)


def chain_hashes(tokens, page_size: int) -> list[int]:
    """The prefix-cache key of each full page of `tokens`: a hash chained over all tokens up to the page's end."""
    out, parent = [], None
    for i in range(len(tokens) // page_size):
        parent = hash((parent, tuple(tokens[i * page_size : (i + 1) * page_size])))
        out.append(parent)
    return out


def guarded(method):
    """Marks the machine broken when a rule or invariant raises, so teardown does not drain a corrupt state (and
    hide the first failure behind a second one)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self.broken = True
            raise

    return wrapper


@st.composite
def engine_configs(draw) -> EngineConfig:
    page_size = draw(st.sampled_from([1, 2, 4]))
    max_num_seqs = draw(st.integers(1, 4))
    method = draw(st.sampled_from([None, "ngram", "eagle3"]))
    spec = None
    if method is not None:
        k = draw(st.integers(1, 3))
        spec = SpeculativeConfig(method=method, num_speculative_tokens=k, model="head" if method == "eagle3" else None)
    cfg = EngineConfig(
        max_model_len=draw(st.integers(2, 24)),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 12)),
        page_size=page_size,
        priority_aging_steps=draw(st.sampled_from([100, 1, 2, 3, 5])),
        enable_prefix_caching=draw(st.sampled_from([True, False, True])),
        precompile=False,
        speculative_config=spec,
    )
    # The engine refuses fewer pages than one max_model_len sequence needs (engine.py); 0-3 pages of slack on top
    # keep preemption frequent.
    return cfg.replace(num_pages=1 + cfg.max_pages_per_seq + draw(st.integers(0, 3)))


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.sched: Scheduler | None = None
        self.broken = False

    # ---- setup and rules ------------------------------------------------------------------------------------

    @initialize(cfg=engine_configs(), drain_seed=st.integers(0, 2**16), data=st.data())
    @guarded
    def setup(self, cfg: EngineConfig, drain_seed: int, data) -> None:
        self.cfg = cfg
        self.page_size = cfg.page_size
        self.bm = BlockManager(cfg.num_pages, cfg.page_size, cfg.enable_prefix_caching)
        self.sched = Scheduler(cfg, self.bm)
        self.drain_rng = random.Random(drain_seed)
        self.requests: dict[str, list[Sequence]] = {}  # every request ever added
        self.live: set[str] = set()  # requests that have not ended
        self.num_ends: Counter[str] = Counter()  # request id -> times it ended
        self.tokens: dict[int, list[int]] = {}  # seq_id -> the tokens it must hold (prompt + everything emitted)
        self.kv: dict[int, list[tuple[int, ...] | None]] = {}  # page -> per slot, the tokens its KV was computed from
        self.corpus: list[list[int]] = []
        self.num_seqs = 0
        self.clock = 0.0
        for _ in range(data.draw(st.integers(1, 4), label="initial requests")):  # load even if `add` is swarmed off
            self.add_request(data)

    def num_live_seqs(self) -> int:
        return sum(not s.is_finished for r in self.live for s in self.requests[r])

    # Arrivals and aborts are followed by a few steps as well (the engine loop keeps stepping), so an example still
    # schedules when hypothesis' swarm testing switches the `step` rule off.
    @precondition(lambda self: self.num_live_seqs() < MAX_LIVE_SEQS)
    @rule(data=st.data(), rng=st.randoms(use_true_random=False), num_steps=st.integers(0, 2))
    @guarded
    def add(self, data, rng: random.Random, num_steps: int) -> None:
        self.add_request(data)
        self.step(rng, num_steps)

    def add_request(self, data) -> None:
        """LLMEngine.add_request: a prompt (often extending a prefix seen before), n samples, a priority."""
        limit = self.cfg.max_model_len
        prompt: list[int] = []
        if self.corpus and data.draw(st.booleans(), label="share a prefix"):
            base = data.draw(st.sampled_from(self.corpus), label="base")
            prompt = base[: data.draw(st.integers(1, len(base)), label="shared length")]
        length = data.draw(st.integers(0 if prompt else 1, limit - 1), label="suffix length")
        suffix = st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length)
        prompt = (prompt + data.draw(suffix, label="suffix"))[: limit - 1]  # the engine needs len < max_model_len
        params = SamplingParams(
            n=data.draw(st.sampled_from([1, 2, 1, 3]), label="n"),
            max_tokens=data.draw(st.integers(1, limit), label="max_tokens"),
            ignore_eos=data.draw(st.booleans(), label="ignore_eos"),
            prompt_logprobs=data.draw(st.sampled_from([None, None, 1]), label="prompt_logprobs"),
        )
        max_tokens = min(params.max_tokens, limit - len(prompt))  # as add_request resolves it
        priority = data.draw(st.integers(0, 3), label="priority")
        rid = f"r{len(self.requests)}"
        self.clock += 1.0
        seqs = []
        for i in range(params.n):
            seq = Sequence(self.num_seqs, rid, i, list(prompt), params, max_tokens, self.clock, priority=priority)
            seqs.append(seq)
            self.tokens[self.num_seqs] = list(prompt)
            self.num_seqs += 1
        self.requests[rid] = seqs
        self.live.add(rid)
        self.corpus = (self.corpus + [list(prompt)])[-CORPUS_SIZE:]
        for s in seqs:
            self.sched.add(s)

    @rule(rng=st.randoms(use_true_random=False), num_steps=st.integers(1, 4))
    @guarded
    def step(self, rng: random.Random, num_steps: int) -> None:
        self.check_state()
        for _ in range(num_steps):
            self.run_step(rng)
            self.check_state()

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), rng=st.randoms(use_true_random=False), num_steps=st.integers(0, 2))
    @guarded
    def abort(self, data, rng: random.Random, num_steps: int) -> None:
        """LLMEngine.abort_request on a live request, wherever its sequences are (waiting, running, preempted)."""
        rid = data.draw(st.sampled_from(sorted(self.live)), label="abort")
        for seq in self.requests[rid]:
            if not seq.is_finished:
                seq.finish("abort", self.clock)
                self.sched.finish(seq)
        self.end_request(rid)
        self.check_state()
        self.step(rng, num_steps)

    def end_request(self, rid: str) -> None:
        expect(rid in self.live, f"request {rid} ended twice")
        self.live.discard(rid)
        self.num_ends[rid] += 1

    # ---- one engine step --------------------------------------------------------------------------------------

    def propose(self, rng: random.Random) -> None:
        """LLMEngine._propose: drafts for decoding sequences, never past the request's end or max_model_len."""
        k_max = self.cfg.num_speculative_tokens
        running = self.sched.running
        for seq in running:
            seq.spec_token_ids = []
        k_step = rng.randint(0, k_max)  # the controller's K for this step
        for seq in running:
            if seq.num_uncomputed_tokens == 1:
                cap = min(
                    k_max, seq.max_tokens - len(seq.output_token_ids) - 1, self.cfg.max_model_len - seq.num_tokens - 1
                )
                seq.spec_token_ids = [rng.randrange(VOCAB) for _ in range(max(0, min(k_step, cap)))]

    def sample(self, rng: random.Random) -> int:
        return EOS if rng.random() < 0.0625 else rng.randrange(1, VOCAB)

    def run_step(self, rng: random.Random) -> None:
        cfg, bm, sched = self.cfg, self.bm, self.sched
        if cfg.speculative_config is not None:
            self.propose(rng)
        had_work = sched.has_unfinished()
        running_before = set(map(id, sched.running))
        preemptions_before = {id(s): s.num_preemptions for s in sched.waiting + sched.running}
        work = sched.schedule()
        self.check_schedule(work, had_work, running_before, preemptions_before)
        self.check_state(reserved={id(w.seq): w.num_tokens for w in work})

        # "Run": write each scheduled token's KV into its slot. A slot's content is the token sequence it was
        # computed from (KV at position p depends on tokens 0..p). Pages written must be exclusively owned and not
        # registered in the prefix cache: shared / cached pages are immutable.
        for w in work:
            seq, start = w.seq, w.seq.num_computed_tokens
            fed = seq.token_ids + seq.spec_token_ids[: w.num_draft]
            for pos in range(start, start + w.num_tokens):
                page = seq.page_ids[pos // self.page_size]
                expect(page != 0, f"seq {seq.seq_id} writes into the padding page 0")
                expect(bm._ref.get(page) == 1, f"seq {seq.seq_id} writes page {page} shared by {bm._ref.get(page)}")
                expect(page not in bm._page_key, f"seq {seq.seq_id} overwrites prefix-cached page {page}")
                self.kv.setdefault(page, [None] * self.page_size)[pos % self.page_size] = tuple(fed[: pos + 1])

        # LLMEngine._postprocess, line for line (the sampler's tokens and the verifier's accepted counts are random).
        finished = []
        for w in work:
            seq = w.seq
            if not w.completes_sequence or seq.is_finished:
                seq.num_computed_tokens += w.num_tokens
                bm.register_computed(seq)
                continue
            drafts = seq.spec_token_ids[: w.num_draft]
            accepted = rng.randint(0, w.num_draft)
            emitted = 0
            for j in range(accepted + 1):
                token = drafts[j] if j < accepted else self.sample(rng)
                seq.output_token_ids.append(token)
                self.tokens[seq.seq_id].append(token)
                emitted += 1
                if token == EOS and not seq.params.ignore_eos:
                    seq.finish("stop", self.clock, token)
                elif len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= cfg.max_model_len:
                    seq.finish("length", self.clock)
                if seq.is_finished:
                    break
            seq.num_computed_tokens += w.num_tokens - w.num_draft + min(accepted, emitted - 1)
            if w.num_draft:
                bm.trim(seq, seq.num_tokens)
            seq.spec_token_ids = []
            bm.register_computed(seq)
            if seq.is_finished:
                finished.append(seq)
        for seq in finished:
            sched.finish(seq)
            self.corpus = (self.corpus + [seq.token_ids])[-CORPUS_SIZE:]
        for rid in {s.request_id for s in finished}:
            if all(s.is_finished for s in self.requests[rid]):
                self.end_request(rid)

    def check_schedule(self, work, had_work: bool, running_before: set[int], preemptions_before: dict) -> None:
        """What every schedule must respect: budget, seats, pages for the work, fairness, progress."""
        cfg, sched = self.cfg, self.sched
        expect(not had_work or work, "nothing scheduled although sequences are unfinished (no progress)")
        expect(len(work) <= cfg.max_num_seqs, f"{len(work)} sequences scheduled > max_num_seqs={cfg.max_num_seqs}")
        expect(len(sched.running) <= cfg.max_num_seqs, f"{len(sched.running)} running > max_num_seqs")
        total = sum(w.num_tokens for w in work)
        expect(total <= cfg.max_num_batched_tokens, f"{total} tokens > max_num_batched_tokens")
        expect(len({id(w.seq) for w in work}) == len(work), "a sequence scheduled twice in one step")
        running = set(map(id, sched.running))
        for w in work:
            seq = w.seq
            is_running = id(seq) in running and seq.status is SequenceStatus.RUNNING
            expect(is_running, f"seq {seq.seq_id} scheduled but not running")
            expect(w.num_tokens >= 1, f"seq {seq.seq_id} scheduled for {w.num_tokens} tokens")
            expect(0 <= w.num_draft <= len(seq.spec_token_ids), f"seq {seq.seq_id}: {w.num_draft} drafts")
            expect(w.num_draft == 0 or seq.num_uncomputed_tokens == 1, f"seq {seq.seq_id} drafts while prefilling")
            expect(w.num_tokens - w.num_draft <= seq.num_uncomputed_tokens, f"seq {seq.seq_id} computes past its end")
            need = seq.num_computed_tokens + w.num_tokens
            expect(len(seq.page_ids) * self.page_size >= need, f"seq {seq.seq_id} lacks pages for {need} tokens")
        if total < cfg.max_num_batched_tokens:  # budget left over: every running sequence got its turn
            expect(running <= {id(w.seq) for w in work}, "a running sequence skipped while budget was left")
        # Admission is in rank order: nobody admitted from the queue ranks after one left waiting.
        was_waiting = [
            w.seq for w in work
            if id(w.seq) not in running_before or w.seq.num_preemptions > preemptions_before[id(w.seq)]
        ]
        sched.num_steps -= 1  # ranks as schedule() saw them
        try:
            if was_waiting and sched.waiting:
                worst_admitted = max(map(sched._rank, was_waiting))
                best_left = min(map(sched._rank, sched.waiting))
                expect(worst_admitted < best_left, f"admission jumped the queue: {worst_admitted} before {best_left}")
        finally:
            sched.num_steps += 1

    # ---- invariants -----------------------------------------------------------------------------------------

    @invariant()
    @guarded
    def state_is_consistent(self) -> None:
        if self.sched is not None:
            self.check_state()

    def check_state(self, reserved: dict[int, int] | None = None) -> None:
        """`reserved`: between schedule and postprocess, the tokens each scheduled sequence has pages reserved for
        (None between steps)."""
        bm, sched, ps = self.bm, self.sched, self.page_size
        try:
            bm.check()  # free + cached + in use == total, no page in two states, hash index in sync
        except AssertionError as e:
            raise InvariantViolation(f"BlockManager.check: {e}") from e
        free, cached, used = set(bm._free), set(bm._evictable), set(bm._ref)
        expect(len(bm._free) + bm.num_cached_pages + bm.num_used_pages == bm.num_pages - 1, "page accounting broken")
        expect(free | cached | used == set(range(1, bm.num_pages)), "a page is missing from every state")
        expect(0 not in free | cached | used, "the padding page 0 is in circulation")
        expect(not free & set(bm._page_key), "a free page is still registered in the prefix cache")
        expect(cached <= set(bm._page_key), "a cached page is not registered")

        # Queues: every unfinished sequence is in exactly one queue, with the matching status.
        waiting, running = list(map(id, sched.waiting)), list(map(id, sched.running))
        expect(len(set(waiting)) == len(waiting) and len(set(running)) == len(running), "a sequence queued twice")
        expect(not set(waiting) & set(running), "a sequence both waiting and running")
        owners: Counter[int] = Counter()
        for rid, seqs in self.requests.items():
            expect((rid in self.live) == (not all(s.is_finished for s in seqs)), f"request {rid} live != unfinished")
            expect(self.num_ends[rid] == (rid not in self.live), f"request {rid} ended {self.num_ends[rid]} times")
            for seq in seqs:
                expect(seq.token_ids == self.tokens[seq.seq_id], f"seq {seq.seq_id} lost or changed tokens")
                if seq.is_finished:
                    expect(id(seq) not in set(waiting) | set(running), f"finished seq {seq.seq_id} still queued")
                    expect(not seq.page_ids, f"finished seq {seq.seq_id} still holds pages {seq.page_ids}")
                    continue
                if seq.status is SequenceStatus.WAITING:
                    expect(id(seq) in waiting, f"waiting seq {seq.seq_id} not in the waiting queue")
                    # A preempted sequence recomputes from scratch: no pages, no computed tokens, no hashes.
                    expect(
                        seq.num_computed_tokens == 0 and not seq.page_ids and not seq.page_hashes,
                        f"waiting seq {seq.seq_id} keeps state: {seq.num_computed_tokens} computed, pages "
                        f"{seq.page_ids}",
                    )
                    continue
                expect(id(seq) in running, f"seq {seq.seq_id} is {seq.status} but not in the running queue")
                self.check_running(seq, (reserved or {}).get(id(seq), 0))
                owners.update(seq.page_ids)

        # Reference counts equal the number of owners; a page with several owners is a shared prefix-cache page
        # at the same position of each owner.
        expect(dict(owners) == bm._ref, f"ref counts {bm._ref} != owners {dict(owners)}")
        positions: dict[int, set[tuple[int, int]]] = {}
        for seq in sched.running:
            for i, page in enumerate(seq.page_ids):
                if owners[page] > 1:
                    expect(i < len(seq.page_hashes), f"shared page {page} is not a computed prefix page")
                    positions.setdefault(page, set()).add((i, seq.page_hashes[i]))
        for page, where in positions.items():
            expect(page in bm._page_key, f"page {page} shared by {owners[page]} sequences but not prefix-cached")
            same = len(where) == 1 and next(iter(where))[1] == bm._page_key[page][0]
            expect(same, f"page {page} shared at different positions or under different hashes: {where}")

        # Every registered page holds the KV of exactly the tokens its key names (full chain, not just the page).
        for page, (h, tokens) in bm._page_key.items():
            slots = self.kv.get(page)
            expect(slots is not None and None not in slots, f"registered page {page} was never fully written")
            ctx = slots[-1]
            expect(len(ctx) % ps == 0 and ctx[-ps:] == tokens, f"registered page {page} holds {ctx}, key {tokens}")
            expect(all(slots[j] == ctx[: len(ctx) - ps + j + 1] for j in range(ps)), f"page {page} mixes contexts")
            expect(chain_hashes(ctx, ps)[-1] == h, f"registered page {page}: hash does not match its content")

    def check_running(self, seq: Sequence, num_reserved: int) -> None:
        ps, nc = self.page_size, seq.num_computed_tokens
        expect(0 <= nc < seq.num_tokens, f"running seq {seq.seq_id}: {nc} computed of {seq.num_tokens}")
        # At most the pages its tokens (or, mid-step, its scheduled work, drafts included) need.
        expect(
            pages_for(nc, ps) <= len(seq.page_ids) <= pages_for(max(seq.num_tokens, nc + num_reserved), ps),
            f"running seq {seq.seq_id}: {len(seq.page_ids)} pages for {nc} computed / {seq.num_tokens} tokens",
        )
        expect(0 not in seq.page_ids, f"seq {seq.seq_id} was handed the padding page 0")
        expect(len(set(seq.page_ids)) == len(seq.page_ids), f"seq {seq.seq_id} holds a page twice: {seq.page_ids}")
        expect(len(seq.page_hashes) * ps <= nc, f"seq {seq.seq_id} hashes pages it has not computed")
        expect(seq.page_hashes == chain_hashes(seq.token_ids, ps)[: len(seq.page_hashes)], "wrong page hashes")
        tokens = seq.token_ids
        for pos in range(nc):
            got = self.kv.get(seq.page_ids[pos // ps], [None] * ps)[pos % ps]
            expect(got == tuple(tokens[: pos + 1]), f"seq {seq.seq_id} position {pos}: KV of {got}, tokens {tokens}")

    # ---- drain ----------------------------------------------------------------------------------------------

    def teardown(self) -> None:
        """With no new arrivals everything finishes within a bound, and then no page is leaked."""
        if self.sched is None or self.broken:
            return
        live = [s for r in self.live for s in self.requests[r] if not s.is_finished]
        remaining = sum(s.num_tokens + s.max_tokens - len(s.output_token_ids) for s in live)
        bound = 20 + 2 * remaining  # measured: at most ~0.25 steps per token
        for _ in range(bound):
            if not self.sched.has_unfinished():
                break
            self.run_step(self.drain_rng)
            self.check_state()
        else:
            raise InvariantViolation(f"not drained within {bound} steps: {len(self.sched.waiting)} waiting, "
                                     f"{len(self.sched.running)} running")
        expect(not self.live, f"requests {sorted(self.live)} never ended")
        expect(self.bm.num_used_pages == 0, f"{self.bm.num_used_pages} pages leaked after everything finished")
        expect(self.bm.num_free_pages == self.bm.num_pages - 1, "pages neither free nor cached after the drain")


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = FUZZ_SETTINGS


# ---- the checker must be able to fail: planted bugs ---------------------------------------------------------------


def _leak_first_page(monkeypatch):
    free = BlockManager.free

    def leaky_free(self, seq):
        seq.page_ids = seq.page_ids[1:]  # forgets to release the first page
        free(self, seq)

    monkeypatch.setattr(BlockManager, "free", leaky_free)


def _overcount_prefix_refs(monkeypatch):
    reuse = BlockManager.reuse_prefix

    def reuse_counting_twice(self, seq):
        hit = reuse(self, seq)
        for page in seq.page_ids:
            if self._ref[page] > 1:
                self._ref[page] += 1  # a prefix hit on an in-use page counts its new owner twice
        return hit

    monkeypatch.setattr(BlockManager, "reuse_prefix", reuse_counting_twice)


def _hand_out_in_use_page(monkeypatch):
    allocate = BlockManager.allocate

    def double_allocate(self, seq, num_tokens):
        if not seq.page_ids and self._ref and self.num_new_pages(seq, num_tokens):
            page = max(self._ref)  # someone else's page, with a correct ref count but not through the prefix cache
            self._ref[page] += 1
            seq.page_ids.append(page)
        allocate(self, seq, num_tokens)

    monkeypatch.setattr(BlockManager, "allocate", double_allocate)


def _preempt_keeps_hashes(monkeypatch):
    preempt = Scheduler._preempt

    def preempt_keeping_hashes(self, seq):
        hashes = list(seq.page_hashes)
        preempt(self, seq)
        seq.page_hashes = hashes  # still claims the prefix pages it no longer holds

    monkeypatch.setattr(Scheduler, "_preempt", preempt_keeping_hashes)


def _register_uncomputed_page(monkeypatch):
    register = BlockManager.register_computed

    def register_ahead(self, seq):
        seq.num_computed_tokens += self.page_size  # registers the page after the computed ones too
        try:
            register(self, seq)
        finally:
            seq.num_computed_tokens -= self.page_size

    monkeypatch.setattr(BlockManager, "register_computed", register_ahead)


def _overspend_budget(monkeypatch):
    init = Scheduler.__init__

    def init_with_bigger_budget(self, cfg, block_manager):
        init(self, cfg.replace(max_num_batched_tokens=cfg.max_num_batched_tokens + 1, token_buckets=()), block_manager)

    monkeypatch.setattr(Scheduler, "__init__", init_with_bigger_budget)


def _hand_out_page_zero(monkeypatch):
    init = BlockManager.__init__

    def init_with_page_zero(self, num_pages, page_size, enable_prefix_caching=True):
        init(self, num_pages, page_size, enable_prefix_caching)
        self._free[0] = 0  # page 1 is lost and the padding page takes its place

    monkeypatch.setattr(BlockManager, "__init__", init_with_page_zero)


def _finish_leaves_waiting(monkeypatch):
    finish = Scheduler.finish

    def finish_running_only(self, seq):
        if seq in self.running:
            finish(self, seq)  # an aborted waiting sequence stays queued

    monkeypatch.setattr(Scheduler, "finish", finish_running_only)


def _thrash(monkeypatch):
    schedule = Scheduler.schedule

    def schedule_after_preempting_all(self):
        for seq in list(self.running):
            self._preempt(seq)  # every step restarts every sequence: nothing with a long prompt ever finishes
        return schedule(self)

    monkeypatch.setattr(Scheduler, "schedule", schedule_after_preempting_all)


PLANTED_BUGS = {
    "leaked page": (_leak_first_page, "ref counts|leaked"),
    "ref count too high": (_overcount_prefix_refs, "ref counts"),
    "page owned twice": (_hand_out_in_use_page, "shared|not a computed prefix page"),
    "preemption keeps state": (_preempt_keeps_hashes, "keeps state|wrong page hashes|hashes pages"),
    "uncomputed page registered": (_register_uncomputed_page, "registered page|hashes pages"),
    "token budget exceeded": (_overspend_budget, "max_num_batched_tokens"),
    "padding page handed out": (_hand_out_page_zero, "page 0|padding|missing from every state"),
    "aborted sequence still queued": (_finish_leaves_waiting, "still queued"),
    "livelock": (_thrash, "not drained"),
}


@pytest.mark.parametrize("bug", PLANTED_BUGS)
def test_machine_catches_planted_bug(bug, monkeypatch):
    plant, message = PLANTED_BUGS[bug]
    plant(monkeypatch)
    quick = settings(FUZZ_SETTINGS, phases=[Phase.generate], report_multiple_bugs=False, print_blob=False)
    with pytest.raises(InvariantViolation, match=message):
        run_state_machine_as_test(SchedulerMachine, settings=quick)
