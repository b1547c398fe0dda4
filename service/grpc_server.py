"""gRPC endpoint (grpc.aio): jaxserve.v1 Generation, KServe v2 GRPCInferenceService, grpc.health.v1, reflection.

Cancellation: when the client cancels, disconnects or passes its deadline, grpc.aio cancels the handler coroutine
at its current await; the request's generator closes and the engine aborts the request and frees its pages.
Health: services "", "jaxserve.v1.Generation" and "inference.GRPCInferenceService" all follow
ServingEngine readiness (engine alive, not draining, making steps); unknown services answer NOT_FOUND.
Auth: with an API key, every RPC except grpc.health.v1 needs `authorization: Bearer <key>` metadata (the scheme in
any case, RFC 7235; the key compared as a SHA-256 digest, so in constant time), else UNAUTHENTICATED.
Hostile input: bytes that are not the method's protobuf message are INVALID_ARGUMENT (`DecodeGuard`: grpc.aio alone
answers UNKNOWN); every field is type- and range-checked before admission (INVALID_ARGUMENT naming the field);
status details quote client values only shortened and are capped at _MAX_DETAILS characters, so an error never
grows with the request (nor overflows the trailers).
Request ids and Abort: a client-chosen `request_id` is at most `limits.max_request_id_len` printable characters.
Ids live in the scope of their *owner*: the authenticated peer identity (a verified TLS client certificate) when
there is one; otherwise, when an API key is set, the connection (`context.peer()`, address and port: the key is
shared by every client, so it names no one, while a connection cannot be used by another client); with neither,
one scope for all (an open server has no notion of a caller). A Generate id must be unique within its scope (else
ALREADY_EXISTS), and Abort reaches only its own scope: for another client's id it answers found=false, exactly as
for an id that does not exist, so it reveals nothing. A client with an API key that aborts from a second channel
must therefore reuse the connection of its Generate call. The engine sees a server-made id, so client ids never
lengthen or collide in the engine.
Priority: a client-set priority outside `limits.priority_range` is INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import inspect
import time
from typing import Callable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

import jaxserve
from jaxserve import SamplingParams
from jaxserve.errors import short_repr as short
from service.async_engine import ServingEngine
from service.proto import jaxserve_v1_pb2 as pb
from service.proto import jaxserve_v1_pb2_grpc as pb_grpc
from service.protocol import (
    DuplicateRequest,
    InvalidRequest,
    ServiceError,
    ServingLimits,
    check_prompt,
    invalid_request,
)

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
_SCALARS = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "seed", "max_tokens", "min_tokens", "ignore_eos", "logprobs", "skip_special_tokens", "include_stop_str_in_output",
)  # fmt: skip
_MAX_DETAILS = 1000  # characters of status details (and in-band error messages)


# ---- shared by both servicers (service/kserve.py imports these) ------------------------------------------------


def status_details(message: str) -> str:
    return message if len(message) <= _MAX_DETAILS else message[:_MAX_DETAILS] + "..."


async def abort(context: grpc.aio.ServicerContext, error: ServiceError) -> None:
    await context.abort(error.grpc_code, status_details(error.message))


def check_request_id(request_id: str, limits: ServingLimits, field: str = "request_id") -> None:
    """Ids are echoed in every response and logged: bounded, and printable (no control characters)."""
    if len(request_id) > limits.max_request_id_len or not request_id.isprintable():
        n = limits.max_request_id_len
        got = f"{len(request_id)} characters" if len(request_id) > n else short(request_id)
        raise InvalidRequest(f"{field} must be at most {n} printable characters (got {got})", field)


def build_params(
    serving: ServingEngine, fields: dict, *, coerce_strings: bool = False, param: str = "sampling_params"
) -> SamplingParams:
    """serving.build_params, with any ValueError / TypeError / OverflowError (request data that slipped past the
    field checks) turned into InvalidRequest naming the field (an InvalidRequestError's `param`), else `param`: a
    request's own values are never the server's fault."""
    try:
        return serving.build_params(fields, coerce_strings=coerce_strings)
    except ServiceError:
        raise
    except (ValueError, TypeError, OverflowError) as e:
        raise invalid_request(e, param, prefix=f"{param}: ") from None


# ---- jaxserve.v1 ----------------------------------------------------------------------------------------------


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, serving: ServingEngine, *, scoped: bool = False):
        self.serving = serving
        self.scoped = scoped  # scope request ids by connection when no peer identity (see the module docstring)
        self._running: dict[tuple[str, str], str] = {}  # (owner, client request id) -> engine request id

    def _owner(self, context: grpc.aio.ServicerContext) -> str:
        identities = context.peer_identities()
        if identities:
            return "identity:" + b"\0".join(identities).decode(errors="replace")
        return f"peer:{context.peer()}" if self.scoped else ""

    def _parse(self, request: pb.GenerateRequest):
        which = request.WhichOneof("prompt")
        if which == "text":
            prompt = request.text
        elif which == "token_ids":
            prompt = list(request.token_ids.ids)
        else:
            raise InvalidRequest("prompt: set either text or token_ids", "prompt")
        prompt = check_prompt(prompt, self.serving.limits, self.serving.vocab_size)
        low, high = self.serving.limits.priority_range
        if not low <= request.priority <= high:
            raise InvalidRequest(f"priority must be an integer in [{low}, {high}] (got {request.priority})", "priority")
        sp = request.sampling_params
        fields = {name: getattr(sp, name) for name in _SCALARS if sp.HasField(name)}
        if sp.stop:
            fields["stop"] = list(sp.stop)
        if sp.stop_token_ids:
            fields["stop_token_ids"] = list(sp.stop_token_ids)
        return prompt, build_params(self.serving, fields)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            rid = request.request_id or self.serving.new_request_id("grpc")
            check_request_id(rid, self.serving.limits)
            prompt, params = self._parse(request)
            key = (self._owner(context), rid)
            if key in self._running:
                raise DuplicateRequest(f"request_id {short(rid)} is already in flight", "request_id")
            engine_id = self.serving.new_request_id("v1")
            self._running[key] = engine_id
            try:
                gen = self.serving.generate(prompt, params, engine_id, protocol="grpc", priority=request.priority)
                async with contextlib.aclosing(gen) as outputs:
                    prev: dict[int, tuple[int, int]] = {}
                    first = True
                    async for out in outputs:
                        yield _response(rid, out, prev, first)
                        first = False
            finally:
                del self._running[key]
        except ServiceError as e:
            await abort(context, e)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            if not request.request_id:
                raise InvalidRequest("request_id is required: the id of a running Generate call", "request_id")
            check_request_id(request.request_id, self.serving.limits)
        except ServiceError as e:
            await abort(context, e)
        engine_id = self._running.get((self._owner(context), request.request_id))
        return pb.AbortResponse(found=engine_id is not None and await self.serving.abort(engine_id))

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        s = self.serving
        model = s.llm.model_config
        return pb.ModelInfo(
            model_name=s.model_name,
            architecture=model.architecture,
            vocab_size=s.vocab_size,
            max_model_len=s.max_model_len,
            eos_token_ids=list(model.eos_token_ids),
            max_logprobs=s.llm.engine_config.max_logprobs,
            has_tokenizer=s.tokenizer is not None,
        )

    async def GetServerInfo(self, request, context) -> pb.ServerInfo:
        s = self.serving
        st = s.stats()
        return pb.ServerInfo(
            version=jaxserve.__version__,
            num_requests_in_flight=s.num_in_flight,
            num_requests_running=st["num_requests_running"],
            num_requests_waiting=st["num_requests_waiting"],
            uptime_seconds=time.time() - s.started,
            ready=s.ready,
            draining=s.draining,
            kv_cache_usage=st["kv_cache_usage"],
        )


def _response(rid: str, out, prev: dict[int, tuple[int, int]], first: bool) -> pb.GenerateResponse:
    """One GenerateResponse: per completion, what is new since `prev` (updated), the usage when finished."""
    resp = pb.GenerateResponse(request_id=rid, finished=out.finished)
    if first:
        resp.prompt_token_ids.extend(out.prompt_token_ids)
    for c in out.outputs:
        n_text, n_tok = prev.get(c.index, (0, 0))
        if len(c.token_ids) == n_tok and len(c.text) == n_text and not c.finish_reason and not first:
            continue
        prev[c.index] = (len(c.text), len(c.token_ids))
        d = resp.outputs.add(
            index=c.index,
            text=c.text[n_text:],
            token_ids=c.token_ids[n_tok:],
            finish_reason=_FINISH.get(c.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
            stop_reason="" if c.stop_reason is None else str(c.stop_reason),
            cumulative_logprob=c.cumulative_logprob or 0.0,
        )
        for tid, top in zip(c.token_ids[n_tok:], (c.logprobs or [])[n_tok:]):
            chosen = top.get(tid)
            entry = d.logprobs.add(token_id=tid, logprob=chosen.logprob if chosen else 0.0)
            for t, v in sorted(top.items(), key=lambda kv: kv[1].rank or 0):
                entry.top.add(token_id=t, logprob=v.logprob, rank=v.rank or 0, token=v.decoded_token or "")
    if out.finished:
        ntok = sum(len(c.token_ids) for c in out.outputs)
        resp.usage.prompt_tokens = len(out.prompt_token_ids)
        resp.usage.completion_tokens = ntok
        resp.usage.total_tokens = len(out.prompt_token_ids) + ntok
    return resp


# ---- interceptors ---------------------------------------------------------------------------------------------


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless `authorization: Bearer <key>` matches (health checks are exempt)."""

    def __init__(self, api_key: str):
        self._digest = hashlib.sha256(api_key.encode()).digest()

    def authorized(self, header: str | bytes) -> bool:
        """The scheme in any case (RFC 7235); the key compared as a SHA-256 digest with compare_digest: constant
        time in its content and its length."""
        if isinstance(header, bytes):
            header = header.decode(errors="replace")
        scheme, _, token = header.strip().partition(" ")
        given = hashlib.sha256(token.strip().encode("utf-8", "surrogatepass")).digest()
        return hmac.compare_digest(given, self._digest) and scheme.lower() == "bearer"

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        if self.authorized(dict(details.invocation_metadata or ()).get("authorization", "")):
            return handler
        return _deny(handler)


class DecodeGuard(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT, not UNKNOWN, for request bytes that are not the method's protobuf message.

    grpc.aio runs the handler's deserializer outside the handler, so a DecodeError there ends the call as UNKNOWN
    with the exception text. Behind this guard the deserializer never raises: it returns an InvalidRequest, which
    the handler's wrapper answers with INVALID_ARGUMENT. Request-streaming methods listed in `in_band` receive it as
    a stream item instead (KServe's ModelStreamInfer answers it in-band and keeps the stream open).
    """

    def __init__(self, in_band: frozenset[str] = frozenset()):
        self.in_band = in_band  # full method names, "/package.Service/Method"

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _guarded(handler, details.method, details.method in self.in_band)


def _guarded(handler: grpc.RpcMethodHandler, method: str, in_band: bool) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    behaviour = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream

    def decode(raw: bytes):
        try:
            return parse(raw)
        except Exception as e:  # noqa: BLE001 -- DecodeError, or whatever else a parser raises on bytes it cannot read
            return InvalidRequest(f"the request is not a valid protobuf message for {method}: {e}", "request")

    async def checked(request, context):
        if isinstance(request, InvalidRequest):
            await abort(context, request)
        return request

    async def checked_stream(requests, context):
        async for request in requests:
            yield await checked(request, context)

    async def prepare(request, context):
        return checked_stream(request, context) if handler.request_streaming else await checked(request, context)

    if handler.request_streaming and in_band:
        run = behaviour
    elif inspect.isasyncgenfunction(behaviour):

        async def run(request, context):
            async for response in behaviour(await prepare(request, context), context):
                yield response

    else:  # a coroutine: a unary response, or a stream written with context.write (health Watch)

        async def run(request, context):
            return await behaviour(await prepare(request, context), context)

    return _rebuild(handler, run, decode)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
        yield  # pragma: no cover  (makes this an async generator)

    return _rebuild(handler, streaming if handler.response_streaming else unary, handler.request_deserializer)


def _rebuild(handler: grpc.RpcMethodHandler, behaviour: Callable, deserializer) -> grpc.RpcMethodHandler:
    """A handler of the same kind and response serializer as `handler`, with a new behaviour and deserializer."""
    kw = dict(request_deserializer=deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behaviour, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behaviour, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behaviour, **kw)
    return grpc.unary_unary_rpc_method_handler(behaviour, **kw)


# ---- the server -----------------------------------------------------------------------------------------------


def _reflection_pool() -> descriptor_pool.DescriptorPool:
    """One private pool with every service we serve, KServe's included, for the reflection service."""
    from service import kserve  # kserve builds on this module's helpers, so it is imported where it is used

    pool = descriptor_pool.DescriptorPool()
    for mod in (pb, health_pb2, reflection_pb2):
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(mod.DESCRIPTOR.serialized_pb))
    for f in kserve.file_descriptor_set().file:
        pool.Add(f)
    return pool


def build_grpc_server(serving: ServingEngine, *, api_key: str | None = None) -> grpc.aio.Server:
    from service import kserve

    limit = serving.limits.max_message_bytes
    guard = DecodeGuard(frozenset({f"/{kserve.SERVICE_NAME}/ModelStreamInfer"}))
    server = grpc.aio.server(
        interceptors=[ApiKeyInterceptor(api_key), guard] if api_key else [guard],
        # Generate calls are bounded by admission (max_in_flight); this also bounds cheap RPCs and idle streams.
        maximum_concurrent_rpcs=max(1024, 4 * serving.limits.max_in_flight),
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
        ],
    )
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(serving, scoped=api_key is not None), server)
    kserve.add_to_server(kserve.KServeServicer(serving), server)

    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = ("", GENERATION_SERVICE, kserve.SERVICE_NAME)

    loop = asyncio.get_running_loop()

    def on_readiness(ready: bool) -> None:  # may be called from any thread
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING

        def apply() -> None:
            for name in services:
                asyncio.ensure_future(health_servicer.set(name, status))

        try:
            loop.call_soon_threadsafe(apply)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    serving.add_readiness_listener(on_readiness)
    names = (GENERATION_SERVICE, kserve.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server, pool=_reflection_pool())
    return server
