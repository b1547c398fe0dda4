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
Hostile input: every malformed request is INVALID_ARGUMENT (NOT_FOUND for an unknown model or version) naming the
input, parameter or field, in-band on a stream: tensors are checked for name, datatype, shape, element count and
encoding; `sampling_parameters` is parsed as flat JSON (no nesting, no NaN / Infinity, integers of at most
_MAX_INT_DIGITS digits, at most _MAX_SAMPLING_JSON bytes) and every field, from it or from the request `parameters`
map, goes through protocol.build_sampling_params. A client that stops reading a stream holds bounded memory: see
ModelStreamInfer.

The messages come from service/proto/kserve_v2.binpb (scripts/gen_protos.sh), loaded into a private descriptor
pool: a client library with its own copy of these protobuf names can live in the same process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import struct

import grpc
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

import jaxserve
from service.async_engine import ServingEngine
from service.grpc_server import abort, build_params, check_request_id, short, status_details
from service.protocol import BadNumber, InvalidRequest, ModelNotFound, ServiceError, check_prompt, loads_strict

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
_OUTPUTS = {"text_output": "BYTES", "finish_reason": "BYTES", "num_input_tokens": "UINT32",
            "num_output_tokens": "UINT32"}
# Request parameters Triton reserves for itself; everything else in `parameters` is read as a sampling field.
_RESERVED = ("sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers", "binary_data_output")
_MAX_SAMPLING_JSON = 64 << 10  # bytes of sampling_parameters: 16 stop strings of 256 characters fit many times over
_MAX_INT_DIGITS = 100  # a longer integer is refused by name (Python's int() would refuse beyond 4300, unnamed)
_STREAM_QUEUE = 16  # responses of one ModelStreamInfer call waiting for the client to read them


def _bytes_elements(raw: bytes, name: str) -> list[bytes]:
    out, i = [], 0
    while i < len(raw):
        if i + 4 > len(raw):
            raise InvalidRequest(f"input {name!r}: BYTES raw contents end inside a 4-byte length prefix", name)
        (n,) = struct.unpack_from("<I", raw, i)
        i += 4
        if i + n > len(raw):
            raise InvalidRequest(f"input {name!r}: a BYTES element of {n} bytes overruns the raw contents", name)
        out.append(raw[i : i + n])
        i += n
    return out


def _input_value(req, index: int, tensor):
    """The one element of an input tensor, from `contents` or `raw_input_contents[index]`."""
    name, datatype = tensor.name, _INPUTS[tensor.name]
    if tensor.datatype != datatype:
        raise InvalidRequest(f"input {name!r} must have datatype {datatype} (got {short(tensor.datatype)})", name)
    if any(d < 0 for d in tensor.shape) or math.prod(tensor.shape) != 1:
        raise InvalidRequest(f"input {name!r} must have shape [1] (got {short(list(tensor.shape))})", name)
    if req.raw_input_contents:
        if tensor.HasField("contents"):
            raise InvalidRequest(f"input {name!r} has contents, but the request uses raw_input_contents", name)
        raw = req.raw_input_contents[index]
        values = _bytes_elements(raw, name) if datatype == "BYTES" else [bool(b) for b in raw]
    else:
        c = tensor.contents
        values = list(c.bytes_contents) if datatype == "BYTES" else list(c.bool_contents)
    if len(values) != 1:
        raise InvalidRequest(f"input {name!r} must hold exactly one element, as its shape says (got {len(values)})",
                             name)
    return values[0]


def _param_value(key: str, p):
    which = p.WhichOneof("parameter_choice")
    if which is None:
        raise InvalidRequest(f"parameter {short(key)} has no value: set one of bool/int64/uint64/double/string_param",
                             key)
    return getattr(p, which)


def _sampling_json(raw: bytes) -> dict:
    """sampling_parameters as a flat JSON object of scalars and lists of scalars, every value checked by name."""
    param = "sampling_parameters"
    if len(raw) > _MAX_SAMPLING_JSON:
        raise InvalidRequest(f"{param} has {len(raw)} bytes; the limit is {_MAX_SAMPLING_JSON}", param)
    try:
        js = loads_strict(raw.decode("utf-8"), _MAX_INT_DIGITS)
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"{param} must be UTF-8 JSON: {e.reason} at byte {e.start}", param) from None
    except RecursionError:
        raise InvalidRequest(f"{param} nests JSON too deep: it must be a flat object of sampling fields",
                             param) from None
    except ValueError as e:  # json.JSONDecodeError says where
        raise InvalidRequest(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(js, dict):
        raise InvalidRequest(f"{param} must be a JSON object (got {type(js).__name__})", param)
    for key, value in js.items():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, BadNumber):
                raise InvalidRequest(
                    f"{key} must be a finite number, integers at most {_MAX_INT_DIGITS} digits (got {short(v.text)})",
                    key
                )
            if isinstance(v, (dict, list)):
                raise InvalidRequest(f"{param}: {short(key)} must be a string, number, boolean or a list of them", key)
            if isinstance(v, str) and not _is_unicode(v):
                raise InvalidRequest(f"{param}: {short(key)} holds an unpaired UTF-16 surrogate", key)
        if not _is_unicode(key):
            raise InvalidRequest(f"{param}: a key holds an unpaired UTF-16 surrogate", param)
    return js


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


class _Parsed:
    def __init__(self, prompt, params, stream, exclude_input, want, empty_final):
        self.prompt, self.params, self.stream = prompt, params, stream
        self.exclude_input, self.want, self.empty_final = exclude_input, want, empty_final


class KServeServicer:
    def __init__(self, serving: ServingEngine):
        self.serving = serving

    def _check_model(self, name: str, version: str, fields: tuple[str, str] = ("model_name", "model_version")) -> None:
        s = self.serving
        if name != s.model_name:
            raise ModelNotFound(f"{fields[0]}: no model {short(name)} here; this server serves {s.model_name!r}",
                                fields[0])
        if version not in ("", "1"):
            raise ModelNotFound(f"{fields[1]}: model {s.model_name!r} has no version {short(version)}, only '1'",
                                fields[1])

    # ---- metadata RPCs --------------------------------------------------------------------------------------

    async def ServerLive(self, request, context):
        return M["ServerLiveResponse"](live=self.serving.llm.is_running)

    async def ServerReady(self, request, context):
        return M["ServerReadyResponse"](ready=self.serving.evaluate_readiness())

    async def ModelReady(self, request, context):
        ok = request.name == self.serving.model_name and request.version in ("", "1")
        return M["ModelReadyResponse"](ready=ok and self.serving.evaluate_readiness())

    async def ServerMetadata(self, request, context):
        return M["ServerMetadataResponse"](name="jaxserve", version=jaxserve.__version__, extensions=[])

    async def ModelMetadata(self, request, context):
        try:
            self._check_model(request.name, request.version, ("name", "version"))
        except ServiceError as e:
            await abort(context, e)
        T = M["ModelMetadataResponse"].TensorMetadata
        return M["ModelMetadataResponse"](
            name=self.serving.model_name,
            versions=["1"],
            platform="jaxserve",
            inputs=[T(name=n, datatype=d, shape=[1]) for n, d in _INPUTS.items()],
            outputs=[T(name=n, datatype=d,
                       shape=[1] if n == "num_input_tokens" else [-1]) for n, d in _OUTPUTS.items()],
        )

    async def ModelConfig(self, request, context):
        try:
            self._check_model(request.name, request.version, ("name", "version"))
        except ServiceError as e:
            await abort(context, e)
        types = {"BYTES": "TYPE_STRING", "BOOL": "TYPE_BOOL", "UINT32": "TYPE_UINT32"}
        enum = self._data_type
        config = M["ModelConfig"](
            name=self.serving.model_name,
            platform="jaxserve",
            backend="jaxserve",
            max_batch_size=0,
            input=[M["ModelInput"](name=n, data_type=enum(types[d]), dims=[1],
                                   optional=n != "text_input") for n, d in _INPUTS.items()],
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
        self._check_model(req.model_name, req.model_version)
        check_request_id(req.id, s.limits, "id")
        if req.raw_input_contents and len(req.raw_input_contents) != len(req.inputs):
            raise InvalidRequest(
                f"raw_input_contents has {len(req.raw_input_contents)} entries for {len(req.inputs)} inputs: "
                "with raw contents, every input has one",
                "raw_input_contents",
            )
        values = {}
        for i, t in enumerate(req.inputs):
            if t.name not in _INPUTS:
                raise InvalidRequest(f"unknown input {short(t.name)}; known inputs: {', '.join(_INPUTS)}", t.name[:100])
            if t.name in values:
                raise InvalidRequest(f"input {t.name!r} is given more than once", t.name)
            values[t.name] = _input_value(req, i, t)
        if "text_input" not in values:
            raise InvalidRequest("the text_input input is required", "text_input")
        try:
            text = values["text_input"].decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequest(f"text_input must be UTF-8 text: {e.reason} at byte {e.start}", "text_input") from None
        prompt = check_prompt(text, s.limits, s.vocab_size, "text_input")
        fields = {}
        for key, p in req.parameters.items():
            if key in _RESERVED or key.startswith("triton_"):
                continue
            fields[key] = _param_value(key, p)
        if "sampling_parameters" in values:
            fields.update(_sampling_json(values["sampling_parameters"]))
        params = build_params(s, fields, coerce_strings=True, param="sampling_parameters")
        stream = values.get("stream", False)
        exclude = values.get("exclude_input_in_output")
        if stream and exclude is False:
            raise InvalidRequest("streaming with exclude_input_in_output=false is not supported",
                                 "exclude_input_in_output")
        exclude = stream if exclude is None else exclude
        want = {o.name for o in req.outputs} or {"text_output"}
        unknown = sorted(want - set(_OUTPUTS))
        if unknown:
            raise InvalidRequest(f"unknown output {short(unknown[0])}; known outputs: {', '.join(_OUTPUTS)}", "outputs")
        for name in ("finish_reason", "num_input_tokens", "num_output_tokens"):
            if values.get(f"return_{name}"):
                want.add(name)
        key = "triton_enable_empty_final_response"
        empty_final = _param_value(key, req.parameters[key]) if key in req.parameters else False
        if not isinstance(empty_final, bool):
            raise InvalidRequest(f"{key} must be a bool_param (got {short(empty_final)})", key)
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
            await abort(context, e)

    async def ModelStreamInfer(self, request_iterator, context):
        """Triton's decoupled stream, in bounded memory whatever the client does.

        A client that stops reading holds at most _STREAM_QUEUE responses in the queue plus one waiting response per
        running request: a request whose response does not fit waits, and since ServingEngine keeps only its newest
        cumulative output meanwhile, its next delta simply covers more tokens. At most `max_in_flight` requests of
        one stream run (or wait to report an error) at once; beyond that the stream stops reading requests and
        HTTP/2 flow control holds the client back.
        """
        queue: asyncio.Queue = asyncio.Queue(maxsize=_STREAM_QUEUE)
        seats = asyncio.Semaphore(self.serving.limits.max_in_flight)
        end = object()
        tasks: set[asyncio.Task] = set()

        async def run_one(req):
            try:
                if isinstance(req, ServiceError):  # bytes that are not a ModelInferRequest (grpc_server.DecodeGuard)
                    raise req
                async for resp in self._results(req, self._parse(req), streamed=True):
                    await queue.put(M["ModelStreamInferResponse"](infer_response=resp))
            except Exception as e:  # noqa: BLE001 -- in-band, so one bad request never ends the shared stream
                await queue.put(self._stream_error(req, e))
            finally:
                seats.release()

        async def read():
            async for req in request_iterator:
                await seats.acquire()
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

    def _stream_error(self, req, e: Exception):
        """An in-band error response; it echoes the request's id, model and version only when they are valid."""
        if isinstance(e, ServiceError):
            message = e.message
        else:
            logger.exception("KServe stream request failed", exc_info=e)
            message = "internal error; the server log has the details"
        resp = M["ModelInferResponse"]()
        if not isinstance(req, ServiceError):
            with contextlib.suppress(ServiceError):
                self._check_model(req.model_name, req.model_version)
                resp.model_name, resp.model_version = req.model_name, req.model_version
            with contextlib.suppress(ServiceError):
                check_request_id(req.id, self.serving.limits, "id")
                resp.id = req.id
        return M["ModelStreamInferResponse"](error_message=status_details(message), infer_response=resp)


def add_to_server(servicer: KServeServicer, server: grpc.aio.Server) -> None:
    def unary(name, req, resp):
        return grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=M[req].FromString,
            response_serializer=M[resp].SerializeToString
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
