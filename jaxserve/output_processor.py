"""From the device's sampled tokens to what users see: append tokens, detokenize, check stops, build RequestOutputs.

Host side, per request. `Request` is one request's state beyond its sequences (detokenizers, texts, the logprob
dicts built so far). `OutputProcessor.append_tokens` walks one sequence's verify rows: rows row0 .. row0+num_draft
verify the drafts in order and the walk stops at the first rejected one, whose row holds the replacement token (all
accepted: the last row holds the bonus token); each appended token is detokenized and checked against the stops.
`request_output` assembles a RequestOutput with vLLM's fields; per-step work is proportional to the new tokens
(logprob dicts are built once per token, token strings decoded once per token id).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.sampler import PromptLogprobs, SamplerOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import ScheduledWork
from jaxserve.sequence import Sequence
from jaxserve.spec_decode.rejection import accepted_length
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer

TopLogprobs = list[tuple[int, float, int]]  # (token id, logprob, rank), best first


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


def _top(top_ids, top_logprobs, k: int, token: int, logprob: float, rank: int) -> TopLogprobs:
    """The k best (token, logprob, rank), plus `token` itself if it is not among them (vLLM's logprobs format)."""
    top = [(int(t), float(lp), r + 1) for r, (t, lp) in enumerate(zip(top_ids[:k], top_logprobs[:k]))]
    if token not in (t for t, _, _ in top):
        top.append((token, logprob, rank))
    return top


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self._decoded: dict[int, str | None] = {}  # token id -> its text, for logprobs

    def stop_ids(self, p: SamplingParams) -> list[int]:
        """Token ids that end generation for these params (EOS unless ignored, plus stop_token_ids)."""
        eos = [] if p.ignore_eos else list(self.eos_ids)
        return list(dict.fromkeys(eos + p.stop_token_ids))

    def new_request(self, request_id: str, prompt: str | None, ids: list[int], params: SamplingParams,
                    seqs: list[Sequence]) -> Request:
        detoks = [
            IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens) if self.tokenizer else None
            for _ in seqs
        ]
        return Request(request_id, prompt, list(ids), params, seqs, detoks, [""] * len(seqs), [[] for _ in seqs])

    # ---- one step's tokens ----------------------------------------------------------------------------------

    def append_tokens(self, req: Request, w: ScheduledWork, out: SamplerOutput, row0: int,
                      now: float) -> tuple[int, int]:
        """Append the step's tokens for one sequence (the verified walk over its draft rows).
        Returns (accepted drafts, tokens emitted); the sequence may have finished."""
        seq = w.seq
        accepted = accepted_length(out.accepted[row0 : row0 + w.num_draft].tolist()) if w.num_draft else 0
        emitted = 0
        for row in range(row0, row0 + accepted + 1):
            self.append_token(req, seq, out, row, now)
            emitted += 1
            if seq.is_finished:
                break
        return accepted, emitted

    def append_token(self, req: Request, seq: Sequence, out: SamplerOutput, row: int, now: float) -> None:
        token = int(out.token_ids[row])
        seq.output_token_ids.append(token)
        seq.output_logprobs.append(float(out.logprobs[row]))
        k = seq.params.logprobs
        if k is not None:
            top = _top(out.top_ids[row], out.top_logprobs[row], k, token, float(out.logprobs[row]), int(out.ranks[row]))
            seq.output_top_logprobs.append(top)
        if seq.first_token_time is None:
            seq.first_token_time = now
        self.check_stop(req, seq, token, now)

    def check_stop(self, req: Request, seq: Sequence, token: int, now: float) -> None:
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
        elif not p.ignore_eos and token in self.eos_ids:
            seq.finish("stop", now)
        elif len(seq.output_token_ids) >= seq.max_tokens or seq.num_known_tokens >= self.max_model_len:
            seq.finish("length", now)

    def record_prompt_logprobs(self, work: list[ScheduledWork], lp: PromptLogprobs) -> None:
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
                    target = seq.prompt_token_ids[pos]
                    seq.prompt_logprobs.append(
                        _top(lp.top_ids[row], lp.top_logprobs[row], k, target, float(lp.logprobs[row]),
                             int(lp.ranks[row]))
                    )
            t += w.num_tokens

    # ---- what users see -------------------------------------------------------------------------------------

    def request_output(self, req: Request) -> RequestOutput:
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
        finished = all(s.is_finished for s in req.seqs)
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_token_time=min((s.first_token_time for s in req.seqs if s.first_token_time), default=None),
            finished_time=max((s.finish_time or 0.0) for s in req.seqs) if finished else None,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_generated_tokens=sum(len(s.output_token_ids) for s in req.seqs),
            num_preemptions=sum(s.num_preemptions for s in req.seqs),
            spec_num_draft_tokens=sum(s.spec_num_verified for s in req.seqs),
            spec_num_accepted_tokens=sum(s.spec_num_accepted for s in req.seqs),
        )
        prompt_logprobs = None
        if req.params.prompt_logprobs is not None:
            built = req.prompt_logprobs
            built.extend(None if top is None else self._logprob_dict(top)
                         for top in first.prompt_logprobs[len(built) :])
            prompt_logprobs = list(built)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=metrics,
        )

    def _logprob_dict(self, top: TopLogprobs) -> dict[int, Logprob]:
        return {t: Logprob(lp, rank, self._decode_one(t)) for t, lp, rank in top}

    def _decode_one(self, token: int) -> str | None:
        text = self._decoded.get(token, False)
        if text is False:  # cached: bounded by the vocabulary
            text = self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else None
            self._decoded[token] = text
        return text
