"""SamplingParams: per-request generation settings, with vLLM's field names and defaults.

Validation happens at construction so a bad request fails alone, before it reaches the engine, with an error
that names the field and the allowed range: every field's type and range is checked (numbers finite and bounded so
no value can overflow the step's int32 / float32 arrays), and numbers are normalised to Python int / float.
Every failure is an `InvalidRequestError` (a ValueError) whose `param` is the field's name and whose `kind` says
what is wrong ("type": not a number / boolean / list of the right sort; "range": out of bounds, NaN or inf
included; "empty": an empty stop string; "conflict": min_tokens > max_tokens), so a server reports the field
without reading the message.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from jaxserve.errors import InvalidRequestError, short_repr

# Bounds every request is checked against (the vocabulary-dependent ones -- top_k, token ids -- in the engine).
MAX_N = 1024
MAX_TEMPERATURE = 100.0  # beyond this the distribution is uniform to float32 precision; 1e300 would overflow to inf
GREEDY_EPS = 1e-5  # temperatures below this are treated as greedy, as vLLM does
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0  # a positive logit / 1e-40 overflows to inf
INT32_MAX = 2**31 - 1


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 = all tokens
    min_p: float = 0.0  # [0, 1]
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0  # EOS and stop tokens are suppressed until this many tokens are out
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k log-probabilities per generated token
    prompt_logprobs: int | None = None  # top-k log-probabilities per prompt token (the first has none)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    num_speculative_tokens: int | None = None  # cap on draft tokens per step for this request (0 = no speculation;
    # None = the engine's choice). A jaxserve extension: vLLM sets speculation per engine only.
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        def check(ok: bool, msg: str, param: str, kind: str = "range"):
            if not ok:
                raise InvalidRequestError(msg, param=param, kind=kind)

        def is_int(v) -> bool:
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def integer(name: str, lo: int | None = None, hi: int | None = None, *, optional: bool = False) -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            rng = f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}" if lo is not None else ""
            msg = f"{name} must be an integer{rng} (got {short_repr(v)})"
            check(is_int(v), msg, name, "type")
            check((lo is None or v >= lo) and (hi is None or v <= hi), msg, name)
            setattr(self, name, int(v))

        def real(name: str, lo: float, hi: float, *, open_lo: bool = False) -> None:
            v = getattr(self, name)
            msg = f"{name} must be in {'(' if open_lo else '['}{lo:g}, {hi:g}] (got {short_repr(v)})"
            check(isinstance(v, numbers.Real) and not isinstance(v, bool), msg, name, "type")
            check(math.isfinite(v) and (v > lo if open_lo else v >= lo) and v <= hi, msg, name)
            setattr(self, name, float(v))

        def boolean(name: str) -> None:
            v = getattr(self, name)
            check(isinstance(v, bool), f"{name} must be a boolean (got {short_repr(v)})", name, "type")

        integer("n", 1, MAX_N)
        real("temperature", 0.0, MAX_TEMPERATURE)
        if self.temperature < GREEDY_EPS:  # vLLM's rule: a temperature this small is greedy (x / 1e-9 overflows)
            self.temperature = 0.0
        real("top_p", 0.0, 1.0, open_lo=True)
        v = self.top_k
        msg = f"top_k must be -1, 0 (disabled) or a positive integer <= the vocabulary size (got {short_repr(v)})"
        check(is_int(v), msg, "top_k", "type")
        check((v >= 0 or v == -1) and v <= INT32_MAX, msg, "top_k")
        self.top_k = 0 if v == -1 else int(v)
        real("min_p", 0.0, 1.0)
        real("presence_penalty", -2.0, 2.0)
        real("frequency_penalty", -2.0, 2.0)
        real("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        integer("seed", optional=True)
        integer("max_tokens", 1, optional=True)
        integer("min_tokens", 0)
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            "min_tokens",
            "conflict",
        )
        integer("logprobs", 0, optional=True)
        integer("prompt_logprobs", 0, optional=True)
        integer("num_speculative_tokens", 0, optional=True)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            boolean(name)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        msg = f"stop must be a non-empty string or a list of them (got {short_repr(self.stop)})"
        check(isinstance(stops, (list, tuple)) and all(isinstance(s, str) for s in stops), msg, "stop", "type")
        check(all(stops), msg, "stop", "empty")
        self._stop_list = list(stops)
        ids = self.stop_token_ids or []
        msg = f"stop_token_ids must be a list of token ids >= 0 (got {short_repr(self.stop_token_ids)})"
        check(isinstance(ids, (list, tuple)) and all(is_int(t) for t in ids), msg, "stop_token_ids", "type")
        check(all(0 <= t <= INT32_MAX for t in ids), msg, "stop_token_ids")
        self.stop_token_ids = [int(t) for t in ids]

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
