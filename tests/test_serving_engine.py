"""ServingEngine's own admission: text is tokenized off the event loop, prompt + max_tokens must fit the context
(never silently capped), a request needing more in-flight slots than are free is refused whole, ids are bounded;
engine rejections map to InvalidRequest by type and `param`, never by their text."""

import asyncio
import threading

import pytest

from jaxserve import AsyncLLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.errors import InvalidRequestError
from service.async_engine import ServingEngine
from service.protocol import InvalidRequest, Overloaded, ServingLimits
from service_fixtures import make_tiny_model_with_tokenizer

CFG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, page_size=16, max_model_len=64, precompile=False,
                   num_pages=20)


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    path = make_tiny_model_with_tokenizer(str(tmp_path_factory.mktemp("tiny")))
    llm = AsyncLLM(path, CFG)
    yield ServingEngine(llm, "tiny", ServingLimits(max_in_flight=3, max_request_id_len=32))
    llm.shutdown()


async def _run(serving, prompt, params, rid="r"):
    outs = [o async for o in serving.generate(prompt, params, rid, protocol="test")]
    return outs[-1]


def test_text_is_tokenized_off_the_event_loop(serving, monkeypatch):
    tok = serving.tokenizer
    threads = []
    original = tok.encode

    def encode(text, *a, **kw):
        threads.append(threading.current_thread())
        return original(text, *a, **kw)

    monkeypatch.setattr(tok, "encode", encode)

    async def main():
        loop_thread = threading.current_thread()
        out = await _run(serving, "hello there", SamplingParams(temperature=0, max_tokens=3))
        return loop_thread, out

    loop_thread, out = asyncio.run(main())
    assert threads and all(t is not loop_thread for t in threads)
    assert len(out.outputs[0].token_ids) == 3 and out.prompt == "hello there"


def test_prompt_plus_max_tokens_must_fit_the_context(serving):
    prompt = {"prompt_token_ids": list(range(3, 53))}  # 50 tokens of 64
    with pytest.raises(InvalidRequest, match="maximum context length is 64 tokens; the request asks for 70") as e:
        asyncio.run(_run(serving, prompt, SamplingParams(temperature=0, max_tokens=20)))
    assert e.value.param == "max_tokens"
    out = asyncio.run(_run(serving, prompt, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)))
    assert len(out.outputs[0].token_ids) == 14 and out.outputs[0].finish_reason == "length"


def test_character_limit_comes_before_tokenizing(serving, monkeypatch):
    monkeypatch.setattr(serving.tokenizer, "encode", lambda *a, **kw: pytest.fail("tokenized an oversized prompt"))
    with pytest.raises(InvalidRequest, match="characters; the limit is") as e:
        asyncio.run(_run(serving, "x" * (serving.limits.max_prompt_chars + 1), SamplingParams()))
    assert e.value.param == "prompt"


def test_capacity_is_checked_for_the_whole_request(serving):
    with pytest.raises(Overloaded, match="4 needed"):
        serving.check_capacity(4)
    serving.check_capacity(3)


def test_request_id_is_bounded(serving):
    with pytest.raises(InvalidRequest, match="longer than 32") as e:
        asyncio.run(_run(serving, "hi", SamplingParams(max_tokens=2), rid="x" * 33))
    assert e.value.param == "request_id" and serving.num_in_flight == 0


@pytest.mark.parametrize(
    "error,param",
    [
        (InvalidRequestError("priority must be an integer (got 'x')", param="priority", kind="type"), "priority"),
        (InvalidRequestError("stop_token_ids must be in [0, 50)", param="stop_token_ids"), "stop_token_ids"),
        (InvalidRequestError("no single field is at fault", param=None), "prompt"),
        (ValueError("top_k must be <= the vocabulary size"), "prompt"),  # plain: never read for a field name
        (TypeError("prompt must be a string"), "prompt"),
    ],
)
def test_engine_rejections_map_by_type_not_text(serving, monkeypatch, error, param):
    def add_request(*args, **kwargs):
        raise error

    monkeypatch.setattr(serving.llm.engine, "add_request", add_request)
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(_run(serving, {"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=2)))
    assert (e.value.param, e.value.message) == (param, str(error)) and serving.num_in_flight == 0


def test_model_facts_come_from_the_public_async_llm_api(serving):
    llm = serving.llm
    assert serving.vocab_size == llm.model_config.vocab_size
    assert serving.max_model_len == llm.engine_config.max_model_len
    assert asyncio.run(llm.get_model_config()) is llm.model_config
    assert asyncio.run(llm.get_tokenizer()) is llm.tokenizer is serving.tokenizer
    assert llm.get_stats()["num_steps"] == serving.stats()["num_steps"]
