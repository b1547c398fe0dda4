"""The serving load generator against a mock OpenAI streaming server (127.0.0.1), and its statistics.

The mock streams `max_tokens` one-token chunks; prompts "fail" (HTTP 500), "midfail" (an error event after one
chunk) and "nousage" (no usage chunk) exercise the failure and counting paths. It records every request's body and
the most requests it had in flight at once, so concurrency limits and request fields can be checked exactly.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from bench import serve  # noqa: E402
from bench.loadgen import (  # noqa: E402
    LoadRequest,
    OpenAICompletionsClient,
    RequestResult,
    arrival_times,
    metrics,
    run_load,
)


class MockServer:
    def __init__(self, chunk_delay_s: float = 0.002, busy_ms_per_request: float = 0.0):
        """`busy_ms_per_request`: CPU time each request spins for (the process CPU clock ticks in 10 ms steps, so a
        test that reads it needs the mock to use some)."""
        self.delay = chunk_delay_s
        self.busy_s = busy_ms_per_request / 1e3
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body["prompt"] == "fail":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        t0 = time.process_time()
        while time.process_time() - t0 < self.busy_s:
            pass
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            n = body["max_tokens"]
            for i in range(n):
                await asyncio.sleep(self.delay)
                done = "length" if i == n - 1 else None
                chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": done}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if body["prompt"] == "midfail":
                    await resp.write(b'data: {"error": {"message": "engine died"}}\n\n')
                    return resp
            if body["prompt"] != "nousage" and body.get("stream_options", {}).get("include_usage"):
                usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}}
                await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1


def run_against_mock(coro_fn, mock: MockServer | None = None):
    """Start the mock on a free port, run `coro_fn(url)`, stop the mock; returns (result, mock)."""
    mock = mock or MockServer()

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", mock.completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await coro_fn(f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()

    return asyncio.run(main()), mock


def reqs(n: int, out_len: int = 5, prompt: str = "hello") -> list[LoadRequest]:
    return [LoadRequest(prompt, 3, out_len) for _ in range(n)]


def test_all_at_once_streams_every_token_and_runs_concurrently():
    async def go(url):
        async with OpenAICompletionsClient(url, "m", extra={"ignore_eos": True}) as c:
            return await run_load(c, reqs(6, out_len=5), math.inf)

    (results, wall), mock = run_against_mock(go)
    assert len(results) == 6 and all(r.ok for r in results), [r.error for r in results]
    assert [r.output_len for r in results] == [5] * 6
    assert all(len(r.itl) == 4 for r in results)  # 5 text chunks -> 4 gaps
    assert all(0 < r.ttft <= r.latency for r in results)
    assert mock.max_in_flight == 6  # rate inf sends everything at once
    body = mock.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 5
    assert body["model"] == "m" and body["temperature"] == 0.0
    m = metrics(results, wall)
    assert (m["completed"], m["failed"], m["output_tokens"]) == (6, 0, 30)
    assert m["finish_reasons"] == {"length": 6}
    assert m["itl_ms"]["n"] == 24 and m["ttft_ms"]["n"] == 6 and m["tpot_ms"]["n"] == 6


def test_max_concurrency_bounds_requests_in_flight():
    async def go(url):
        async with OpenAICompletionsClient(url, "m") as c:
            return await run_load(c, reqs(6, out_len=3), math.inf, max_concurrency=2)

    (results, _), mock = run_against_mock(go)
    assert all(r.ok for r in results)
    assert mock.max_in_flight == 2


def test_poisson_rate_completes_every_request():
    async def go(url):
        async with OpenAICompletionsClient(url, "m") as c:
            return await run_load(c, reqs(5, out_len=2), 200.0, seed=3)

    (results, _), mock = run_against_mock(go)
    assert len(mock.bodies) == 5 and all(r.ok for r in results)


def test_failures_are_counted_by_kind_and_excluded_from_latency():
    mixed = reqs(2) + [LoadRequest("fail", 1, 4), LoadRequest("midfail", 1, 4)]

    async def go(url):
        async with OpenAICompletionsClient(url, "m") as c:
            return await run_load(c, mixed, math.inf)

    (results, wall), _ = run_against_mock(go)
    assert [r.ok for r in results] == [True, True, False, False]
    assert results[2].error.startswith("HTTP 500") and "boom" in results[2].error
    assert results[3].error.startswith("stream error") and "engine died" in results[3].error
    m = metrics(results, wall)
    assert m["failed"] == 2 and m["errors"] == {"HTTP 500": 1, "stream error": 1}
    assert m["ttft_ms"]["n"] == 2 and m["output_tokens"] == 10


def test_connection_refused_is_a_failed_request_not_a_crash():
    async def go():
        async with OpenAICompletionsClient("http://127.0.0.1:9", "m", timeout_s=5) as c:
            return await run_load(c, reqs(2), math.inf)

    results, wall = asyncio.run(go())
    assert not any(r.ok for r in results)
    assert metrics(results, wall)["failed"] == 2


def test_token_count_falls_back_to_text_chunks_without_usage():
    async def go(url):
        async with OpenAICompletionsClient(url, "m") as c:
            return await run_load(c, reqs(1, out_len=4, prompt="nousage"), math.inf)

    (results, _), _ = run_against_mock(go)
    assert results[0].ok and results[0].output_len == 4


def test_arrival_times():
    assert arrival_times(4, math.inf) == [0.0] * 4
    a = arrival_times(4000, 10.0, seed=1)
    assert a == arrival_times(4000, 10.0, seed=1) and a != arrival_times(4000, 10.0, seed=2)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    mean = sum(gaps) / len(gaps)
    assert abs(mean - 0.1) < 0.01  # exponential gaps, mean 1/rate (sd of the mean ~0.0016)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert 0.9 < cv < 1.1  # exponential: sd == mean (a fixed-gap generator would give 0)
    with pytest.raises(ValueError, match="rate"):
        arrival_times(3, 0.0)


def test_goodput_and_slo_attainment_by_hand():
    def res(ttft, latency, n):
        return RequestResult(ok=True, prompt_len=10, output_len=n, ttft=ttft, latency=latency, itl=[0.01] * (n - 1))

    results = [
        res(0.1, 1.1, 11),  # TPOT 100 ms: meets both
        res(0.5, 1.5, 11),  # TTFT 500 ms: misses TTFT
        res(0.1, 3.1, 11),  # TPOT 300 ms: misses TPOT
        res(0.1, 0.1, 1),  # one token: no TPOT, meets
        RequestResult(ok=False, prompt_len=10, error="HTTP 429: busy"),
    ]
    m = metrics(results, 2.0, slo_ttft_ms=200, slo_tpot_ms=150)
    assert m["completed"] == 4 and m["failed"] == 1 and m["errors"] == {"HTTP 429": 1}
    assert m["goodput"] == pytest.approx(2 / 2.0)
    assert m["slo_attainment"] == pytest.approx(2 / 5)
    assert m["tpot_ms"]["n"] == 3 and m["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert m["output_tok_s"] == pytest.approx(34 / 2.0)
    assert metrics(results, 2.0)["goodput"] == pytest.approx(4 / 2.0)  # no SLO: every completed request counts


def test_serve_measure_interleaves_engines_and_reports(tmp_path):
    """serve.measure over two 'engines' (the same mock twice), then medians, the markdown and the PNG."""

    class Args:
        rates = [math.inf, 100.0]
        rounds = 2
        reuse_prompts = False
        seed = 0
        max_concurrency = None
        slo_ttft_ms = 10_000.0
        slo_tpot_ms = 10_000.0

    async def go(url):
        targets = {"jaxserve": dict(url=url, model="m", extra={}, pid=os.getpid()),  # the mock runs in here
                   "peer": dict(url=url, model="m", extra={})}
        requests = [r for i in range(2 + 4 * 3) for r in reqs(1, out_len=3, prompt=f"p{i}")]
        return await serve.measure(targets, requests, Args)

    # each request spins 20 ms of CPU: the process CPU clock counts in 10 ms ticks, and 3 requests' few ms of
    # streaming read 0 in every run now and then
    raw, mock = run_against_mock(go, MockServer(busy_ms_per_request=20))
    assert set(raw) == {"jaxserve", "peer"} and set(raw["peer"]) == {"inf", "100.0"}
    assert all(len(rounds) == 2 for by_rate in raw.values() for rounds in by_rate.values())
    prompts = [b["prompt"] for b in mock.bodies]
    assert len(prompts) == 2 * 2 + 2 * 2 * 2 * 3  # warm-up 2 per engine, then rounds x rates x engines x 3
    # each run (round, rate) sends 3 prompts of its own, the same to both engines
    runs = [prompts[4 + 6 * i : 4 + 6 * (i + 1)] for i in range(4)]
    assert all(sorted(r[:3]) == sorted(r[3:]) for r in runs)
    assert sorted(p for r in runs for p in r[:3]) == sorted(f"p{i}" for i in range(2, 14))
    summary = {n: {r: serve.medians(ms) for r, ms in by_rate.items()} for n, by_rate in raw.items()}
    assert summary["jaxserve"]["inf"]["failed"] == 0 and summary["jaxserve"]["inf"]["slo_attainment"] == 1.0
    cpu = [m["server_cpu_ms_per_token"] for by_rate in raw["jaxserve"].values() for m in by_rate]
    assert all(0 <= c < 1e4 for c in cpu) and sum(cpu) > 0  # the mock served them from this process
    assert math.isnan(summary["peer"]["inf"]["server_cpu_ms_per_token"])  # no process to measure
    record = dict(args=dict(dataset="random", num_prompts=3, max_output_len=3, max_num_seqs=4, slo_ttft_ms=1e4,
                            slo_tpot_ms=1e4, rounds=2), summary=summary, notes={"peer": "a mock"},
                  command="python -m bench serve", machine=_machine())
    md = serve.report(record)
    assert "| jaxserve | inf |" in md and "| peer | 100.0 |" in md and "vs peer at inf req/s" in md
    from bench import plots

    png = plots.latency_vs_rate(summary, str(tmp_path / "serve.png"))
    assert png and open(png[0], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_server_cpu_seconds_counts_child_processes():
    """cpu_seconds sums a server's process tree: a busy child's CPU time shows in its parent's total."""
    import subprocess
    import sys

    from bench.servers import cpu_seconds

    before = cpu_seconds(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.5: pass\ninput()"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while cpu_seconds(child.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cpu_seconds(child.pid) >= 0.5
        assert cpu_seconds(os.getpid()) - before >= 0.5
    finally:
        child.communicate(b"\n", timeout=30)
    assert cpu_seconds(child.pid) is None  # gone


def _machine():
    from bench.common import machine_info

    return machine_info()


def test_grpc_client_against_a_mock_generation_service():
    """The jaxserve.v1 gRPC client counts streamed token ids exactly and reports RPC errors by status."""
    grpc = pytest.importorskip("grpc")
    from bench.grpc_client import JaxserveGrpcClient
    from service.proto import jaxserve_v1_pb2 as pb
    from service.proto import jaxserve_v1_pb2_grpc as pbg

    seen = []

    class Generation(pbg.GenerationServicer):
        async def Generate(self, request, context):
            seen.append(request)
            if request.text == "fail":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens too large")
            n = request.sampling_params.max_tokens
            for i in range(0, n, 2):  # two tokens per response, as a step with a speculative hit would send
                ids = list(range(i, min(i + 2, n)))
                yield pb.GenerateResponse(outputs=[pb.CompletionDelta(text="x" * len(ids), token_ids=ids)])
            yield pb.GenerateResponse(finished=True, usage=pb.Usage(completion_tokens=n))

    async def go():
        server = grpc.aio.server()
        pbg.add_GenerationServicer_to_server(Generation(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with JaxserveGrpcClient(f"127.0.0.1:{port}") as c:
                mixed = [LoadRequest("hi", 2, 5), LoadRequest([1, 2, 3], 3, 4), LoadRequest("fail", 1, 4)]
                return await run_load(c, mixed, math.inf)
        finally:
            await server.stop(None)

    results, wall = asyncio.run(go())
    assert [r.ok for r in results] == [True, True, False]
    assert [r.output_len for r in results[:2]] == [5, 4] and [len(r.itl) for r in results[:2]] == [2, 1]
    assert results[2].error == "gRPC INVALID_ARGUMENT: max_tokens too large"
    by_prompt = {r.WhichOneof("prompt"): r for r in seen}
    assert list(by_prompt["token_ids"].token_ids.ids) == [1, 2, 3]
    assert by_prompt["text"].sampling_params.ignore_eos and by_prompt["text"].sampling_params.temperature == 0.0
    assert metrics(results, wall)["errors"] == {"gRPC INVALID_ARGUMENT": 1}


def test_settle_waits_for_other_servers_to_go_idle():
    """serve.settle returns once the other servers use no CPU: not while one still works, right away when idle."""
    import subprocess
    import sys

    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 2.5: pass\n"
                             "time.sleep(60)"])
    try:
        t0 = time.monotonic()
        asyncio.run(serve.settle({"busy": busy.pid, "gone": None}, timeout_s=30))
        assert time.monotonic() - t0 >= 1.5  # it waited for the busy loop to end
        t0 = time.monotonic()
        asyncio.run(serve.settle({"busy": busy.pid}, timeout_s=30))
        assert time.monotonic() - t0 < 5  # idle now: one one-second look
    finally:
        busy.kill()
        busy.wait()


def test_split_requests_gives_each_run_its_own_prompts_unless_reused():
    class Args:
        rates = [1.0, math.inf]
        rounds = 2
        reuse_prompts = False

    requests = list(range(2 + 4 * 3))
    warmup, runs = serve.split_requests(requests, Args)
    assert warmup == [0, 1] and runs == [[2, 3, 4], [5, 6, 7], [8, 9, 10], [11, 12, 13]]
    Args.reuse_prompts = True
    assert serve.num_runs(Args) == 1
    warmup, runs = serve.split_requests(list(range(2 + 3)), Args)
    assert warmup == [0, 1] and runs == [[2, 3, 4]] * 4
