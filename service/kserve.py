"""KServe v2 `inference.GRPCInferenceService` with Triton's LLM conventions, so stock `tritonclient[grpc]` works.

The tensor contract is the one Triton's vLLM backend established:
  inputs   text_input BYTES [1] (required), stream BOOL [1], sampling_parameters BYTES [1] (JSON of vLLM
           SamplingParams fields; values may be strings), exclude_input_in_output BOOL [1],
           return_finish_reason / return_num_input_tokens / return_num_output_tokens BOOL [1]
  outputs  text_output BYTES [n] (deltas when streaming, full text otherwise; non-streaming prepends the prompt
           unless exclude_input_in_output), finish_reason BYTES [n], num_input_tokens UINT32 [1],
           num_output_tokens UINT32 [n]
The metadata RPCs (ServerLive/Ready, ModelReady, ServerMetadata, ModelMetadata) and a minimal ModelConfig (tensors,
max_batch_size 0, decoupled transaction policy, as tools such as perf_analyzer read it) describe this contract.
ModelInfer answers with the full result. ModelStreamInfer is Triton's decoupled bidirectional stream: many
requests on one stream, matched by `id`, each answered by one or more responses; errors travel in-band as
`error_message` and the stream stays open. Every streamed response carries `triton_final_response`; a request
with `triton_enable_empty_final_response` gets a last empty response marked final. Cancelling the stream aborts
all its requests.

The messages come from service/proto/kserve_v2.binpb (scripts/gen_protos.sh), loaded into a private descriptor
pool: a client library with its own copy of these protobuf names can live in the same process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import struct

import grpc
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

import jaxserve
from service.async_engine import ServingEngine
from service.protocol import InvalidRequest, ModelNotFound, ServiceError, check_prompt

logger = logging.getLogger(__name__)
SERVICE_NAME = "inference.GRPCInferenceService"
_BINPB = os.path.join(os.path.dirname(__file__), "proto", "kserve_v2.binpb")


def file_descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    with open(_BINPB, "rb") as f:
        return descriptor_pb2.FileDescriptorSet.FromString(f.read())


def _load_messages() -> dict[str, type]:
    pool = descriptor_pool.DescriptorPool()
    fds = file_descriptor_set()
    for f in fds.file:
        pool.Add(f)
    names = [m.name for f in fds.file for m in f.message_type]  # top-level messages (nested ones hang off them)
    return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"inference.{n}")) for n in names}


M = _load_messages()
_INPUTS = {
    "text_input": "BYTES",
    "stream": "BOOL",
    "sampling_parameters": "BYTES",
    "exclude_input_in_output": "BOOL",
    "return_finish_reason": "BOOL",
    "return_num_input_tokens": "BOOL",
    "return_num_output_tokens": "BOOL",
}
_OUTPUTS = {"text_output": "BYTES", "finish_reason": "BYTES", "num_input_tokens": "UINT32", "num_output_tokens": "UINT32"}
# Request parameters Triton reserves for itself; everything else in `parameters` is read as a sampling field.
_RESERVED = ("sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers", "binary_data_output")


def _bytes_elements(raw: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(raw):
        if i + 4 > len(raw):
            raise InvalidRequest("BYTES tensor: truncated length prefix")
        (n,) = struct.unpack_from("<I", raw, i)
        i += 4
        if i + n > len(raw):
            raise InvalidRequest(f"BYTES tensor: element of {n} bytes overruns the buffer")
        out.append(raw[i : i + n])
        i += n
    return out


def _input_values(req, index: int, tensor) -> list:
    if tensor.datatype != _INPUTS[tensor.name]:
        raise InvalidRequest(f"input {tensor.name!r} must have datatype {_INPUTS[tensor.name]} (got {tensor.datatype!r})", tensor.name)
    if req.raw_input_contents:
        if index >= len(req.raw_input_contents):
            raise InvalidRequest(f"input {tensor.name!r} has no raw_input_contents entry", tensor.name)
        raw = req.raw_input_contents[index]
        values = _bytes_elements(raw) if tensor.datatype == "BYTES" else [bool(b) for b in raw]
    else:
        c = tensor.contents
        values = list(c.bytes_contents) if tensor.datatype == "BYTES" else list(c.bool_contents)
    if len(values) != 1:
        raise InvalidRequest(f"input {tensor.name!r} must hold exactly one element (got {len(values)})", tensor.name)
    return values


def _param_value(p):
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


class _Parsed:
    def __init__(self, prompt, params, stream, exclude_input, want, empty_final):
        self.prompt, self.params, self.stream = prompt, params, stream
        self.exclude_input, self.want, self.empty_final = exclude_input, want, empty_final


class KServeServicer:
    def __init__(self, serving: ServingEngine):
        self.serving = serving

    # ---- metadata RPCs --------------------------------------------------------------------------------------

    async def ServerLive(self, request, context):
        return M["ServerLiveResponse"](live=self.serving.llm.is_running)

    async def ServerReady(self, request, context):
        return M["ServerReadyResponse"](ready=self.serving.evaluate_readiness())

    async def ModelReady(self, request, context):
        ok = request.name == self.serving.model_name and self.serving.evaluate_readiness()
        return M["ModelReadyResponse"](ready=ok)

    async def ServerMetadata(self, request, context):
        return M["ServerMetadataResponse"](name="jaxserve", version=jaxserve.__version__, extensions=[])

    async def ModelMetadata(self, request, context):
        if request.name != self.serving.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r}")
        T = M["ModelMetadataResponse"].TensorMetadata
        return M["ModelMetadataResponse"](
            name=self.serving.model_name,
            versions=["1"],
            platform="jaxserve",
            inputs=[T(name=n, datatype=d, shape=[1]) for n, d in _INPUTS.items()],
            outputs=[T(name=n, datatype=d, shape=[1] if n == "num_input_tokens" else [-1]) for n, d in _OUTPUTS.items()],
        )

    async def ModelConfig(self, request, context):
        if request.name != self.serving.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r}")
        types = {"BYTES": "TYPE_STRING", "BOOL": "TYPE_BOOL", "UINT32": "TYPE_UINT32"}
        enum = self._data_type
        config = M["ModelConfig"](
            name=self.serving.model_name,
            platform="jaxserve",
            backend="jaxserve",
            max_batch_size=0,
            input=[M["ModelInput"](name=n, data_type=enum(types[d]), dims=[1], optional=n != "text_input") for n, d in _INPUTS.items()],
            output=[M["ModelOutput"](name=n, data_type=enum(types[d]), dims=[-1]) for n, d in _OUTPUTS.items()],
            model_transaction_policy=M["ModelTransactionPolicy"](decoupled=True),
        )
        return M["ModelConfigResponse"](config=config)

    @staticmethod
    def _data_type(name: str) -> int:
        return M["ModelInput"].DESCRIPTOR.fields_by_name["data_type"].enum_type.values_by_name[name].number

    # ---- inference ------------------------------------------------------------------------------------------

    def _parse(self, req) -> _Parsed:
        s = self.serving
        if req.model_name != s.model_name:
            raise ModelNotFound(f"unknown model {req.model_name!r}; this server serves {s.model_name!r}", "model_name")
        values = {}
        for i, t in enumerate(req.inputs):
            if t.name not in _INPUTS:
                raise InvalidRequest(f"unknown input {t.name!r}; known inputs: {', '.join(_INPUTS)}", t.name)
            values[t.name] = _input_values(req, i, t)[0]
        if "text_input" not in values:
            raise InvalidRequest("the text_input input is required", "text_input")
        try:
            text = values["text_input"].decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest("text_input must be UTF-8 text", "text_input") from None
        prompt = check_prompt(text, s.limits, s.vocab_size, "text_input")
        fields = {}
        for key, p in req.parameters.items():
            if key in _RESERVED or key.startswith("triton_"):
                continue
            fields[key] = _param_value(p)
        if "sampling_parameters" in values:
            try:
                js = json.loads(values["sampling_parameters"])
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise InvalidRequest("sampling_parameters must be a JSON object", "sampling_parameters") from None
            if not isinstance(js, dict):
                raise InvalidRequest("sampling_parameters must be a JSON object", "sampling_parameters")
            fields.update(js)
        params = s.build_params(fields, coerce_strings=True)
        stream = bool(values.get("stream", False))
        exclude = values.get("exclude_input_in_output")
        if stream and exclude is False:
            raise InvalidRequest("streaming with exclude_input_in_output=false is not supported", "exclude_input_in_output")
        exclude = stream if exclude is None else exclude
        want = {o.name for o in req.outputs} or {"text_output"}
        for name in ("finish_reason", "num_input_tokens", "num_output_tokens"):
            if values.get(f"return_{name}"):
                want.add(name)
        p = req.parameters.get("triton_enable_empty_final_response")
        empty_final = p is not None and _param_value(p) is True
        return _Parsed(prompt, params, stream, exclude, want, empty_final)

    def _response(self, req, parsed: _Parsed, out, texts: list[str], final: bool | None):
        resp = M["ModelInferResponse"](model_name=self.serving.model_name, model_version="1", id=req.id)

        def add(name, datatype, shape, raw):
            if name in parsed.want:
                resp.outputs.add(name=name, datatype=datatype, shape=shape)
                resp.raw_output_contents.append(raw)

        def pack(strings):
            return b"".join(struct.pack("<I", len(b)) + b for b in (x.encode() for x in strings))

        n = len(out.outputs)
        add("text_output", "BYTES", [n], pack(texts))
        add("finish_reason", "BYTES", [n], pack([c.finish_reason or "" for c in out.outputs]))
        add("num_input_tokens", "UINT32", [1], np.array([len(out.prompt_token_ids)], np.uint32).tobytes())
        add("num_output_tokens", "UINT32", [n], np.array([len(c.token_ids) for c in out.outputs], np.uint32).tobytes())
        if final is not None:
            resp.parameters["triton_final_response"].bool_param = final
        return resp

    async def _results(self, req, parsed: _Parsed, streamed: bool):
        """ModelInferResponses for one request: deltas if streaming, else one full response."""
        rid = self.serving.new_request_id("kserve")
        gen = self.serving.generate(parsed.prompt, parsed.params, rid, protocol="kserve")
        sent = {}
        async with contextlib.aclosing(gen) as outputs:
            async for out in outputs:
                if parsed.stream:
                    deltas = [c.text[sent.get(c.index, 0) :] for c in out.outputs]
                    if not any(deltas) and not out.finished:
                        continue
                    sent.update({c.index: len(c.text) for c in out.outputs})
                    final = out.finished and not parsed.empty_final
                    yield self._response(req, parsed, out, deltas, final if streamed else None)
                elif out.finished:
                    prefix = "" if parsed.exclude_input or out.prompt is None else out.prompt
                    texts = [prefix + c.text for c in out.outputs]
                    yield self._response(req, parsed, out, texts, (not parsed.empty_final) if streamed else None)
        if streamed and parsed.empty_final:
            resp = M["ModelInferResponse"](model_name=self.serving.model_name, model_version="1", id=req.id)
            resp.parameters["triton_final_response"].bool_param = True
            yield resp

    async def ModelInfer(self, request, context):
        try:
            parsed = self._parse(request)
            parsed.stream = False  # one response: the full result
            result = None
            async for resp in self._results(request, parsed, streamed=False):
                result = resp
            return result
        except ServiceError as e:
            await context.abort(e.grpc_code, e.message)

    async def ModelStreamInfer(self, request_iterator, context):
        queue: asyncio.Queue = asyncio.Queue()
        end = object()
        tasks: set[asyncio.Task] = set()

        async def run_one(req):
            try:
                async for resp in self._results(req, self._parse(req), streamed=True):
                    await queue.put(M["ModelStreamInferResponse"](infer_response=resp))
            except Exception as e:  # noqa: BLE001 -- in-band, so one bad request never ends the shared stream
                if not isinstance(e, ServiceError):
                    logger.exception("KServe stream request %r failed", req.id)
                message = e.message if isinstance(e, ServiceError) else f"internal error: {e!r}"
                err = M["ModelInferResponse"](model_name=req.model_name, model_version=req.model_version, id=req.id)
                await queue.put(M["ModelStreamInferResponse"](error_message=message, infer_response=err))

        async def read():
            async for req in request_iterator:
                t = asyncio.create_task(run_one(req))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            while tasks:  # the client closed its side: finish what it asked for
                await asyncio.gather(*list(tasks), return_exceptions=True)
            await queue.put(end)

        reader = asyncio.create_task(read())
        try:
            while True:
                item = await queue.get()
                if item is end:
                    break
                yield item
        finally:  # the call is over (or cancelled): abort whatever is still running
            reader.cancel()
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(reader, *list(tasks), return_exceptions=True)


def add_to_server(servicer: KServeServicer, server: grpc.aio.Server) -> None:
    def unary(name, req, resp):
        return grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=M[req].FromString, response_serializer=M[resp].SerializeToString
        )

    handlers = {
        "ServerLive": unary("ServerLive", "ServerLiveRequest", "ServerLiveResponse"),
        "ServerReady": unary("ServerReady", "ServerReadyRequest", "ServerReadyResponse"),
        "ModelReady": unary("ModelReady", "ModelReadyRequest", "ModelReadyResponse"),
        "ServerMetadata": unary("ServerMetadata", "ServerMetadataRequest", "ServerMetadataResponse"),
        "ModelMetadata": unary("ModelMetadata", "ModelMetadataRequest", "ModelMetadataResponse"),
        "ModelInfer": unary("ModelInfer", "ModelInferRequest", "ModelInferResponse"),
        "ModelConfig": unary("ModelConfig", "ModelConfigRequest", "ModelConfigResponse"),
        "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
            servicer.ModelStreamInfer,
            request_deserializer=M["ModelInferRequest"].FromString,
            response_serializer=M["ModelStreamInferResponse"].SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
