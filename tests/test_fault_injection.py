"""Fault injection: a failure that belongs to one request ends that request alone; a failure of the engine itself
reaches every request at once, and the server exits non-zero.

Faults are real where they can be: NaN logits come from a NaN row planted in the model's embedding table (so the
poisoned request's KV pages hold NaN too, and the pages must neither be reused through the prefix cache nor leak
into the next owner's attention); step exceptions are raised from the runner, as a device error would be.
"""

import asyncio
import dataclasses
import threading
import time

import numpy as np
import pytest

from jaxserve import LLM, AsyncLLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine import MAX_FAILED_STEPS
from jaxserve.errors import EngineDeadError, RequestFailedError
from tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
POISON = 299  # the token whose embedding row is NaN in the poisoned engine
CFG = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=96, precompile=False, num_pages=40)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama_gqa", str(p))
    return str(p)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 290, int(rng.integers(6, 30))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def reference(path):
    llm = LLM(path, **CFG)
    prompts = _prompts(6, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


def _poison(engine) -> None:
    runner = engine.runner
    w = runner.weights
    runner.weights = dataclasses.replace(w, embed=w.embed.at[POISON].set(np.nan))


def _cached_tokens(llm: LLM) -> set[int]:
    return {t for _, tokens in llm.llm_engine.block_manager._page_key.values() for t in tokens}


def _check_idle(llm: LLM) -> None:
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_used_pages == 0
    eng.block_manager.check()


def test_nan_logits_fail_only_that_request(path, reference):
    prompts, want = reference
    llm = LLM(path, **CFG)
    _poison(llm.llm_engine)
    bad = prompts[0][:5] + [POISON] + prompts[0][5:]
    batch = [bad] + prompts[1:]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    c = outs[0].outputs[0]
    assert outs[0].finished and c.finish_reason == "error" and "non-finite" in c.stop_reason
    assert [o.outputs[0].token_ids for o in outs[1:]] == want[1:]
    _check_idle(llm)
    assert POISON not in _cached_tokens(llm), "pages holding NaN KV were left in the prefix cache"
    assert llm.llm_engine.num_failed_requests == 1
    # The freed pages (NaN in their KV slots) are reused by the next requests: their outputs stay exact.
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want
    _check_idle(llm)


def test_nan_logits_raise_request_failed_in_async_llm(path, reference):
    prompts, want = reference
    llm = AsyncLLM(path, EngineConfig(**CFG))
    _poison(llm.engine)

    async def run(rid, ids):
        final = None
        async for out in llm.generate({"prompt_token_ids": ids}, GREEDY, rid):
            final = out
        return final.outputs[0].token_ids

    async def main():
        return await asyncio.gather(
            run("bad", [5, POISON, 7]), *(run(f"ok{i}", p) for i, p in enumerate(prompts[:3])), return_exceptions=True
        )

    try:
        got = asyncio.run(main())
        assert isinstance(got[0], RequestFailedError) and got[0].request_id == "bad"
        assert got[1:] == want[:3]
        assert llm.is_running
    finally:
        llm.shutdown()


def _raise_when(llm: LLM, predicate) -> list[int]:
    """Make the runner raise (before touching the device, like a failed launch) on inputs matching `predicate`."""
    runner = llm.llm_engine.runner
    original = runner.dispatch
    calls = []

    def dispatch(steps):
        for _, batch in steps:
            calls.append(int(np.count_nonzero(batch.inputs.token_ids)))
            if predicate(batch.inputs):
                raise RuntimeError("injected device fault")
        return original(steps)

    runner.dispatch = dispatch
    return calls


def test_step_exception_for_one_request_fails_only_it(path, reference):
    prompts, want = reference
    llm = LLM(path, **CFG)
    _raise_when(llm, lambda inputs: POISON in inputs.token_ids)
    batch = [prompts[0][:3] + [POISON]] + prompts[1:4]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    c = outs[0].outputs[0]
    assert c.finish_reason == "error" and "injected device fault" in c.stop_reason
    assert [o.outputs[0].token_ids for o in outs[1:]] == want[1:4]
    _check_idle(llm)
    assert llm.llm_engine._failed_runs == 0  # the others ran: the engine is healthy


def test_host_side_exception_fails_only_that_request(path, reference, monkeypatch):
    prompts, want = reference
    llm = LLM(path, **CFG)
    eng = llm.llm_engine
    original = eng.output.check_stop

    def check_stop(req, seq, token, now):
        if req.request_id.endswith("-0") and len(seq.output_token_ids) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return original(req, seq, token, now)

    monkeypatch.setattr(eng.output, "check_stop", check_stop)
    ids = [f"offline-{i}" for i in range(4)]
    monkeypatch.setattr(llm, "_ids", iter(range(4)))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], GREEDY, use_tqdm=False)
    assert [o.request_id for o in outs] == ids
    assert outs[0].outputs[0].finish_reason == "error" and len(outs[0].outputs[0].token_ids) == 3
    assert [o.outputs[0].token_ids for o in outs[1:]] == want[1:4]
    _check_idle(llm)


def test_build_exception_fails_only_that_request(path, reference, monkeypatch):
    prompts, want = reference
    llm = LLM(path, **CFG)
    eng = llm.llm_engine
    original = eng.builder.fill_row

    def fill_row(sampling, row, seq, extra):
        if seq.prompt_token_ids == prompts[2]:
            raise OverflowError("injected: Python int too large to convert to C int")
        return original(sampling, row, seq, extra)

    monkeypatch.setattr(eng.builder, "fill_row", fill_row)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], GREEDY, use_tqdm=False)
    assert outs[2].outputs[0].finish_reason == "error" and "OverflowError" in outs[2].outputs[0].stop_reason
    assert [outs[i].outputs[0].token_ids for i in (0, 1, 3)] == [want[i] for i in (0, 1, 3)]
    _check_idle(llm)


def test_step_exception_for_every_request_kills_the_engine_after_retries(path, reference):
    prompts, _ = reference
    llm = LLM(path, **CFG)
    _raise_when(llm, lambda inputs: True)
    for i in range(MAX_FAILED_STEPS - 1):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], GREEDY, use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "error" for o in outs)
        _check_idle(llm)
    with pytest.raises(EngineDeadError, match=f"{MAX_FAILED_STEPS} steps in a row"):
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], GREEDY, use_tqdm=False)


def test_engine_death_errors_every_pending_and_future_request(path):
    """A request queued while the fatal step runs (its add not yet applied) gets the error too, at once."""
    llm = AsyncLLM(path, EngineConfig(**CFG))
    runner = llm.engine.runner
    entered, release = threading.Event(), threading.Event()

    def dispatch(*args, **kw):
        entered.set()
        release.wait(10)
        raise RuntimeError("injected: device lost")

    runner.dispatch = dispatch
    runner.kv_is_intact = lambda: False  # the failed call consumed the donated KV cache: unrecoverable
    deaths = []
    llm.add_death_callback(deaths.append)

    async def collect(rid, ids):
        async for _ in llm.generate({"prompt_token_ids": ids}, GREEDY, rid):
            pass

    async def main():
        first = asyncio.create_task(collect("first", [5, 6, 7]))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        queued = asyncio.create_task(collect("queued", [8, 9]))  # its add waits in the command queue
        await asyncio.sleep(0.05)
        release.set()
        results = await asyncio.wait_for(asyncio.gather(first, queued, return_exceptions=True), 10)
        t = time.monotonic()
        with pytest.raises(EngineDeadError):
            await collect("later", [1, 2])
        return results, time.monotonic() - t

    try:
        (first, queued), later_s = asyncio.run(main())
        assert isinstance(first, EngineDeadError) and "device lost" in str(first)
        assert isinstance(queued, EngineDeadError)
        assert later_s < 1.0
        assert not llm.is_running
        llm._thread.join(5)  # the engine thread errs the requests first, then calls the death callbacks and ends
        assert len(deaths) == 1 and isinstance(deaths[0], EngineDeadError)
    finally:
        llm.shutdown()


def test_serve_exits_nonzero_when_the_engine_dies(path):
    """`jaxserve serve` returns exit status 1 on an engine death, so a supervisor restarts it."""
    from service.async_engine import ServingEngine
    from service.protocol import ServiceError
    from service.server import ServerConfig, serve

    llm = AsyncLLM(path, EngineConfig(**CFG))
    llm.engine.step = lambda: (_ for _ in ()).throw(RuntimeError("injected device fault"))
    serving = ServingEngine(llm, "tiny", watchdog_interval_s=0.05)

    async def main():
        server = asyncio.create_task(serve(serving, ServerConfig(grpc_port=0, http_port=0)))
        await asyncio.sleep(0.2)
        with pytest.raises(ServiceError, match="engine failure"):
            async for _ in serving.generate({"prompt_token_ids": [4, 5]}, GREEDY, "r1", protocol="test"):
                pass
        return await asyncio.wait_for(server, 20)

    try:
        assert asyncio.run(main()) == 1
    finally:
        llm.shutdown()
