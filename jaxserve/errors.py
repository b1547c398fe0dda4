"""Errors the engine raises to its callers, by kind, so a server maps them to statuses by type, never by text.

- `InvalidRequestError`, a `ValueError` (raised by `SamplingParams` and `LLMEngine.add_request`): the request is
  invalid; it was never admitted and nothing else is affected. `param` names the offending field (`prompt`,
  `top_k`, ...) and `kind` says what is wrong with it, so a server reports both without reading the message.
- `RequestFailedError`: an admitted request failed inside a step (its logits turned NaN, its host-side processing
  raised). The engine removed it and freed its pages; every other request goes on.
- `EngineDeadError`: the engine loop stopped on a failure it cannot attribute to one request (the device step
  raised repeatedly, the KV cache was lost). Every pending and future request gets it; a server should exit so that
  its supervisor restarts it.
"""

from __future__ import annotations


def short_repr(value) -> str:
    """repr of a client value for an error message, at most ~60 characters: errors say what was wrong without echoing
    megabytes back (and a 5000-digit integer, which repr() refuses, is described instead)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    return text if len(text) <= 60 else f"{text[:60]}... ({len(text)} characters)"


class InvalidRequestError(ValueError):
    """A request rejected before admission. `param`: the field at fault (a `SamplingParams` field name, `prompt`,
    `request_id`, `priority`), or None when no single field is; `kind`: one of `KINDS`."""

    KINDS = ("type", "range", "empty", "too_long", "conflict", "duplicate", "unsupported")

    def __init__(self, message: str, param: str | None = None, kind: str = "range"):
        if kind not in self.KINDS:
            raise ValueError(f"unknown error kind {kind!r}; one of {self.KINDS}")
        super().__init__(message)
        self.param = param
        self.kind = kind


class RequestFailedError(RuntimeError):
    def __init__(self, request_id: str, reason: str):
        super().__init__(f"request {request_id!r} failed in the engine: {reason}")
        self.request_id = request_id
        self.reason = reason


class EngineDeadError(RuntimeError):
    def __init__(self, cause: BaseException | str):
        super().__init__(f"the engine loop died: {cause!r}" if isinstance(cause, BaseException) else cause)
        self.cause = cause
