"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

step() = schedule (host) -> build padded inputs (host numpy) -> run (device, one transfer) -> postprocess (host:
append tokens, detokenize, stop checks, free pages). Requests are validated when added, so a bad one fails alone.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from jaxserve import attention
from jaxserve.batch import ScheduledSeq, build_step_inputs, choose_bucket, row_offsets
from jaxserve.block_manager import BlockManager
from jaxserve.config import EngineConfig, ModelConfig, kv_storage_dtype
from jaxserve.errors import EngineDeadError
from jaxserve.kv_cache import kv_cache_bytes
from jaxserve.loader import load_checkpoint
from jaxserve.loader.weights import to_weights
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.runner import ModelRunner, default_dtype
from jaxserve.sampler import MAX_BANNED, SamplingInputs
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler, ScheduledWork
from jaxserve.sequence import Sequence
from jaxserve.spec_decode import SpecController, make_proposer, proposer_cache_configs, target_hidden_layer_ids
from jaxserve.spec_decode.rejection import NO_DRAFT, accepted_length
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

PromptType = str | dict  # "text" | {"prompt_token_ids": [...]} | {"prompt": "text"}
MAX_FAILED_STEPS = 3  # device steps in a row that raise for every sequence before the engine is declared dead


class _RunFailed(Exception):
    """The device step raised, with the KV cache intact (so the step can be retried in parts)."""

    def __init__(self, cause: BaseException):
        super().__init__(repr(cause))
        self.cause = cause


class _RequestError(Exception):
    def __init__(self, request_id: str, reason: str):
        super().__init__(reason)
        self.request_id, self.reason = request_id, reason
DEFAULT_KV_CACHE_BYTES = 1 << 30


def _mix32(*values: int) -> int:
    """A deterministic 32-bit hash of integers (per-row sampling key material)."""
    h = 0x9E3779B9
    for v in values:
        h = (h ^ (v & 0xFFFFFFFF)) * 0x85EBCA6B & 0xFFFFFFFF
        h ^= h >> 13
        h = h * 0xC2B2AE35 & 0xFFFFFFFF
        h ^= h >> 16
    return h


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer | None]
    texts: list[str] = field(default_factory=list)
    # Logprob dicts built so far, per sequence (and for the prompt): each step converts only the new tokens'.
    logprobs: list[list[dict[int, Logprob]]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)


def resolve_num_pages(
    engine_cfg: EngineConfig, model_cfg: ModelConfig, kv_dtype: str, extra_caches: tuple[ModelConfig, ...] = ()
) -> int:
    """Pages of the KV cache: as configured, or as many as the memory budget holds at the cache's dtype (so an int8
    cache holds 4x the pages of a float32 one in the same bytes). `extra_caches`: models whose caches use the same
    page ids (a draft model, an EAGLE-3 head), so a page costs their bytes too."""
    if engine_cfg.num_pages is not None:
        return engine_cfg.num_pages
    per_page = sum(kv_cache_bytes(c, 1, engine_cfg.page_size, kv_dtype) for c in (model_cfg, *extra_caches))
    if engine_cfg.kv_cache_memory_bytes is not None:
        return max(2, engine_cfg.kv_cache_memory_bytes // per_page)
    want = 1 + engine_cfg.max_num_seqs * engine_cfg.max_pages_per_seq
    return max(2, min(want, DEFAULT_KV_CACHE_BYTES // per_page))


class LLMEngine:
    def __init__(self, model: str | None = None, engine_config: EngineConfig | None = None):
        engine_config = engine_config or EngineConfig()
        ckpt = load_checkpoint(model)
        self.model_config = ckpt.config
        self.tokenizer: Tokenizer | None = ckpt.tokenizer
        dtype = engine_config.dtype or default_dtype()
        max_model_len = min(engine_config.max_model_len, ckpt.config.max_position_embeddings)
        engine_config = engine_config.replace(dtype=dtype, max_model_len=max_model_len)
        if attention.uses_native_kernel(attention.attention_backend()):
            # The native CPU kernel walks only each sequence's own pages: one block-table size serves every step.
            engine_config = engine_config.replace(page_buckets=engine_config.page_buckets[-1:])
        kv_dtype = kv_storage_dtype(engine_config.kv_cache_dtype, dtype)
        extra = proposer_cache_configs(engine_config.speculative_config, ckpt.config)
        engine_config = engine_config.replace(num_pages=resolve_num_pages(engine_config, ckpt.config, kv_dtype, extra))
        if engine_config.num_pages - 1 < engine_config.max_pages_per_seq:
            raise ValueError(
                f"num_pages={engine_config.num_pages} cannot hold one sequence of max_model_len={max_model_len} "
                f"({engine_config.max_pages_per_seq} pages of {engine_config.page_size}); lower max_model_len or "
                "raise num_pages"
            )
        self.config = engine_config
        weights = to_weights(ckpt.config, ckpt.tensors, jnp.dtype(dtype), ckpt.path)
        del ckpt
        hidden_ids = target_hidden_layer_ids(engine_config.speculative_config, self.model_config)
        self.runner = ModelRunner(self.model_config, engine_config, weights, dtype, hidden_layer_ids=hidden_ids)
        if engine_config.precompile:
            self.runner.warmup()
        self.block_manager = BlockManager(
            engine_config.num_pages, engine_config.page_size, engine_config.enable_prefix_caching
        )
        self.scheduler = Scheduler(engine_config, self.block_manager)
        self._eos_ids = tuple(
            dict.fromkeys(self.model_config.eos_token_ids + (self.tokenizer.eos_token_ids if self.tokenizer else ()))
        )
        self.spec: SpecController | None = None
        self._timed_buckets: set = set()  # buckets whose step time the controller has seen once (see step)
        self._proposer_seconds = 0.0
        if engine_config.speculative_config is not None:
            self.spec = SpecController(engine_config.speculative_config, engine_config.token_buckets)
            self.proposer = make_proposer(engine_config.speculative_config, engine_config, self.model_config, self.runner)
            if engine_config.precompile:
                self.proposer.warmup()
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._rng = np.random.default_rng(engine_config.seed)
        self.num_steps = 0
        self.num_failed_requests = 0
        self._failed_runs = 0  # consecutive steps whose device run raised for every request (see step)
        self._decoded: dict[int, str | None] = {}  # token id -> its text, for logprobs

    # ---- requests -------------------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, (int, np.integer)) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), [int(t) for t in ids]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a dict prompt needs 'prompt_token_ids' or 'prompt' (got keys {sorted(prompt)})")
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string or a dict with 'prompt_token_ids' (got {type(prompt).__name__})")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass {'prompt_token_ids': [...]} instead of text")
        if not prompt:  # it would still tokenize to a lone BOS: say so instead of generating from nothing
            raise ValueError("prompt is empty: it must contain at least one token")
        return prompt, self.tokenizer.encode(prompt)

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, priority: int = 0
    ) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        limit = self.config.max_model_len
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        if len(ids) >= limit:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_model_len is {limit}: it must be shorter to leave room for output"
            )
        V = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {V}) (got {bad[:5]})")
        if params.top_k > V:
            raise ValueError(f"top_k must be <= the vocabulary size {V} (got {params.top_k}); 0 or -1 = all tokens")
        bad = [t for t in params.stop_token_ids if t >= V]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {V}) (got {bad[:5]})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.config.max_logprobs:
                raise ValueError(f"{name} must be <= max_logprobs={self.config.max_logprobs} (got {k})")
        if params.min_tokens and len(self._stop_ids(params)) > MAX_BANNED:
            raise ValueError(f"with min_tokens, at most {MAX_BANNED} EOS + stop_token_ids can be suppressed")
        max_tokens = limit - len(ids) if params.max_tokens is None else min(params.max_tokens, limit - len(ids))
        now = time.time()
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer (got {priority!r})")
        seqs = [
            Sequence(next(self._seq_ids), request_id, i, list(ids), params, max_tokens, now, priority=priority)
            for i in range(params.n)
        ]
        detoks = [
            IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens) if self.tokenizer else None
            for _ in seqs
        ]
        self.requests[request_id] = Request(
            request_id, text, list(ids), params, seqs, detoks, [""] * len(seqs), [[] for _ in seqs]
        )
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
        return self._request_output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> dict[str, float | list[int]]:
        """A read-only snapshot for monitoring (/metrics); cheap, and safe to call from another thread."""
        bm = self.block_manager
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": bm.num_used_pages / max(1, bm.num_pages - 1),
            "prefix_cache_hit_rate": bm.prefix_hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
        } | ({} if self.spec is None else {
            "spec_decode_acceptance_rate": self.spec.metrics.acceptance_rate,
            "spec_decode_mean_acceptance_length": self.spec.metrics.mean_acceptance_length,
            "spec_decode_num_draft_tokens": sum(self.spec.metrics.num_drafts),
            "spec_decode_num_accepted_tokens": sum(self.spec.metrics.num_accepted),
            "spec_decode_num_draft_tokens_per_pos": list(self.spec.metrics.num_drafts),
            "spec_decode_num_accepted_tokens_per_pos": list(self.spec.metrics.num_accepted),
        })

    # ---- the step -------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the RequestOutputs of every request it touched.

        A request whose processing fails (its logits are NaN/inf, building its row or appending its token raises)
        ends alone with finish_reason "error" and its pages are dropped from the prefix cache; the others go on. If
        the device step itself raises and the KV cache survived, the step's sequences are retried one at a time, so
        only the culprit fails; `MAX_FAILED_STEPS` steps in a row where nothing could run, or a lost KV cache,
        raise EngineDeadError.
        """
        if self.spec is not None:
            self._propose()
        work = self.scheduler.schedule()
        if not work:
            return []
        self._proposer_seconds = 0.0  # the proposer's device work for this step (draft passes), timed below
        if self.spec is not None and self.proposer.drafts_after_scheduling:
            t = time.perf_counter()
            self.proposer.propose(work)
            self._proposer_seconds += time.perf_counter() - t
        failed: list[RequestOutput] = []
        try:
            outputs = self._run(work, failed, timed=True)
            self._failed_runs = 0
        except _RunFailed as e:
            logger.error("the model step raised %r; retrying its %d sequences one at a time", e.cause, len(work))
            outputs, ran = [], False
            for w in work:
                req = self.requests.get(w.seq.request_id)
                if req is None:
                    continue  # a sibling sequence's failure ended the request
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
        return failed + outputs

    def _run(self, work: list[ScheduledWork], failed: list[RequestOutput], timed: bool = False) -> list[RequestOutput]:
        """Build, run and postprocess `work`. Requests whose host-side processing raises are failed into `failed`;
        raises _RunFailed if the device step raised (KV cache intact) and EngineDeadError if it lost the cache."""
        while True:
            try:
                bucket, inputs, sampling = self._build(work)
                break
            except _RequestError as e:
                failed.append(self._fail(self.requests[e.request_id], e.reason))
                work = [w for w in work if w.seq.request_id in self.requests]
                if not work:
                    return []
        targets = self._prompt_targets(work, bucket.num_tokens)
        t0 = time.perf_counter()
        try:
            out, prompt_lp = self.runner.run(bucket, inputs, sampling, targets)
        except Exception as e:
            if not self.runner.kv_is_intact():
                raise EngineDeadError(e) from e
            raise _RunFailed(e) from e
        run_seconds = time.perf_counter() - t0
        self.num_steps += 1
        if prompt_lp is not None:
            self._record_prompt_logprobs(work, prompt_lp)
        outputs = self._postprocess(work, out, failed)  # an EAGLE-3 head drafts for the next step in here (timed)
        if self.spec is not None and timed:
            # The controller weighs a step size by what it costs: the target's step plus the proposer's work for it.
            if bucket in self._timed_buckets:
                self.spec.record_step(sum(w.num_tokens for w in work), run_seconds + self._proposer_seconds)
            else:  # a bucket's first run is an outlier (one-time allocations), and a pessimistic first sample would
                self._timed_buckets.add(bucket)  # never be revisited: the controller would avoid that size
        return outputs

    def _fail(self, req: Request, reason: str) -> RequestOutput:
        """End `req` with finish_reason "error": free its pages, dropping the ones only it holds from the prefix
        cache (their KV may be garbage). Returns its final output."""
        logger.error("request %s failed: %s", req.request_id, reason)
        now = time.time()
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish("error", now, reason)
            self.block_manager.discard(seq)
            self.scheduler.finish(seq)
        del self.requests[req.request_id]
        self.num_failed_requests += 1
        return self._request_output(req)

    def _propose(self) -> None:
        """Draft tokens for every decoding sequence (the scheduler decides how many of them it can verify)."""
        running = self.scheduler.running
        decoding = [s for s in running if s.num_uncomputed_tokens == 1]
        base = sum(min(s.num_uncomputed_tokens, self.config.max_num_batched_tokens) for s in running)
        after_step, after_scheduling = self.proposer.drafts_after_step, self.proposer.drafts_after_scheduling
        made = {seq.seq_id: seq.spec_token_ids for seq in decoding} if after_step else {}
        for seq in running:
            seq.spec_token_ids = []
        drafts = []  # per decoding sequence: its drafts (host proposers, or made after the last step), else None
        caps = []  # ... and the most drafts it may have
        for seq in decoding:
            k = self._draft_cap(seq)
            if after_step:
                d = made[seq.seq_id][:k]  # drafted at the end of the previous step
            elif after_scheduling:
                d = None  # drafted once the scheduler has placed the sequence (pages for the draft model's KV)
            else:
                d = self.proposer.propose(seq.token_ids, k) if k else []  # host lookup: cheap, and shows what exists
            drafts.append(d)
            caps.append(k if d is None else len(d))
        k_step = self.spec.choose_k(min(base, self.config.max_num_batched_tokens), caps)
        for seq, d, cap in zip(decoding, drafts, caps):
            k = min(k_step, cap)
            if d is not None:
                seq.spec_token_ids = d[:k]
            elif k > 0:
                seq.spec_token_ids = [NO_DRAFT] * k  # placeholders: the scheduler only counts them

    def _draft_cap(self, seq) -> int:
        """The most drafts `seq` may verify next step: the engine's K, the request's cap, and never past the
        request's end (at most k drafts + 1 token may still be emitted)."""
        p = seq.params
        if seq.spec_disabled:
            return 0
        k = self.spec.k_max if p.num_speculative_tokens is None else min(self.spec.k_max, p.num_speculative_tokens)
        return max(0, min(k, seq.max_tokens - len(seq.output_token_ids) - 1, self.config.max_model_len - seq.num_tokens - 1))

    def _k_hint(self) -> int:
        """The K the controller would choose for a next step made of the running sequences as they are now, each
        decoding one that may speculate with its full cap of drafts: how many drafts a proposer that drafts ahead
        (EAGLE-3) should make; 0 = the next step would not speculate."""
        budget = self.config.max_num_batched_tokens
        running = [s for s in self.scheduler.running if not s.is_finished]
        base = sum(min(s.num_uncomputed_tokens, budget) for s in running)
        caps = [c for s in running if s.num_uncomputed_tokens == 1 and (c := self._draft_cap(s)) > 0]
        return self.spec.choose_k(min(base, budget), caps, optimistic=True)

    def _prompt_targets(self, work: list[ScheduledWork], num_tokens: int) -> np.ndarray | None:
        """Next-token targets for prompt chunks of requests that asked for prompt_logprobs (None if none did)."""
        targets, t = None, 0
        for w in work:
            seq, start = w.seq, w.seq.num_computed_tokens
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens:
                if targets is None:
                    targets = np.full(num_tokens, -1, np.int32)
                end = min(start + w.num_tokens, seq.num_prompt_tokens - 1)  # the last prompt token has no target
                targets[t : t + max(0, end - start)] = seq.prompt_token_ids[start + 1 : end + 1]
            t += w.num_tokens
        return targets

    def _record_prompt_logprobs(self, work: list[ScheduledWork], lp: dict[str, np.ndarray]) -> None:
        t = 0
        for w in work:
            seq, start = w.seq, w.seq.num_computed_tokens
            k = seq.params.prompt_logprobs
            if k is not None:
                for i in range(w.num_tokens):
                    pos = start + i + 1  # the prompt position whose token this row predicts
                    if pos != len(seq.prompt_logprobs) or pos >= seq.num_prompt_tokens:
                        continue  # recorded already (recompute after preemption) or past the prompt
                    row = t + i
                    top = [(int(a), float(b), r + 1) for r, (a, b) in enumerate(zip(lp["top_ids"][row][:k], lp["top_logprobs"][row][:k]))]
                    target = seq.prompt_token_ids[pos]
                    if target not in (a for a, _, _ in top):
                        top.append((target, float(lp["logprobs"][row]), int(lp["ranks"][row])))
                    seq.prompt_logprobs.append(top)
            t += w.num_tokens

    def _build(self, work: list[ScheduledWork]):
        seqs = [
            ScheduledSeq(
                w.seq.token_ids[w.seq.num_computed_tokens : w.seq.num_computed_tokens + w.num_tokens - w.num_draft]
                + w.seq.spec_token_ids[: w.num_draft],
                w.seq.num_computed_tokens,
                w.seq.page_ids,
                w.num_draft,
            )
            for w in work
        ]
        cfg = self.config
        bucket = choose_bucket(
            sum(w.num_tokens for w in work),
            max(len(s.page_ids) for s in seqs),
            cfg.token_buckets,
            cfg.page_buckets,
            cfg.max_num_seqs,
            1 + cfg.num_speculative_tokens,
            num_rows=len(work) + sum(w.num_draft for w in work),
        )
        inputs = build_step_inputs(seqs, bucket, cfg.page_size)
        sampling = SamplingInputs.host_arrays(bucket.rows, bucket.max_pages * cfg.page_size)
        if self.spec is not None:
            sampling["draft_ids"] = np.full(bucket.rows, NO_DRAFT, np.int32)
        for w, row0 in zip(work, row_offsets(seqs)):
            if not w.completes_sequence:
                continue  # a prefill chunk that samples nothing: neutral row
            drafts = w.seq.spec_token_ids[: w.num_draft]
            try:
                for j in range(w.num_draft + 1):  # verify position j has drafts[:j] as its newest output tokens
                    self._fill_row(sampling, row0 + j, w.seq, drafts[:j])
                    if j < w.num_draft:
                        sampling["draft_ids"][row0 + j] = drafts[j]
            except Exception as e:  # noqa: BLE001 -- this request's data; the others must not pay for it
                raise _RequestError(w.seq.request_id, f"building its sampling row raised {e!r}") from e
        return bucket, inputs, sampling

    def _fill_row(self, sampling: dict[str, np.ndarray], row: int, seq: Sequence, extra: list[int]) -> None:
        """Sampling settings of one row: `seq` as if `extra` (verified drafts) had already been generated."""
        p = seq.params
        num_out = len(seq.output_token_ids) + len(extra)
        sampling["temperature"][row] = p.temperature
        sampling["top_k"][row] = p.top_k
        sampling["top_p"][row] = p.top_p
        sampling["min_p"][row] = p.min_p
        sampling["wants_logprobs"][row] = p.logprobs is not None
        if p.seed is not None:  # same seed -> same draws, whatever shares the batch
            sampling["seeds"][row] = _mix32(p.seed, seq.index, num_out)
        else:
            sampling["seeds"][row] = self._rng.integers(0, 2**32, dtype=np.uint32)
        if p.has_penalties:
            sampling["repetition_penalty"][row] = p.repetition_penalty
            sampling["frequency_penalty"][row] = p.frequency_penalty
            sampling["presence_penalty"][row] = p.presence_penalty
            tokens = seq.token_ids + extra
            sampling["history"][row, : len(tokens)] = tokens
            sampling["history_is_output"][row, seq.num_prompt_tokens : len(tokens)] = True
        if num_out < p.min_tokens:
            banned = self._stop_ids(p)
            sampling["banned"][row, : len(banned)] = banned

    def _postprocess(
        self, work: list[ScheduledWork], out: dict[str, np.ndarray], failed: list[RequestOutput]
    ) -> list[RequestOutput]:
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
                seq.num_computed_tokens += w.num_tokens
                self.block_manager.register_computed(seq)
                continue
            if out["nonfinite"][row0 : row0 + w.num_draft + 1].any():
                failed.append(self._fail(req, "the model produced non-finite logits (NaN or inf)"))
                touched.pop(req.request_id, None)
                continue
            try:
                if self._accept(req, w, out, row0, now):
                    finished.append(seq)
            except Exception as e:  # noqa: BLE001 -- e.g. the detokenizer: this request fails, the others go on
                failed.append(self._fail(req, f"processing its output raised {e!r}"))
                touched.pop(req.request_id, None)
                continue
            touched[req.request_id] = req
        if self.spec is not None and self.proposer.drafts_after_step:
            # before finished sequences free their pages: the head's KV in them may be reused via the prefix cache
            # (failed requests' sequences hold no pages any more: the head skips them)
            t = time.perf_counter()
            self.proposer.after_step(work, starts, self.runner.last_hidden, self._draft_cap, self._k_hint())
            self._proposer_seconds += time.perf_counter() - t
        for seq in finished:
            self.scheduler.finish(seq)
        outputs = [self._request_output(req) for req in touched.values()]
        for o in outputs:
            if o.finished:
                del self.requests[o.request_id]
        return outputs

    def _accept(self, req: Request, w: ScheduledWork, out: dict[str, np.ndarray], row0: int, now: float) -> bool:
        """Append the step's tokens for one sequence (the verified walk over its draft rows); True if it finished."""
        seq = w.seq
        # Rows row0 .. row0+num_draft verify the drafts in order; the walk stops at the first rejected one,
        # whose row holds the replacement token (or, all accepted, the last row holds the bonus token).
        accepted = accepted_length(out["accepted"][row0 : row0 + w.num_draft].tolist()) if w.num_draft else 0
        emitted, num_tokens_before = 0, seq.num_tokens
        for row in range(row0, row0 + accepted + 1):
            self._append_token(req, seq, out, row, now)
            emitted += 1
            if seq.is_finished:
                break
        # KV is valid for the old tokens and the accepted drafts that were kept; the last emitted token is new.
        seq.num_computed_tokens += w.num_tokens - w.num_draft + min(accepted, emitted - 1)
        if w.num_draft:
            self.spec.record(w.num_draft, accepted)
            seq.spec_num_verified += w.num_draft
            seq.spec_num_accepted += accepted
            self.proposer.verified(seq, num_tokens_before, w.num_draft, accepted)
            self.block_manager.trim(seq, seq.num_tokens)  # pages that only held rejected drafts
        seq.spec_token_ids = []
        self.block_manager.register_computed(seq)
        return seq.is_finished

    def _append_token(self, req: Request, seq: Sequence, out: dict[str, np.ndarray], row: int, now: float) -> None:
        token = int(out["token_ids"][row])
        seq.output_token_ids.append(token)
        seq.output_logprobs.append(float(out["logprobs"][row]))
        k = seq.params.logprobs
        if k is not None:
            top = [
                (int(t), float(lp), r + 1)
                for r, (t, lp) in enumerate(zip(out["top_ids"][row][:k], out["top_logprobs"][row][:k]))
            ]
            if token not in (t for t, _, _ in top):
                top.append((token, float(out["logprobs"][row]), int(out["ranks"][row])))
            seq.output_top_logprobs.append(top)
        if seq.first_token_time is None:
            seq.first_token_time = now
        self._check_stop(req, seq, token, now)

    def _check_stop(self, req: Request, seq: Sequence, token: int, now: float) -> None:
        p = seq.params
        detok = req.detokenizers[seq.index]
        if detok is not None:
            old = req.texts[seq.index]
            text = old + detok.add(token)
            req.texts[seq.index] = text
            for stop in p.stop_strings:
                at = text.find(stop, max(0, len(old) - len(stop) + 1))
                if at >= 0:
                    req.texts[seq.index] = text[: at + len(stop)] if p.include_stop_str_in_output else text[:at]
                    seq.finish("stop", now, stop)
                    return
        if token in p.stop_token_ids:
            seq.finish("stop", now, token)
        elif not p.ignore_eos and token in self._eos_ids:
            seq.finish("stop", now)
        elif len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            seq.finish("length", now)

    def _stop_ids(self, p: SamplingParams) -> list[int]:
        """Token ids that end generation for these params (EOS unless ignored, plus stop_token_ids)."""
        eos = [] if p.ignore_eos else list(self._eos_ids)
        return list(dict.fromkeys(eos + p.stop_token_ids))

    def _request_output(self, req: Request) -> RequestOutput:
        completions = []
        for seq, text, built in zip(req.seqs, req.texts, req.logprobs):
            stops = seq.params.stop_strings
            if stops and not seq.is_finished:
                # Hold back what could be the start of a stop string, so streamed text never has to be retracted.
                text = text[: max(0, len(text) - (max(map(len, stops)) - 1))]
            logprobs = None
            if seq.params.logprobs is not None:  # convert only this step's new tokens; the list copy is pointers
                built.extend(self._logprob_dict(top) for top in seq.output_top_logprobs[len(built) :])
                logprobs = list(built)
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=float(sum(seq.output_logprobs)),
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        first = req.seqs[0]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_token_time=min((s.first_token_time for s in req.seqs if s.first_token_time), default=None),
            finished_time=max((s.finish_time or 0.0) for s in req.seqs) if all(s.is_finished for s in req.seqs) else None,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_generated_tokens=sum(len(s.output_token_ids) for s in req.seqs),
            num_preemptions=sum(s.num_preemptions for s in req.seqs),
            spec_num_draft_tokens=sum(s.spec_num_verified for s in req.seqs),
            spec_num_accepted_tokens=sum(s.spec_num_accepted for s in req.seqs),
        )
        prompt_logprobs = None
        if req.params.prompt_logprobs is not None:
            built = req.prompt_logprobs
            built.extend(None if top is None else self._logprob_dict(top) for top in first.prompt_logprobs[len(built) :])
            prompt_logprobs = list(built)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=all(s.is_finished for s in req.seqs),
            metrics=metrics,
        )

    def _logprob_dict(self, top: list[tuple[int, float, int]]) -> dict[int, Logprob]:
        return {t: Logprob(lp, rank, self._decode_one(t)) for t, lp, rank in top}

    def _decode_one(self, token: int) -> str | None:
        text = self._decoded.get(token, False)
        if text is False:  # cached: bounded by the vocabulary
            text = self._decoded[token] = self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else None
        return text

