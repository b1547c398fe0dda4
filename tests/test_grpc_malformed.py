"""A table of malformed gRPC requests (jaxserve.v1 and KServe v2) against one server on 127.0.0.1.

Each case expects one status code and, where there is a field to blame, its name in the details (in-band
`error_message` on a KServe stream); UNKNOWN and INTERNAL never appear, details stay short whatever the request
echoes. After every case a known greedy request still returns the text it returned at the start (and on a stream
the same stream still serves it): no input can damage the server, the engine or a shared stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc
import pytest

from grpc_helpers import METHODS, bytes_tensor_raw, callable_for, gen, infer, raw_infer, tensor, text_output, varint
from service.kserve import M
from service.proto import jaxserve_v1_pb2 as pb
from service.protocol import ServingLimits
from service_fixtures import MODEL_NAME, make_tiny_model_with_tokenizer, start_server, wait_engine_idle

INVALID, NOT_FOUND, OK = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OK
IN_BAND = "in-band"  # a KServe stream answers with error_message and stays open
LIMITS = ServingLimits(max_in_flight=6, priority_range=(-10, 10))
GREEDY = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
GREEDY_JSON = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
GARBAGE = b"\xff\xff\xff\xff"  # field 31, wire type 7: no such wire type
TRUNCATED = b"\x12\x10abc"  # field 2, 16 bytes announced, 3 given
DEEP_GROUPS = varint((99 << 3) | 3) * 5000  # an unknown field opening 5000 nested groups
MB = 1 << 20


@dataclass(frozen=True)
class Case:
    id: str
    method: str
    request: object  # a message, or raw bytes sent as they are
    code: grpc.StatusCode | str
    field: str | None = None  # named in the details
    check: object = None  # for OK: a predicate on the response


def v1(id, request, field, code=INVALID):
    return Case(id, "Generate", request, code, field)


def ks(id, request, field, code=INVALID):
    return Case(id, "ModelInfer", request, code, field)


def sp(id, sampling, field):
    return Case(id, "ModelInfer", infer(sampling=sampling), INVALID, field)


CASES = [
    # ---- jaxserve.v1 Generate: prompt --------------------------------------------------------------------------
    v1("no-prompt", gen(None), "prompt"),
    v1("empty-text", gen(""), "prompt"),
    v1("empty-token-ids", gen([]), "prompt"),
    v1("token-id-beyond-vocab", gen([5, 300]), "prompt"),
    v1("token-id-uint32-max", gen([2**32 - 1]), "prompt"),
    v1("prompt-longer-than-context", gen("x" * 300), "prompt"),
    v1("prompt-over-char-limit", gen("x" * (MB + 1)), "prompt"),
    # ---- Generate: sampling ranges, NaN / inf, huge numbers --------------------------------------------------
    v1("max-tokens-0", gen(max_tokens=0), "max_tokens"),
    v1("max-tokens-negative-as-uint32", gen(max_tokens=2**32 - 1), "max_tokens"),
    v1("prompt-plus-max-tokens-over-context", gen(max_tokens=252), "max_tokens"),
    v1("temperature-negative", gen(temperature=-1.0), "temperature"),
    v1("temperature-nan", gen(temperature=float("nan")), "temperature"),
    v1("temperature-inf", gen(temperature=float("inf")), "temperature"),
    v1("temperature-minus-inf", gen(temperature=float("-inf")), "temperature"),
    v1("temperature-1e30", gen(temperature=1e30), "temperature"),
    v1("top-p-0", gen(top_p=0.0), "top_p"),
    v1("top-p-above-1", gen(top_p=1.5), "top_p"),
    v1("top-p-nan", gen(top_p=float("nan")), "top_p"),
    v1("top-k-minus-2", gen(top_k=-2), "top_k"),
    v1("top-k-int32-max", gen(top_k=2**31 - 1), "top_k"),
    v1("top-k-vocab-plus-1", gen(top_k=301), "top_k"),
    v1("min-p-2", gen(min_p=2.0), "min_p"),
    v1("min-p-nan", gen(min_p=float("nan")), "min_p"),
    v1("n-0", gen(n=0), "n"),
    v1("n-17", gen(n=17), "n"),
    v1("n-uint32-max", gen(n=2**32 - 1), "n"),
    v1("logprobs-21", gen(logprobs=21), "logprobs"),
    v1("stop-empty-string", gen(stop=[""]), "stop"),
    v1("stop-17-strings", gen(stop=[f"s{i}" for i in range(17)]), "stop"),
    v1("stop-string-257-chars", gen(stop=["y" * 257]), "stop"),
    v1("stop-token-beyond-vocab", gen(stop_token_ids=[100000]), "stop_token_ids"),
    v1("repetition-penalty-0", gen(repetition_penalty=0.0), "repetition_penalty"),
    v1("repetition-penalty-inf", gen(repetition_penalty=float("inf")), "repetition_penalty"),
    v1("frequency-penalty-minus-3", gen(frequency_penalty=-3.0), "frequency_penalty"),
    v1("presence-penalty-nan", gen(presence_penalty=float("nan")), "presence_penalty"),
    v1("min-tokens-over-max-tokens", gen(max_tokens=2, min_tokens=3), "min_tokens"),
    # ---- Generate: ids, priorities, bytes ----------------------------------------------------------------------
    v1("request-id-1mb", gen(request_id="r" * MB), "request_id"),
    v1("request-id-257-chars", gen(request_id="r" * 257), "request_id"),
    v1("request-id-newline", gen(request_id="a\nb"), "request_id"),
    v1("request-id-nul", gen(request_id="a\0b"), "request_id"),
    v1("request-id-escape-sequence", gen(request_id="\x1b[31mred"), "request_id"),
    v1("priority-above-range", gen(priority=11), "priority"),
    v1("priority-int32-min", gen(priority=-(2**31)), "priority"),
    v1("bytes-garbage", GARBAGE, "not a valid protobuf message"),
    v1("bytes-text-not-utf8", b"\x12\x02\xff\xfe", "not a valid protobuf message"),
    v1("bytes-truncated", TRUNCATED, "not a valid protobuf message"),
    v1("bytes-nested-groups", DEEP_GROUPS, "not a valid protobuf message"),
    v1("message-over-16mb", gen("x" * (17 * MB)), None, grpc.StatusCode.RESOURCE_EXHAUSTED),
    # ---- Abort, GetModelInfo -----------------------------------------------------------------------------------
    Case("abort-bytes-garbage", "Abort", GARBAGE, INVALID, "not a valid protobuf message"),
    Case("abort-bytes-truncated", "Abort", b"\x0a\x05ab", INVALID, "not a valid protobuf message"),
    Case("abort-empty-id", "Abort", pb.AbortRequest(), INVALID, "request_id"),
    Case("abort-id-1mb", "Abort", b"\x0a" + varint(MB) + b"r" * MB, INVALID, "request_id"),
    Case("abort-id-control-chars", "Abort", b"\x0a\x03a\x07b", INVALID, "request_id"),
    Case("abort-unknown-id", "Abort", b"\x0a\x07nothing", OK, check=lambda r: not r.found),
    Case("model-info-bytes-garbage", "GetModelInfo", GARBAGE, INVALID, "not a valid protobuf message"),
    Case("model-info-bytes-nested-groups", "GetModelInfo", DEEP_GROUPS, INVALID, "not a valid protobuf message"),
    Case("model-info-unknown-fields", "GetModelInfo", b"\x08\x01\x12\x01x", OK,
         check=lambda r: r.model_name == MODEL_NAME),
    # ---- KServe ModelInfer: model, ids, tensors ------------------------------------------------------------------
    ks("unknown-model", infer(model="nope"), "model_name", NOT_FOUND),
    ks("model-name-100k", infer(model="m" * 100_000), "model_name", NOT_FOUND),
    ks("unknown-version", infer(version="2"), "model_version", NOT_FOUND),
    ks("id-1mb", infer(id="i" * MB), "id"),
    ks("id-control-chars", infer(id="a\tb"), "id"),
    ks("no-inputs", infer(None), "text_input"),
    ks("text-input-int32", infer(None, extra=[tensor("text_input", "INT32", 5)]), "text_input"),
    ks("text-input-shape-2", infer(None, extra=[tensor("text_input", "BYTES", b"hi", shape=(2,))]), "text_input"),
    ks("text-input-shape-negative", infer(None, extra=[tensor("text_input", "BYTES", b"hi", shape=(-1,))]),
       "text_input"),
    ks("text-input-two-elements", infer(None, extra=[tensor("text_input", "BYTES", [b"a", b"b"])]), "text_input"),
    ks("text-input-no-elements", infer(None, extra=[tensor("text_input", "BYTES", [])]), "text_input"),
    ks("text-input-not-utf8", infer(b"\xff\xfeHello"), "text_input"),
    ks("text-input-empty", infer(b""), "text_input"),
    ks("text-input-twice", infer(extra=[tensor("text_input", "BYTES", b"again")]), "text_input"),
    ks("text-input-longer-than-context", infer(b"x" * 300), "prompt"),
    ks("unknown-input", infer(extra=[tensor("prompt", "BYTES", b"x")]), "prompt"),
    ks("stream-as-bytes", infer(extra=[tensor("stream", "BYTES", b"true")]), "stream"),
    ks("stream-keeping-input", infer(stream=True, extra=[tensor("exclude_input_in_output", "BOOL", False)]),
       "exclude_input_in_output"),
    ks("unknown-output", infer(outputs=["logits"]), "outputs"),
    # ---- raw_input_contents ----------------------------------------------------------------------------------------
    ks("raw-count-mismatch", raw_infer(b"", b""), "raw_input_contents"),
    ks("raw-truncated-prefix", raw_infer(b"\x05\x00"), "text_input"),
    ks("raw-element-overruns", raw_infer(b"\xff\x00\x00\x00ab"), "text_input"),
    ks("raw-and-contents", raw_infer(bytes_tensor_raw(b"x"), inputs=[tensor("text_input", "BYTES", b"x")]),
       "text_input"),
    ks("raw-two-elements", raw_infer(bytes_tensor_raw(b"a", b"b")), "text_input"),
    Case("raw-valid", "ModelInfer", raw_infer(bytes_tensor_raw(b"Hello")), OK, check=lambda r: text_output(r)[0]),
    # ---- sampling_parameters JSON ----------------------------------------------------------------------------------
    sp("json-not-json", b"{nope", "sampling_parameters"),
    sp("json-array", b"[1, 2]", "sampling_parameters"),
    sp("json-not-utf8", b'{"temperature": "\xff"}', "sampling_parameters"),
    sp("json-over-64k", json.dumps({"stop": ["z" * 70_000]}).encode(), "sampling_parameters"),
    sp("json-nested-100k", b'{"stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "sampling_parameters"),
    sp("json-nested-list", {"stop": [["a"]]}, "stop"),
    sp("json-object-value", {"temperature": {"value": 1}}, "temperature"),
    sp("top-k-1e10-string", {"top_k": "10000000000"}, "top_k"),
    sp("top-k-1e10-number", {"top_k": 10000000000}, "top_k"),
    sp("seed-5000-digits", b'{"seed": ' + b"9" * 5000 + b"}", "seed"),
    sp("seed-5000-digit-string", {"seed": "9" * 5000}, "seed"),
    sp("seed-2**64", {"seed": 2**64}, "seed"),
    sp("temperature-nan-literal", b'{"temperature": NaN}', "temperature"),
    sp("temperature-nan-string", {"temperature": "NaN"}, "temperature"),
    sp("temperature-1e400", b'{"temperature": 1e400}', "temperature"),
    sp("temperature-infinity-string", {"temperature": "Infinity"}, "temperature"),
    sp("temperature-1e300", {"temperature": 1e300}, "temperature"),
    sp("temperature-word", {"temperature": "hot"}, "temperature"),
    sp("temperature-60k-string", {"temperature": "h" * 60_000}, "temperature"),
    sp("max-tokens-negative", {"max_tokens": "-1"}, "max_tokens"),
    sp("max-tokens-fraction", {"max_tokens": 1.5}, "max_tokens"),
    sp("max-tokens-bool", {"max_tokens": True}, "max_tokens"),
    sp("top-p-0-string", {"top_p": "0"}, "top_p"),
    sp("ignore-eos-maybe", {"ignore_eos": "maybe"}, "ignore_eos"),
    sp("unknown-parameter", {"beam_width": 2}, "beam_width"),
    sp("stop-lone-surrogate", b'{"stop": "\\ud800"}', "stop"),
    sp("stop-token-ids-not-json", {"stop_token_ids": "[1,"}, "stop_token_ids"),
    # ---- the request parameters map --------------------------------------------------------------------------------
    ks("param-temperature-bool", infer(params={"temperature": True}), "temperature"),
    ks("param-max-tokens-word", infer(params={"max_tokens": "many"}), "max_tokens"),
    ks("param-seed-uint64-max", infer(params={"seed": 2**64 - 1}), "seed"),
    ks("param-top-k-int64-max", infer(params={"top_k": 2**63 - 1}), "top_k"),
    ks("param-no-value", infer(params={"temperature": None}), "temperature"),
    ks("param-empty-final-not-bool", infer(params={"triton_enable_empty_final_response": "yes"}),
       "triton_enable_empty_final_response"),
    ks("infer-bytes-garbage", GARBAGE, "not a valid protobuf message"),
    ks("infer-bytes-truncated", TRUNCATED, "not a valid protobuf message"),
    ks("infer-bytes-model-name-not-utf8", b"\x0a\x02\xc3\x28", "not a valid protobuf message"),
    # ---- ModelStreamInfer (in-band; the stream then still serves a greedy request) ----------------------------------
    Case("stream-unknown-model", "ModelStreamInfer", infer(model="nope", stream=True), IN_BAND, "model_name"),
    Case("stream-bad-json", "ModelStreamInfer", infer(b"x", b"{nope", stream=True), IN_BAND, "sampling_parameters"),
    Case("stream-top-k-huge", "ModelStreamInfer", infer(b"x", {"top_k": "10000000000"}, stream=True), IN_BAND, "top_k"),
    Case("stream-temperature-nan", "ModelStreamInfer", infer(b"x", b'{"temperature": NaN}', stream=True), IN_BAND,
         "temperature"),
    Case("stream-id-1mb", "ModelStreamInfer", infer(b"x", id="i" * MB, stream=True), IN_BAND, "id"),
    Case("stream-bytes-garbage", "ModelStreamInfer", GARBAGE, IN_BAND, "not a valid protobuf message"),
    Case("stream-bytes-truncated", "ModelStreamInfer", TRUNCATED, IN_BAND, "not a valid protobuf message"),
    # ---- ModelMetadata, ModelReady, ModelConfig ------------------------------------------------------------------
    Case("metadata-unknown-model", "ModelMetadata", M["ModelMetadataRequest"](name="nope"), NOT_FOUND, "name"),
    Case("metadata-unknown-version", "ModelMetadata", M["ModelMetadataRequest"](name=MODEL_NAME, version="7"),
         NOT_FOUND, "version"),
    Case("metadata-name-100k", "ModelMetadata", M["ModelMetadataRequest"](name="n" * 100_000), NOT_FOUND, "name"),
    Case("metadata-bytes-garbage", "ModelMetadata", GARBAGE, INVALID, "not a valid protobuf message"),
    Case("ready-unknown-model", "ModelReady", M["ModelReadyRequest"](name="nope"), OK, check=lambda r: not r.ready),
    Case("ready-unknown-version", "ModelReady", M["ModelReadyRequest"](name=MODEL_NAME, version="9"), OK,
         check=lambda r: not r.ready),
    Case("ready-bytes-garbage", "ModelReady", GARBAGE, INVALID, "not a valid protobuf message"),
    Case("ready-bytes-not-utf8", "ModelReady", b"\x0a\x01\xff", INVALID, "not a valid protobuf message"),
    Case("config-unknown-model", "ModelConfig", M["ModelConfigRequest"](name="nope"), NOT_FOUND, "name"),
    Case("config-bytes-nested-groups", "ModelConfig", DEEP_GROUPS, INVALID, "not a valid protobuf message"),
    # ---- health and reflection share the decode guard --------------------------------------------------------------
    Case("health-check-bytes-garbage", "HealthCheck", GARBAGE, INVALID, "not a valid protobuf message"),
    Case("health-watch-bytes-not-utf8", "HealthWatch", b"\x0a\x01\xff", INVALID, "not a valid protobuf message"),
    Case("reflection-bytes-truncated", "Reflection", TRUNCATED, INVALID, "not a valid protobuf message"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(make_tiny_model_with_tokenizer(str(tmp_path_factory.mktemp("tiny_malformed"))), limits=LIMITS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def channel(server):
    # A 17 MB request must reach the server (and be refused there), so the client may send that much.
    ch = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=[("grpc.max_send_message_length", 32 * MB)])
    yield ch
    ch.close()


def _greedy_v1(channel) -> str:
    responses = callable_for(channel, "Generate")(gen("Hello world", **GREEDY), timeout=30)
    return "".join(d.text for r in responses for d in r.outputs)


def _greedy_kserve(channel) -> str:
    req = infer(b"Hello world", GREEDY_JSON, extra=[tensor("exclude_input_in_output", "BOOL", True)])
    return text_output(callable_for(channel, "ModelInfer")(req, timeout=30))[0]


def _good_stream_request():
    return infer(b"Hello world", GREEDY_JSON, id="good", stream=True)


@pytest.fixture(scope="module")
def reference(channel) -> str:
    text = _greedy_v1(channel)
    assert text and _greedy_kserve(channel) == text
    return text


def _stream(channel, request) -> tuple[str, str]:
    """Send `request` then a good greedy request on one stream: (the in-band error, the good request's text)."""
    responses = list(callable_for(channel, "ModelStreamInfer")(iter([request, _good_stream_request()]), timeout=30))
    errors = [r.error_message for r in responses if r.error_message]
    assert len(errors) == 1, errors
    bad = [r for r in responses if r.error_message][0].infer_response
    assert bad.id in ("", request.id if not isinstance(request, bytes) else ""), "an invalid id is never echoed"
    good = [r.infer_response for r in responses if not r.error_message and r.infer_response.id == "good"]
    return errors[0], "".join(t for r in good if r.outputs for t in text_output(r))


def test_table_is_large_enough():
    assert len(CASES) >= 50 and len({c.id for c in CASES}) == len(CASES)
    methods = {c.method for c in CASES}
    assert {"Generate", "Abort", "GetModelInfo", "ModelInfer", "ModelStreamInfer", "ModelMetadata",
            "ModelReady"} <= methods


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed(case: Case, channel, reference):
    if case.code == IN_BAND:
        message, text = _stream(channel, case.request)
        assert case.field in message, message
        assert len(message) <= 1100, "in-band errors are capped"
        assert text == reference, "the stream still serves a good request after a bad one"
    else:
        call = callable_for(channel, case.method)
        if case.code == OK:
            assert case.check(call(case.request, timeout=30))
        else:
            streaming = METHODS[case.method][3:]
            with pytest.raises(grpc.RpcError) as e:
                result = call(iter([case.request]) if streaming[0] else case.request, timeout=30)
                if streaming[1]:
                    list(result)
            code, details = e.value.code(), e.value.details() or ""
            assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (code, details)
            assert code == case.code, (code, details)
            if case.field is not None:
                assert case.field in details, details
            assert len(details) <= 1100, "status details are capped, whatever the request echoes"
    assert _greedy_v1(channel) == reference
    if case.method.startswith("Model"):
        assert _greedy_kserve(channel) == reference


def test_no_request_left_behind(server, channel, reference):
    wait_engine_idle(server)
    assert server.server.serving.num_in_flight == 0
