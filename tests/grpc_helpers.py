"""Builders for gRPC test requests: jaxserve.v1 and KServe messages, raw (possibly invalid) bytes, and calls on any
method of either service with any payload.

KServe messages come from service.kserve's private descriptor pool (`M`), so tests need no tritonclient for them.
"""

from __future__ import annotations

import json

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from service.kserve import SERVICE_NAME as KSERVE
from service.kserve import M
from service.proto import jaxserve_v1_pb2 as pb
from service_fixtures import MODEL_NAME

V1 = "jaxserve.v1.Generation"
# method -> (full path, request message, response message, request streaming, response streaming)
METHODS = {
    "Generate": (f"/{V1}/Generate", pb.GenerateRequest, pb.GenerateResponse, False, True),
    "Abort": (f"/{V1}/Abort", pb.AbortRequest, pb.AbortResponse, False, False),
    "GetModelInfo": (f"/{V1}/GetModelInfo", pb.GetModelInfoRequest, pb.ModelInfo, False, False),
    "ModelInfer": (f"/{KSERVE}/ModelInfer", M["ModelInferRequest"], M["ModelInferResponse"], False, False),
    "ModelStreamInfer": (f"/{KSERVE}/ModelStreamInfer", M["ModelInferRequest"], M["ModelStreamInferResponse"], True,
                         True),
    "ModelMetadata": (f"/{KSERVE}/ModelMetadata", M["ModelMetadataRequest"], M["ModelMetadataResponse"], False, False),
    "ModelReady": (f"/{KSERVE}/ModelReady", M["ModelReadyRequest"], M["ModelReadyResponse"], False, False),
    "ModelConfig": (f"/{KSERVE}/ModelConfig", M["ModelConfigRequest"], M["ModelConfigResponse"], False, False),
    "HealthCheck": ("/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse,
                    False, False),
    "HealthWatch": ("/grpc.health.v1.Health/Watch", health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse,
                    False, True),
    "Reflection": (
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        reflection_pb2.ServerReflectionRequest,
        reflection_pb2.ServerReflectionResponse,
        True,
        True,
    ),
}


def callable_for(channel: grpc.Channel, method: str):
    """A multi-callable for `method` that sends messages or raw bytes (as they are) and parses the responses."""
    path, _, resp, req_stream, resp_stream = METHODS[method]

    def serialize(msg) -> bytes:
        return msg if isinstance(msg, bytes) else msg.SerializeToString()

    kind = {(False, False): "unary_unary", (False, True): "unary_stream", (True, True): "stream_stream"}
    multi_callable = getattr(channel, kind[req_stream, resp_stream])
    return multi_callable(path, request_serializer=serialize, response_deserializer=resp.FromString)


def gen(prompt: str | list[int] | None = "Hello", *, request_id: str = "", priority: int = 0, **sampling):
    req = pb.GenerateRequest(request_id=request_id, priority=priority, sampling_params=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.token_ids.ids.extend(prompt)
    return req


def tensor(name: str, datatype: str, value, shape=(1,)):
    t = M["ModelInferRequest"].InferInputTensor(name=name, datatype=datatype, shape=list(shape))
    values = value if isinstance(value, list) else [value]
    if datatype == "BYTES":
        t.contents.bytes_contents.extend(values)
    elif datatype == "BOOL":
        t.contents.bool_contents.extend(values)
    else:
        t.contents.int_contents.extend(values)
    return t


def param(value):
    p = M["InferParameter"]()
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        if value >= 2**63:
            p.uint64_param = value
        else:
            p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    elif isinstance(value, str):
        p.string_param = value
    return p  # None: a parameter with no value set


def infer(
    prompt: bytes | None = b"Hello",
    sampling: dict | bytes | None = None,
    *,
    extra=(),
    model: str = MODEL_NAME,
    version: str = "",
    id: str = "",
    params: dict | None = None,
    outputs=(),
    stream: bool | None = None,
):
    """A ModelInferRequest with text_input (unless None), sampling_parameters (a dict as JSON, or raw bytes)."""
    req = M["ModelInferRequest"](model_name=model, model_version=version, id=id)
    if prompt is not None:
        req.inputs.append(tensor("text_input", "BYTES", prompt))
    if stream is not None:
        req.inputs.append(tensor("stream", "BOOL", stream))
    if sampling is not None:
        raw = sampling if isinstance(sampling, bytes) else json.dumps(sampling).encode()
        req.inputs.append(tensor("sampling_parameters", "BYTES", raw))
    req.inputs.extend(extra)
    for key, value in (params or {}).items():
        req.parameters[key].CopyFrom(param(value))
    for name in outputs:
        req.outputs.add(name=name)
    return req


def raw_infer(*raw: bytes, inputs=None):
    """A ModelInferRequest whose text_input (or `inputs`) data travel in raw_input_contents."""
    tensors = inputs or [M["ModelInferRequest"].InferInputTensor(name="text_input", datatype="BYTES", shape=[1])]
    return M["ModelInferRequest"](model_name=MODEL_NAME, inputs=tensors, raw_input_contents=list(raw))


def bytes_tensor_raw(*elements: bytes) -> bytes:
    """BYTES raw contents: each element prefixed by its 4-byte little-endian length."""
    return b"".join(len(e).to_bytes(4, "little") + e for e in elements)


def text_output(resp) -> list[str]:
    """The text_output tensor of a ModelInferResponse (raw contents)."""
    i = [o.name for o in resp.outputs].index("text_output")
    raw, out, pos = resp.raw_output_contents[i], [], 0
    while pos < len(raw):
        n = int.from_bytes(raw[pos : pos + 4], "little")
        out.append(raw[pos + 4 : pos + 4 + n].decode())
        pos += 4 + n
    return out


def varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([b])
        out += bytes([b | 0x80])
