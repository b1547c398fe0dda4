"""OpenAI-compatible HTTP endpoint (aiohttp): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Request and response shapes follow the OpenAI API as vLLM serves it, including vLLM's extra sampling fields
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...). Streaming is Server-Sent Events:
one `data: {json}` event per chunk and `data: [DONE]` at the end; `stream_options.include_usage` adds a final
chunk with empty choices and the usage. Errors are `{"error": {"message", "type", "param", "code"}}` with 400
(invalid field, named in `param`), 401 (API key), 404 (unknown model), 413 (body too large), 429 (overload),
503 (draining / not ready). An error after streaming has started is sent as a `data: {"error": ...}` event.
A client that disconnects cancels its handler (handler_cancellation), which aborts its requests in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.async_engine import ServingEngine
from service.protocol import InvalidRequest, ModelNotFound, ServiceError

# OpenAI / vLLM request field -> SamplingParams field, for fields that pass straight through.
_PASSTHROUGH = (
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
_UNSUPPORTED = ("echo", "suffix", "logit_bias", "best_of", "tools", "response_format", "prompt_logprobs")


def _error_body(e: ServiceError) -> dict:
    return {"error": {"message": e.message, "type": e.error_type, "param": e.param, "code": e.http_status}}


def _error_response(e: ServiceError) -> web.Response:
    return web.json_response(_error_body(e), status=e.http_status)


class OpenAIServer:
    def __init__(self, serving: ServingEngine, *, api_key: str | None = None):
        self.serving = serving
        self.api_key = api_key
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
            err = InvalidRequest(f"request body too large: {e.text}")
            err.http_status = 413
            return _error_response(err)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key is not None and request.path != "/health":
            given = request.headers.get("Authorization", "")
            want = f"Bearer {self.api_key}"
            if not hmac.compare_digest(given.encode(), want.encode()):
                body = {"error": {"message": "missing or invalid API key", "type": "authentication_error", "param": None, "code": 401}}
                return web.json_response(body, status=401)
        return await handler(request)

    # ---- simple endpoints -----------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.serving.evaluate_readiness() else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.serving.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

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

    # ---- request parsing ------------------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InvalidRequest("the request body must be a JSON object") from None
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.serving.model_name:
            raise ModelNotFound(f"model {model!r} does not exist; this server serves {self.serving.model_name!r}", "model")
        for name in _UNSUPPORTED:
            if body.get(name) not in (None, False, {}, [], 1 if name == "best_of" else None):
                raise InvalidRequest(f"{name} is not supported by this server", name)
        return body

    def _fields(self, body: dict, max_tokens_keys: tuple[str, ...], default_max_tokens: int | None) -> dict:
        fields = {k: body[k] for k in _PASSTHROUGH if k in body}
        fields["max_tokens"] = default_max_tokens
        for key in max_tokens_keys:
            if body.get(key) is not None:
                fields["max_tokens"] = body[key]
                break
        return fields

    @staticmethod
    def _stream_options(body: dict) -> tuple[bool, bool]:
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise InvalidRequest(f"stream must be a boolean (got {stream!r})", "stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise InvalidRequest("stream_options must be an object", "stream_options")
        return stream, bool(opts.get("include_usage", False))

    # ---- /v1/completions ------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        raw = body.get("prompt")
        if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise InvalidRequest("prompt must be a string, a list of strings, or a list of token-id lists", "prompt")
        prompts = [self._check_prompt(p) for p in raw]
        fields = self._fields(body, ("max_tokens",), 16)  # OpenAI's default for completions
        logprobs = body.get("logprobs")
        if logprobs is not None:
            fields["logprobs"] = logprobs
        params = self.serving.build_params(fields)
        stream, include_usage = self._stream_options(body)
        cid = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": self.serving.model_name}

        def choices(i: int, out, prev: dict) -> list[dict]:
            result = []
            for c in out.outputs:
                key = (i, c.index)
                n_text, n_tok = prev.get(key, (0, 0))
                if stream and len(c.text) == n_text and not c.finish_reason and (params.logprobs is None or len(c.token_ids) == n_tok):
                    continue  # nothing to show yet (e.g. half a UTF-8 character)
                lp = _completion_logprobs(c, n_tok, n_text) if params.logprobs is not None else None
                prev[key] = (len(c.text), len(c.token_ids))
                result.append(
                    {"index": i * params.n + c.index, "text": c.text[n_text:], "logprobs": lp, "finish_reason": c.finish_reason}
                )
            return result

        return await self._respond(request, prompts, params, cid, head, stream, include_usage, choices, "completions")

    def _check_prompt(self, p):
        from service.protocol import check_prompt

        return check_prompt(p, self.serving.limits, self.serving.vocab_size)

    # ---- /v1/chat/completions -------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty list of {role, content} objects", "messages")
        conv = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InvalidRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: only text is understood
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                    raise InvalidRequest(f"messages[{i}].content: only text parts are supported", "messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise InvalidRequest(f"messages[{i}].content must be a string", "messages")
            conv.append({"role": m["role"], "content": content})
        tok = self.serving.tokenizer
        if tok is None:
            raise InvalidRequest("this model has no tokenizer, so it cannot render chat messages", "messages")
        try:
            text = tok.apply_chat_template(conv, add_generation_prompt=True)
        except Exception as e:  # template errors (e.g. raise_exception on an unsupported role)
            raise InvalidRequest(f"cannot render messages with the chat template: {e}", "messages") from None
        if len(text) > self.serving.limits.max_prompt_chars:
            raise InvalidRequest(f"messages render to {len(text)} characters; the limit is {self.serving.limits.max_prompt_chars}", "messages")
        prompt = {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
        fields = self._fields(body, ("max_completion_tokens", "max_tokens"), None)  # chat: up to the context
        want_lp = body.get("logprobs", False)
        if not isinstance(want_lp, bool):
            raise InvalidRequest(f"logprobs must be a boolean (got {want_lp!r})", "logprobs")
        if want_lp:
            fields["logprobs"] = body.get("top_logprobs") or 0
        elif body.get("top_logprobs"):
            raise InvalidRequest("top_logprobs requires logprobs: true", "top_logprobs")
        params = self.serving.build_params(fields)
        stream, include_usage = self._stream_options(body)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        obj = "chat.completion.chunk" if stream else "chat.completion"
        head = {"id": cid, "object": obj, "created": int(time.time()), "model": self.serving.model_name}

        def choices(i: int, out, prev: dict) -> list[dict]:
            result = []
            for c in out.outputs:
                key = (i, c.index)
                first = key not in prev
                n_text, n_tok = prev.get(key, (0, 0))
                if stream and not first and len(c.text) == n_text and not c.finish_reason and (params.logprobs is None or len(c.token_ids) == n_tok):
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

        return await self._respond(request, [prompt], params, cid, head, stream, include_usage, choices, "chat")

    # ---- shared response loop -------------------------------------------------------------------------------

    async def _respond(self, request, prompts, params, cid, head, stream, include_usage, choices, protocol):
        gens = [
            self.serving.generate(p, params, f"{cid}-{i}", protocol=f"http-{protocol}") for i, p in enumerate(prompts)
        ]
        finals: dict[int, object] = {}
        async with contextlib.aclosing(_merge(gens)) as merged:
            # The first output (or error) comes before any byte is sent, so refusals get a proper status code.
            first = await anext(merged, None)
            if not stream:
                prev: dict = {}
                item = first
                while item is not None:
                    i, out = item
                    if out.finished:
                        finals[i] = out
                    item = await anext(merged, None)
                body = dict(head)
                body["choices"] = sorted((c for i, o in sorted(finals.items()) for c in choices(i, o, prev)), key=lambda c: c["index"])
                body["usage"] = _usage(finals.values())
                return web.json_response(body)

            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
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
                if include_usage:
                    await _sse(resp, dict(head, choices=[], usage=_usage(finals.values())))
            except ServiceError as e:
                await _sse(resp, _error_body(e))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp


async def _sse(resp: web.StreamResponse, payload: dict) -> None:
    await resp.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


async def _merge(gens):
    """Interleave several async iterators; yields (index, item). Closing it cancels (and so aborts) them all."""
    if len(gens) == 1:  # the common case, without extra tasks
        async with contextlib.aclosing(gens[0]) as g:
            async for out in g:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen):
        try:
            async with contextlib.aclosing(gen) as g:
                async for out in g:
                    await queue.put((i, out))
            await queue.put((i, done))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
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
                    {"token": v.decoded_token or "", "logprob": v.logprob, "bytes": list((v.decoded_token or "").encode())}
                    for v in best
                ],
            }
        )
    return {"content": content}
