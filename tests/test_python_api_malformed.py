"""Malformed input through the Python API (`SamplingParams`, `LLM.generate`, `LLMEngine.add_request`): every case
raises ValueError / TypeError naming what is wrong, and afterwards a known greedy request still returns the same
text. A hypothesis property closes the gap between the table and everything else: whatever SamplingParams accepts,
the engine runs without error.

The other doors have their own tables (tests/test_http_malformed.py, tests/test_grpc_malformed.py).
"""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve import LLM, SamplingParams
from jaxserve.errors import InvalidRequestError
from service_fixtures import make_tiny_model_with_tokenizer

V = 300  # the tiny model's vocabulary
MAX_LEN = 64
KNOWN = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
NAN, INF = math.nan, math.inf
# A prompt of the wrong type: TypeError from older engines, InvalidRequestError(kind="type") (a ValueError) now.
WRONG_TYPE = (TypeError, InvalidRequestError)

# (SamplingParams kwargs, the text the error must contain)
BAD_PARAMS = [
    (dict(n=0), "n must be"),
    (dict(n=-1), "n must be"),
    (dict(n=1.5), "n must be"),
    (dict(n=True), "n must be"),
    (dict(n="2"), "n must be"),
    (dict(n=5000), "n must be"),
    (dict(temperature=-0.1), "temperature must be"),
    (dict(temperature=NAN), "temperature must be"),
    (dict(temperature=INF), "temperature must be"),
    (dict(temperature=1e300), "temperature must be"),
    (dict(temperature="1"), "temperature must be"),
    (dict(temperature=None), "temperature must be"),
    (dict(top_p=0), "top_p must be"),
    (dict(top_p=-0.5), "top_p must be"),
    (dict(top_p=1.5), "top_p must be"),
    (dict(top_p=NAN), "top_p must be"),
    (dict(top_k=-2), "top_k must be"),
    (dict(top_k=10**10), "top_k must be"),
    (dict(top_k=1.5), "top_k must be"),
    (dict(top_k=True), "top_k must be"),
    (dict(min_p=-0.1), "min_p must be"),
    (dict(min_p=1.1), "min_p must be"),
    (dict(min_p=NAN), "min_p must be"),
    (dict(presence_penalty=3), "presence_penalty must be"),
    (dict(presence_penalty=-INF), "presence_penalty must be"),
    (dict(frequency_penalty=2.5), "frequency_penalty must be"),
    (dict(frequency_penalty=NAN), "frequency_penalty must be"),
    (dict(repetition_penalty=0), "repetition_penalty must be"),
    (dict(repetition_penalty=-1), "repetition_penalty must be"),
    (dict(repetition_penalty=INF), "repetition_penalty must be"),
    (dict(repetition_penalty=1e-9), "repetition_penalty must be"),
    (dict(repetition_penalty=1e9), "repetition_penalty must be"),
    (dict(seed=1.5), "seed must be"),
    (dict(seed="7"), "seed must be"),
    (dict(max_tokens=0), "max_tokens must be"),
    (dict(max_tokens=-1), "max_tokens must be"),
    (dict(max_tokens=1.5), "max_tokens must be"),
    (dict(max_tokens="16"), "max_tokens must be"),
    (dict(min_tokens=-1), "min_tokens must be"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logprobs=-1), "logprobs must be"),
    (dict(logprobs=1.5), "logprobs must be"),
    (dict(prompt_logprobs=-2), "prompt_logprobs must be"),
    (dict(stop=""), "stop must be"),
    (dict(stop=[""]), "stop must be"),
    (dict(stop=5), "stop must be"),
    (dict(stop=[5]), "stop must be"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be"),
    (dict(stop_token_ids=["a"]), "stop_token_ids must be"),
    (dict(stop_token_ids=5), "stop_token_ids must be"),
    (dict(stop_token_ids=[True]), "stop_token_ids must be"),
    (dict(stop_token_ids=[2**40]), "stop_token_ids must be"),
    (dict(ignore_eos="yes"), "ignore_eos must be"),
    (dict(ignore_eos=1), "ignore_eos must be"),
    (dict(skip_special_tokens=None), "skip_special_tokens must be"),
    (dict(include_stop_str_in_output="no"), "include_stop_str_in_output must be"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens must be"),
]

# (prompt, SamplingParams kwargs, add_request kwargs, exception, the text the error must contain)
BAD_REQUESTS = [
    ("hello", dict(top_k=1000), {}, ValueError, "top_k must be <= the vocabulary size 300"),
    ("hello", dict(stop_token_ids=[V]), {}, ValueError, r"stop_token_ids must be in \[0, 300\)"),
    ("hello", dict(logprobs=50), {}, ValueError, "logprobs must be <= max_logprobs"),
    ("hello", dict(prompt_logprobs=21), {}, ValueError, "prompt_logprobs must be <= max_logprobs"),
    ("hello", dict(min_tokens=2, stop_token_ids=list(range(3, 30))), {}, ValueError, "at most 16"),
    ("", {}, {}, ValueError, "prompt is empty"),
    ({"prompt_token_ids": []}, {}, {}, ValueError, "prompt is empty"),
    ("x" * (MAX_LEN + 10), {}, {}, ValueError, f"max_model_len is {MAX_LEN}"),
    ({"prompt_token_ids": [5] * MAX_LEN}, {}, {}, ValueError, f"max_model_len is {MAX_LEN}"),
    ({"prompt_token_ids": [5, -1]}, {}, {}, ValueError, r"token ids must be in \[0, 300\)"),
    ({"prompt_token_ids": [5, V]}, {}, {}, ValueError, r"token ids must be in \[0, 300\)"),
    ({"prompt_token_ids": [5, 2**40]}, {}, {}, ValueError, r"token ids must be in \[0, 300\)"),
    ({"prompt_token_ids": "abc"}, {}, {}, ValueError, "list of integers"),
    ({"prompt_token_ids": [1.5, 2]}, {}, {}, ValueError, "list of integers"),
    ({"prompt_token_ids": [None]}, {}, {}, ValueError, "list of integers"),
    ({"text": "x"}, {}, {}, ValueError, "needs 'prompt_token_ids' or 'prompt'"),
    ({"prompt": 5}, {}, {}, WRONG_TYPE, "prompt must be a string"),
    (5, {}, {}, WRONG_TYPE, "prompt must be a string"),
    (None, {}, {}, WRONG_TYPE, "prompt must be a string"),
    (b"bytes", {}, {}, WRONG_TYPE, "prompt must be a string"),
    ("hello", {}, dict(priority="high"), ValueError, "priority must be an integer"),
    ("hello", {}, dict(priority=True), ValueError, "priority must be an integer"),
    ("hello", {}, dict(priority=1.5), ValueError, "priority must be an integer"),
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model_with_tokenizer(str(tmp_path_factory.mktemp("tiny")))
    return LLM(path, max_num_seqs=4, max_num_batched_tokens=32, page_size=8, max_model_len=MAX_LEN, precompile=False)


@pytest.fixture(scope="module")
def known(llm):
    return _known(llm)


def _known(llm) -> str:
    return llm.generate("known prompt", KNOWN, use_tqdm=False)[0].outputs[0].text


def _still_serving(llm, known: str) -> None:
    assert _known(llm) == known
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests() and eng.block_manager.num_used_pages == 0
    eng.block_manager.check()


def test_table_is_large_enough():
    assert len(BAD_PARAMS) + len(BAD_REQUESTS) >= 75


@pytest.mark.parametrize("kwargs,match", BAD_PARAMS, ids=[repr(k) for k, _ in BAD_PARAMS])
def test_bad_sampling_params(llm, known, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    _still_serving(llm, known)


@pytest.mark.parametrize(
    "prompt,kwargs,add_kw,exc,match", BAD_REQUESTS,
    ids=[f"{i}-{str(r[0])[:20]!r}-{r[1] or r[2]}" for i, r in enumerate(BAD_REQUESTS)]
)
def test_bad_requests(llm, known, prompt, kwargs, add_kw, exc, match):
    eng = llm.llm_engine
    with pytest.raises(exc, match=match) as e:
        eng.add_request("bad", prompt, SamplingParams(**kwargs), **add_kw)
    if isinstance(e.value, InvalidRequestError):
        assert e.value.param is not None, f"the engine names the field at fault: {e.value}"
    assert "bad" not in eng.requests
    # ... and the same through LLM.generate, beside a good prompt: nothing of the batch starts
    if not add_kw:
        with pytest.raises(exc, match=match):
            llm.generate(["fine", prompt], SamplingParams(**kwargs), use_tqdm=False)
    _still_serving(llm, known)


def test_duplicate_request_id_leaves_the_first_untouched(llm, known):
    eng = llm.llm_engine
    eng.add_request("dup", "known prompt", KNOWN)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("dup", "other", KNOWN)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out
    assert final.request_id == "dup" and final.outputs[0].text == known
    _still_serving(llm, known)


def test_tiny_temperature_is_greedy(llm, known):
    """Below 1e-5 a temperature is greedy (vLLM's rule): x / 1e-30 would overflow float32."""
    out = llm.generate("known prompt", SamplingParams(temperature=1e-30, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].text == known


_number = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 0.5, 1e-6, 2.0, 100.0, 1e5]),
)


def _mostly(lo: float, hi: float, *edges: float):
    """Values in [lo, hi] (edges included) three times out of four, anything else otherwise."""
    valid = st.one_of(st.floats(lo, hi), st.sampled_from([lo, hi, *edges]))
    return st.one_of(valid, valid, valid, _number)


def _mostly_int(lo: int, hi: int, *bad: int):
    valid = st.integers(lo, hi)
    return st.one_of(valid, valid, valid, st.sampled_from(bad))


@settings(max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(
    kw=st.fixed_dictionaries(
        {},
        optional={
            "n": _mostly_int(1, 3, -1, 0),
            "temperature": _mostly(0.0, 100.0, 1e-6, 1e-5, 2.0),
            "top_p": _mostly(1e-9, 1.0, 1e-30, 0.5),
            "top_k": _mostly_int(-1, V, 301, -2, 2**40),
            "min_p": _mostly(0.0, 1.0),
            "presence_penalty": _mostly(-2.0, 2.0),
            "frequency_penalty": _mostly(-2.0, 2.0),
            "repetition_penalty": _mostly(0.01, 100.0, 1.0),
            "seed": st.one_of(st.none(), st.integers(-(2**80), 2**80)),
            "max_tokens": _mostly_int(1, 5, 0, -1),
            "min_tokens": _mostly_int(0, 2, -1, 6),
            "logprobs": st.one_of(st.none(), _mostly_int(0, 20, -1, 21)),
            "prompt_logprobs": st.one_of(st.none(), _mostly_int(0, 20, -1, 21)),
            "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
            "stop_token_ids": st.one_of(*[st.lists(st.integers(0, V - 1), max_size=4)] * 3,
                                        st.lists(st.integers(-5, 2**33), max_size=20)),
            "ignore_eos": st.booleans(),
            "skip_special_tokens": st.booleans(),
            "include_stop_str_in_output": st.booleans(),
        },
    )
)
def test_anything_accepted_runs(llm, known, kw):
    """Whatever SamplingParams and the engine accept runs to the end without error; whatever they refuse is refused
    with ValueError / TypeError -- never another exception, never a failed step."""
    try:
        params = SamplingParams(**kw)
        llm.llm_engine.add_request("prop", "a prompt", params)
    except (ValueError, TypeError):
        assert "prop" not in llm.llm_engine.requests
        return
    eng, final = llm.llm_engine, None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out
    assert final is not None and final.finished
    assert all(c.finish_reason in ("stop", "length") for c in final.outputs), [c.stop_reason for c in final.outputs]
    assert eng.num_failed_requests == 0
    _still_serving(llm, known)
