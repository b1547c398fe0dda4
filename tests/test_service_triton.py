"""KServe v2 / Triton compatibility: the stock `tritonclient[grpc]` client against jaxserve on 127.0.0.1."""

import asyncio
import json
import queue
from types import SimpleNamespace

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from grpc_helpers import infer
from jaxserve import LLM, SamplingParams
from service import kserve
from service.protocol import ServingLimits, build_sampling_params
from service_fixtures import CFG, MODEL_NAME, EngineHook, make_tiny_model_with_tokenizer, start_server, wait_engine_idle


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model_with_tokenizer(str(tmp_path_factory.mktemp("tiny_triton")))


@pytest.fixture(scope="module")
def server(path):
    srv = start_server(path)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    c = tc.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(path):
    return LLM(path, engine_config=CFG)


def _inputs(prompt: str, stream: bool, sampling: dict | None = None, **flags):
    tensors = []

    def add(name, datatype, value):
        t = tc.InferInput(name, [1], datatype)
        t.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
        tensors.append(t)

    add("text_input", "BYTES", prompt.encode())
    add("stream", "BOOL", stream)
    if sampling is not None:  # Triton's vLLM backend convention: JSON with string values
        strings = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in sampling.items()}
        add("sampling_parameters", "BYTES", json.dumps(strings).encode())
    for name, value in flags.items():
        add(name, "BOOL", value)
    return tensors


GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def test_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL_NAME) and not client.is_model_ready("nope")
    meta = client.get_model_metadata(MODEL_NAME)
    assert meta.name == MODEL_NAME
    assert {i.name: i.datatype for i in meta.inputs}["text_input"] == "BYTES"
    assert [o.name for o in meta.outputs][0] == "text_output"
    assert client.get_server_metadata().name == "jaxserve"
    config = client.get_model_config(MODEL_NAME).config
    assert config.model_transaction_policy.decoupled and config.max_batch_size == 0
    assert [i.name for i in config.input][0] == "text_input" and config.input[0].data_type == 13  # TYPE_STRING
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("nope")
    assert "StatusCode.NOT_FOUND" in e.value.status()


def test_infer_equals_python_api(client, reference):
    want = reference.generate("Hello world", SamplingParams(**GREEDY), use_tqdm=False)[0]
    result = client.infer(MODEL_NAME, _inputs("Hello world", False, GREEDY, return_finish_reason=True,
                                              return_num_output_tokens=True))
    # Non-streaming: the prompt comes first unless exclude_input_in_output (Triton's vLLM backend behaviour).
    assert result.as_numpy("text_output")[0].decode() == "Hello world" + want.outputs[0].text
    assert result.as_numpy("finish_reason")[0].decode() == "length"
    assert result.as_numpy("num_output_tokens")[0] == 8
    excl = client.infer(MODEL_NAME, _inputs("Hello world", False, GREEDY, exclude_input_in_output=True))
    assert excl.as_numpy("text_output")[0].decode() == want.outputs[0].text


def _stream(client, requests, *, empty_final=True, timeout=30):
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        for rid, inputs in requests:
            client.async_stream_infer(MODEL_NAME, inputs, request_id=rid, enable_empty_final_response=empty_final)
    finally:
        client.stop_stream()  # closes our side; waits for the server to finish every request
    items = []
    while not got.empty():
        items.append(got.get())
    return items


def test_stream_infer_deltas_equal_python_api(client, reference):
    prompts = {"a": "Hello world", "b": "The quick brown fox"}
    want = {k: reference.generate(p, SamplingParams(**GREEDY),
                                  use_tqdm=False)[0].outputs[0].text for k, p in prompts.items()}
    items = _stream(client, [(k, _inputs(p, True, GREEDY)) for k, p in prompts.items()])
    assert all(err is None for _, err in items)
    texts = {k: "" for k in prompts}
    finals = {k: 0 for k in prompts}
    for result, _ in items:
        resp = result.get_response()
        final = resp.parameters["triton_final_response"].bool_param
        if final:
            finals[resp.id] += 1
            assert not resp.outputs, "the final response is the empty one we asked for"
        else:
            texts[resp.id] += result.as_numpy("text_output")[0].decode()
    assert texts == want
    assert finals == {"a": 1, "b": 1}
    assert len(items) > 4, "deltas arrive as separate responses"


def test_stream_errors_are_in_band(client, reference):
    want = reference.generate("ok", SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text
    bad_model = _inputs("x", True, GREEDY)
    items = _stream(
        client,
        [
            ("bad-json", _inputs("x", True) + [_raw_bytes("sampling_parameters", b"{nope")]),
            ("bad-temp", _inputs("x", True, {"temperature": "-1"})),
            ("bad-key", _inputs("x", True, {"beam_width": "2"})),
            ("good", _inputs("ok", True, GREEDY)),
        ],
    )
    errors = [err for _, err in items if err is not None]
    assert len(errors) == 3
    msgs = " | ".join(str(e) for e in errors)
    assert "sampling_parameters" in msgs and "temperature" in msgs and "beam_width" in msgs
    text = "".join(
        r.as_numpy("text_output")[0].decode() for r, err in items if err is None and r.get_response().outputs
    )
    assert text == want, "the stream stays usable after errors"
    with pytest.raises(InferenceServerException) as e:
        client.infer("nope", bad_model)
    assert "StatusCode.NOT_FOUND" in e.value.status()
    with pytest.raises(InferenceServerException) as e:
        client.infer(MODEL_NAME, _inputs("x", False, {"top_p": "2"}))
    assert "StatusCode.INVALID_ARGUMENT" in e.value.status() and "top_p" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.infer(MODEL_NAME, [_raw_bytes("prompt", b"x")])
    assert "StatusCode.INVALID_ARGUMENT" in e.value.status()
    # Values that once escaped as UNKNOWN with raw exception text: each names its parameter.
    for sampling, field in (
        (b'{"top_k": "10000000000"}', "top_k"),
        (b'{"seed": ' + b"9" * 5000 + b"}", "seed"),
        (b'{"stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "sampling_parameters"),
        (b'{"temperature": [1]}', "temperature"),
    ):
        with pytest.raises(InferenceServerException) as e:
            client.infer(MODEL_NAME, _inputs("x", False) + [_raw_bytes("sampling_parameters", sampling)])
        assert "StatusCode.INVALID_ARGUMENT" in e.value.status() and field in e.value.message(), e.value.message()


def _raw_bytes(name, value: bytes):
    t = tc.InferInput(name, [1], "BYTES")
    t.set_data_from_numpy(np.array([value], dtype=object))
    return t


def test_stop_stream_cancels_requests(client, server):
    got: queue.Queue = queue.Queue()
    with EngineHook(server, step_delay=0.01):
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer(MODEL_NAME, _inputs("go", True,
                                                      {"temperature": 0, "max_tokens": 200, "ignore_eos": True}))
        got.get(timeout=30)  # generation is under way
        assert server.server.serving.llm.engine.has_unfinished_requests()
        client.stop_stream(cancel_requests=True)
        wait_engine_idle(server, timeout=1.5)


class _FloodServing:
    """A stand-in ServingEngine whose requests yield a new cumulative output each time one is taken, forever."""

    model_name = MODEL_NAME
    vocab_size = 300
    limits = ServingLimits(max_in_flight=4)

    def __init__(self):
        self.num_started = self.num_closed = self.num_outputs = 0

    def build_params(self, fields: dict, *, coerce_strings: bool = False) -> SamplingParams:
        return build_sampling_params(fields, self.limits, vocab_size=self.vocab_size, coerce_strings=coerce_strings)

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{self.num_started}"

    async def generate(self, prompt, params, request_id, *, protocol, priority=0):
        self.num_started += 1
        try:
            for n in range(1, 10**9):
                self.num_outputs += 1
                c = SimpleNamespace(index=0, text="x" * n, token_ids=[0] * n, finish_reason=None)
                yield SimpleNamespace(finished=False, prompt=prompt, prompt_token_ids=[1], outputs=[c])
                await asyncio.sleep(0)
        finally:
            self.num_closed += 1


def test_stream_memory_is_bounded_when_the_client_stops_reading():
    """ModelStreamInfer with 100 endless requests and a client that reads one response, then nothing: the server
    stops producing (a bounded response queue) and starts at most max_in_flight of the requests."""

    async def main():
        serving = _FloodServing()
        client_open = asyncio.Event()

        async def requests():
            for i in range(100):
                yield infer(b"hi", id=str(i), stream=True)
            await client_open.wait()

        responses = kserve.KServeServicer(serving).ModelStreamInfer(requests(), None)
        assert not (await anext(responses)).error_message
        await asyncio.sleep(0.3)
        produced = serving.num_outputs
        await asyncio.sleep(0.3)
        assert serving.num_outputs == produced, "nothing is produced while the client reads nothing"
        assert produced <= kserve._STREAM_QUEUE + 2 * serving.limits.max_in_flight
        assert serving.num_started <= serving.limits.max_in_flight
        await responses.aclose()  # the call ends: every request is closed (aborted)
        assert serving.num_closed == serving.num_started

    asyncio.run(main())
