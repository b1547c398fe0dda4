"""Host-side state of one sequence (one of a request's `n` samples). Plain Python: no jax here."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from jaxserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved limit on generated tokens
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # log-probability of each generated token
    output_top_logprobs: list[list[tuple[int, float, int]]] = field(default_factory=list)  # (token, logprob, rank)
    # prompt_logprobs[i]: [(token, logprob, rank)] for prompt position i (entry 0 is None: nothing predicts it)
    prompt_logprobs: list[list[tuple[int, float, int]] | None] = field(default_factory=lambda: [None])
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    page_ids: list[int] = field(default_factory=list)
    page_hashes: list[int] = field(default_factory=list)  # prefix-cache hashes of the leading full, computed pages
    priority: int = 0  # lower runs first (vLLM's convention)
    arrival_step: int = 0  # scheduler step at arrival, for aging
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens proposed for the next step
    # >= 0: spec_token_ids are placeholders for drafts on the device, at this offset of the EAGLE-3 head's draft
    # array (`Eagle3Proposer`; valid until the head runs again)
    spec_draft_slot: int = -1
    draft_num_computed: int = 0  # tokens whose draft-model KV is valid (draft_model speculation)
    spec_disabled: bool = False  # the proposer can no longer draft for it (an EAGLE-3 head skipped its catch-up)
    spec_num_verified: int = 0  # draft tokens verified so far (speculative decoding metrics)
    spec_num_accepted: int = 0  # of which accepted
    # Async scheduling: tokens being sampled by steps still in flight. They count in num_tokens (the scheduler plans
    # the next step past them) but are not in output_token_ids yet; the newest one is row `pending_row` of the
    # step in flight, which feeds it to the next step on the device.
    num_pending_tokens: int = 0
    pending_row: int = -1

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, including those still being sampled (`num_pending_tokens`)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has (`token_ids`): all but the pending ones."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, including those still being sampled."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str, now: float, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = now
