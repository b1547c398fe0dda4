"""The HTTP request contract: which fields each route takes, how a body is parsed, and the OpenAPI 3 document of
the routes (served at GET /openapi.json) with this server's real limits.

One table of fields serves both the validator (service/http_server.py) and the document, so they cannot drift.
Body parsing is strict because every byte is the client's: the charset must exist, the bytes must decode, the JSON
must be an object nesting at most `_MAX_DEPTH` levels, holding only finite numbers (no NaN / Infinity literals, no
float that overflows to inf, no integer over `_MAX_INT_DIGITS` digits: Python's int() refuses 4300+ digits) and no
unpaired surrogates; each failure is an InvalidRequest naming the field, never another exception.

The document is built from the running ServingEngine, so every bound it states (n, max_tokens, prompt characters,
prompts per request, token ids < vocabulary size, priorities) is the one the server enforces, and a schema-driven
fuzzer (tests/test_http_schemathesis.py) explores the edges that matter. Cross-field rules a JSON schema cannot
state (prompt tokens + max_tokens <= context, min_tokens <= max_tokens) are in the descriptions; breaking them is
a documented 400. Request objects are closed (`additionalProperties: false`): the server refuses unknown fields.
Numeric ranges come from jaxserve.sampling_params, whose checks are the ones applied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.errors import short_repr
from jaxserve.sampling_params import MAX_REPETITION_PENALTY, MAX_TEMPERATURE, MIN_REPETITION_PENALTY
from service.protocol import BadNumber, InvalidRequest, loads_strict

if TYPE_CHECKING:
    from service.async_engine import ServingEngine

ROLES = ("system", "developer", "user", "assistant", "tool")
_MAX_DEPTH = 32  # JSON nesting levels; the deepest real request (chat content parts) needs 5
_MAX_INT_DIGITS = 40  # longer integers cannot be any field's value (seeds fit in 20 digits)

# OpenAI / vLLM request field -> SamplingParams field, for fields that pass straight through.
PASSTHROUGH = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
)
# Features we do not implement, with the values that ask for nothing (accepted, so default clients work); any other
# value is refused. `functions` / `function_call` are the legacy form of `tools` / `tool_choice`.
_UNSUPPORTED_COMMON = {"logit_bias": ({},), "response_format": ({"type": "text"},), "prompt_logprobs": ()}
UNSUPPORTED_COMPLETIONS = _UNSUPPORTED_COMMON | {"echo": (False,), "suffix": ("",), "best_of": (1,)}
UNSUPPORTED_CHAT = _UNSUPPORTED_COMMON | {
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
}
_COMMON_FIELDS = frozenset(("model", "stream", "stream_options", "max_tokens", "user", "priority", *PASSTHROUGH))
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", *UNSUPPORTED_COMPLETIONS}
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "parallel_tool_calls",
    "allow_special_tokens_in_content",
    *UNSUPPORTED_CHAT,
}


# ---- body parsing ---------------------------------------------------------------------------------------------


def parse_body(raw: bytes, charset: str) -> dict:
    """The request body as a JSON object, or InvalidRequest naming what is wrong (and the field, where there is one)."""
    try:
        text = raw.decode(charset)
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"the body is not valid {charset}: {e.reason} at byte {e.start}") from None
    except (LookupError, ValueError):  # an unknown codec, or one that is not a text encoding (base64, rot13)
        raise InvalidRequest(f"unknown charset {short_repr(charset)} in Content-Type; send UTF-8 JSON") from None
    try:
        body = loads_strict(text, _MAX_INT_DIGITS)
    except RecursionError:
        raise InvalidRequest(f"the body nests JSON deeper than {_MAX_DEPTH} levels") from None
    except ValueError as e:  # json.JSONDecodeError: says where
        raise InvalidRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object (got {type(body).__name__})")
    _check_values(body)
    return body


def _check_values(body: dict) -> None:
    """Depth, numbers and strings of every value, iteratively (a recursive walk is what deep nesting attacks)."""
    stack = [(v, k, (k,), 1) for k, v in body.items()]
    while stack:
        value, top, path, depth = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                raise InvalidRequest(
                    f"{_path(path)} contains an unpaired UTF-16 surrogate; strings must be valid Unicode", top
                )
        elif isinstance(value, BadNumber):
            raise InvalidRequest(
                f"{_path(path)} must be a finite number, integers at most {_MAX_INT_DIGITS} digits "
                f"(got {value.text[:20]}{'...' if len(value.text) > 20 else ''})",
                top,
            )
        elif isinstance(value, (dict, list)):
            if depth >= _MAX_DEPTH:
                raise InvalidRequest(f"{_path(path)} nests deeper than {_MAX_DEPTH} levels", top)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                if isinstance(k, str) and not _encodable(k):
                    raise InvalidRequest(f"a key in {_path(path)} contains an unpaired UTF-16 surrogate", top)
                stack.append((v, top, (path, k), depth + 1))
    for k in body:
        if not _encodable(k):
            raise InvalidRequest("a top-level key contains an unpaired UTF-16 surrogate")


def _encodable(s: str) -> bool:
    try:
        s.encode()
        return True
    except UnicodeEncodeError:
        return False


def _path(path: tuple) -> str:
    """`messages[0].content` from the linked tuple (parent, key) built while walking."""
    keys = []
    while len(path) == 2:
        path, key = path
        keys.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return str(path[0]) + "".join(reversed(keys))


# ---- the OpenAPI document -------------------------------------------------------------------------------------




def _int(lo: int | None = None, hi: int | None = None, **extra) -> dict:
    s = {"type": "integer", **extra}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def _num(lo: float, hi: float, *, open_lo: bool = False, **extra) -> dict:
    s = {"type": "number", "minimum": lo, "maximum": hi, **extra}
    if open_lo:
        s["exclusiveMinimum"] = True  # OpenAPI 3.0 form
    return s


def _nullable(s: dict) -> dict:
    return {**s, "nullable": True}


def _request_fields(serving: "ServingEngine") -> dict:
    """Properties both generation routes share."""
    lim, vocab, ctx = serving.limits, serving.vocab_size, serving.max_model_len
    max_tokens = ctx - 1 if lim.max_tokens is None else min(lim.max_tokens, ctx - 1)
    low, high = lim.priority_range
    return {
        "model": {"type": "string", "enum": [serving.model_name], "description": "optional; the one model served"},
        "n": _nullable(_int(1, lim.max_n)),
        "temperature": _nullable(_num(0.0, MAX_TEMPERATURE, description="0 = greedy")),
        "top_p": _nullable(_num(0.0, 1.0, open_lo=True)),
        "top_k": _nullable(_int(-1, vocab, description="0 or -1 = all tokens")),
        "min_p": _nullable(_num(0.0, 1.0)),
        "presence_penalty": _nullable(_num(-2.0, 2.0)),
        "frequency_penalty": _nullable(_num(-2.0, 2.0)),
        "repetition_penalty": _nullable(_num(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)),
        "seed": _nullable(_int(-(2**63), 2**63 - 1)),
        "max_tokens": _nullable(_int(1, max_tokens, description="prompt tokens + max_tokens must fit the context")),
        "min_tokens": _nullable(_int(0, max_tokens, description="<= max_tokens")),
        "stop": {
            "nullable": True,
            "oneOf": [
                {"type": "string", "minLength": 1, "maxLength": lim.max_stop_len},
                {
                    "type": "array",
                    "maxItems": lim.max_stop,
                    "items": {"type": "string", "minLength": 1, "maxLength": lim.max_stop_len},
                },
            ],
        },
        "stop_token_ids": _nullable({"type": "array", "items": _int(0, vocab - 1)}),
        "ignore_eos": _nullable({"type": "boolean"}),
        "skip_special_tokens": _nullable({"type": "boolean"}),
        "include_stop_str_in_output": _nullable({"type": "boolean"}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable(
            {
                "type": "object",
                "description": "only with stream: true",
                "properties": {"include_usage": _nullable({"type": "boolean"})},
                "additionalProperties": False,
            }
        ),
        "user": _nullable({"type": "string"}),
        "priority": _nullable(_int(low, high, description="lower = sooner (vLLM's convention)")),
        "logit_bias": {"type": "object", "maxProperties": 0, "description": "not supported: only {}"},
        "prompt_logprobs": {"nullable": True, "enum": [None], "description": "not supported: only null"},
        "response_format": {
            "type": "object",
            "properties": {"type": {"type": "string", "enum": ["text"]}},
            "required": ["type"],
            "additionalProperties": False,
        },
    }


def _token_ids(serving: "ServingEngine") -> dict:
    return {
        "type": "array",
        "minItems": 1,
        "maxItems": serving.max_model_len,
        "items": _int(0, serving.vocab_size - 1),
    }


def _completion_request(serving: "ServingEngine") -> dict:
    lim = serving.limits
    text = {"type": "string", "minLength": 1, "maxLength": lim.max_prompt_chars}
    ids = _token_ids(serving)
    props = _request_fields(serving) | {
        "prompt": {
            "oneOf": [
                text,
                {"type": "array", "minItems": 1, "maxItems": lim.max_prompts, "items": text},
                ids,
                {"type": "array", "minItems": 1, "maxItems": lim.max_prompts, "items": ids},
            ]
        },
        "logprobs": _nullable(_int(0, serving.llm.engine_config.max_logprobs)),
        "echo": {"type": "boolean", "enum": [False], "description": "not supported"},
        "suffix": _nullable({"type": "string", "maxLength": 0, "description": "not supported"}),
        "best_of": _nullable(_int(1, 1, description="not supported beyond 1")),
    }
    return {"type": "object", "required": ["prompt"], "properties": props, "additionalProperties": False}


def _chat_request(serving: "ServingEngine") -> dict:
    lim = serving.limits
    part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
        "additionalProperties": False,
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": list(ROLES)},
            "content": {"oneOf": [{"type": "string", "maxLength": lim.max_prompt_chars},
                                  {"type": "array", "items": part}]},
            "name": {"type": "string"},
        },
        "additionalProperties": False,
    }
    props = _request_fields(serving) | {
        "messages": {"type": "array", "minItems": 1, "items": message},
        "max_completion_tokens": _request_fields(serving)["max_tokens"],
        "logprobs": _nullable({"type": "boolean"}),
        "top_logprobs": _nullable(_int(0, serving.llm.engine_config.max_logprobs, description="needs logprobs: true")),
        "parallel_tool_calls": _nullable({"type": "boolean"}),
        "tools": {"type": "array", "maxItems": 0, "description": "not supported"},
        "tool_choice": {"type": "string", "enum": ["none"]},
        "functions": {"type": "array", "maxItems": 0, "description": "legacy form of tools: not supported"},
        "function_call": {"type": "string", "enum": ["none"], "description": "legacy form of tool_choice"},
        "allow_special_tokens_in_content": _nullable(
            {
                "type": "boolean",
                "description": "parse special-token text inside message content as special tokens (default: plain "
                "text, so content cannot forge roles)",
            }
        ),
    }
    return {"type": "object", "required": ["messages"], "properties": props, "additionalProperties": False}


_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True, "description": "the field at fault"},
                "code": {"type": "integer"},
            },
        }
    },
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {k: _int(0) for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
}
# One Server-Sent Event (OpenAPI before 3.2: a text/event-stream `schema` describes each event).
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk (or error), then the literal [DONE]"}},
}
_FINISH = {"type": "string", "nullable": True, "enum": ["stop", "length", "abort", None]}


def _response(kind: str) -> dict:
    """A unary completion / chat completion response."""
    if kind == "completion":
        choice = {
            "type": "object",
            "required": ["index", "text", "finish_reason"],
            "properties": {
                "index": _int(0),
                "text": {"type": "string"},
                "logprobs": {"type": "object", "nullable": True},
                "finish_reason": _FINISH,
            },
        }
    else:
        choice = {
            "type": "object",
            "required": ["index", "message", "finish_reason"],
            "properties": {
                "index": _int(0),
                "message": {
                    "type": "object",
                    "required": ["role", "content"],
                    "properties": {"role": {"type": "string", "enum": ["assistant"]}, "content": {"type": "string"}},
                },
                "logprobs": {"type": "object", "nullable": True},
                "finish_reason": _FINISH,
            },
        }
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["text_completion" if kind == "completion" else "chat.completion"]},
            "created": _int(0),
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": _USAGE,
        },
    }


def _errors(*codes: int) -> dict:
    why = {
        400: "invalid request; `param` names the field",
        401: "missing or invalid API key",
        404: "unknown model",
        413: "body larger than the server's limit",
        415: "body is not JSON",
        429: "the server is at capacity; retry later",
        503: "the server is draining or not ready",
    }
    body = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(c): {"description": why[c], "content": body} for c in codes}


def _generation(summary: str, request: str, response: str) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{request}"}}}},
            "responses": {
                "200": {
                    "description": (
                        "the completion; with stream: true, Server-Sent Events of chunks, then `data: [DONE]`"
                    ),
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{response}"}},
                        "text/event-stream": {"schema": _SSE_EVENT},
                    },
                },
                **_errors(400, 401, 404, 413, 415, 429, 503),
            },
        }
    }


def openapi_schema(serving: "ServingEngine") -> dict:
    model_card = {
        "type": "object",
        "required": ["id", "object", "created", "owned_by", "max_model_len"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["model"]},
            "created": _int(0),
            "owned_by": {"type": "string"},
            "root": {"type": "string"},
            "parent": {"type": "string", "nullable": True},
            "max_model_len": _int(1),
        },
    }
    models = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"type": "string", "enum": ["list"]}, "data": {"type": "array", "items": model_card}},
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "jaxserve OpenAI-compatible API", "version": "1"},
        "paths": {
            "/v1/completions": _generation("text completion", "CompletionRequest", "CompletionResponse"),
            "/v1/chat/completions": _generation("chat completion", "ChatCompletionRequest", "ChatCompletionResponse"),
            "/v1/models": {
                "get": {
                    "summary": "the served model",
                    "responses": {
                        "200": {"description": "one model card", "content": {"application/json": {"schema": models}}},
                        **_errors(401),
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "readiness (no API key needed)",
                    "responses": {"200": {"description": "ready"}, "503": {"description": "not ready or draining"}},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {"description": "text exposition format",
                                "content": {"text/plain": {"schema": {"type": "string"}}}},
                        **_errors(401),
                    },
                }
            },
        },
        "components": {
            "schemas": {
                "CompletionRequest": _completion_request(serving),
                "ChatCompletionRequest": _chat_request(serving),
                "CompletionResponse": _response("completion"),
                "ChatCompletionResponse": _response("chat"),
                "Error": _ERROR,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
