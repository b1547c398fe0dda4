"""AsyncLLM: the engine behind an asyncio API, for servers and concurrent clients.

Threads and queues:
  - one *engine thread* owns the LLMEngine (which is not thread-safe; with a mesh of dp > 1, a DataParallelEngine
    whose step() runs its replicas on a small pool of its own) and runs its loop: take every pending
    command (add / abort) from `_commands`, run one `engine.step()` if anything is unfinished, hand each
    RequestOutput to its request's asyncio queue with `loop.call_soon_threadsafe`, repeat; when idle it blocks
    on `_commands`, so an idle server burns no CPU;
  - any number of *asyncio tasks* call `generate()`: each puts an "add" command, then awaits its own
    `asyncio.Queue` and yields outputs until the finished one. A request that fails validation gets its
    exception through the same queue, so one bad request never disturbs the others;
  - leaving the `async for` early (client gone, task cancelled) aborts the request in the engine thread.
Outputs are cumulative RequestOutputs (text and tokens so far), as vLLM's AsyncLLM yields by default; an aborted
request ends with a finished output whose finish_reason is "abort".
Failures (jaxserve.errors): a request the engine fails inside a step (finish_reason "error") raises
RequestFailedError in its own generate() and nowhere else. If the engine loop itself dies, every registered
request, every add still queued and every later generate() raises EngineDeadError at once: `_lock` makes "check
the engine is alive, then queue the add" and "mark it dead, then drain the queue" exclusive, so no add can slip in
between and wait forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.data_parallel import make_engine
from jaxserve.engine import PromptType
from jaxserve.errors import EngineDeadError, RequestFailedError
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int
    sink: "_Sink"


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


class _Sink:
    """Delivers items from the engine thread into one request's asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the client's event loop is closed: nobody is listening any more
            pass


class AsyncLLM:
    def __init__(self, model: str | None = None, engine_config: EngineConfig | None = None, *,
                 distributed_context=None):
        """`distributed_context`: this process leads a multi-host job (`jaxserve.distributed.initialize`'s context,
        process 0): every engine step is published to the other processes, which run `distributed.follow_engine`
        with the same model and config; `shutdown` stops them."""
        self.engine = make_engine(model, engine_config)  # a Data- or PipelineEngine when mesh.dp or pp > 1
        self._leader = None
        if distributed_context is not None:
            from jaxserve import distributed

            self._leader = distributed.lead_engine(self.engine, distributed_context)
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._error: EngineDeadError | None = None
        self._lock = threading.Lock()
        self._on_death: list = []  # callbacks(error), called from the engine thread when the loop dies
        # Profiling (JAXSERVE_STEP_TRACE=path): the engine's per-step records plus this loop's time in each
        # engine.step() call, written as JSON lines at shutdown.
        self._trace_path = os.environ.get("JAXSERVE_STEP_TRACE")
        self._loop_trace: list[dict] = []
        if self._trace_path and hasattr(self.engine, "step_trace"):
            self.engine.step_trace = []
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # ---- model and engine facts (fixed at construction; safe to read from any thread) ---------------------------
    # vLLM's AsyncLLM names: `model_config` / `tokenizer` attributes and their coroutine getters.

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    @property
    def engine_config(self) -> EngineConfig:
        return self.engine.config

    async def get_model_config(self) -> ModelConfig:
        return self.model_config

    async def get_tokenizer(self):
        return self.tokenizer

    def get_stats(self) -> dict[str, float | list[int]]:
        """LLMEngine.get_stats(): a read-only snapshot of the engine's counters, the one engine call that is safe
        outside the engine thread."""
        return self.engine.get_stats()

    @property
    def is_running(self) -> bool:
        """False once the engine thread has stopped: shut down, or died on an engine failure."""
        return self._thread.is_alive() and self._error is None

    # ---- asyncio side ---------------------------------------------------------------------------------------

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams | None, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        sink = _Sink(asyncio.get_running_loop())
        with self._lock:
            if self._error is not None:
                raise self._error
            self._commands.put(_Add(request_id, prompt, sampling_params or SamplingParams(), priority, sink))
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def add_death_callback(self, callback) -> None:
        """`callback(error)` runs in the engine thread if the engine loop dies (a server exits on it)."""
        self._on_death.append(callback)

    def shutdown(self) -> None:
        self._commands.put(_Stop())
        self._thread.join(timeout=30)
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()
        if self._leader is not None:
            self._leader.stop()  # the followers leave their step loops
        if self._trace_path:
            self._write_trace()

    def _write_trace(self) -> None:
        with open(self._trace_path, "w") as f:
            for kind, records in (("step", getattr(self.engine, "step_trace", None) or []),
                                  ("loop", self._loop_trace)):
                for r in records:
                    f.write(json.dumps({"kind": kind, **r}) + "\n")
            spec = getattr(self.engine, "spec", None)
            if spec is not None:
                c = spec.controller
                f.write(json.dumps(dict(kind="controller", cost=c.cost, cost_overlapped=c.cost_overlapped,
                                        recent_drafts=c.recent_drafts, recent_accepted=c.recent_accepted)) + "\n")
        logger.info("wrote the step trace to %s", self._trace_path)

    # ---- engine thread --------------------------------------------------------------------------------------

    def _apply(self, cmd) -> bool:
        """Run one command in the engine thread; False means stop."""
        if isinstance(cmd, _Stop):
            return False
        if isinstance(cmd, _Add):
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, priority=cmd.priority)
            except Exception as e:  # a bad request fails alone
                cmd.sink.put(e)
            else:
                self._sinks[cmd.request_id] = cmd.sink
        elif isinstance(cmd, _Abort):
            sink = self._sinks.pop(cmd.request_id, None)
            final = self.engine.abort_request(cmd.request_id)
            if sink is not None and final is not None:
                sink.put(final)  # finished, finish_reason "abort"
        return True

    def _run(self) -> None:
        try:
            while True:
                # Block only when there is nothing to compute.
                block = not self.engine.has_unfinished_requests()
                try:
                    cmd = self._commands.get(block=block)
                    if not self._apply(cmd):
                        return
                    while True:
                        if not self._apply(self._commands.get_nowait()):
                            return
                except queue.Empty:
                    pass
                if self.engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    outs = self.engine.step()
                    if self._trace_path:
                        self._loop_trace.append(dict(t=t0, step_ms=1e3 * (time.perf_counter() - t0), outputs=len(outs)))
                    for out in outs:
                        sink = self._sinks.get(out.request_id)
                        if sink is None:
                            continue
                        failed = next((c for c in out.outputs if c.finish_reason == "error"), None)
                        sink.put(out if failed is None else RequestFailedError(out.request_id, str(failed.stop_reason)))
                        if out.finished:
                            del self._sinks[out.request_id]
        except BaseException as e:  # surface engine failures to every waiting client, now and later
            logger.exception("engine loop failed")
            self._die(e if isinstance(e, EngineDeadError) else EngineDeadError(e))

    def _die(self, error: EngineDeadError) -> None:
        with self._lock:
            self._error = error
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        for cmd in pending:
            if isinstance(cmd, _Add):
                cmd.sink.put(error)
        for sink in self._sinks.values():
            sink.put(error)
        self._sinks.clear()
        for callback in self._on_death:
            try:
                callback(error)
            except Exception:  # noqa: BLE001 -- a listener must not stop the others
                logger.exception("engine death callback failed")
