"""Schema-driven fuzzing of the OpenAI HTTP routes with schemathesis, against a live server on 127.0.0.1.

The schema is the server's own (GET /openapi.json), built from its limits; this server's limits are small (n <= 2,
max_tokens <= 8, 2 prompts, short prompts), so every generated request is cheap to run. Schemathesis sends valid
requests and invalid ones (wrong types, out-of-range values, missing and unknown fields); for each the checks are:
never a 5xx, a status the schema documents, a documented content type, and a JSON body that matches the documented
response schema. Cross-field rules the schema cannot state (prompt + max_tokens <= context, min_tokens <=
max_tokens) make some valid-looking requests 400s, which the schema documents, so "valid data must be accepted" is
not checked.
"""

import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from service.protocol import ServingLimits
from service_fixtures import make_tiny_model_with_tokenizer, start_server, wait_engine_idle

LIMITS = ServingLimits(
    max_n=2, max_tokens=8, max_stop=2, max_stop_len=8, max_prompt_chars=256, max_prompts=2, max_in_flight=8
)
DEFAULT_MAX_TOKENS = 4  # chat without max_tokens would run to the context: fuzzed requests set it when absent
MAX_EXAMPLES = 50  # per route and mode: the whole file runs in well under a minute on 2 CPU cores
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model_with_tokenizer(str(tmp_path_factory.mktemp("tiny_fuzz")))
    srv = start_server(path, limits=LIMITS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"http://127.0.0.1:{server.http_port}/openapi.json")


# (method, path, mode): bodies are generated valid and invalid; the GET routes take no input, one valid call each.
OPERATIONS = [
    (method, path, mode)
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"))
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
] + [("GET", path, GenerationMode.POSITIVE) for path in ("/v1/models", "/health", "/metrics")]


@pytest.mark.parametrize("method, path, mode", OPERATIONS, ids=[f"{m} {p} {g.value}" for m, p, g in OPERATIONS])
def test_api_never_fails_and_keeps_its_schema(api_schema, method, path, mode):
    operation = api_schema[path][method]
    examples = MAX_EXAMPLES if method == "POST" else 1

    @hypothesis.settings(max_examples=examples, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        body = case.body
        if isinstance(body, dict) and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = DEFAULT_MAX_TOKENS
        case.call_and_validate(checks=CHECKS, timeout=60)

    run()


def test_fuzzing_left_nothing_behind(server):
    wait_engine_idle(server)
    assert server.server.serving.num_in_flight == 0
