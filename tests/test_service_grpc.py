"""jaxserve.v1 gRPC on 127.0.0.1: streaming Generate equals the Python API, Abort, deadlines and cancels free pages,
malformed requests, overload, health that follows engine progress, reflection, API key, fresh stubs."""

import os
import subprocess
import sys
import threading
import time

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from jaxserve import LLM, SamplingParams
from service.proto import jaxserve_v1_pb2 as pb
from service.proto import jaxserve_v1_pb2_grpc as pb_grpc
from service_fixtures import CFG, MODEL_NAME, EngineHook, make_tiny_model_with_tokenizer, start_server, wait_engine_idle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model_with_tokenizer(str(tmp_path_factory.mktemp("tiny_grpc")))


@pytest.fixture(scope="module")
def server(path):
    srv = start_server(path)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def channel(server):
    ch = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def reference(path):
    return LLM(path, engine_config=CFG)


def _request(prompt, **sampling):
    req = pb.GenerateRequest(sampling_params=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def _join(responses):
    responses = list(responses)
    text = "".join(d.text for r in responses for d in r.outputs)
    ids = [t for r in responses for d in r.outputs for t in d.token_ids]
    return text, ids


def test_streaming_generate_equals_python_api(stub, reference):
    prompts = ["Hello world", "The quick brown fox"]
    want = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, w in zip(prompts, want):
        responses = list(stub.Generate(_request(prompt, temperature=0, max_tokens=10, ignore_eos=True)))
        assert len(responses) >= 3, "tokens stream incrementally"
        assert [r.finished for r in responses] == [False] * (len(responses) - 1) + [True]
        text, ids = _join(responses)
        assert ids == w.outputs[0].token_ids and text == w.outputs[0].text
        assert list(responses[0].prompt_token_ids) == w.prompt_token_ids
        final = responses[-1]
        assert final.outputs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert final.usage.prompt_tokens == len(w.prompt_token_ids) and final.usage.completion_tokens == 10
        assert final.usage.total_tokens == len(w.prompt_token_ids) + 10
        # Token-id input gives the same tokens.
        _, ids2 = _join(stub.Generate(_request(w.prompt_token_ids, temperature=0, max_tokens=10, ignore_eos=True)))
        assert ids2 == ids


def test_explicit_zero_is_honoured(stub, reference):
    """temperature=0 set explicitly means greedy; unset means the default (1.0): proto3 `optional` keeps them apart."""
    want = reference.generate("abc", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    _, greedy = _join(stub.Generate(_request("abc", temperature=0.0, max_tokens=16, ignore_eos=True)))
    assert greedy == want.outputs[0].token_ids
    _, sampled = _join(stub.Generate(_request("abc", max_tokens=16, ignore_eos=True, seed=1)))
    assert sampled != greedy
    # top_k=0 (disabled) and min_tokens=0 explicitly are accepted and change nothing.
    _, same = _join(stub.Generate(_request("abc", temperature=0.0, top_k=0, min_tokens=0, max_tokens=16,
                                           ignore_eos=True)))
    assert same == greedy


def test_logprobs_and_n(stub):
    responses = list(stub.Generate(_request("ab", temperature=0.8, seed=3, n=2, logprobs=2, max_tokens=5,
                                            ignore_eos=True)))
    per_index = {0: [], 1: []}
    for r in responses:
        for d in r.outputs:
            per_index[d.index].extend(d.logprobs)
            for lp in d.logprobs:
                assert len(lp.top) >= 2 and lp.logprob <= 0
                assert any(t.token_id == lp.token_id and abs(t.logprob - lp.logprob) < 1e-6 for t in lp.top)
    assert len(per_index[0]) == len(per_index[1]) == 5
    assert responses[-1].usage.completion_tokens == 10


def test_abort_rpc(stub, server):
    with EngineHook(server, step_delay=0.01):
        stream = stub.Generate(_request("go", temperature=0, max_tokens=200, ignore_eos=True, seed=0), metadata=())
        first = next(stream)
        rid = first.request_id
        assert rid
        assert stub.Abort(pb.AbortRequest(request_id=rid)).found
        rest = list(stream)
    assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert sum(len(d.token_ids) for r in [first, *rest] for d in r.outputs) < 200
    assert not stub.Abort(pb.AbortRequest(request_id=rid)).found
    wait_engine_idle(server)


def test_deadline_and_cancel_free_pages(stub, server):
    with EngineHook(server, step_delay=0.01):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(_request("deadline", temperature=0, max_tokens=200, ignore_eos=True), timeout=0.5))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_engine_idle(server, timeout=1.5)  # freed at once, long before the 2 s the generation would take

        call = stub.Generate(_request("cancel", temperature=0, max_tokens=200, ignore_eos=True))
        next(call)
        next(call)
        assert server.server.serving.llm.engine.block_manager.num_used_pages > 0
        call.cancel()
        wait_engine_idle(server, timeout=1.5)


BAD = [
    (pb.GenerateRequest(), "prompt"),
    (_request(""), "prompt"),
    (_request([]), "prompt"),
    (_request([100000]), "prompt"),
    (_request("x" * 300), "prompt"),  # the prompt alone fills the context
    (_request("a", max_tokens=0), "max_tokens"),
    (_request("a", temperature=-1.0), "temperature"),
    (_request("a", temperature=float("nan")), "temperature"),
    (_request("a", temperature=float("inf")), "temperature"),
    (_request("a", top_p=0.0), "top_p"),
    (_request("a", top_p=1.5), "top_p"),
    (_request("a", top_k=-2), "top_k"),
    (_request("a", min_p=2.0), "min_p"),
    (_request("a", n=0), "n"),
    (_request("a", n=17), "n"),
    (_request("a", logprobs=21), "logprobs"),
    (_request("a", stop=[""]), "stop"),
    (_request("a", stop_token_ids=[100000]), "stop_token_ids"),
    (_request("a", repetition_penalty=0.0), "repetition_penalty"),
    (_request("a", frequency_penalty=-3.0), "frequency_penalty"),
    (_request("a", max_tokens=2, min_tokens=3), "min_tokens"),
]


def test_malformed_requests_get_invalid_argument(stub, server):
    for req, field in BAD:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (req, e.value.details())
        assert field in e.value.details(), (req, e.value.details())
    # Invalid UTF-8 in a string field does not parse: INVALID_ARGUMENT (grpc.aio alone says UNKNOWN); the server
    # carries on.
    bad_utf8 = b"\x12\x02\xff\xfe"  # field 2 (text), 2 bytes, not UTF-8
    call = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}").unary_stream(
        "/jaxserve.v1.Generation/Generate", request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString
    )
    with pytest.raises(grpc.RpcError) as e:
        list(call(bad_utf8))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid protobuf message" in e.value.details()
    _, ids = _join(stub.Generate(_request("still alive", temperature=0, max_tokens=3)))
    assert 1 <= len(ids) <= 3
    wait_engine_idle(server)


def test_duplicate_request_id_and_overload(stub, server):
    serving = server.server.serving
    cap = serving.limits.max_in_flight
    with EngineHook(server, paused=True):
        calls = []
        for i in range(cap):
            req = _request("go", temperature=0, max_tokens=5, ignore_eos=True)
            req.request_id = f"held-{i}"
            calls.append(stub.Generate(req))
        # Streams start lazily: touch each so the server admits it.
        threads = [threading.Thread(target=lambda c=c: list(c)) for c in calls]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while serving.num_in_flight < cap and time.monotonic() < deadline:
            time.sleep(0.01)
        assert serving.num_in_flight == cap
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(_request("one too many", max_tokens=2)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for t in threads:
        t.join(timeout=10)
    wait_engine_idle(server)

    with EngineHook(server, paused=True):
        req = _request("dup", temperature=0, max_tokens=3)
        req.request_id = "same-id"
        first = stub.Generate(req)
        t = threading.Thread(target=lambda: list(first))
        t.start()
        while serving.num_in_flight < 1:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    t.join(timeout=10)
    wait_engine_idle(server)


def _health(channel, service=""):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_follows_engine_progress(channel, stub, server):
    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert _health(channel) == SERVING and _health(channel, "jaxserve.v1.Generation") == SERVING
    assert _health(channel, "inference.GRPCInferenceService") == SERVING
    with pytest.raises(grpc.RpcError) as e:
        _health(channel, "no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND

    serving = server.server.serving
    serving.stall_timeout_s = 0.3
    try:
        with EngineHook(server, paused=True):  # the engine stalls with a request in flight
            call = stub.Generate(_request("stall", temperature=0, max_tokens=3))
            t = threading.Thread(target=lambda: list(call))
            t.start()
            deadline = time.monotonic() + 5
            while _health(channel) != NOT_SERVING and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _health(channel) == NOT_SERVING
            assert _health(channel, "jaxserve.v1.Generation") == NOT_SERVING
            assert not stub.GetServerInfo(pb.GetServerInfoRequest()).ready
        t.join(timeout=10)  # the engine moves again
        deadline = time.monotonic() + 5
        while _health(channel) != SERVING and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _health(channel) == SERVING
    finally:
        serving.stall_timeout_s = 30.0
    wait_engine_idle(server)


def test_reflection_lists_every_service(channel):
    db = ProtoReflectionDescriptorDatabase(channel)
    services = set(db.get_services())
    assert {"jaxserve.v1.Generation", "inference.GRPCInferenceService", "grpc.health.v1.Health"} <= services
    assert db.FindFileContainingSymbol("inference.ModelInferRequest").package == "inference"
    assert db.FindFileContainingSymbol("jaxserve.v1.GenerateRequest").package == "jaxserve.v1"


def test_model_and_server_info(stub, server):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_name == MODEL_NAME and info.vocab_size == 300 and info.max_model_len == CFG.max_model_len
    assert info.has_tokenizer and info.max_logprobs == 20 and list(info.eos_token_ids) == [2]
    s = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert s.ready and not s.draining and s.version and s.uptime_seconds > 0


def test_api_key_interceptor(server):
    from service.server import ServerConfig, ServerThread

    keyed = ServerThread(server.server.serving, ServerConfig(grpc_port=0, http_port=None, api_key="k3y")).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{keyed.grpc_port}") as ch:
            stub = pb_grpc.GenerationStub(ch)
            refused = ("Bearer nope", "Basic k3y", "k3y", "Bearerk3y", "Bearer k3y2", "Bearer k3")
            for metadata in ((), *((("authorization", v),) for v in refused)):
                with pytest.raises(grpc.RpcError) as e:
                    stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Generate(_request("a", max_tokens=1), metadata=metadata))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            for scheme in ("bearer", "BEARER", "bEaReR"):  # the scheme is case-insensitive (RFC 7235)
                metadata = (("authorization", f"{scheme} k3y"),)
                assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata).model_name == MODEL_NAME
            ok = (("authorization", "Bearer k3y"),)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=ok).model_name == MODEL_NAME
            assert _join(stub.Generate(_request("a", temperature=0, max_tokens=2), metadata=ok))[1]
            assert _health(ch) == health_pb2.HealthCheckResponse.SERVING  # health needs no key
    finally:
        keyed.stop(close_engine=False)


def test_abort_is_scoped_to_the_callers_connection(server):
    """With an API key (shared, so it names no one), Abort reaches only requests started on the caller's own
    connection: another client cannot stop mine (found=false, as for an unknown id) and may even reuse my id."""
    from service.server import ServerConfig, ServerThread

    keyed = ServerThread(server.server.serving, ServerConfig(grpc_port=0, http_port=None, api_key="k3y")).start()
    auth = (("authorization", "Bearer k3y"),)
    own_connection = [("grpc.use_local_subchannel_pool", 1)]  # else both channels share one connection
    address = f"127.0.0.1:{keyed.grpc_port}"
    try:
        with grpc.insecure_channel(address, own_connection) as a, grpc.insecure_channel(address, own_connection) as b:
            mine, theirs = pb_grpc.GenerationStub(a), pb_grpc.GenerationStub(b)
            with EngineHook(server, step_delay=0.01):
                req = _request("go", temperature=0, max_tokens=200, ignore_eos=True)
                req.request_id = "mine"
                stream = mine.Generate(req, metadata=auth)
                next(stream)
                assert not theirs.Abort(pb.AbortRequest(request_id="mine"), metadata=auth).found
                same_id = _request("other", temperature=0, max_tokens=2)
                same_id.request_id = "mine"
                assert len(_join(theirs.Generate(same_id, metadata=auth))[1]) == 2
                assert not next(stream).finished, "my request still runs"
                assert mine.Abort(pb.AbortRequest(request_id="mine"), metadata=auth).found
                rest = list(stream)
            assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == pb.FINISH_REASON_ABORT
    finally:
        keyed.stop(close_engine=False)
    wait_engine_idle(server)


def test_generated_stubs_are_fresh(tmp_path):
    """The committed stubs match what scripts/gen_protos.sh makes from the .proto sources now."""
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run([os.path.join(ROOT, "scripts", "gen_protos.sh"), str(tmp_path)], check=True, cwd=ROOT, env=env)
    with open(tmp_path / "kserve_v2.binpb", "rb") as f:
        fresh_kserve = f.read()
    with open(os.path.join(ROOT, "service", "proto", "kserve_v2.binpb"), "rb") as f:
        assert f.read() == fresh_kserve, "service/proto/kserve_v2.binpb is stale: run scripts/gen_protos.sh"
    ns: dict = {}
    src = (tmp_path / "jaxserve_v1_pb2.py").read_text()
    start = src.index("AddSerializedFile(") + len("AddSerializedFile(")
    fresh = eval(src[start : src.index(")\n", start)], ns)  # the bytes literal protoc wrote
    committed = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert descriptor_pb2.FileDescriptorProto.FromString(fresh) == committed, (
        "service/proto/jaxserve_v1_pb2.py is stale: run scripts/gen_protos.sh"
    )


def test_draining_refuses_new_requests(channel, stub, server):
    serving = server.server.serving
    serving.draining = True
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(_request("late", max_tokens=2)))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        serving.evaluate_readiness()
        deadline = time.monotonic() + 5
        while _health(channel) != health_pb2.HealthCheckResponse.NOT_SERVING and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        serving.draining = False
        serving.evaluate_readiness()


def test_engine_failure_fails_requests_and_health(path):
    """An exception in the engine loop fails in-flight requests with INTERNAL, then UNAVAILABLE and NOT_SERVING."""
    srv = start_server(path)
    try:
        engine = srv.server.serving.llm.engine

        def broken_step():
            raise RuntimeError("injected device fault")

        engine.step = broken_step
        with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as ch:
            stub = pb_grpc.GenerationStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(_request("boom", max_tokens=3), timeout=10))
            assert e.value.code() == grpc.StatusCode.INTERNAL and "injected device fault" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(_request("after", max_tokens=3), timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            deadline = time.monotonic() + 5
            while _health(ch) != health_pb2.HealthCheckResponse.NOT_SERVING and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _health(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        srv.stop()
