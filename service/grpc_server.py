"""gRPC endpoint (grpc.aio): jaxserve.v1 Generation, KServe v2 GRPCInferenceService, grpc.health.v1, reflection.

Cancellation: when the client cancels, disconnects or passes its deadline, grpc.aio cancels the handler coroutine
at its current await; the request's generator closes and the engine aborts the request and frees its pages.
Health: services "", "jaxserve.v1.Generation" and "inference.GRPCInferenceService" all follow
ServingEngine readiness (engine alive, not draining, making steps); unknown services answer NOT_FOUND.
Auth: with an API key, every RPC except grpc.health.v1 needs `authorization: Bearer <key>` metadata (compared in
constant time), else UNAUTHENTICATED.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

import jaxserve
from service import kserve
from service.async_engine import ServingEngine
from service.proto import jaxserve_v1_pb2 as pb
from service.proto import jaxserve_v1_pb2_grpc as pb_grpc
from service.protocol import InvalidRequest, ServiceError, check_prompt

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
_SCALARS = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "seed", "max_tokens", "min_tokens", "ignore_eos", "logprobs", "skip_special_tokens", "include_stop_str_in_output",
)  # fmt: skip


def engine_request_id(request_id: str) -> str:
    return f"v1/{request_id}"


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, serving: ServingEngine):
        self.serving = serving

    def _parse(self, request: pb.GenerateRequest):
        which = request.WhichOneof("prompt")
        if which == "text":
            prompt = request.text
        elif which == "token_ids":
            prompt = list(request.token_ids.ids)
        else:
            raise InvalidRequest("prompt: set either text or token_ids", "prompt")
        prompt = check_prompt(prompt, self.serving.limits, self.serving.vocab_size)
        sp = request.sampling_params
        fields = {name: getattr(sp, name) for name in _SCALARS if sp.HasField(name)}
        if sp.stop:
            fields["stop"] = list(sp.stop)
        if sp.stop_token_ids:
            fields["stop_token_ids"] = list(sp.stop_token_ids)
        return prompt, self.serving.build_params(fields)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id or self.serving.new_request_id("grpc")
        try:
            prompt, params = self._parse(request)
            gen = self.serving.generate(prompt, params, engine_request_id(rid), protocol="grpc", priority=request.priority)
            prev: dict[int, tuple[int, int]] = {}
            first = True
            async with contextlib.aclosing(gen) as outputs:
                async for out in outputs:
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
                    first = False
                    yield resp
        except ServiceError as e:
            await context.abort(e.grpc_code, e.message)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        return pb.AbortResponse(found=await self.serving.abort(engine_request_id(request.request_id)))

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        s = self.serving
        eng = s.llm.engine
        return pb.ModelInfo(
            model_name=s.model_name,
            architecture=eng.model_config.architecture,
            vocab_size=s.vocab_size,
            max_model_len=s.max_model_len,
            eos_token_ids=list(eng.model_config.eos_token_ids),
            max_logprobs=eng.config.max_logprobs,
            has_tokenizer=s.tokenizer is not None,
        )

    async def GetServerInfo(self, request, context) -> pb.ServerInfo:
        import time

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


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless `authorization: Bearer <key>` matches (health checks are exempt)."""

    def __init__(self, api_key: str):
        self._want = f"Bearer {api_key}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(given, bytes):
            given = given.decode(errors="replace")
        if hmac.compare_digest(given.encode(), self._want):
            return handler
        return _deny(handler)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
        yield  # pragma: no cover  (makes this an async generator)

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


def _reflection_pool() -> descriptor_pool.DescriptorPool:
    """One private pool with every service we serve, KServe's included, for the reflection service."""
    pool = descriptor_pool.DescriptorPool()
    for mod in (pb, health_pb2, reflection_pb2):
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(mod.DESCRIPTOR.serialized_pb))
    for f in kserve.file_descriptor_set().file:
        pool.Add(f)
    return pool


def build_grpc_server(serving: ServingEngine, *, api_key: str | None = None) -> grpc.aio.Server:
    limit = serving.limits.max_message_bytes
    server = grpc.aio.server(
        interceptors=[ApiKeyInterceptor(api_key)] if api_key else [],
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
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(serving), server)
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
