"""The serving benchmark's load generator against a real jaxserve server (tiny model, 127.0.0.1): every request
streams to its max_tokens, and what `bench.loadgen.metrics` reports is what the raw per-request records say.

Small and bounded: 10 requests of at most 12 tokens, all at once and then as a fast Poisson stream."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

pytest.importorskip("aiohttp")

from bench.loadgen import LoadRequest, OpenAICompletionsClient, metrics, run_load  # noqa: E402
from service.protocol import ServingLimits  # noqa: E402
from service_fixtures import MODEL_NAME, make_tiny_model_with_tokenizer, start_server, wait_engine_idle  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model_with_tokenizer(str(tmp_path_factory.mktemp("tiny_load")))
    srv = start_server(path, limits=ServingLimits(max_in_flight=16))  # all 10 at once are admitted
    yield srv
    srv.stop()


def _requests() -> list[LoadRequest]:
    words = "the quick brown fox jumps over the lazy dog again and again".split()
    return [LoadRequest(" ".join(words[: 2 + i]), 0, 4 + i % 9) for i in range(10)]


def _load(server, rate: float):
    async def go():
        async with OpenAICompletionsClient(f"http://127.0.0.1:{server.http_port}", MODEL_NAME,
                                           extra={"ignore_eos": True, "temperature": 0}) as client:
            return await run_load(client, _requests(), rate, seed=3)

    return asyncio.run(go())


@pytest.mark.parametrize("rate", [math.inf, 40.0])
def test_reported_percentiles_match_the_raw_records(server, rate):
    results, wall = _load(server, rate)
    reqs = _requests()
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    # the server's usage count: every request ran to its max_tokens (EOS ignored)
    assert [r.output_len for r in results] == [q.output_len for q in reqs]
    assert all(r.finish_reason == "length" for r in results)
    for r in results:
        assert 0 < r.ttft <= r.latency <= wall
        # one gap per text chunk after the first (a chunk may carry several tokens); they tile first -> last chunk
        assert len(r.itl) <= r.output_len - 1 and all(g >= 0 for g in r.itl)
        assert sum(r.itl) <= r.latency - r.ttft + 1e-6

    m = metrics(results, wall, slo_ttft_ms=1e9, slo_tpot_ms=1e9)
    raw = {
        "ttft_ms": [1e3 * r.ttft for r in results],
        "e2e_ms": [1e3 * r.latency for r in results],
        "tpot_ms": [1e3 * (r.latency - r.ttft) / (r.output_len - 1) for r in results],
        "itl_ms": [1e3 * g for r in results for g in r.itl],
    }
    for key, xs in raw.items():
        assert m[key]["n"] == len(xs)
        for q in (50, 90, 99):
            assert m[key][f"p{q}"] == pytest.approx(np.percentile(xs, q), rel=1e-9), (key, q)
        assert m[key]["mean"] == pytest.approx(np.mean(xs)) and m[key]["max"] == pytest.approx(max(xs))
    assert m["completed"] == 10 and m["failed"] == 0 and m["slo_attainment"] == 1.0
    assert m["output_tokens"] == sum(q.output_len for q in reqs)
    assert m["output_tok_s"] == pytest.approx(m["output_tokens"] / wall)
    assert m["goodput"] == pytest.approx(10 / wall)
    if not math.isinf(rate):  # Poisson arrivals: the run lasts at least until the last request was sent
        assert wall >= max(r.start for r in results) - min(r.start for r in results)
    wait_engine_idle(server)


def test_a_running_stream_gets_a_token_every_step_while_a_long_prompt_is_prefilled(tmp_path):
    """Chunked prefill keeps decodes going: while a 400-token prompt is prefilled in budget-sized chunks, the
    stream already running gets one token in every step (its inter-token gap is one step, never a whole prefill),
    and each step stays within the token budget."""
    from jaxserve import SamplingParams
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    from tiny_models import make_tiny_model

    make_tiny_model("llama_gqa", str(tmp_path))
    budget = 32
    eng = LLMEngine(str(tmp_path), EngineConfig(max_num_seqs=4, max_num_batched_tokens=budget, page_size=16,
                                                max_model_len=512, precompile=False))
    assert eng.async_scheduling
    eng.add_request("stream", {"prompt_token_ids": list(range(3, 13))},
                    SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    tokens = {"stream": 0, "long": 0}

    def step():
        for out in eng.step():
            tokens[out.request_id] = len(out.outputs[0].token_ids)

    while tokens["stream"] < 3:
        step()
    eng.step_trace = []
    eng.add_request("long", {"prompt_token_ids": [3 + i % 250 for i in range(400)]},
                    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    gaps = []
    while tokens["long"] == 0:
        before = tokens["stream"]
        step()
        gaps.append(tokens["stream"] - before)
    prefill_steps = [r for r in eng.step_trace if r["prefill"] > 0]
    assert len(prefill_steps) == math.ceil(400 / (budget - 1))  # the prompt in chunks beside the one decode
    assert all(r["decodes"] == 1 and r["tokens"] <= budget for r in prefill_steps)
    assert gaps and all(g == 1 for g in gaps), gaps  # a token for the stream from every step


def test_step_trace_env_writes_one_record_per_step(tmp_path, monkeypatch):
    """JAXSERVE_STEP_TRACE=path: AsyncLLM writes the engine's per-step records and its loop's step() timings as JSON
    lines at shutdown; the records add up to the tokens the requests computed."""
    import json

    from jaxserve import AsyncLLM, SamplingParams
    from jaxserve.config import EngineConfig
    from tiny_models import make_tiny_model

    make_tiny_model("llama_gqa", str(tmp_path / "m"))
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("JAXSERVE_STEP_TRACE", str(trace))
    llm = AsyncLLM(str(tmp_path / "m"), EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, page_size=16,
                                                     max_model_len=256, precompile=False))

    async def go():
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        async for _ in llm.generate({"prompt_token_ids": list(range(3, 43))}, params, "a"):
            pass

    asyncio.run(go())
    llm.shutdown()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert steps and any(r["kind"] == "loop" for r in records)
    assert sum(r["prefill"] for r in steps) == 40 and sum(r["decodes"] for r in steps) == 4
    assert all(r["run_ms"] > 0 and r["tokens"] <= r["bucket"] <= 32 for r in steps)
