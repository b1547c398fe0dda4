"""What every endpoint shares: request errors, per-request limits, and building SamplingParams from wire values.

Each protocol (jaxserve.v1 gRPC, KServe v2, OpenAI HTTP) turns its request into a plain dict of vLLM-named
sampling fields and calls `build_sampling_params`, so a field is checked the same way whichever door it came in
by, and every rejection names the field. The error classes map onto one gRPC status and one HTTP status each.
Engine errors map by type, never by message text: `invalid_request(e, default)` turns a jaxserve
`InvalidRequestError` into InvalidRequest naming its `param`, and any other ValueError / TypeError (older paths
that raise them plain) into one naming `default`, the field the caller handed over.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import grpc

from jaxserve import SamplingParams
from jaxserve.errors import InvalidRequestError


class ServiceError(Exception):
    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(ServiceError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    error_type = "invalid_request_error"


def invalid_request(error: Exception, default: str | None, prefix: str = "") -> InvalidRequest:
    """InvalidRequest for a request error the engine raised: its `param` if it is an InvalidRequestError that names
    one, else `default`. `prefix` goes before the message (e.g. "sampling_parameters: ")."""
    param = error.param if isinstance(error, InvalidRequestError) and error.param is not None else default
    return InvalidRequest(f"{prefix}{error}", param)


class ModelNotFound(ServiceError):
    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404
    error_type = "not_found_error"


class DuplicateRequest(ServiceError):
    grpc_code = grpc.StatusCode.ALREADY_EXISTS
    http_status = 409
    error_type = "conflict_error"


class Overloaded(ServiceError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    error_type = "rate_limit_error"


class Unavailable(ServiceError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    error_type = "service_unavailable"


@dataclass(frozen=True, kw_only=True)
class ServingLimits:
    """Per-request and per-server bounds. Requests beyond them are rejected, never silently clamped."""

    max_n: int = 16
    max_tokens: int | None = None  # None = up to max_model_len
    max_stop: int = 16  # stop strings per request
    max_stop_len: int = 256  # characters per stop string
    max_prompt_chars: int = 1 << 20
    max_in_flight: int = 256  # admitted, unfinished requests; beyond -> RESOURCE_EXHAUSTED / 429
    max_message_bytes: int = 16 << 20  # gRPC receive limit and HTTP body limit
    max_request_id_len: int = 256  # characters of a client-chosen request id (echoed in every response)
    max_prompts: int = 64  # prompts in one request (a /v1/completions list); each one counts toward max_in_flight
    priority_range: tuple[int, int] = (-(2**31), 2**31 - 1)  # client-set priorities allowed (lower = sooner)


# Field name -> kind, for every SamplingParams field a client may set.
_INT = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs")
_FLOAT = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_BOOL = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
FIELDS = _INT + _FLOAT + _BOOL + ("stop", "stop_token_ids")


def build_sampling_params(
    fields: dict, limits: ServingLimits, *, vocab_size: int, coerce_strings: bool = False
) -> SamplingParams:
    """SamplingParams from a dict of vLLM-named fields (None = default), checked field by field.

    coerce_strings: accept numbers and booleans written as strings ("0.5", "true"), as Triton's vLLM backend
    clients send them.
    """
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(unknown)}", unknown[0])
    kw = {}
    for name, value in fields.items():
        if value is None:
            continue
        if coerce_strings and isinstance(value, str) and name not in ("stop",):
            value = _from_string(name, value)
        if name in _INT:
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidRequest(f"{name} must be an integer (got {value!r})", name)
        elif name in _FLOAT:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidRequest(f"{name} must be a finite number (got {value!r})", name)
            value = float(value)
        elif name in _BOOL:
            if not isinstance(value, bool):
                raise InvalidRequest(f"{name} must be a boolean (got {value!r})", name)
        kw[name] = value
    if kw.get("n", 1) > limits.max_n:
        raise InvalidRequest(f"n must be <= {limits.max_n} (got {kw['n']})", "n")
    if limits.max_tokens is not None and kw.get("max_tokens", 0) > limits.max_tokens:
        raise InvalidRequest(f"max_tokens must be <= {limits.max_tokens} (got {kw['max_tokens']})", "max_tokens")
    if "seed" in kw and not -(2**63) <= kw["seed"] < 2**63:
        raise InvalidRequest(f"seed must fit in 64 bits (got {kw['seed']})", "seed")
    stop = kw.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise InvalidRequest(f"stop must be a string or a list of strings (got {stop!r})", "stop")
        if len(stops) > limits.max_stop or any(len(s) > limits.max_stop_len for s in stops):
            raise InvalidRequest(
                f"stop allows at most {limits.max_stop} strings of at most {limits.max_stop_len} characters", "stop"
            )
    ids = kw.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest(f"stop_token_ids must be a list of integers (got {ids!r})", "stop_token_ids")
        if any(not 0 <= t < vocab_size for t in ids):
            raise InvalidRequest(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    try:
        params = SamplingParams(**kw)
    except ValueError as e:  # SamplingParams' own checks: InvalidRequestError naming the field
        raise invalid_request(e, None) from None
    if params.top_k > vocab_size:
        raise InvalidRequest(f"top_k must be <= the vocabulary size {vocab_size} (got {params.top_k}); 0 or -1 = all",
                             "top_k")
    return params


def _from_string(name: str, value: str):
    try:
        if name in _INT:
            return int(value)
        if name in _FLOAT:
            return float(value)
        if name in _BOOL:
            if value.lower() in ("true", "1"):
                return True
            if value.lower() in ("false", "0"):
                return False
        if name == "stop_token_ids":
            import json

            return json.loads(value)
    except ValueError:
        pass
    raise InvalidRequest(f"{name}: cannot parse {value!r}", name)


class BadNumber:
    """A JSON number Python would read wrongly or not at all (NaN / Infinity literals, floats that overflow to inf,
    integers of more than the caller's digit limit): kept as a marker so the error can name the field holding it."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


def loads_strict(text: str, max_int_digits: int):
    """json.loads with every doubtful number (see BadNumber) replaced by a BadNumber marker."""

    def parse_int(t: str):
        return BadNumber(t) if len(t) > max_int_digits else int(t)

    def parse_float(t: str):
        value = float(t)
        return value if math.isfinite(value) else BadNumber(t)

    return json.loads(text, parse_int=parse_int, parse_float=parse_float, parse_constant=BadNumber)


def check_prompt(prompt, limits: ServingLimits, vocab_size: int, param: str = "prompt"):
    """A text prompt or a list of token ids, type- and size-checked; returns the engine's prompt form."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest(f"{param} is empty: it must contain at least one token", param)
        if len(prompt) > limits.max_prompt_chars:
            raise InvalidRequest(f"{param} has {len(prompt)} characters; the limit is {limits.max_prompt_chars}", param)
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise InvalidRequest(f"{param} is empty: it must contain at least one token", param)
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"{param} token ids must be in [0, {vocab_size}) (got {bad[:5]})", param)
        return {"prompt_token_ids": prompt}
    raise InvalidRequest(f"{param} must be a string or a list of token ids (got {type(prompt).__name__})", param)
