"""Async scheduling (`engine.py`): step N+1 is scheduled and dispatched before step N lands, N's tokens fed to it on
the device. Every test compares the engine with it on against the same engine with it off: the outputs must be
the same tokens, finish reasons and logprobs, through preemption, aborts, stops, penalties, prompt logprobs,
seeded sampling, prefix caching and a device step that fails after the next one was built on it."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.factory import resolve_async_scheduling
from tiny_models import make_tiny_model

# 40 pages of 4 tokens for 4 sequences of up to 64 tokens: long requests preempt each other
CFG = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=64, precompile=False,
           num_pages=1 + 40)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama_gqa", str(p))
    return str(p)


@pytest.fixture(scope="module")
def engines(path):
    return {mode: LLM(path, async_scheduling=mode, **CFG) for mode in (False, True)}


def _outputs(outs):
    return [[(c.token_ids, c.finish_reason, c.stop_reason, round(c.cumulative_logprob, 4),
              None if c.logprobs is None else [{t: round(lp.logprob, 4) for t, lp in d.items()} for d in c.logprobs])
             for c in o.outputs]
            + [None if o.prompt_logprobs is None else
               [None if d is None else {t: round(lp.logprob, 4) for t, lp in d.items()} for d in o.prompt_logprobs]]
            for o in outs]


def _workload(seed=0, n=12):
    """Mixed requests: greedy stopping early on any of 40 stop tokens, seeded random with n=2 and min_tokens,
    penalties, logprobs and prompt logprobs, max_tokens from 1 up to the context; some prompts repeat (prefix cache
    hits)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 300, int(rng.integers(2, 40))).tolist() for _ in range(n)]
    prompts[5] = list(prompts[0])
    prompts[9] = prompts[1] + [7, 8, 9]
    params = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            p = SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 30)), ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[int(t) for t in rng.integers(3, 300, 40)])
        elif kind == 2:
            p = SamplingParams(temperature=0.9, seed=i, max_tokens=25, min_tokens=4, n=2, ignore_eos=True)
        elif kind == 3:
            p = SamplingParams(temperature=0, max_tokens=15, repetition_penalty=1.3, presence_penalty=0.2,
                               ignore_eos=True)
        elif kind == 4:
            p = SamplingParams(temperature=0, max_tokens=10, logprobs=2, prompt_logprobs=1, ignore_eos=True)
        else:
            p = SamplingParams(temperature=0.7, top_p=0.9, seed=100 + i, max_tokens=64, ignore_eos=True)
        params.append(p)
    return [{"prompt_token_ids": p} for p in prompts], params


def _idle(llm):
    bm = llm.llm_engine.block_manager
    bm.check()
    assert bm.num_used_pages == 0 and not llm.llm_engine.requests


def test_outputs_are_the_same_with_and_without_async_scheduling(engines):
    prompts, params = _workload()
    got = {}
    for mode, llm in engines.items():
        eng = llm.llm_engine
        assert eng.async_scheduling is mode
        steps, preemptions = eng.num_steps, eng.scheduler.num_preemptions
        got[mode] = _outputs(llm.generate(prompts, params, use_tqdm=False))
        assert eng.scheduler.num_preemptions > preemptions  # the page budget is tight enough to preempt
        _idle(llm)
        got[mode, "steps"] = eng.num_steps - steps
    assert got[True] == got[False]
    assert engines[True].llm_engine.num_overlapped_steps > 0
    # the overlap costs at most the steps wasted on sequences that stopped on a token (not on a length limit)
    assert got[False, "steps"] <= got[True, "steps"] <= got[False, "steps"] + 12


def test_length_limited_requests_waste_no_step(engines, path):
    """A sequence whose token in flight is its last (max_tokens) is not scheduled again, so a lone request runs
    exactly as many device steps with async scheduling as without."""
    prompt = {"prompt_token_ids": list(range(3, 30))}
    for max_tokens in (1, 2, 7):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        counts = {}
        for mode, llm in engines.items():
            before = llm.llm_engine.num_steps
            llm.generate(prompt, params, use_tqdm=False)
            while llm.llm_engine._in_flight is not None:  # land what is still in flight
                llm.llm_engine.step()
            counts[mode] = llm.llm_engine.num_steps - before
        assert counts[True] == counts[False], max_tokens


def test_max_model_len_stops_at_the_same_token(engines):
    prompt = {"prompt_token_ids": list(range(3, 60))}  # 57 tokens: 7 more reach max_model_len = 64
    outs = {mode: llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0] for mode, llm in engines.items()}
    assert len(outs[True].token_ids) == 7 and outs[True].finish_reason == "length"
    assert outs[True].token_ids == outs[False].token_ids


def _drive(llm, prompts, params, abort_at: dict[int, str]):
    """Add every request, step until all end; abort request `abort_at[k]` right after step k."""
    eng = llm.llm_engine
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        eng.add_request(rid, prompt, p)
    final, k = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        k += 1
        if k in abort_at and abort_at[k] in eng.requests:
            final[abort_at[k]] = eng.abort_request(abort_at[k])
    return [final[rid] for rid in ids]


def test_aborts_in_flight_leave_the_others_unchanged(engines):
    prompts, params = _workload(seed=1)
    got = {}
    for mode, llm in engines.items():
        outs = _drive(llm, prompts, params, abort_at={3: "r2", 6: "r5", 9: "r0"})
        for rid in ("r2", "r5"):
            o = next(o for o in outs if o.request_id == rid)
            assert o.finished and {c.finish_reason for c in o.outputs} <= {"abort", "length", "stop"}
        got[mode] = outs
        _idle(llm)
    # aborted requests end wherever the step count put them; everyone else is unaffected
    assert _outputs([o for o in got[True] if o.request_id not in ("r2", "r5", "r0")]) == \
        _outputs([o for o in got[False] if o.request_id not in ("r2", "r5", "r0")])


def test_a_failed_step_with_the_next_in_flight_fails_only_its_culprit(path):
    """The device step fails when its outputs are fetched, after the next step was built on its tokens: the next
    step is rolled back, the failed one retried a sequence at a time, and only the culprit's request fails."""
    poison = 299
    prompts = [{"prompt_token_ids": [5, 6, 7, poison]}] + [{"prompt_token_ids": list(range(10 + i, 30 + i))}
                                                           for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(path, async_scheduling=False, **CFG).generate(prompts[1:], params, use_tqdm=False)
    llm = LLM(path, async_scheduling=True, **CFG)
    runner, poisoned = llm.llm_engine.runner, set()
    dispatch, fetch = runner.dispatch, runner.fetch

    def dispatch_and_mark(steps):
        outs = dispatch(steps)
        if any(poison in batch.inputs.token_ids for _, batch in steps):
            poisoned.add(id(outs))
        return outs

    def failing_fetch(outs):
        if id(outs) in poisoned:
            raise RuntimeError("injected device fault at fetch")
        return fetch(outs)

    runner.dispatch, runner.fetch = dispatch_and_mark, failing_fetch
    eng, rolled_back = llm.llm_engine, []
    roll_back = eng._roll_back
    eng._roll_back = lambda launched: (rolled_back.append(launched.advanced), roll_back(launched))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert rolled_back == [True, True]  # the failed step and the one built on it
    assert outs[0].outputs[0].finish_reason == "error" and "at fetch" in outs[0].outputs[0].stop_reason
    assert [o.outputs[0].token_ids for o in outs[1:]] == [o.outputs[0].token_ids for o in want]
    assert llm.llm_engine.num_overlapped_steps > 0
    _idle(llm)


def test_async_scheduling_is_refused_where_unsupported():
    ngram = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert resolve_async_scheduling(ngram) is True  # overlaps the steps that do not speculate
    eagle = EngineConfig(speculative_config={"method": "eagle3", "model": "/head", "num_speculative_tokens": 2})
    assert resolve_async_scheduling(eagle) is True  # the same (tests/test_eagle3.py)
    with pytest.raises(ValueError, match="does not support pipeline parallelism"):
        resolve_async_scheduling(EngineConfig(mesh="pp2", async_scheduling=True))
    assert resolve_async_scheduling(EngineConfig()) is True
    assert resolve_async_scheduling(EngineConfig(async_scheduling=False)) is False


def _repetitive_workload(n=8):
    """Prompts that repeat themselves (n-gram lookup finds drafts), greedy, with stops and length limits."""
    rng = np.random.default_rng(7)
    prompts, params = [], []
    for i in range(n):
        motif = rng.integers(3, 300, int(rng.integers(3, 8))).tolist()
        prompts.append({"prompt_token_ids": (motif * 6)[: int(rng.integers(12, 36))]})
        stops = [] if i % 3 else [int(t) for t in rng.integers(3, 300, 8)]
        params.append(SamplingParams(temperature=0, max_tokens=int(rng.integers(5, 28)), stop_token_ids=stops,
                                     ignore_eos=True))
    return prompts, params


def test_ngram_speculation_overlaps_the_steps_that_do_not_speculate(path, alternating_controller):
    """With n-gram speculation, a step that verifies drafts is built from landed tokens and lands before the next
    one; a step the controller would not speculate in overlaps. The controller is made to alternate (K = 0 on every
    other decision, whatever the timings), so both kinds of steps occur; greedy outputs equal the synchronous
    engine's and the non-speculative engine's."""
    prompts, params = _repetitive_workload()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    want = [o.outputs[0].token_ids for o in LLM(path, async_scheduling=False, **CFG).generate(
        prompts, params, use_tqdm=False)]
    for mode in (False, True):
        llm = LLM(path, async_scheduling=mode, speculative_config=spec, **CFG)
        eng = llm.llm_engine
        assert eng.async_scheduling is mode
        eng.step_trace = []  # JAXSERVE_STEP_TRACE's records: each step's drafts and accepted drafts add up
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want, mode
        m = eng.spec.metrics
        assert m.num_steps > 0 and sum(m.num_accepted) > 0  # drafts were verified, some accepted
        assert sum(r["drafts"] for r in eng.step_trace) == sum(m.num_drafts)
        assert sum(r["accepted"] for r in eng.step_trace) == sum(m.num_accepted)
        assert any(r["overlapped"] for r in eng.step_trace) is mode
        assert (eng.num_overlapped_steps > 0) is mode
        # the trace's controller decisions: a step with drafts had K > 0; a hint that made the engine wait for the
        # step before (async only) is recorded on the step built after it, never on one built behind
        assert all(r["spec_k"] > 0 for r in eng.step_trace if r["drafts"])
        assert all(r["spec_hint"] is None for r in eng.step_trace if r["overlapped"])
        assert any(r["spec_hint"] for r in eng.step_trace) is mode
        # host time between a step's landing and the next step's start: none for a step built behind it
        assert all(r["gap_ms"] == 0 for r in eng.step_trace if r["overlapped"])
        assert all(r["gap_ms"] >= 0 for r in eng.step_trace)
        _idle(llm)


def test_a_step_whose_period_saw_a_compile_is_not_timed(path, monkeypatch):
    """The adaptive controller weighs step sizes by their measured periods. With async scheduling the next step is
    built while one runs, so without precompilation a new bucket's compile falls inside the running step's period;
    such periods are not recorded (one of them made a 16-row step look 5x dearer than a verify step, and the
    controller speculated at a loss from then on). Every compile is made 0.3 s slower here: no recorded period
    comes near that, while compiles did happen behind running steps."""
    import time

    llm = LLM(path, async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              **CFG)
    eng = llm.llm_engine
    runner, compiled = eng.runner, eng.runner.executable

    def slow_compile(bucket, prompt_logprobs=False):
        if (bucket, prompt_logprobs) not in runner._executables:
            time.sleep(0.3)
        return compiled(bucket, prompt_logprobs)

    periods, record = [], eng.spec.record_step
    monkeypatch.setattr(runner, "executable", slow_compile)
    monkeypatch.setattr(eng.spec, "record_step", lambda b, n, s, o, **kw: periods.append(s) or record(b, n, s, o, **kw))
    prompts, params = _repetitive_workload()
    llm.generate(prompts, params, use_tqdm=False)
    assert runner.num_compiles >= 3 and eng.num_overlapped_steps > 0
    assert len(periods) > 10 and max(periods) < 0.3, sorted(periods)[-3:]
