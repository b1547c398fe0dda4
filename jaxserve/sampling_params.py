"""SamplingParams: per-request generation settings, with vLLM's field names and defaults.

Validation happens at construction so a bad request fails alone, before it reaches the engine, with an error
that names the field and the allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
        def check(ok: bool, msg: str):
            if not ok:
                raise ValueError(msg)

        check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1 (got {self.n!r})")
        check(self.temperature >= 0, f"temperature must be >= 0 (got {self.temperature})")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p})")
        check(
            isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
            f"top_k must be -1, 0 (disabled) or a positive integer (got {self.top_k!r})",
        )
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1] (got {self.min_p})")
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1 (got {self.max_tokens!r})",
        )
        check(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2] (got {self.presence_penalty})")
        check(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2] (got {self.frequency_penalty})")
        check(self.repetition_penalty > 0, f"repetition_penalty must be > 0 (got {self.repetition_penalty})")
        check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            f"min_tokens must be an integer >= 0 (got {self.min_tokens!r})",
        )
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            check(v is None or (isinstance(v, int) and v >= 0), f"{name} must be an integer >= 0 (got {v!r})")
        check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer (got {self.seed!r})")
        check(
            self.num_speculative_tokens is None
            or (isinstance(self.num_speculative_tokens, int) and self.num_speculative_tokens >= 0),
            f"num_speculative_tokens must be None or an integer >= 0 (got {self.num_speculative_tokens!r})",
        )
        if self.top_k == -1:
            self.top_k = 0
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        check(all(isinstance(s, str) and s for s in stops), f"stop must be non-empty strings (got {self.stop!r})")
        self._stop_list = stops
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
