"""ServingEngine: the one engine every endpoint shares, with admission control, readiness, drain and metrics.

Threads and queues of a running server (`jaxserve serve`):
  - the *engine thread* (started by jaxserve.AsyncLLM) owns the LLMEngine. It blocks on a command queue while
    idle; otherwise it applies pending add/abort commands, runs one `engine.step()`, and hands each request's
    cumulative RequestOutput to that request's asyncio.Queue with `loop.call_soon_threadsafe`;
  - the *event-loop thread* (the main thread) runs asyncio: the grpc.aio server (jaxserve.v1 Generation,
    KServe v2 GRPCInferenceService, grpc.health.v1, reflection), the aiohttp server (OpenAI HTTP, /health,
    /metrics) and the watchdog task below. Every RPC or HTTP request is a coroutine that iterates
    `ServingEngine.generate()`, which awaits its request's queue;
  - grpc.aio keeps a few internal threads of its own (polling, completion queues); none of them touch the engine.
Nothing but the engine thread calls into the LLMEngine, except `get_stats()`, a read-only snapshot of counters.

Per request, a small *pump task* moves outputs from AsyncLLM's queue into a one-slot mailbox (`_Latest`); the
client's coroutine takes the newest. Outputs are cumulative, so a slow reader skips intermediate ones instead of
piling them up: memory per request stays bounded whatever the client does.
Admission: a request is refused at once (never queued without bound) when the server is draining (Unavailable),
when `max_in_flight` admitted requests are unfinished (Overloaded), or when its id is in flight already.
Cancellation: when a client cancels, disconnects or hits its deadline, grpc.aio / aiohttp cancel the request's
coroutine; its `finally` cancels the pump task, whose closing of AsyncLLM.generate sends an abort, and the engine
thread frees the pages before its next step.
Readiness (health): the engine thread is alive, the server is not draining, and the engine has made a step within
`stall_timeout_s` whenever requests are in flight. Under data parallelism one engine thread steps every replica and
a replica that dies kills it, so ready means every replica is alive (progress: any replica's step). The watchdog
task re-evaluates this every `watchdog_interval_s` and tells listeners (the gRPC health servicer) when it changes.
Drain (SIGTERM): stop admitting, let in-flight requests finish up to a grace period, abort the rest.
Prompts: text is tokenized here, in a worker thread (never on the event loop: a 1M-character prompt takes ~1 s),
after the character limit, so that prompt + max_tokens is checked against max_model_len before admission.
Errors map by type (jaxserve.errors): InvalidRequestError from the engine -> InvalidRequest naming its `param`
(a plain ValueError / TypeError, or one without a param -> InvalidRequest naming the prompt); a request failed
inside a step -> ServiceError (500) for that request only; a dead engine -> ServiceError for the requests it held,
Unavailable for new ones (and `jaxserve serve` exits non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import AsyncIterator, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve import AsyncLLM, RequestOutput, SamplingParams
from jaxserve.errors import EngineDeadError, RequestFailedError
from service.protocol import (
    DuplicateRequest,
    InvalidRequest,
    Overloaded,
    ServiceError,
    ServingLimits,
    Unavailable,
    invalid_request,
)

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCollector:
    """Gauges read from the engine at scrape time."""

    def __init__(self, serving: "ServingEngine"):
        self.serving = serving

    def collect(self):
        s = self.serving.stats()
        # Under data parallelism (`replicas` in the stats) the engine's gauges and counters carry one sample per
        # replica, labelled replica="0", "1", ... (sum them for the whole server, as with vLLM's engine label);
        # the server's own (in flight, ready) and the speculation family stay unlabelled.
        replicas = s.get("replicas")
        for name, doc, key in (
            ("num_requests_running", "Sequences running in the engine.", "num_requests_running"),
            ("num_requests_waiting", "Sequences queued in the engine, waiting for a seat or KV pages.",
             "num_requests_waiting"),
            ("kv_cache_usage_perc", "Fraction of KV-cache pages in use (0..1).", "kv_cache_usage"),
            ("prefix_cache_hit_rate", "Fraction of looked-up prompt tokens served from the prefix cache.",
             "prefix_cache_hit_rate"),
        ):
            yield _per_replica(GaugeMetricFamily, f"jaxserve_{name}", doc, key, s, replicas)
        yield GaugeMetricFamily("jaxserve_num_requests_in_flight", "Requests admitted by the server and not finished.",
                                value=s["num_requests_in_flight"])
        yield GaugeMetricFamily("jaxserve_ready", "1 while the server is ready to serve.",
                                value=float(self.serving.ready))
        yield _per_replica(CounterMetricFamily, "jaxserve_num_preemptions", "Sequences preempted (recompute).",
                           "num_preemptions", s, replicas)
        if replicas is not None:
            yield _per_replica(CounterMetricFamily, "jaxserve_num_engine_steps", "Engine steps run.", "num_steps", s,
                               replicas)
        if "spec_decode_acceptance_rate" in s:  # present when the engine runs speculative decoding
            yield GaugeMetricFamily(
                "jaxserve_spec_decode_acceptance_rate", "Accepted / proposed draft tokens.",
                value=s["spec_decode_acceptance_rate"]
            )
            yield GaugeMetricFamily(
                "jaxserve_spec_decode_mean_acceptance_length",
                "Tokens emitted per verifying sequence-step (accepted drafts + 1).",
                value=s["spec_decode_mean_acceptance_length"],
            )
            for what in ("draft", "accepted"):
                doc = "Draft tokens verified" if what == "draft" else "Draft tokens accepted"
                yield CounterMetricFamily(
                    f"jaxserve_spec_decode_num_{what}_tokens", f"{doc}.", value=s[f"spec_decode_num_{what}_tokens"]
                )
                per_pos = CounterMetricFamily(
                    f"jaxserve_spec_decode_num_{what}_tokens_per_pos", f"{doc}, by draft position (0-based).",
                    labels=["position"],
                )
                for i, n in enumerate(s[f"spec_decode_num_{what}_tokens_per_pos"]):
                    per_pos.add_metric([str(i)], n)
                yield per_pos


def _per_replica(family, name: str, doc: str, key: str, stats: dict, replicas: list[dict] | None):
    """One unlabelled sample of `stats[key]`, or with data-parallel replicas one per replica labelled `replica`."""
    if replicas is None:
        return family(name, doc, value=stats[key])
    m = family(name, doc, labels=["replica"])
    for i, r in enumerate(replicas):
        m.add_metric([str(i)], r[key])
    return m


class _Latest:
    """A one-slot mailbox between the engine stream and a client. Outputs are cumulative, so a client that reads
    slower than tokens arrive skips straight to the newest one: memory per request stays bounded, and a slow reader
    gets fewer, larger deltas instead of a growing backlog."""

    def __init__(self):
        self._item = None
        self._ready = asyncio.Event()

    def _put(self, item) -> None:
        self._item = item
        self._ready.set()

    async def pump(self, stream) -> None:
        try:
            async with contextlib.aclosing(stream) as outs:
                async for out in outs:
                    self._put(out)
                    if out.finished:
                        return
            self._put(RuntimeError("the engine stream ended without a final output"))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 -- handed to the consumer, which raises it
            self._put(e)

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        item, self._item = self._item, None
        if isinstance(item, BaseException):
            raise item
        return item


class ServingEngine:
    def __init__(
        self,
        llm: AsyncLLM,
        model_name: str,
        limits: ServingLimits | None = None,
        *,
        stall_timeout_s: float = 30.0,
        watchdog_interval_s: float = 0.5,
    ):
        self.llm = llm
        self.model_name = model_name
        self.limits = limits or ServingLimits()
        self.stall_timeout_s = stall_timeout_s
        self.watchdog_interval_s = watchdog_interval_s
        self.draining = False
        self.started = time.time()
        self._in_flight: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._ids = itertools.count()
        self._last_steps = -1
        self._last_progress = time.monotonic()
        self._ready = False
        self._listeners: list[Callable[[bool], None]] = []
        self._watchdog: asyncio.Task | None = None

        self.registry = CollectorRegistry()
        self.m_requests = Counter("jaxserve_requests", "Requests admitted, by protocol.", ["protocol"],
                                  registry=self.registry)
        self.m_finished = Counter(
            "jaxserve_request_success", "Finished requests, by finish reason.", ["finished_reason"],
            registry=self.registry
        )
        self.m_rejected = Counter("jaxserve_requests_rejected", "Requests refused, by reason.", ["reason"],
                                  registry=self.registry)
        self.m_prompt_tokens = Counter("jaxserve_prompt_tokens", "Prompt tokens of finished requests.",
                                       registry=self.registry)
        self.m_generation_tokens = Counter("jaxserve_generation_tokens", "Generated tokens.", registry=self.registry)
        self.m_ttft = Histogram(
            "jaxserve_time_to_first_token_seconds", "Arrival to first token.", buckets=_LATENCY_BUCKETS,
            registry=self.registry
        )
        self.m_tpot = Histogram(
            "jaxserve_time_per_output_token_seconds",
            "Mean time between output tokens, per request.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.m_e2e = Histogram(
            "jaxserve_e2e_request_latency_seconds", "Arrival to finish.", buckets=_LATENCY_BUCKETS,
            registry=self.registry
        )
        self.registry.register(_EngineCollector(self))

    # ---- model facts ----------------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.llm.model_config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.llm.engine_config.max_model_len

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.time_ns() & 0xFFFFFFFF:08x}"

    def build_params(self, fields: dict, *, coerce_strings: bool = False) -> SamplingParams:
        from service.protocol import build_sampling_params

        params = build_sampling_params(fields, self.limits, vocab_size=self.vocab_size, coerce_strings=coerce_strings)
        if params.max_tokens is not None and params.max_tokens >= self.max_model_len:
            raise InvalidRequest(
                f"max_tokens must be < max_model_len={self.max_model_len} (got {params.max_tokens}); "
                "prompt + output must fit in the context",
                "max_tokens",
            )
        return params

    def check_capacity(self, n: int) -> None:
        """Refuse now (Overloaded) a request that needs `n` in-flight slots when fewer are free, instead of admitting
        part of it."""
        if len(self._in_flight) + n > self.limits.max_in_flight:
            self.m_rejected.labels("overloaded").inc()
            raise Overloaded(
                f"the server is at capacity ({len(self._in_flight)} of {self.limits.max_in_flight} requests in flight, "
                f"{n} needed); retry later"
            )

    async def _tokenized(self, prompt, params: SamplingParams):
        """The engine's prompt form with token ids (text tokenized off the loop), checked against the context."""
        if isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt):
            text = prompt if isinstance(prompt, str) else prompt.get("prompt")
            if isinstance(text, str) and self.tokenizer is not None:
                if len(text) > self.limits.max_prompt_chars:
                    raise InvalidRequest(
                        f"prompt has {len(text)} characters; the limit is {self.limits.max_prompt_chars}", "prompt"
                    )
                prompt = {"prompt": text, "prompt_token_ids": await asyncio.to_thread(self.tokenizer.encode, text)}
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if isinstance(ids, list):
            n, limit = len(ids), self.max_model_len
            if n >= limit:
                raise InvalidRequest(
                    f"prompt has {n} tokens but max_model_len is {limit}: it must be shorter to leave room for output",
                    "prompt",
                )
            if params.max_tokens is not None and n + params.max_tokens > limit:
                raise InvalidRequest(
                    f"this model's maximum context length is {limit} tokens; "
                    f"the request asks for {n + params.max_tokens} "
                    f"({n} in the prompt, max_tokens={params.max_tokens}): lower max_tokens or shorten the prompt",
                    "max_tokens",
                )
        return prompt

    def stats(self) -> dict:
        s = dict(self.llm.get_stats())
        s["num_requests_in_flight"] = len(self._in_flight)
        return s

    # ---- readiness ------------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready

    def add_readiness_listener(self, callback: Callable[[bool], None]) -> None:
        self._listeners.append(callback)
        callback(self._ready)

    def evaluate_readiness(self) -> bool:
        """Recompute readiness now (see the module docstring) and notify listeners if it changed."""
        now = time.monotonic()
        steps = self.llm.get_stats()["num_steps"]
        if steps != self._last_steps or not self._in_flight:
            self._last_steps, self._last_progress = steps, now
        stalled = now - self._last_progress > self.stall_timeout_s
        if stalled and self._ready:
            logger.error("engine made no step for %.1f s with %d requests in flight", now - self._last_progress,
                         len(self._in_flight))
        ready = self.llm.is_running and not self.draining and not stalled
        if ready != self._ready:
            self._ready = ready
            for cb in self._listeners:
                cb(ready)
        return ready

    async def start(self) -> None:
        if self._watchdog is not None:  # a second server on the same engine
            return
        self.evaluate_readiness()
        self._watchdog = asyncio.create_task(self._watch(), name="jaxserve-watchdog")

    async def _watch(self) -> None:
        while True:
            self.evaluate_readiness()
            await asyncio.sleep(self.watchdog_interval_s)

    # ---- requests -------------------------------------------------------------------------------------------

    def _admit(self, request_id: str) -> None:
        if self.draining:
            self.m_rejected.labels("draining").inc()
            raise Unavailable("the server is shutting down and admits no new requests")
        if not self.llm.is_running:
            self.m_rejected.labels("engine_dead").inc()
            raise Unavailable("the engine is not running")
        if len(self._in_flight) >= self.limits.max_in_flight:
            self.m_rejected.labels("overloaded").inc()
            raise Overloaded(
                f"the server is at capacity ({self.limits.max_in_flight} requests in flight); retry later"
            )
        if request_id in self._in_flight:
            self.m_rejected.labels("duplicate").inc()
            raise DuplicateRequest(f"request_id {request_id!r} is already in flight", "request_id")

    async def generate(
        self, prompt, params: SamplingParams, request_id: str, *, protocol: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Admit and run one request; yields cumulative RequestOutputs until the finished one.

        Raises a ServiceError subclass (before the first output) when the request is refused or invalid.
        Closing the iterator early (cancel, disconnect, deadline) aborts the request in the engine.
        """
        if len(request_id) > self.limits.max_request_id_len:
            raise InvalidRequest(f"request_id is longer than {self.limits.max_request_id_len} characters", "request_id")
        self._admit(request_id)
        self._in_flight.add(request_id)
        self._idle.clear()
        self.m_requests.labels(protocol).inc()
        last: RequestOutput | None = None
        latest = _Latest()
        pump = None
        try:
            try:
                prompt = await self._tokenized(prompt, params)
            except InvalidRequest:
                self.m_rejected.labels("invalid").inc()
                raise
            pump = asyncio.create_task(latest.pump(self.llm.generate(prompt, params, request_id, priority=priority)))
            while last is None or not last.finished:
                last = await latest.get()
                yield last
        except (ValueError, TypeError) as e:  # refused by the engine's admission checks (prompt length, ids, ...)
            if last is not None:
                raise
            self.m_rejected.labels("invalid").inc()
            raise invalid_request(e, "prompt") from None
        except RequestFailedError as e:
            raise ServiceError(f"the request failed in the engine: {e.reason}") from None
        except EngineDeadError as e:
            raise ServiceError(f"engine failure: {e}") from None
        finally:
            # Release the slot first: a second cancellation can interrupt the await below.
            self._in_flight.discard(request_id)
            if not self._in_flight:
                self._idle.set()
            self._record(last)
            if pump is not None:
                pump.cancel()  # if still running: cancelling it closes the engine stream, which sends the abort
                await asyncio.gather(pump, return_exceptions=True)

    def _record(self, out: RequestOutput | None) -> None:
        if out is None:
            return
        reasons = [c.finish_reason or "abort" for c in out.outputs] if out.finished else ["abort"] * len(out.outputs)
        for r in reasons:
            self.m_finished.labels(r).inc()
        m = out.metrics
        if m is None:
            return
        self.m_prompt_tokens.inc(m.num_prompt_tokens)
        self.m_generation_tokens.inc(m.num_generated_tokens)
        if m.first_token_time is not None:
            self.m_ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            end = m.finished_time or time.time()
            self.m_e2e.observe(max(0.0, end - m.arrival_time))
            per_seq = m.num_generated_tokens / max(1, len(out.outputs))
            if per_seq > 1:
                self.m_tpot.observe(max(0.0, end - m.first_token_time) / (per_seq - 1))

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._in_flight:
            return False
        await self.llm.abort(request_id)
        return True

    # ---- shutdown -------------------------------------------------------------------------------------------

    async def drain(self, grace_s: float) -> bool:
        """Stop admitting; wait up to `grace_s` for in-flight requests; abort the rest. True if none was cut."""
        self.draining = True
        self.evaluate_readiness()
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
            return True
        except asyncio.TimeoutError:
            logger.warning("drain: %d requests still running after %.1f s; aborting them", len(self._in_flight),
                           grace_s)
            for rid in list(self._in_flight):
                await self.llm.abort(rid)
            try:
                await asyncio.wait_for(self._idle.wait(), 5.0)
            except asyncio.TimeoutError:
                pass
            return False

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            try:
                await self._watchdog
            except asyncio.CancelledError:
                pass
        await asyncio.to_thread(self.llm.shutdown)
