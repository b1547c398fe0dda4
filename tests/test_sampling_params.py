"""SamplingParams rejections carry their field (`param`) and what is wrong with it (`kind`), so servers map them by
attribute, never by message text; the messages themselves are unchanged (tests/test_python_api_malformed.py)."""

import math

import pytest

from jaxserve import SamplingParams
from jaxserve.errors import InvalidRequestError

# (keyword arguments, param, kind)
CASES = [
    (dict(n=0), "n", "range"),
    (dict(n=2000), "n", "range"),
    (dict(n=1.0), "n", "type"),
    (dict(n=True), "n", "type"),
    (dict(temperature=-0.5), "temperature", "range"),
    (dict(temperature=math.nan), "temperature", "range"),
    (dict(temperature=math.inf), "temperature", "range"),
    (dict(temperature="0.5"), "temperature", "type"),
    (dict(top_p=0.0), "top_p", "range"),
    (dict(top_p=1.5), "top_p", "range"),
    (dict(top_p=None), "top_p", "type"),
    (dict(top_k=-2), "top_k", "range"),
    (dict(top_k=2**31), "top_k", "range"),
    (dict(top_k=4.0), "top_k", "type"),
    (dict(min_p=1.5), "min_p", "range"),
    (dict(min_p=[0.1]), "min_p", "type"),
    (dict(presence_penalty=3.0), "presence_penalty", "range"),
    (dict(presence_penalty=False), "presence_penalty", "type"),
    (dict(frequency_penalty=-2.5), "frequency_penalty", "range"),
    (dict(frequency_penalty="x"), "frequency_penalty", "type"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "range"),
    (dict(repetition_penalty=None), "repetition_penalty", "type"),
    (dict(seed=1.5), "seed", "type"),
    (dict(seed="7"), "seed", "type"),
    (dict(max_tokens=0), "max_tokens", "range"),
    (dict(max_tokens="16"), "max_tokens", "type"),
    (dict(min_tokens=-1), "min_tokens", "range"),
    (dict(min_tokens=None), "min_tokens", "type"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens", "conflict"),
    (dict(logprobs=-1), "logprobs", "range"),
    (dict(logprobs=2.0), "logprobs", "type"),
    (dict(prompt_logprobs=-1), "prompt_logprobs", "range"),
    (dict(prompt_logprobs="1"), "prompt_logprobs", "type"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens", "range"),
    (dict(num_speculative_tokens=1.0), "num_speculative_tokens", "type"),
    (dict(ignore_eos=1), "ignore_eos", "type"),
    (dict(skip_special_tokens="yes"), "skip_special_tokens", "type"),
    (dict(include_stop_str_in_output=None), "include_stop_str_in_output", "type"),
    (dict(stop=""), "stop", "empty"),
    (dict(stop=["a", ""]), "stop", "empty"),
    (dict(stop=[1]), "stop", "type"),
    (dict(stop=42), "stop", "type"),
    (dict(stop_token_ids=[-1]), "stop_token_ids", "range"),
    (dict(stop_token_ids=[2**31]), "stop_token_ids", "range"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids", "type"),
    (dict(stop_token_ids=5), "stop_token_ids", "type"),
]


@pytest.mark.parametrize("kwargs,param,kind", CASES, ids=[f"{p}-{k}-{i}" for i, (_, p, k) in enumerate(CASES)])
def test_rejection_names_its_field_and_kind(kwargs, param, kind):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert (e.value.param, e.value.kind) == (param, kind), str(e.value)
    assert kind in InvalidRequestError.KINDS
    assert isinstance(e.value, ValueError), "callers catching ValueError keep working"
    assert str(e.value).startswith(param), "the message still names the field first"


def test_every_validated_field_has_a_case():
    validated = {f for f in SamplingParams.__dataclass_fields__ if not f.startswith("_")}
    assert validated == {param for _, param, _ in CASES}


def test_valid_values_are_normalised():
    p = SamplingParams(n=2, temperature=1, top_k=-1, stop="x", stop_token_ids=(3,), seed=5)
    assert (p.n, p.temperature, p.top_k, p.stop_strings, p.stop_token_ids, p.seed) == (2, 1.0, 0, ["x"], [3], 5)
