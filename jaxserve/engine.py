"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

step() = propose drafts (speculation) -> schedule (`scheduler.py`) -> build the padded StepBatch
(`step_builder.py`) -> run it (`runner.py`: one transfer, one executable, one fetch) -> process the outputs
(`output_processor.py`: append tokens, detokenize, stop checks, RequestOutputs; the scheduler advances the KV
bookkeeping). Loading and config resolution are `factory.py`; admission checks `input_processor.py`.

A request whose processing fails (its logits are NaN/inf, building its row or appending its token raises) ends
alone with finish_reason "error" and its pages are dropped from the prefix cache; the others go on. If the device
step itself raises and the KV cache survived, the step's sequences are retried one at a time, so only the culprit
fails; `MAX_FAILED_STEPS` steps in a row where nothing could run, or a lost KV cache, raise EngineDeadError.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.block_manager import BlockManager
from jaxserve.config import EngineConfig
from jaxserve.errors import EngineDeadError, InvalidRequestError
from jaxserve.factory import EngineParts, build_engine_parts
from jaxserve.input_processor import InputProcessor, PromptType
from jaxserve.output_processor import OutputProcessor, Request
from jaxserve.outputs import RequestOutput
from jaxserve.pipeline import split_microbatches
from jaxserve.sampler import SamplerOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import ScheduledWork, Scheduler
from jaxserve.sequence import Sequence, SequenceStatus
from jaxserve.spec_decode.speculator import Speculator
from jaxserve.step_builder import RowBuildError, StepBuilder

__all__ = ["LLMEngine", "MAX_FAILED_STEPS", "PromptType"]

logger = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # device steps in a row that raise for every sequence before the engine is declared dead


def _concat_rows(parts: list[tuple[SamplerOutput, int]]) -> SamplerOutput:
    """Micro-batches' sampler outputs (each padded to its bucket) as one, the first `n` rows of each in order."""
    return jax.tree.map(lambda *a: np.concatenate([x[:n] for x, (_, n) in zip(a, parts)]), *(o for o, _ in parts))


class _RunFailed(Exception):
    """The device step raised, with the KV cache intact (so the step can be retried in parts)."""

    def __init__(self, cause: BaseException):
        super().__init__(repr(cause))
        self.cause = cause


@dataclass
class _Launched:
    """A step built and dispatched: its (possibly reduced) work, micro-batches and device outputs or error."""

    work: list[ScheduledWork]
    groups: list[list[ScheduledWork]]
    steps: list[tuple]  # (Bucket, StepBatch) per micro-batch
    t0: float  # when it was dispatched
    t_begin: float  # when its step began (before proposing and scheduling)
    compiles_at_begin: int  # executables compiled (`_num_compiles`) when its step began: a step whose period saw
    # a compile is not timed
    device_outputs: list | None = None
    error: BaseException | None = None
    hidden: object = None  # the step's target features on device (EAGLE-3: `ModelRunner.last_hidden`)
    # Async scheduling: the sequences were advanced when the step was dispatched (`_advance_launched`), so the next
    # step could be scheduled before this one lands. Per work item: its start and whether it samples a token.
    advanced: bool = False
    starts: list[int] | None = None
    completes: list[bool] | None = None
    # Speculation (traced, `_trace_step`): the controller's K for this step, and the hint that made the engine wait
    # for the step before instead of building this one behind it (`Speculator.skip_proposal`; None: no such hint).
    spec_k: int | None = None
    spec_hint: int | None = None


@dataclass
class _Pending:
    """What `begin_step` hands to `finish_step`."""

    work: list[ScheduledWork]  # as scheduled (the retry path walks it)
    failed: list[RequestOutput]  # requests already failed while building
    launched: _Launched | None


class LLMEngine:
    def __init__(self, model: str | None = None, engine_config: EngineConfig | None = None, *,
                 parts: EngineParts | None = None, block_manager: BlockManager | None = None):
        """`parts` (instead of loading `model`) and `block_manager`: an engine sharing another's runner and KV pages,
        one of a `PipelineEngine`'s virtual engines."""
        parts = parts if parts is not None else build_engine_parts(model, engine_config)
        self.model_config, self.tokenizer, self.config = parts.model_config, parts.tokenizer, parts.config
        self.runner = parts.runner
        # a step's split over pipeline stages (1: none); an EAGLE-3 head needs the step's features whole
        self.num_microbatches = 1 if self.runner.hidden_layer_ids else self.runner.num_microbatches
        cfg = self.config
        self.spec = None if parts.proposer is None else Speculator(cfg, parts.proposer)
        self.block_manager = block_manager or BlockManager(cfg.num_pages, cfg.page_size, cfg.enable_prefix_caching)
        reuse = None if self.spec is None else self.spec.proposer.reusable_prefix
        self.scheduler = Scheduler(cfg, self.block_manager, prefix_reuse=reuse)
        self.output = OutputProcessor(self.tokenizer, parts.eos_token_ids, cfg.max_model_len)
        self.inputs = InputProcessor(cfg, self.model_config.vocab_size, self.tokenizer, self.output.stop_ids)
        drafts_fed = getattr(self.runner, "drafts", None) is not None  # an EAGLE-3 head's drafts stay on the device
        self.builder = StepBuilder(cfg, self.output.stop_ids, draft_feed=drafts_fed)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.num_steps = 0
        self.num_failed_requests = 0
        self._failed_runs = 0  # consecutive steps whose device run raised for every request (see step)
        self.async_scheduling = bool(cfg.async_scheduling)
        self._in_flight: _Pending | None = None  # async scheduling: the step dispatched and not landed yet
        self._last_landed = 0.0  # perf_counter when the last step landed
        # a drafting-ahead proposer's run after the last step landed while the next was in flight behind it: it fell
        # in that next step's period (`_land`)
        self._proposer_seconds_behind = 0.0
        self.num_overlapped_steps = 0  # steps the next one was scheduled behind (async scheduling)
        # Profiling: when a list, one record per landed step (`_trace_step`); AsyncLLM fills it with
        # JAXSERVE_STEP_TRACE=path and writes it as JSON lines.
        self.step_trace: list[dict] | None = None
        # What loading left on the heap (tokenizer tables, weight pytrees, executables: ~10^5 objects per engine)
        # lives as long as the engine: moved out of the cyclic collector's generations, so the full collections that
        # steps' short-lived objects trigger do not walk it again. Measured with six engines in one process (bench
        # latency): batch-1 Q4_1 decode 83 -> 94 tok/s.
        gc.collect()
        gc.freeze()

    @property
    def proposer(self):
        return None if self.spec is None else self.spec.proposer

    # ---- requests -------------------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, priority: int = 0
    ) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", "request_id", "duplicate")
        p = self.inputs.process(prompt, params, priority)
        now = time.time()
        seqs = [
            Sequence(next(self._seq_ids), request_id, i, list(p.token_ids), params, p.max_tokens, now,
                     priority=priority)
            for i in range(params.n)
        ]
        self.requests[request_id] = self.output.new_request(request_id, p.text, p.token_ids, params, seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its pages; returns its final output (finish_reason "abort")."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        now = time.time()
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish("abort", now)
                self.scheduler.finish(seq)
        return self.output.request_output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's name), e.g. so that a benchmark's repeated prompts are computed again;
        False, and nothing forgotten, while requests hold pages."""
        return self.block_manager.reset_prefix_cache()

    def get_stats(self) -> dict[str, float | list[int]]:
        """A read-only snapshot for monitoring (/metrics); cheap, and safe to call from another thread."""
        bm = self.block_manager
        stats = {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": bm.num_used_pages / max(1, bm.num_pages - 1),
            "prefix_cache_hit_rate": bm.prefix_hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_overlapped_steps": self.num_overlapped_steps,
        }
        return stats if self.spec is None else stats | self.spec.stats()

    # ---- the step -------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the RequestOutputs of every request it touched (see the module docstring).
        With async scheduling, a step dispatches the next step before it lands the one dispatched by the call
        before, and returns that one's outputs."""
        if self.async_scheduling:
            return self._step_async()
        pending = self.begin_step()
        return [] if pending is None else self.finish_step(pending)

    def begin_step(self, overlap: bool = False, propose: bool = True) -> _Pending | None:
        """The first half of `step`: propose, schedule, build and dispatch the step to the devices without waiting
        for it (None: nothing to run). Until `finish_step`, the scheduler must not run again: the sequences and
        pages of the step in flight are not settled -- unless the step was `advanced` (async scheduling, `overlap`
        and every sequence allows it: `_can_advance`). `propose=False`: the step has no drafts."""
        t_begin, compiles = time.perf_counter(), self._num_compiles()
        hint = None
        if self.spec is not None:
            if propose:
                self.spec.propose(self.scheduler.running, self.scheduler.waiting)
            hint, self.spec.last_hint = self.spec.last_hint, None  # this step's, if the engine waited for the last
        work = self.scheduler.schedule()
        if not work:
            return None
        if self.spec is not None:
            self.spec.after_schedule(work)
        failed: list[RequestOutput] = []
        launched = self._launch(work, failed, t_begin, compiles)
        if self.spec is not None and launched is not None:
            launched.spec_k, launched.spec_hint = self.spec.last_k if propose else 0, hint
        if overlap and launched is not None and launched.error is None and self._can_advance(launched.work):
            self._advance_launched(launched)
        return _Pending(work, failed, launched)

    def finish_step(self, pending: _Pending) -> list[RequestOutput]:
        """The second half of `step`: wait for the step's outputs and process them."""
        try:
            outputs = self._land(pending.launched, pending.failed, timed=True)
            self._failed_runs = 0
        except _RunFailed as e:
            outputs = self._retry_one_at_a_time(pending.work, e, pending.failed)
        return pending.failed + outputs

    # ---- async scheduling -----------------------------------------------------------------------------------
    #
    # Step N+1 is scheduled, built and dispatched while step N runs; N's sampled tokens reach N+1 on the device
    # (`StepBatch.token_feed`), so the host's work (scheduling, building, the transfer, then detokenizing and
    # streaming N) overlaps the device's. When N is dispatched its sequences are advanced as if it had landed:
    # computed tokens move on and each sampling sequence holds one pending token (`Sequence.num_pending_tokens`),
    # which the scheduler plans past. Outputs are those of the synchronous engine: a sequence that ends when N lands
    # wastes its N+1 row (skipped when N+1 lands), except that one whose pending token is its last (max_tokens,
    # max_model_len) is not scheduled at all. A step whose sequences need their new tokens on the host before the
    # next step is built (penalties: the next row's history; prompt logprobs; drafts) is not advanced: it lands
    # before the next step is scheduled.
    #
    # Speculation: drafts come from the landed tokens (n-gram, draft model) or from the head that runs when the step
    # before lands (EAGLE-3), so a step that verifies drafts is built after the one before it lands, and lands
    # before the next is built. A step that does not speculate overlaps like any other: with a step in flight, the
    # next one is built at once, without drafts, when the controller would not speculate even if every sequence
    # had the drafts its proposer expects (`Speculator.skip_proposal`: a loaded server); otherwise the step in
    # flight lands first and the next one proposes from its tokens (an EAGLE-3 head catches up on it and drafts
    # when it lands).
    # For a step landing with the next in flight, an EAGLE-3 head only catches up (no drafts: the next step is
    # built), or, when the controller would not speculate, is off for its sequences as in the synchronous engine
    # (`spec_decode/eagle3.py`). Outputs are those of the synchronous engine (drafts never change them: the
    # verification is lossless).

    def _step_async(self) -> list[RequestOutput]:
        prev, self._in_flight = self._in_flight, None
        overlap = prev is None or (prev.launched is not None and prev.launched.advanced)
        if overlap and prev is not None and self.spec is not None:
            overlap = self.spec.skip_proposal(self.scheduler.running, self.scheduler.waiting)
        nxt = self.begin_step(overlap=True, propose=prev is None) if overlap else None
        outputs: list[RequestOutput] = []
        if prev is not None:
            try:
                landed = self._land(prev.launched, prev.failed, timed=True, behind=nxt is not None)
                self._failed_runs = 0
            except _RunFailed as e:
                if nxt is not None:  # built on prev's tokens: undone, its sequences are scheduled again
                    outputs += nxt.failed
                    if nxt.launched is not None:
                        self._roll_back(nxt.launched)
                    nxt = None
                self._roll_back(prev.launched)
                landed = self._retry_one_at_a_time(prev.work, e, prev.failed)
            outputs += prev.failed + landed
            if nxt is None:
                nxt = self.begin_step(overlap=True)  # what prev's tokens (or freed pages) made schedulable
        self._in_flight = nxt
        return outputs

    def _can_advance(self, work: list[ScheduledWork]) -> bool:
        """Whether the next step may be built before this one lands (see above)."""
        return self.num_microbatches == 1 and all(
            w.num_draft == 0 and w.seq.params.prompt_logprobs is None and not w.seq.params.has_penalties
            for w in work)

    def _advance_launched(self, launched: _Launched) -> None:
        """Settle a dispatched step's sequences as if it had landed: their tokens computed, and each sequence that
        samples holding a pending token, row `pending_row` of the step's output (one row per sequence)."""
        launched.starts = [w.seq.num_computed_tokens for w in launched.work]
        launched.completes = [w.completes_sequence for w in launched.work]
        for row, (w, completes) in enumerate(zip(launched.work, launched.completes)):
            self.scheduler.advance(w.seq, w.num_tokens)
            if completes:
                w.seq.num_pending_tokens += 1
                w.seq.pending_row = row
        launched.advanced = True
        self.num_overlapped_steps += 1

    def _roll_back(self, launched: _Launched) -> None:
        """Undo `_advance_launched` for a step whose device run failed (sequences preempted since keep their
        reset); the pages it registered in the prefix cache leave it (their KV was not written)."""
        if not launched.advanced:
            return
        for w, start, completes in zip(launched.work, launched.starts, launched.completes):
            seq = w.seq
            if completes:
                seq.num_pending_tokens -= 1
            if seq.num_computed_tokens == start + w.num_tokens:
                self.scheduler.roll_back(seq, start)
        launched.advanced = False

    def _process_advanced(self, launched: _Launched, out: SamplerOutput, failed: list[RequestOutput],
                          behind: bool) -> list[RequestOutput]:
        """`_process` for an advanced step: its sequences moved on at dispatch, so only the sampled tokens are
        appended (a sequence that ended, or whose request did, since the step was built skips its row). An EAGLE-3
        head then catches up on the step and drafts for the next one, unless that one is in flight `behind` it
        (built without drafts): then it only catches up, or does not run if the controller would not speculate."""
        now = time.time()
        touched: dict[str, Request] = {}
        finished: list[Sequence] = []
        for row, (w, completes) in enumerate(zip(launched.work, launched.completes)):
            seq = w.seq
            if not completes:
                continue
            seq.num_pending_tokens -= 1
            req = self.requests.get(seq.request_id)
            if req is None or seq.is_finished:
                continue
            if out.nonfinite[row]:
                failed.append(self._fail(req, "the model produced non-finite logits (NaN or inf)"))
                touched.pop(req.request_id, None)
                continue
            try:
                self.output.append_token(req, seq, out, row, now)
                self.scheduler.advance(seq, 0)  # pages the token completed join the prefix cache
            except Exception as e:  # noqa: BLE001 -- e.g. the detokenizer: this request fails, the others go on
                failed.append(self._fail(req, f"processing its output raised {e!r}"))
                touched.pop(req.request_id, None)
                continue
            if seq.is_finished:
                finished.append(seq)
            touched[req.request_id] = req
        if self.spec is not None:  # before finished sequences free their pages (see `_process`)
            # every token of the step was kept (it verified no drafts), unless its sequence was preempted since
            ends = [min(start + w.num_tokens, w.seq.num_computed_tokens)
                    for w, start in zip(launched.work, launched.starts)]
            self.spec.after_step(launched.work, launched.starts, ends, self.scheduler.running, launched.hidden,
                                 draft=not behind, waiting=self.scheduler.waiting)
        return self._emit(finished, touched)

    def _emit(self, finished: list[Sequence], touched: dict[str, Request]) -> list[RequestOutput]:
        """End a landed step: free the finished sequences, and the RequestOutputs of the requests it touched (those
        that finished leave the engine)."""
        for seq in finished:
            self.scheduler.finish(seq)
        outputs = [self.output.request_output(req) for req in touched.values()]
        for o in outputs:
            if o.finished:
                del self.requests[o.request_id]
        return outputs

    def _retry_one_at_a_time(self, work: list[ScheduledWork], e: _RunFailed, failed: list) -> list[RequestOutput]:
        logger.error("the model step raised %r; retrying its %d sequences one at a time", e.cause, len(work))
        outputs, ran = [], False
        for w in work:
            req = self.requests.get(w.seq.request_id)
            if req is None or w.seq.status is not SequenceStatus.RUNNING:
                continue  # a sibling sequence's failure ended the request, or it was preempted since (recomputes)
            cause = e.cause  # alone in the step: it is the culprit
            if len(work) > 1:
                try:
                    outputs += self._run([w], failed)
                    ran = True
                    continue
                except _RunFailed as alone:
                    cause = alone.cause
            failed.append(self._fail(req, f"the model step raised {cause!r}"))
        self._failed_runs = 0 if ran else self._failed_runs + 1
        if self._failed_runs >= MAX_FAILED_STEPS:
            raise EngineDeadError(f"the model step raised in {self._failed_runs} steps in a row: {e.cause!r}") from e
        return outputs

    def _run(self, work: list[ScheduledWork], failed: list[RequestOutput], timed: bool = False) -> list[RequestOutput]:
        """Build, run and process `work`. Requests whose host-side processing raises are failed into `failed`;
        raises _RunFailed if the device step raised (KV cache intact) and EngineDeadError if it lost the cache."""
        return self._land(self._launch(work, failed), failed, timed)

    def _launch(self, work: list[ScheduledWork], failed: list[RequestOutput], t_begin: float | None = None,
                compiles: int | None = None) -> _Launched | None:
        """Build `work` into micro-batches and dispatch them (not waited for); rows that cannot be built fail their
        request into `failed`. None if nothing is left to run."""
        while True:
            try:
                groups = self._microbatches(work)
                steps = [self.builder.build(g) for g in groups]
                break
            except RowBuildError as e:
                failed.append(self._fail(self.requests[e.request_id], e.reason))
                work = [w for w in work if w.seq.request_id in self.requests]
                if not work:
                    return None
        t0 = time.perf_counter()
        launched = _Launched(work, groups, steps, t0, t0 if t_begin is None else t_begin,
                             self._num_compiles() if compiles is None else compiles)
        try:
            launched.device_outputs = self.runner.dispatch(steps)
            launched.hidden = self.runner.last_hidden
        except Exception as e:  # raised again by _land, where the step's failure is handled
            launched.error = e
        return launched

    def _land(self, launched: _Launched | None, failed: list[RequestOutput], timed: bool = False,
              behind: bool = False) -> list[RequestOutput]:
        """Wait for a launched step and process its outputs (see `_run`). `behind`: the next step is already in
        flight (async scheduling), built without drafts: the step's processing does not delay it, and an EAGLE-3
        head does not draft for it."""
        if launched is None:
            return []
        work, groups, steps = launched.work, launched.groups, launched.steps
        try:
            if launched.error is not None:
                raise launched.error
            results = self.runner.fetch(launched.device_outputs)
        except Exception as e:
            if not self.runner.kv_is_intact():
                raise EngineDeadError(e) from e
            raise _RunFailed(e) from e
        now = time.perf_counter()
        # What the step costs the engine, its period: a step built while the one before ran (async scheduling) from
        # when that one landed, a step built after the one before landed from when it began (proposing,
        # scheduling, building); plus its processing below unless the next step is in flight behind it (otherwise
        # the next step waits for it). The controller keeps the two kinds apart: only a step without drafts can
        # have the next one built behind it.
        overlapped = launched.t_begin < self._last_landed
        run_seconds = now - max(launched.t_begin, self._last_landed)
        gap = 0.0 if overlapped else launched.t_begin - self._last_landed  # host time before the step began
        self._last_landed = now
        self.num_steps += 1
        trace_accepted = self.step_trace is not None and self.spec is not None
        accepted = sum(self.spec.metrics.num_accepted) if trace_accepted else 0
        for g, (_, prompt_lp) in zip(groups, results):
            if prompt_lp is not None:
                self.output.record_prompt_logprobs(g, prompt_lp)
        out = results[0][0] if len(results) == 1 else _concat_rows(
            [(o, sum(1 + w.num_draft for w in g)) for g, (o, _) in zip(groups, results)])
        if launched.advanced:
            outputs = self._process_advanced(launched, out, failed, behind)
        else:
            outputs = self._process(work, out, failed, launched.hidden)  # an EAGLE-3 head drafts in here
        if not behind:
            run_seconds += time.perf_counter() - now
        # The proposer's share of the period (an EAGLE-3 head's catch-up and drafting in `after_step`): its run
        # after the step before landed, if this step was built behind that one, and its run after this step, unless
        # the next step is in flight behind it (then that one's period holds it).
        own = 0.0 if self.spec is None else self.spec.take_proposer_seconds()
        proposer_seconds = (self._proposer_seconds_behind if overlapped else 0.0) + (0.0 if behind else own)
        self._proposer_seconds_behind = own if behind else 0.0
        # A period that included compiling (this step's executables, the proposer's, or those of the next step,
        # built while this one ran) says nothing about what the step costs.
        timed = timed and self._num_compiles() == launched.compiles_at_begin
        if self.spec is not None and timed:
            self.spec.record_step(steps[0][0], sum(w.num_tokens for w in work), run_seconds, overlapped,
                                  num_drafts=sum(w.num_draft for w in work), proposer_seconds=proposer_seconds)
        if self.step_trace is not None:
            accepted = sum(self.spec.metrics.num_accepted) - accepted if trace_accepted else 0
            self._trace_step(launched, run_seconds, accepted, timed, overlapped, gap, proposer_seconds)
        return outputs

    def _num_compiles(self) -> int:
        """Executables compiled so far, the target's and the proposer's."""
        return self.runner.num_compiles + (0 if self.spec is None else self.spec.proposer.num_compiles)

    def _trace_step(self, launched: _Launched, run_seconds: float, accepted: int, timed: bool,
                    overlapped: bool, gap: float, proposer_seconds: float) -> None:
        """One landed step's record: when it was dispatched, its period (`run_seconds`, as `_land` times it for the
        controller; `timed`: the controller got it), its padded size, its mix of decodes and prompt tokens, and the
        drafts it verified and accepted; `proposer_seconds`: the proposer's share of the period (`_land`)."""
        work = launched.work
        decodes = [w for w in work if w.completes_sequence and w.num_tokens - w.num_draft == 1]
        self.step_trace.append(dict(
            t=launched.t0, run_ms=1e3 * run_seconds, bucket=launched.steps[0][0].num_tokens, seqs=len(work),
            tokens=sum(w.num_tokens for w in work), decodes=len(decodes), drafts=sum(w.num_draft for w in work),
            prefill=sum(w.num_tokens for w in work) - sum(1 + w.num_draft for w in decodes), accepted=accepted,
            waiting=len(self.scheduler.waiting), overlapped=overlapped, advanced=launched.advanced, timed=timed,
            spec_k=launched.spec_k, spec_hint=launched.spec_hint, gap_ms=1e3 * gap,
            proposer_ms=1e3 * proposer_seconds))

    def _microbatches(self, work: list[ScheduledWork]) -> list[list[ScheduledWork]]:
        """The step's work as the runner's micro-batches: one group, or under pipeline parallelism up to one per
        stage, contiguous and balanced by tokens (`pipeline.split_microbatches`)."""
        if self.num_microbatches == 1:
            return [work]
        sizes = split_microbatches([w.num_tokens for w in work], self.num_microbatches)
        starts = itertools.accumulate(sizes, initial=0)
        return [work[a:a + n] for a, n in zip(starts, sizes)]

    def _process(self, work: list[ScheduledWork], out: SamplerOutput, failed: list[RequestOutput],
                 hidden=None) -> list[RequestOutput]:
        now = time.time()
        touched: dict[str, Request] = {}
        starts = [w.seq.num_computed_tokens for w in work]
        finished: list[Sequence] = []
        rows = itertools.accumulate((1 + w.num_draft for w in work), initial=0)
        for w, row0 in zip(work, rows):
            seq = w.seq
            req = self.requests.get(seq.request_id)
            if req is None:
                continue  # failed earlier in this step (a sibling sequence)
            if not w.completes_sequence or seq.is_finished:
                self.scheduler.advance(seq, w.num_tokens)
                continue
            if out.nonfinite[row0 : row0 + w.num_draft + 1].any():
                failed.append(self._fail(req, "the model produced non-finite logits (NaN or inf)"))
                touched.pop(req.request_id, None)
                continue
            try:
                num_tokens_before = seq.num_tokens
                accepted, emitted = self.output.append_tokens(req, w, out, row0, now)
                # KV is valid for the old tokens and the accepted drafts that were kept; the last emitted token is new
                self.scheduler.advance(seq, w.num_tokens - w.num_draft + min(accepted, emitted - 1), w.num_draft > 0)
                if w.num_draft:
                    self.spec.verified(seq, num_tokens_before, w.num_draft, accepted)
            except Exception as e:  # noqa: BLE001 -- e.g. the detokenizer: this request fails, the others go on
                failed.append(self._fail(req, f"processing its output raised {e!r}"))
                touched.pop(req.request_id, None)
                continue
            if seq.is_finished:
                finished.append(seq)
            touched[req.request_id] = req
        if self.spec is not None:
            # before finished sequences free their pages: the head's KV in them may be reused via the prefix cache
            # (failed requests' sequences hold no pages any more: the head skips them)
            ends = [w.seq.num_computed_tokens for w in work]
            self.spec.after_step(work, starts, ends, self.scheduler.running, hidden, waiting=self.scheduler.waiting)
        return self._emit(finished, touched)

    def _fail(self, req: Request, reason: str) -> RequestOutput:
        """End `req` with finish_reason "error": free its pages, dropping the ones only it holds from the prefix
        cache (their KV may be garbage). Returns its final output."""
        logger.error("request %s failed: %s", req.request_id, reason)
        now = time.time()
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish("error", now, reason)
            self.scheduler.fail(seq)
        del self.requests[req.request_id]
        self.num_failed_requests += 1
        return self.output.request_output(req)
