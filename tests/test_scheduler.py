"""Host-only tests of the block manager and scheduler (no jax, no model)."""

import pytest

from jaxserve.block_manager import BlockManager
from jaxserve.config import EngineConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler
from jaxserve.sequence import Sequence, SequenceStatus

_ids = iter(range(10**6))


def seq(n_prompt, arrival=0.0):
    sid = next(_ids)
    return Sequence(sid, f"r{sid}", 0, list(range(n_prompt)), SamplingParams(), 100, arrival)


def run_step(sched, work, token=7):
    """Mimic the engine's postprocess: mark computed, append a token when the sequence is complete."""
    for w in work:
        done = w.completes_sequence
        w.seq.num_computed_tokens += w.num_tokens
        if done:
            w.seq.output_token_ids.append(token)


def test_block_manager_page_boundaries():
    bm = BlockManager(num_pages=5, page_size=4)
    s = seq(4)
    assert bm.num_new_pages(s, 4) == 1 and bm.num_new_pages(s, 5) == 2
    bm.allocate(s, 4)
    assert len(s.page_ids) == 1 and 0 not in s.page_ids
    bm.allocate(s, 4)  # idempotent at an exact page boundary
    assert len(s.page_ids) == 1
    bm.allocate(s, 5)
    assert len(s.page_ids) == 2
    assert not bm.can_allocate(seq(0), 4 * 3)
    with pytest.raises(RuntimeError, match="out of KV pages"):
        bm.allocate(seq(0), 4 * 3)
    bm.check()
    bm.free(s)
    assert bm.num_free_pages == 4 and s.page_ids == []
    bm.check()


def test_block_manager_rejects_too_few_pages():
    with pytest.raises(ValueError, match="page 0 is reserved"):
        BlockManager(num_pages=1, page_size=4)


def test_chunked_prefill_and_decodes_share_budget():
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, page_size=4)
    sched = Scheduler(cfg, BlockManager(64, 4))
    a, b = seq(3), seq(13)
    sched.add(a)
    sched.add(b)
    work = sched.schedule()
    assert [(w.seq, w.num_tokens) for w in work] == [(a, 3), (b, 5)]
    assert work[0].completes_sequence and not work[1].completes_sequence
    run_step(sched, work)
    work = sched.schedule()  # a decodes (1 token), b gets the rest of its prompt (8 left, 7 fit)
    assert [(w.seq, w.num_tokens) for w in work] == [(a, 1), (b, 7)]
    run_step(sched, work)
    work = sched.schedule()
    assert [(w.seq, w.num_tokens) for w in work] == [(a, 1), (b, 1)]
    assert work[1].completes_sequence


def test_max_num_seqs_and_fcfs():
    cfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, page_size=4)
    sched = Scheduler(cfg, BlockManager(64, 4))
    seqs = [seq(2) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    work = sched.schedule()
    assert [w.seq for w in work] == seqs[:2]
    assert list(sched.waiting) == seqs[2:]


def test_preempts_newest_and_resumes_first():
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=4)
    bm = BlockManager(1 + 3, 4)  # three usable pages
    sched = Scheduler(cfg, bm)
    old, new = seq(4), seq(4)
    sched.add(old)
    sched.add(new)
    run_step(sched, sched.schedule())  # both prefilled: 1 page each, each now holds 5 tokens
    work = sched.schedule()  # old needs a 2nd page (ok, 1 free); new needs one too: none left -> new preempts itself
    assert [w.seq for w in work] == [old]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and new.page_ids == []
    assert sched.waiting[0] is new and sched.num_preemptions == 1
    bm.check()


def test_preempting_the_last_running_request():
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, page_size=4)
    bm = BlockManager(1 + 1, 4)  # one usable page: a 4-token prompt fits, its first output does not
    sched = Scheduler(cfg, bm)
    s = seq(4)
    sched.add(s)
    run_step(sched, sched.schedule())
    assert sched.schedule() == []
    assert s.status is SequenceStatus.WAITING and bm.num_free_pages == 1


def test_finish_frees_waiting_and_running():
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, page_size=4)
    bm = BlockManager(16, 4)
    sched = Scheduler(cfg, bm)
    a, b = seq(5), seq(5)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(a)
    sched.finish(b)
    assert not sched.has_unfinished() and bm.num_free_pages == 15
    bm.check()


# ---- prefix caching ---------------------------------------------------------------------------------------------


def computed(bm, s, n):
    """Pretend the engine computed the first n tokens of s."""
    bm.allocate(s, n)
    s.num_computed_tokens = n
    bm.register_computed(s)


def seq_of(tokens, arrival=0.0, priority=0):
    sid = next(_ids)
    return Sequence(sid, f"r{sid}", 0, list(tokens), SamplingParams(), 100, arrival, priority=priority)


def test_prefix_pages_are_shared_and_counted():
    bm = BlockManager(num_pages=16, page_size=4)
    a = seq_of(range(10))
    computed(bm, a, 10)  # pages: [0-3] [4-7] full, [8-9] partial
    b = seq_of(list(range(8)) + [99, 98, 97])
    assert bm.reuse_prefix(b) == 8 and b.page_ids == a.page_ids[:2]
    assert b.num_computed_tokens == 8
    bm.check()
    c = seq_of(list(range(4)) + [55] * 6)  # diverges inside the second page
    assert bm.reuse_prefix(c) == 4
    d = seq_of(range(8))  # fully cached prompt: one token is still left to compute
    assert bm.reuse_prefix(d) == 4
    bm.check()


def test_cached_pages_survive_free_until_evicted_lru():
    bm = BlockManager(num_pages=1 + 4, page_size=2)
    a = seq_of([1, 2, 3, 4, 5])
    computed(bm, a, 5)  # 3 pages: two full (registered), one partial
    first, second, partial = a.page_ids
    bm.free(a)
    assert bm.num_cached_pages == 2 and bm.num_free_pages == 4
    bm.check()
    b = seq_of([1, 2, 3, 4, 9])
    assert bm.reuse_prefix(b) == 4 and b.page_ids == [first, second]
    bm.free(b)
    # Allocation takes plain free pages first, then evicts least recently used cached pages: tails before prefixes.
    x = seq_of([7] * 8)
    bm.allocate(x, 8)
    assert set(x.page_ids) == {first, second, partial, 4} and bm.num_cached_pages == 0
    bm.check()
    c = seq_of([1, 2, 3, 4, 9])
    assert bm.reuse_prefix(c) == 0  # evicted content is forgotten


@pytest.mark.parametrize("holdback", [0, 1, 2])
def test_a_proposer_may_have_prefix_hits_recompute_the_last_cached_pages(holdback):
    """A proposer may ask that a prefix hit reuse fewer pages (`prefix_reuse`; EAGLE-3: 0 or 1 fewer): those pages
    are recomputed, the earlier ones shared, and the block manager's books stay consistent."""
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=4)
    bm = BlockManager(num_pages=32, page_size=4)
    asked = []

    def reuse(seq, hit):
        asked.append(hit)
        return hit - 4 * holdback

    sched = Scheduler(cfg, bm, prefix_reuse=reuse)
    prompt = list(range(100, 113))  # 3 full pages + 1 token
    a = seq_of(prompt)
    computed(bm, a, 13)
    b = seq_of(prompt)
    sched.add(b)
    (w,) = sched.schedule()
    reused = 3 - holdback
    assert asked == [12]
    assert b.num_computed_tokens == 4 * reused and w.num_tokens == 13 - 4 * reused
    assert b.page_ids[:reused] == a.page_ids[:reused] and set(b.page_ids[reused:]).isdisjoint(a.page_ids)
    bm.check()


def test_prefix_caching_off():
    bm = BlockManager(num_pages=16, page_size=4, enable_prefix_caching=False)
    a = seq_of(range(10))
    computed(bm, a, 10)
    assert bm.reuse_prefix(seq_of(range(10))) == 0


def test_scheduler_charges_only_uncached_tokens():
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=4)
    bm = BlockManager(32, 4)
    sched = Scheduler(cfg, bm)
    a = seq_of(range(12))
    sched.add(a)
    run_step(sched, sched.schedule())
    bm.register_computed(a)
    b = seq_of(list(range(12)) + [50])
    sched.add(b)
    work = sched.schedule()
    assert [(w.seq, w.num_tokens) for w in work] == [(a, 1), (b, 1)]
    assert bm.num_prefix_hits == 12 and bm.prefix_hit_rate > 0


# ---- priorities, aging, aborts ------------------------------------------------------------------------------------


def test_priority_orders_admission_and_preempts_lower():
    cfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, page_size=4)
    sched = Scheduler(cfg, BlockManager(64, 4))
    low1, low2 = seq_of(range(3), arrival=0, priority=5), seq_of(range(3), arrival=1, priority=5)
    sched.add(low1)
    sched.add(low2)
    run_step(sched, sched.schedule())
    urgent = seq_of(range(3), arrival=2, priority=0)
    sched.add(urgent)
    work = sched.schedule()  # no free seat: the newest low-priority request yields its seat
    assert {w.seq.seq_id for w in work} == {low1.seq_id, urgent.seq_id}
    assert low2.status is SequenceStatus.WAITING and low2.num_preemptions == 1


def test_victim_is_lowest_priority_then_latest():
    cfg = EngineConfig(max_num_seqs=3, max_num_batched_tokens=64, page_size=4)
    bm = BlockManager(1 + 4, 4)
    sched = Scheduler(cfg, bm)
    hi = seq_of(range(4), arrival=0, priority=0)
    lo_old = seq_of(range(4), arrival=1, priority=3)
    mid = seq_of(range(4), arrival=2, priority=1)
    for s in (hi, lo_old, mid):
        sched.add(s)
    run_step(sched, sched.schedule())  # 3 pages used, 1 free; each now needs a second page
    work = sched.schedule()
    assert lo_old.status is SequenceStatus.WAITING  # lowest priority goes first, though it is not the latest
    assert {w.seq.seq_id for w in work} == {hi.seq_id, mid.seq_id}
    bm.check()


def test_aging_prevents_starvation():
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, page_size=4, priority_aging_steps=3)
    sched = Scheduler(cfg, BlockManager(256, 4))
    starving = seq_of(range(2), arrival=0, priority=10)
    sched.add(starving)
    for i in range(200):  # a stream of high-priority requests, each one step long
        s = seq_of(range(2), arrival=1 + i, priority=0)
        sched.add(s)
        work = sched.schedule()
        if any(w.seq is starving for w in work):
            break
        for w in work:
            sched.finish(w.seq)
    else:
        pytest.fail("a low-priority request starved")
    assert i < 60


@pytest.mark.parametrize("where", ["waiting", "running", "preempted"])
def test_abort_anywhere_frees_pages(where):
    cfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, page_size=4)
    bm = BlockManager(1 + 3, 4)
    sched = Scheduler(cfg, bm)
    a, b = seq_of(range(4), arrival=0), seq_of(range(4), arrival=1)
    sched.add(a)
    sched.add(b)
    if where != "waiting":
        run_step(sched, sched.schedule())
    if where == "preempted":
        sched.schedule()  # both need a 2nd page, one is free: b is preempted
        assert b.status is SequenceStatus.WAITING and b.num_preemptions == 1
    target = b
    sched.finish(target)
    assert target not in sched.waiting and target not in sched.running and target.page_ids == []
    bm.check()
    sched.finish(a)
    assert bm.num_free_pages == 3 and not sched.has_unfinished()
