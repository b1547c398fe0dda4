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
