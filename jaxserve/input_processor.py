"""Admission: a prompt and its SamplingParams checked against this engine before anything is queued.

`SamplingParams` checks what it can alone (types, ranges); what depends on the model and the engine is checked
here: the prompt's form and length against `max_model_len`, token ids and `top_k` against the vocabulary,
logprob counts against `max_logprobs`. Every failure is an `InvalidRequestError` naming its field, so a bad
request fails alone and a server reports the field without reading the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.errors import InvalidRequestError
from jaxserve.sampler import MAX_BANNED
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

PromptType = str | dict  # "text" | {"prompt_token_ids": [...]} | {"prompt": "text"}


@dataclass(frozen=True)
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]
    max_tokens: int  # the request's limit on generated tokens, cut to what fits in max_model_len


class InputProcessor:
    def __init__(self, cfg: EngineConfig, vocab_size: int, tokenizer: Tokenizer | None,
                 stop_ids: Callable[[SamplingParams], list[int]]):
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids

    def prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, (int, np.integer)) for t in ids):
                    raise InvalidRequestError("prompt_token_ids must be a list of integers", "prompt_token_ids", "type")
                return prompt.get("prompt"), [int(t) for t in ids]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError(
                    f"a dict prompt needs 'prompt_token_ids' or 'prompt' (got keys {sorted(prompt)})", "prompt", "type"
                )
        if not isinstance(prompt, str):
            raise InvalidRequestError(
                f"prompt must be a string or a dict with 'prompt_token_ids' (got {type(prompt).__name__})", "prompt",
                "type"
            )
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer; pass {'prompt_token_ids': [...]} instead of text", "prompt", "unsupported"
            )
        if not prompt:  # it would still tokenize to a lone BOS: say so instead of generating from nothing
            raise InvalidRequestError("prompt is empty: it must contain at least one token", "prompt", "empty")
        return prompt, self.tokenizer.encode(prompt)

    def process(self, prompt: PromptType, params: SamplingParams, priority: int) -> ProcessedPrompt:
        text, ids = self.prompt_ids(prompt)
        limit, V = self.cfg.max_model_len, self.vocab_size
        if not ids:
            raise InvalidRequestError("prompt is empty: it must contain at least one token", "prompt", "empty")
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but max_model_len is {limit}: "
                "it must be shorter to leave room for output",
                "prompt", "too_long",
            )
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be in [0, {V}) (got {bad[:5]})", "prompt", "range")
        if params.top_k > V:
            raise InvalidRequestError(
                f"top_k must be <= the vocabulary size {V} (got {params.top_k}); 0 or -1 = all tokens", "top_k", "range"
            )
        bad = [t for t in params.stop_token_ids if t >= V]
        if bad:
            raise InvalidRequestError(f"stop_token_ids must be in [0, {V}) (got {bad[:5]})", "stop_token_ids", "range")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.cfg.max_logprobs:
                raise InvalidRequestError(f"{name} must be <= max_logprobs={self.cfg.max_logprobs} (got {k})", name,
                                          "range")
        if params.min_tokens and len(self.stop_ids(params)) > MAX_BANNED:
            raise InvalidRequestError(
                f"with min_tokens, at most {MAX_BANNED} EOS + stop_token_ids can be suppressed", "min_tokens",
                "conflict"
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer (got {priority!r})", "priority", "type")
        room = limit - len(ids)
        return ProcessedPrompt(text, ids, room if params.max_tokens is None else min(params.max_tokens, room))
