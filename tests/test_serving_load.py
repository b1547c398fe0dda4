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
