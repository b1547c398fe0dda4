"""Malformed HTTP requests, one table: each gets its documented status and names its field, none gets a 5xx, and
after each one a fixed greedy request still returns the text it returned first (the server is unharmed).

Covers issue 16's classes for the OpenAI endpoint: types, ranges, NaN / Infinity, huge numbers, sizes, encodings,
missing / unknown / unsupported fields, bad JSON, content types, methods, routes, model names, chat messages and
roles, and the fields whose errors used to name the wrong parameter.
"""

import json

import pytest

from http_helpers import call, probe_text
from service.protocol import ServingLimits
from service_fixtures import make_tiny_model_with_tokenizer, start_server, wait_engine_idle

LIMITS = ServingLimits(max_in_flight=6, max_prompt_chars=4096, max_message_bytes=1 << 20)
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
JSON = {"Content-Type": "application/json"}


def comp(**kw) -> dict:
    return {"prompt": "a", "max_tokens": 2, **kw}


def chat(**kw) -> dict:
    return {"messages": MSG, "max_tokens": 2, **kw}


def nested(depth: int) -> str:
    return '{"prompt": ' + "[" * depth + "1" + "]" * depth + "}"


# (id, method, route, body, headers (None = JSON), status, param (None = no field to name))
CASES = [
    # ---- body bytes, encodings, JSON itself
    ("int-5000-digits", "POST", C, '{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}", None, 400, "max_tokens"),
    ("int-5000-digits-in-ids", "POST", C, '{"prompt": [' + "1" * 5000 + "]}", None, 400, "prompt"),
    ("nested-100k", "POST", C, nested(100_000), None, 400, None),
    ("nested-60", "POST", C, nested(60), None, 400, "prompt"),
    ("charset-bogus", "POST", C, json.dumps(comp()), {"Content-Type": "application/json; charset=bogus-42"}, 400, None),
    ("charset-not-text", "POST", C, json.dumps(comp()), {"Content-Type": "application/json; charset=base64"}, 400,
     None),
    ("charset-quoted-garbage", "POST", C, json.dumps(comp()), {"Content-Type": 'application/json; charset="utf-8; x"'},
     400, None),
    ("content-type-garbage", "POST", C, json.dumps(comp()), {"Content-Type": ";;=;"}, 415, None),
    ("invalid-utf8", "POST", C, b'{"prompt": "\xff\xfe\xc3"}', None, 400, None),
    ("utf16-without-charset", "POST", C, json.dumps(comp()).encode("utf-16"), None, 400, None),
    ("nan-temperature", "POST", C, '{"prompt": "a", "temperature": NaN}', None, 400, "temperature"),
    ("infinity-top-p", "POST", C, '{"prompt": "a", "top_p": Infinity}', None, 400, "top_p"),
    ("minus-infinity-penalty", "POST", C, '{"prompt": "a", "presence_penalty": -Infinity}', None, 400,
     "presence_penalty"),
    ("float-overflows-to-inf", "POST", C, '{"prompt": "a", "temperature": 1e400}', None, 400, "temperature"),
    ("temperature-1e300", "POST", C, comp(temperature=1e300), None, 400, "temperature"),
    ("nan-in-stop-list", "POST", C, '{"prompt": "a", "stop": [NaN]}', None, 400, "stop"),
    ("lone-surrogate", "POST", C, '{"prompt": "a\\ud800b"}', None, 400, "prompt"),
    ("empty-body", "POST", C, b"", None, 400, None),
    ("body-null", "POST", C, "null", None, 400, None),
    ("body-string", "POST", C, '"hello"', None, 400, None),
    ("body-array", "POST", C, "[1, 2]", None, 400, None),
    ("not-json", "POST", C, "{not json", None, 400, None),
    ("trailing-garbage", "POST", C, '{"prompt": "a"} x', None, 400, None),
    ("duplicate-key-last-wins", "POST", C, '{"prompt": "a", "prompt": 5}', None, 400, "prompt"),
    ("body-too-large", "POST", C, b'{"prompt": "' + b"x" * (1 << 20) + b'"}', None, 413, None),
    ("content-type-text", "POST", C, json.dumps(comp()), {"Content-Type": "text/plain"}, 415, None),
    ("content-type-form", "POST", C, "prompt=a", {"Content-Type": "application/x-www-form-urlencoded"}, 415, None),
    ("content-type-multipart", "POST", C, json.dumps(comp()), {"Content-Type": "multipart/form-data; boundary=x"}, 415,
     None),
    # ---- methods and routes
    ("get-completions", "GET", C, None, {}, 405, None),
    ("put-chat", "PUT", CHAT, json.dumps(chat()), None, 405, None),
    ("delete-models", "DELETE", "/v1/models", None, {}, 405, None),
    ("post-health", "POST", "/health", "{}", None, 405, None),
    ("post-models", "POST", "/v1/models", "{}", None, 405, None),
    ("options-completions", "OPTIONS", C, None, {}, 405, None),
    ("patch-completions", "PATCH", C, json.dumps(comp()), None, 405, None),
    ("unknown-route", "GET", "/v1/nope", None, {}, 404, None),
    ("huge-unknown-route", "GET", "/" + "x" * 4000, None, {}, 404, None),
    ("route-suffix", "POST", C + "/x", json.dumps(comp()), None, 404, None),
    ("legacy-engines-route", "POST", "/v1/engines/tiny/completions", json.dumps(comp()), None, 404, None),
    # ---- model
    ("model-unknown", "POST", C, comp(model="nope"), None, 404, "model"),
    ("model-empty", "POST", C, comp(model=""), None, 404, "model"),
    ("model-not-string", "POST", C, comp(model=5), None, 400, "model"),
    ("chat-model-unknown", "POST", CHAT, chat(model="gpt-4"), None, 404, "model"),
    # ---- completions: prompt
    ("prompt-missing", "POST", C, {"max_tokens": 2}, None, 400, "prompt"),
    ("prompt-null", "POST", C, {"prompt": None}, None, 400, "prompt"),
    ("prompt-empty", "POST", C, comp(prompt=""), None, 400, "prompt"),
    ("prompt-empty-list", "POST", C, comp(prompt=[]), None, 400, "prompt"),
    ("prompt-empty-ids", "POST", C, comp(prompt=[[]]), None, 400, "prompt"),
    ("prompt-id-too-big", "POST", C, comp(prompt=[999999]), None, 400, "prompt"),
    ("prompt-id-negative", "POST", C, comp(prompt=[-1]), None, 400, "prompt"),
    ("prompt-id-bool", "POST", C, comp(prompt=[True]), None, 400, "prompt"),
    ("prompt-id-float", "POST", C, comp(prompt=[1.5]), None, 400, "prompt"),
    ("prompt-number", "POST", C, comp(prompt=5), None, 400, "prompt"),
    ("prompt-object", "POST", C, comp(prompt={"a": 1}), None, 400, "prompt"),
    ("prompt-mixed-list", "POST", C, comp(prompt=["a", 5]), None, 400, "prompt"),
    ("prompts-over-max-prompts", "POST", C, comp(prompt=["a"] * 65), None, 400, "prompt"),
    ("prompt-over-max-chars", "POST", C, comp(prompt="x" * 5000), None, 400, "prompt"),
    ("prompt-ids-longer-than-context", "POST", C, comp(prompt=[5] * 300), None, 400, "prompt"),
    ("prompt-plus-max-tokens-over-context", "POST", C, comp(prompt="x" * 200, max_tokens=100), None, 400, "max_tokens"),
    # ---- completions: sampling fields, types and ranges
    ("max-tokens-zero", "POST", C, comp(max_tokens=0), None, 400, "max_tokens"),
    ("max-tokens-negative", "POST", C, comp(max_tokens=-1), None, 400, "max_tokens"),
    ("max-tokens-string", "POST", C, comp(max_tokens="ten"), None, 400, "max_tokens"),
    ("max-tokens-float", "POST", C, comp(max_tokens=4.5), None, 400, "max_tokens"),
    ("max-tokens-bool", "POST", C, comp(max_tokens=True), None, 400, "max_tokens"),
    ("max-tokens-over-context", "POST", C, comp(max_tokens=100000), None, 400, "max_tokens"),
    ("temperature-negative", "POST", C, comp(temperature=-1), None, 400, "temperature"),
    ("temperature-string", "POST", C, comp(temperature="hot"), None, 400, "temperature"),
    ("top-p-zero", "POST", C, comp(top_p=0), None, 400, "top_p"),
    ("top-p-over-one", "POST", C, comp(top_p=1.5), None, 400, "top_p"),
    ("top-k-negative", "POST", C, comp(top_k=-5), None, 400, "top_k"),
    ("top-k-1e10", "POST", C, comp(top_k=10_000_000_000), None, 400, "top_k"),
    ("top-k-over-vocab", "POST", C, comp(top_k=301), None, 400, "top_k"),
    ("min-p-over-one", "POST", C, comp(min_p=2), None, 400, "min_p"),
    ("n-zero", "POST", C, comp(n=0), None, 400, "n"),
    ("n-over-limit", "POST", C, comp(n=17), None, 400, "n"),
    ("n-string", "POST", C, comp(n="2"), None, 400, "n"),
    ("logprobs-bool-on-completions", "POST", C, comp(logprobs=True), None, 400, "logprobs"),
    ("logprobs-over-max", "POST", C, comp(logprobs=21), None, 400, "logprobs"),
    ("logprobs-negative", "POST", C, comp(logprobs=-1), None, 400, "logprobs"),
    ("stop-number", "POST", C, comp(stop=5), None, 400, "stop"),
    ("stop-empty", "POST", C, comp(stop=""), None, 400, "stop"),
    ("stop-list-of-numbers", "POST", C, comp(stop=[5]), None, 400, "stop"),
    ("stop-too-many", "POST", C, comp(stop=["s"] * 17), None, 400, "stop"),
    ("stop-too-long", "POST", C, comp(stop=["s" * 300]), None, 400, "stop"),
    ("stop-token-ids-over-vocab", "POST", C, comp(stop_token_ids=[99999]), None, 400, "stop_token_ids"),
    ("stop-token-ids-string", "POST", C, comp(stop_token_ids="x"), None, 400, "stop_token_ids"),
    ("stop-token-ids-negative", "POST", C, comp(stop_token_ids=[-1]), None, 400, "stop_token_ids"),
    ("seed-string", "POST", C, comp(seed="x"), None, 400, "seed"),
    ("seed-over-64-bits", "POST", C, comp(seed=2**64), None, 400, "seed"),
    ("presence-penalty-3", "POST", C, comp(presence_penalty=3), None, 400, "presence_penalty"),
    ("frequency-penalty-minus-3", "POST", C, comp(frequency_penalty=-3), None, 400, "frequency_penalty"),
    ("repetition-penalty-zero", "POST", C, comp(repetition_penalty=0), None, 400, "repetition_penalty"),
    ("min-tokens-over-max-tokens", "POST", C, comp(max_tokens=2, min_tokens=5), None, 400, "min_tokens"),
    ("ignore-eos-string", "POST", C, comp(ignore_eos="yes"), None, 400, "ignore_eos"),
    ("priority-string", "POST", C, comp(priority="high"), None, 400, "priority"),
    ("priority-out-of-range", "POST", C, comp(priority=2**40), None, 400, "priority"),
    # ---- streaming options
    ("stream-string", "POST", C, comp(stream="yes"), None, 400, "stream"),
    ("stream-options-not-object", "POST", C, comp(stream=True, stream_options="x"), None, 400, "stream_options"),
    ("include-usage-string", "POST", C, comp(stream=True, stream_options={"include_usage": "no"}), None, 400,
     "stream_options.include_usage"),
    ("include-usage-number", "POST", C, comp(stream=True, stream_options={"include_usage": 1}), None, 400,
     "stream_options.include_usage"),
    ("stream-options-without-stream", "POST", C, comp(stream_options={"include_usage": True}), None, 400,
     "stream_options"),
    ("stream-options-unknown-key", "POST", C, comp(stream=True, stream_options={"foo": True}), None, 400,
     "stream_options.foo"),
    # ---- unknown and unsupported fields
    ("unknown-field-typo", "POST", C, comp(max_token=5), None, 400, "max_token"),
    ("unknown-field", "POST", C, comp(frobnicate=1), None, 400, "frobnicate"),
    ("user-not-string", "POST", C, comp(user=5), None, 400, "user"),
    ("echo", "POST", C, comp(echo=True), None, 400, "echo"),
    ("echo-zero-is-not-false", "POST", C, comp(echo=0), None, 400, "echo"),
    ("suffix", "POST", C, comp(suffix="x"), None, 400, "suffix"),
    ("best-of", "POST", C, comp(best_of=2), None, 400, "best_of"),
    ("best-of-true", "POST", C, comp(best_of=True), None, 400, "best_of"),
    ("logit-bias", "POST", C, comp(logit_bias={"5": 1}), None, 400, "logit_bias"),
    ("response-format-json", "POST", C, comp(response_format={"type": "json_object"}), None, 400, "response_format"),
    ("prompt-logprobs", "POST", C, comp(prompt_logprobs=1), None, 400, "prompt_logprobs"),
    ("tools-on-completions", "POST", C, comp(tools=[]), None, 400, "tools"),
    # ---- chat: messages
    ("messages-missing", "POST", CHAT, {"max_tokens": 2}, None, 400, "messages"),
    ("messages-empty", "POST", CHAT, chat(messages=[]), None, 400, "messages"),
    ("messages-string", "POST", CHAT, chat(messages="hi"), None, 400, "messages"),
    ("message-not-object", "POST", CHAT, chat(messages=[5]), None, 400, "messages"),
    ("role-missing", "POST", CHAT, chat(messages=[{"content": "hi"}]), None, 400, "messages"),
    ("role-unknown", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), None, 400, "messages"),
    ("role-function", "POST", CHAT, chat(messages=[{"role": "function", "content": "hi", "name": "f"}]), None, 400,
     "messages"),
    ("role-with-special-text", "POST", CHAT, chat(messages=[{"role": "user</s>", "content": "hi"}]), None, 400,
     "messages"),
    ("content-missing", "POST", CHAT, chat(messages=[{"role": "user"}]), None, 400, "messages"),
    ("content-number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), None, 400, "messages"),
    ("content-null", "POST", CHAT, chat(messages=[{"role": "assistant", "content": None}]), None, 400, "messages"),
    ("content-image-part", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), None, 400,
     "messages"),
    ("content-part-missing-text", "POST", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), None,
     400, "messages"),
    ("message-tool-calls", "POST", CHAT, chat(messages=[{"role": "assistant", "content": "", "tool_calls": []}]), None,
     400, "messages"),
    ("message-name-number", "POST", CHAT, chat(messages=[{"role": "user", "content": "hi", "name": 5}]), None, 400,
     "messages"),
    ("messages-over-max-chars", "POST", CHAT, chat(messages=[{"role": "user", "content": "x" * 3000}] * 2), None, 400,
     "messages"),
    ("chat-prompt-field", "POST", CHAT, {"prompt": "a"}, None, 400, "messages"),
    # ---- chat: fields that must be refused, not ignored, and errors that must name what the client sent
    ("functions", "POST", CHAT, chat(functions=[{"name": "f", "parameters": {}}]), None, 400, "functions"),
    ("function-call", "POST", CHAT, chat(function_call="auto"), None, 400, "function_call"),
    ("tools", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), None, 400, "tools"),
    ("tool-choice-auto", "POST", CHAT, chat(tool_choice="auto"), None, 400, "tool_choice"),
    ("top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=2), None, 400, "top_logprobs"),
    ("top-logprobs-over-max", "POST", CHAT, chat(logprobs=True, top_logprobs=21), None, 400, "top_logprobs"),
    ("top-logprobs-negative", "POST", CHAT, chat(logprobs=True, top_logprobs=-1), None, 400, "top_logprobs"),
    ("top-logprobs-string", "POST", CHAT, chat(logprobs=True, top_logprobs="3"), None, 400, "top_logprobs"),
    ("chat-logprobs-int", "POST", CHAT, chat(logprobs=1), None, 400, "logprobs"),
    ("max-completion-tokens-zero", "POST", CHAT, {"messages": MSG, "max_completion_tokens": 0}, None, 400,
     "max_completion_tokens"),
    ("max-completion-tokens-string", "POST", CHAT, {"messages": MSG, "max_completion_tokens": "4"}, None, 400,
     "max_completion_tokens"),
    ("max-completion-tokens-over-context", "POST", CHAT, {"messages": MSG, "max_completion_tokens": 100000}, None, 400,
     "max_completion_tokens"),
    (
        "max-completion-tokens-plus-prompt-over-context",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": "x" * 200}], "max_completion_tokens": 100},
        None,
        400,
        "max_completion_tokens",
    ),
    ("max-tokens-and-max-completion-tokens-differ", "POST", CHAT, chat(max_completion_tokens=3), None, 400,
     "max_tokens"),
    ("chat-n-string", "POST", CHAT, chat(n="2"), None, 400, "n"),
    ("chat-stop-number", "POST", CHAT, chat(stop=5), None, 400, "stop"),
    ("chat-user-number", "POST", CHAT, chat(user=5), None, 400, "user"),
    ("chat-include-usage-string", "POST", CHAT, chat(stream=True, stream_options={"include_usage": "no"}), None, 400,
     "stream_options.include_usage"),
    ("parallel-tool-calls-string", "POST", CHAT, chat(parallel_tool_calls="yes"), None, 400, "parallel_tool_calls"),
    ("allow-special-tokens-string", "POST", CHAT, chat(allow_special_tokens_in_content="yes"), None, 400,
     "allow_special_tokens_in_content"),
    ("echo-on-chat", "POST", CHAT, chat(echo=True), None, 400, "echo"),
    ("chat-nan-temperature", "POST", CHAT, '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
     None, 400, "temperature"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model_with_tokenizer(str(tmp_path_factory.mktemp("tiny_malformed")))
    srv = start_server(path, limits=LIMITS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(server) -> str:
    return probe_text(server.http_port)


def test_enough_cases():
    assert len(CASES) >= 70 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_request(server, reference, case):
    _, method, route, body, headers, status, param = case
    got, text = call(server.http_port, method, route, body, JSON if headers is None else headers)
    assert got == status, (case[0], got, text[:500])
    err = json.loads(text)["error"]  # every error, routing ones included, is an OpenAI error object
    assert err["code"] == status and err["message"], err
    assert err["param"] == param, (case[0], err)
    assert len(text) < 4000, "errors do not echo huge client values back"
    assert probe_text(server.http_port) == reference, "a malformed request changed the server's behaviour"


def test_nothing_leaked(server, reference):
    """Run last in this module (pytest keeps file order): no request or KV page is left behind."""
    wait_engine_idle(server)
    assert server.server.serving.num_in_flight == 0
    status, _ = call(server.http_port, "GET", "/health", headers={})
    assert status == 200
