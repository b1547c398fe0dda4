"""OpenAI-compatible HTTP endpoint (aiohttp): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics,
and its own OpenAPI 3 schema at /openapi.json (service/openapi.py).

Request and response shapes follow the OpenAI API as vLLM serves it, including vLLM's extra sampling fields
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, priority, ...). Streaming is Server-Sent
Events: one `data: {json}` event per chunk and `data: [DONE]` at the end; `stream_options.include_usage` adds a
final chunk with empty choices and the usage. Errors are `{"error": {"message", "type", "param", "code"}}` with 400
(invalid field, named in `param`), 401 (API key), 404 (unknown model or route), 405 (method), 413 (body too large),
415 (not JSON), 429 (overload), 503 (draining / not ready). An error after streaming has started is sent as a
`data: {"error": ...}` event. A client that disconnects cancels its handler (handler_cancellation), which aborts its
requests in the engine.

Hostile input: every byte of a request is the client's, so nothing in it may raise anything but a ServiceError.
The body is read and parsed by us, not aiohttp (service/openapi.py: charset, encoding, JSON depth, finite numbers).
Every top-level field is known to its route and type-checked; an unknown or unsupported field is a 400 naming it,
never silently ignored (as OpenAI does; vLLM only logs). Parsing, validation and chat-template rendering +
tokenization run in a worker thread, so a 16 MiB body or a 1M-character conversation never stalls the event loop
(health, other streams), and sizes are checked before anything is tokenized. A request with several prompts is
admitted whole or refused once (429); its streams are merged keeping only each one's newest output.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import hashlib
import hmac
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jaxserve import SamplingParams
from jaxserve.errors import short_repr
from service.async_engine import ServingEngine
from service.openapi import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    PASSTHROUGH,
    ROLES,
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETIONS,
    openapi_schema,
    parse_body,
)
from service.protocol import InvalidRequest, ModelNotFound, ServiceError, check_prompt

logger = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 1000  # error messages quote client values; a 16 MiB value is not echoed back
_STREAMING = web.RequestKey("jaxserve_streaming", bool)  # set once a response's status line is sent


class _TooLarge(InvalidRequest):
    http_status = 413


class _NotJSON(InvalidRequest):
    http_status = 415


class _HTTPError(ServiceError):
    """A routing error (404 unknown route, 405 method) as a JSON error body."""

    error_type = "invalid_request_error"

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.http_status = status


def _error_body(e: ServiceError) -> dict:
    message = e.message if len(e.message) <= _MAX_ERROR_CHARS else e.message[:_MAX_ERROR_CHARS] + "..."
    return {"error": {"message": message, "type": e.error_type, "param": e.param, "code": e.http_status}}


def _error_response(e: ServiceError, headers: dict | None = None) -> web.Response:
    return web.json_response(_error_body(e), status=e.http_status, headers=headers)


def _parsed_and(prepare: Callable[[dict], "_Request"], raw: bytes, charset: str) -> "_Request":
    return prepare(parse_body(raw, charset))


def _renamed(e: ServiceError, renames: dict[str, str]) -> ServiceError:
    """The error with a field renamed to the one the client sent (chat's max_completion_tokens arrives in
    SamplingParams as max_tokens, top_logprobs as logprobs, and their errors must name what the client wrote)."""
    if e.param in renames:
        old = e.param
        e.param = renames[old]
        e.message = re.sub(rf"\b{old}\b", e.param, e.message)
    return e


@dataclass
class _Request:
    """A validated request: what the engine runs, and how the answer is shaped."""

    prompts: list
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    renames: dict[str, str] = field(default_factory=dict)


class OpenAIServer:
    def __init__(self, serving: ServingEngine, *, api_key: str | None = None):
        self.serving = serving
        self._key_digest = None if api_key is None else hashlib.sha256(api_key.encode()).digest()
        self.app = web.Application(
            middlewares=[self._errors, self._auth], client_max_size=serving.limits.max_message_bytes
        )
        self.app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
                web.get("/openapi.json", self.openapi),
            ]
        )

    # ---- middleware -----------------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ServiceError as e:
            return _error_response(e)
        except web.HTTPRequestEntityTooLarge as e:
            return _error_response(_TooLarge(f"request body too large: {e.text}"))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            return _error_response(_HTTPError(f"{request.method} {short_repr(request.path)}: {e.reason}", e.status),
                                   allow)
        except Exception:
            if request.get(_STREAMING):  # the status line is sent already; the stream loop reported what it could
                raise
            logger.exception("internal error on %s %s", request.method, request.path)
            return _error_response(ServiceError("internal server error; the server log has the details"))

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self._key_digest is not None and request.path not in ("/health", "/openapi.json"):
            if not self._authorized(request.headers.get(hdrs.AUTHORIZATION, "")):
                body = {"error": {"message": "missing or invalid API key", "type": "authentication_error",
                                  "param": None, "code": 401}}
                return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    def _authorized(self, header: str) -> bool:
        """`Bearer <key>`, the scheme in any case (RFC 7235). The key is compared as a SHA-256 digest with
        compare_digest: constant time in its content and its length."""
        scheme, _, token = header.strip().partition(" ")
        given = hashlib.sha256(token.strip().encode("utf-8", "surrogatepass")).digest()
        return hmac.compare_digest(given, self._key_digest) and scheme.lower() == "bearer"

    # ---- simple endpoints -----------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.serving.evaluate_readiness() else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.serving.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_schema(self.serving))

    async def models(self, request: web.Request) -> web.Response:
        s = self.serving
        card = {
            "id": s.model_name,
            "object": "model",
            "created": int(s.started),
            "owned_by": "jaxserve",
            "root": s.model_name,
            "parent": None,
            "max_model_len": s.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    # ---- request parsing (in a worker thread, see the module docstring) --------------------------------------

    async def _request(self, request: web.Request, prepare: Callable[[dict], _Request]) -> _Request:
        mime = request.content_type
        if hdrs.CONTENT_TYPE in request.headers and mime != "application/json" and not (
            mime.startswith("application/") and mime.endswith("+json")
        ):
            raise _NotJSON(f"the body must be JSON: send Content-Type: application/json (got {short_repr(mime)})")
        charset = request.charset or "utf-8"
        raw = await request.read()  # HTTPRequestEntityTooLarge beyond client_max_size -> 413
        return await asyncio.to_thread(_parsed_and, prepare, raw, charset)

    def _check_fields(self, body: dict, required: str, allowed: frozenset, unsupported: dict) -> None:
        if body.get(required) is None:  # first: {"prompt": ...} sent to the chat route is missing its messages
            raise InvalidRequest(f"{required} is required", required)
        for name in body:
            if name not in allowed:
                close = difflib.get_close_matches(name, allowed, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else " (GET /openapi.json lists the fields)"
                raise InvalidRequest(f"unknown field {short_repr(name)}{hint}", name[:100])
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequest(f"model must be a string (got {short_repr(model)})", "model")
        if model is not None and model != self.serving.model_name:
            raise ModelNotFound(
                f"model {short_repr(model)} does not exist; this server serves {self.serving.model_name!r}", "model"
            )
        for name, harmless in unsupported.items():
            value = body.get(name)
            if value is not None and not any(type(value) is type(h) and value == h for h in harmless):
                raise InvalidRequest(f"{name} is not supported by this server (got {short_repr(value)})", name)
        for name, kind in (("user", str), ("parallel_tool_calls", bool), ("allow_special_tokens_in_content", bool)):
            value = body.get(name)
            if value is not None and not isinstance(value, kind):
                raise InvalidRequest(
                    f"{name} must be a {'string' if kind is str else 'boolean'} (got {short_repr(value)})", name
                )

    def _priority(self, body: dict) -> int:
        value = body.get("priority")
        if value is None:
            return 0
        low, high = self.serving.limits.priority_range
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise InvalidRequest(f"priority must be an integer in [{low}, {high}] (got {short_repr(value)})",
                                 "priority")
        return value

    @staticmethod
    def _stream_options(body: dict) -> tuple[bool, bool]:
        stream = body.get("stream")
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise InvalidRequest(f"stream must be a boolean (got {short_repr(stream)})", "stream")
        opts = body.get("stream_options")
        if opts is None:
            return stream, False
        if not isinstance(opts, dict):
            raise InvalidRequest(f"stream_options must be an object (got {short_repr(opts)})", "stream_options")
        if not stream:
            raise InvalidRequest("stream_options is only allowed with stream: true", "stream_options")
        for key, value in opts.items():
            if key not in ("include_usage", "continuous_usage_stats"):
                raise InvalidRequest(f"unknown field stream_options.{short_repr(key)}", f"stream_options.{key[:100]}")
            if value is not None and not isinstance(value, bool):
                raise InvalidRequest(f"stream_options.{key} must be a boolean (got {short_repr(value)})",
                                     f"stream_options.{key}")
        if opts.get("continuous_usage_stats"):
            raise InvalidRequest("stream_options.continuous_usage_stats is not supported by this server",
                                 "stream_options.continuous_usage_stats")
        return stream, bool(opts.get("include_usage"))

    def _sampling_fields(self, body: dict) -> dict:
        return {k: body[k] for k in PASSTHROUGH if k in body}

    # ---- /v1/completions ------------------------------------------------------------------------------------

    def _completion_request(self, body: dict) -> _Request:
        self._check_fields(body, "prompt", COMPLETION_FIELDS, UNSUPPORTED_COMPLETIONS)
        limits = self.serving.limits
        raw = body.get("prompt")
        if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise InvalidRequest("prompt must be a string, a list of strings, or a list of token-id lists", "prompt")
        if len(raw) > limits.max_prompts:
            raise InvalidRequest(f"prompt holds {len(raw)} prompts; the limit is {limits.max_prompts} per request",
                                 "prompt")
        for p in raw:  # a token list longer than the context is refused before its ids are looked at
            if isinstance(p, list) and len(p) > self.serving.max_model_len:
                raise InvalidRequest(
                    f"prompt has {len(p)} tokens; this model's context is {self.serving.max_model_len}", "prompt"
                )
        prompts = [check_prompt(p, limits, self.serving.vocab_size) for p in raw]
        fields = self._sampling_fields(body)
        max_tokens = body.get("max_tokens")
        fields["max_tokens"] = 16 if max_tokens is None else max_tokens  # OpenAI's default for completions
        if body.get("logprobs") is not None:
            fields["logprobs"] = body["logprobs"]
        params = self.serving.build_params(fields)
        stream, include_usage = self._stream_options(body)
        return _Request(prompts, params, stream, include_usage, self._priority(body))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._request(request, self._completion_request)
        params, stream = req.params, req.stream
        cid = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": self.serving.model_name}

        def choices(i: int, out, prev: dict) -> list[dict]:
            result = []
            for c in out.outputs:
                key = (i, c.index)
                n_text, n_tok = prev.get(key, (0, 0))
                if (stream and len(c.text) == n_text and not c.finish_reason
                        and (params.logprobs is None or len(c.token_ids) == n_tok)):
                    continue  # nothing to show yet (e.g. half a UTF-8 character)
                lp = _completion_logprobs(c, n_tok, n_text) if params.logprobs is not None else None
                prev[key] = (len(c.text), len(c.token_ids))
                result.append(
                    {"index": i * params.n + c.index, "text": c.text[n_text:], "logprobs": lp,
                     "finish_reason": c.finish_reason}
                )
            return result

        return await self._respond(request, req, cid, head, choices, "completions")

    # ---- /v1/chat/completions -------------------------------------------------------------------------------

    def _chat_request(self, body: dict) -> _Request:
        """Validated chat request, its prompt rendered and tokenized (this runs in a worker thread).

        Message content is tokenized as plain text: special-token strings a client writes ("</s>",
        "<|im_start|>system") stay characters and cannot forge turns. The request field
        `allow_special_tokens_in_content: true` opts in to parsing them as special tokens (the behaviour before).
        """
        self._check_fields(body, "messages", CHAT_FIELDS, UNSUPPORTED_CHAT)
        conv = self._messages(body.get("messages"))
        fields, renames = self._sampling_fields(body), {}
        mct, mt = body.get("max_completion_tokens"), body.get("max_tokens")
        if mct is not None and mt is not None and mct != mt:
            raise InvalidRequest("give max_completion_tokens or max_tokens (its deprecated name), not both",
                                 "max_tokens")
        fields["max_tokens"] = mct if mct is not None else mt  # None: up to the context
        if mct is not None:
            renames["max_tokens"] = "max_completion_tokens"
        want_lp, top = body.get("logprobs"), body.get("top_logprobs")
        if want_lp is not None and not isinstance(want_lp, bool):
            raise InvalidRequest(f"logprobs must be a boolean (got {short_repr(want_lp)})", "logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
            raise InvalidRequest(f"top_logprobs must be an integer >= 0 (got {short_repr(top)})", "top_logprobs")
        if want_lp:
            fields["logprobs"] = top or 0
            renames["logprobs"] = "top_logprobs"
        elif top:
            raise InvalidRequest("top_logprobs requires logprobs: true", "top_logprobs")
        try:
            params = self.serving.build_params(fields)
        except ServiceError as e:
            raise _renamed(e, renames) from None
        stream, include_usage = self._stream_options(body)
        priority = self._priority(body)
        tok = self.serving.tokenizer
        if tok is None:
            raise InvalidRequest("this model has no tokenizer, so it cannot render chat messages", "messages")
        try:
            text, ids = tok.encode_chat(
                conv, add_generation_prompt=True,
                allow_special_tokens_in_content=bool(body.get("allow_special_tokens_in_content"))
            )
        except Exception as e:  # template errors (raise_exception on an unsupported role), refused special tokens
            raise InvalidRequest(f"cannot render messages with the chat template: {e}", "messages") from None
        limit = self.serving.limits.max_prompt_chars
        if len(text) > limit:
            raise InvalidRequest(f"messages render to {len(text)} characters; the limit is {limit}", "messages")
        prompt = {"prompt": text, "prompt_token_ids": ids}
        return _Request([prompt], params, stream, include_usage, priority, renames)

    def _messages(self, messages) -> list[dict]:
        """The conversation as {role, content[, name]} dicts of strings, counted against max_prompt_chars before
        anything is rendered or tokenized."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty list of {role, content} objects", "messages")
        limit, chars, conv = self.serving.limits.max_prompt_chars, 0, []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content' (got {short_repr(m)})",
                                     "messages")
            role = m.get("role")
            if role not in ROLES:
                legacy = (" (function messages belong to the legacy functions API, which is not supported)"
                          if role == "function" else "")
                raise InvalidRequest(
                    f"messages[{i}].role must be one of {', '.join(ROLES)} (got {short_repr(role)}){legacy}", "messages"
                )
            for key in m:
                if key not in ("role", "content", "name"):
                    raise InvalidRequest(f"messages[{i}].{short_repr(key)} is not supported by this server", "messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: only text is understood
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           and len(p) == 2 for p in content):
                    raise InvalidRequest(f"messages[{i}].content: only {{type: text, text}} parts are supported",
                                         "messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise InvalidRequest(
                    f"messages[{i}].content must be a string or a list of text parts (got {short_repr(content)})",
                    "messages",
                )
            entry = {"role": role, "content": content}
            name = m.get("name")
            if name is not None:
                if not isinstance(name, str):
                    raise InvalidRequest(f"messages[{i}].name must be a string (got {short_repr(name)})", "messages")
                entry["name"] = name
            chars += len(content) + len(name or "")
            if chars > limit:
                raise InvalidRequest(f"messages hold more than {limit} characters (the limit)", "messages")
            conv.append(entry)
        return conv

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._request(request, self._chat_request)
        params, stream = req.params, req.stream
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        obj = "chat.completion.chunk" if stream else "chat.completion"
        head = {"id": cid, "object": obj, "created": int(time.time()), "model": self.serving.model_name}

        def choices(i: int, out, prev: dict) -> list[dict]:
            result = []
            for c in out.outputs:
                key = (i, c.index)
                first = key not in prev
                n_text, n_tok = prev.get(key, (0, 0))
                if (stream and not first and len(c.text) == n_text and not c.finish_reason
                        and (params.logprobs is None or len(c.token_ids) == n_tok)):
                    continue
                lp = _chat_logprobs(c, n_tok, params.logprobs) if params.logprobs is not None else None
                prev[key] = (len(c.text), len(c.token_ids))
                if stream:
                    delta = {"content": c.text[n_text:]}
                    if first:
                        delta["role"] = "assistant"
                    result.append({"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason})
                else:
                    msg = {"role": "assistant", "content": c.text}
                    result.append({"index": c.index, "message": msg, "logprobs": lp, "finish_reason": c.finish_reason})
            return result

        try:
            return await self._respond(request, req, cid, head, choices, "chat")
        except ServiceError as e:  # refusals before the first byte (e.g. the context check on max_tokens)
            raise _renamed(e, req.renames) from None

    # ---- shared response loop -------------------------------------------------------------------------------

    async def _respond(self, request, req: _Request, cid, head, choices, protocol):
        if len(req.prompts) > 1:  # all or nothing: never admit part of a request and then refuse the rest
            self.serving.check_capacity(len(req.prompts))
        gens = [
            self.serving.generate(p, req.params, f"{cid}-{i}", protocol=f"http-{protocol}", priority=req.priority)
            for i, p in enumerate(req.prompts)
        ]
        finals: dict[int, object] = {}
        async with contextlib.aclosing(_merge(gens)) as merged:
            # The first output (or error) comes before any byte is sent, so refusals get a proper status code.
            first = await anext(merged, None)
            if not req.stream:
                prev: dict = {}
                item = first
                while item is not None:
                    i, out = item
                    if out.finished:
                        finals[i] = out
                    item = await anext(merged, None)
                body = dict(head)
                body["choices"] = sorted((c for i, o in sorted(finals.items()) for c in choices(i, o, prev)),
                                         key=lambda c: c["index"])
                body["usage"] = _usage(finals.values())
                return web.json_response(body)

            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            request[_STREAMING] = True
            prev = {}
            try:
                item = first
                while item is not None:
                    i, out = item
                    if out.finished:
                        finals[i] = out
                    cs = choices(i, out, prev)
                    if cs:
                        await _sse(resp, dict(head, choices=cs))
                    item = await anext(merged, None)
                if req.include_usage:
                    await _sse(resp, dict(head, choices=[], usage=_usage(finals.values())))
            except ServiceError as e:
                await _sse(resp, _error_body(e))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp


async def _sse(resp: web.StreamResponse, payload: dict) -> None:
    await resp.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


async def _merge(gens):
    """Interleave several request streams; yields (index, output). Closing it cancels (and so aborts) them all.

    Memory stays bounded whatever the client does: outputs are cumulative, so each stream keeps only its newest
    output until the consumer takes it (a client that stops reading holds one output per prompt, not a backlog).
    """
    if len(gens) == 1:  # the common case, without extra tasks
        async with contextlib.aclosing(gens[0]) as g:
            async for out in g:
                yield 0, out
        return
    latest: dict[int, object] = {}  # index -> its newest output, or the exception that ended it
    changed = asyncio.Event()

    async def pump(i, gen):
        try:
            last = None
            async with contextlib.aclosing(gen) as g:
                async for last in g:
                    latest[i] = last
                    changed.set()
            if last is None or not last.finished:
                latest[i] = RuntimeError("a request stream ended without its final output")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 -- handed to the consumer, which raises it
            latest[i] = e
        changed.set()

    finished = [False] * len(gens)
    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        while not all(finished):  # every pump ends by leaving a finished output or an exception in `latest`
            await changed.wait()
            changed.clear()
            for i in sorted(latest):
                item = latest.pop(i)
                if isinstance(item, Exception):
                    raise item
                finished[i] = item.finished
                yield i, item
        await asyncio.gather(*tasks)  # each stream ends right after its final output: let it close, uncancelled
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(outs) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_logprobs(c, start: int, text_start: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_start
    for tid, top in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        lp = top.get(tid)
        tok = lp.decoded_token if lp is not None and lp.decoded_token is not None else ""
        tokens.append(tok)
        token_lps.append(lp.logprob if lp is not None else None)
        entry: dict[str, float] = {}
        for t, v in sorted(top.items(), key=lambda kv: kv[1].rank or 0):
            entry.setdefault(v.decoded_token or str(t), v.logprob)  # tokens that decode alike: keep the likelier
        tops.append(entry)
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(c, start: int, k: int) -> dict:
    content = []
    for tid, top in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        lp = top.get(tid)
        tok = (lp.decoded_token if lp is not None else None) or ""
        best = sorted((v for v in top.values() if v.rank is not None and v.rank <= k), key=lambda v: v.rank)
        content.append(
            {
                "token": tok,
                "logprob": lp.logprob if lp is not None else None,
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": v.decoded_token or "", "logprob": v.logprob,
                     "bytes": list((v.decoded_token or "").encode())}
                    for v in best
                ],
            }
        )
    return {"content": content}
