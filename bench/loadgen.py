"""Serving load generator: Poisson arrivals against a streaming endpoint, per-request timings, latency statistics.

A client is any async callable `client(request) -> RequestResult` that streams one generation and timestamps each
chunk; `OpenAICompletionsClient` speaks the OpenAI `/v1/completions` SSE protocol, which jaxserve, vLLM and
llama.cpp's servers all serve, so one client measures all of them. A gRPC client plugs in the same way.

Definitions (vLLM's benchmark uses the same ones):
- TTFT: request sent -> first chunk with generated text;
- ITL: gaps between consecutive chunks with text (a chunk may carry several tokens);
- TPOT: (latency - TTFT) / (output tokens - 1), per request;
- goodput: completed requests per second that met every SLO given (TTFT and/or TPOT and/or end-to-end).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from bench.common import summarize


@dataclass(frozen=True)
class LoadRequest:
    prompt: str | list[int]  # text, or token ids where the server accepts them
    prompt_len: int  # tokens, for accounting
    output_len: int  # max_tokens (EOS ignored where the server supports it)


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0  # generated tokens (the server's usage count when it sends one, else text chunks)
    start: float = 0.0  # perf_counter when sent
    ttft: float = math.nan  # s
    latency: float = math.nan  # s, sent -> last byte
    itl: list[float] = field(default_factory=list)  # s, gaps between text chunks
    error: str | None = None
    finish_reason: str | None = None  # "length" when max_tokens was reached; "stop" = ended early (EOS not ignored)

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.ok and self.output_len > 1 else math.nan


Client = Callable[[LoadRequest], Awaitable[RequestResult]]


class OpenAICompletionsClient:
    """Streams `/v1/completions` (SSE `data: {...}` chunks, `data: [DONE]`) with aiohttp.

    `extra` goes into every request body: vLLM and jaxserve take `{"ignore_eos": true}`; llama-cpp-python's server
    has no ignore_eos, so pass a logit bias against EOS instead (`{"logit_bias": {"2": -100}}` for SmolLM2).
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, extra: dict | None = None,
                 timeout_s: float = 600.0):
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.extra = dict(extra or {})
        self.timeout_s = timeout_s
        self._session = None

    async def __aenter__(self):
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                              connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc):
        await self._session.close()

    async def __call__(self, req: LoadRequest) -> RequestResult:
        body = {"model": self.model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, **self.extra}
        res = RequestResult(ok=False, prompt_len=req.prompt_len)
        res.start = last = time.perf_counter()
        chunks = 0
        usage_tokens = None
        try:
            async with self._session.post(self.url, json=body, headers=self.headers) as resp:
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return res
                async for raw in resp.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    msg = json.loads(data)
                    if "error" in msg:
                        res.error = f"stream error: {json.dumps(msg['error'])[:200]}"
                        return res
                    if msg.get("usage"):
                        usage_tokens = msg["usage"].get("completion_tokens", usage_tokens)
                    for c in msg.get("choices") or ():
                        res.finish_reason = c.get("finish_reason") or res.finish_reason
                    if any(c.get("text") for c in msg.get("choices") or ()):
                        now = time.perf_counter()
                        if chunks == 0:
                            res.ttft = now - res.start
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
        except Exception as e:  # noqa: BLE001 - any failure is one failed request, reported with its cause
            res.error = f"{type(e).__name__}: {e}"[:300]
            return res
        res.latency = time.perf_counter() - res.start
        res.output_len = usage_tokens if usage_tokens is not None else chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no generated text in the stream"
        return res


def arrival_times(num: int, rate: float, seed: int = 0) -> list[float]:
    """Send offsets in s of `num` requests: a Poisson process of `rate` requests/s (exponential gaps);
    inf = all at 0."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 requests/s, or inf for all at once (got {rate})")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_load(client: Client, requests: list[LoadRequest], rate: float, *, seed: int = 0,
                   max_concurrency: int | None = None) -> tuple[list[RequestResult], float]:
    """Send `requests` at Poisson arrivals of `rate`/s (at most `max_concurrency` in flight); (results, wall s)."""
    offsets = arrival_times(len(requests), rate, seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(req: LoadRequest, at: float) -> RequestResult:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is None:
            return await client(req)
        async with gate:
            return await client(req)

    results = await asyncio.gather(*(one(r, at) for r, at in zip(requests, offsets)))
    return list(results), time.perf_counter() - t0


def metrics(results: list[RequestResult], wall_s: float, *, slo_ttft_ms: float | None = None,
            slo_tpot_ms: float | None = None, slo_e2e_ms: float | None = None) -> dict:
    """Throughput, latency percentiles (ms), goodput under the SLOs given, and error counts of one load run."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)

    def meets(r: RequestResult) -> bool:
        return ((slo_ttft_ms is None or r.ttft * 1e3 <= slo_ttft_ms)
                and (slo_tpot_ms is None or not r.tpot * 1e3 > slo_tpot_ms)  # nan (1 token) has no TPOT to miss
                and (slo_e2e_ms is None or r.latency * 1e3 <= slo_e2e_ms))

    good = [r for r in ok if meets(r)]
    finish: dict[str, int] = {}
    for r in ok:
        finish[str(r.finish_reason)] = finish.get(str(r.finish_reason), 0) + 1
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "unknown").split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    ms = 1e3
    return dict(
        requests=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        errors=errors,
        finish_reasons=finish,
        error_examples=sorted({r.error for r in results if not r.ok and r.error})[:3],
        wall_s=wall_s,
        request_throughput=len(ok) / wall_s if wall_s > 0 else math.nan,
        input_tok_s=in_tokens / wall_s if wall_s > 0 else math.nan,
        output_tok_s=out_tokens / wall_s if wall_s > 0 else math.nan,
        output_tokens=out_tokens,
        ttft_ms=summarize(r.ttft * ms for r in ok),
        tpot_ms=summarize(r.tpot * ms for r in ok if not math.isnan(r.tpot)),
        itl_ms=summarize(x * ms for r in ok for x in r.itl),
        e2e_ms=summarize(r.latency * ms for r in ok),
        slo=dict(ttft_ms=slo_ttft_ms, tpot_ms=slo_tpot_ms, e2e_ms=slo_e2e_ms),
        goodput=len(good) / wall_s if wall_s > 0 else math.nan,
        slo_attainment=len(good) / len(results) if results else math.nan,
    )
