"""AsyncLLM: concurrent streams equal offline results, aborts free everything, bad requests fail alone."""

import asyncio

import numpy as np
import pytest

from jaxserve import LLM, AsyncLLM, SamplingParams
from jaxserve.config import EngineConfig
from tiny_models import make_tiny_model

CFG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=128, precompile=False)
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("tiny_async")
    make_tiny_model("llama_gqa", str(p))
    return str(p)


@pytest.fixture(scope="module")
def engine(path):
    llm = AsyncLLM(path, CFG)
    yield llm
    llm.shutdown()


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, int(rng.integers(2, 40))).tolist() for _ in range(n)]


async def _collect(llm, prompt, params, rid, priority=0):
    outs = []
    async for out in llm.generate(prompt, params, rid, priority=priority):
        outs.append(out)
    return outs


def test_concurrent_streams_equal_offline(engine, path):
    prompts = _prompts(6)
    offline = LLM(path, engine_config=CFG).generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)

    async def main():
        return await asyncio.gather(
            *(_collect(engine, {"prompt_token_ids": p}, PARAMS, f"c{i}") for i, p in enumerate(prompts))
        )

    streams = asyncio.run(main())
    for stream, want in zip(streams, offline):
        lengths = [len(o.outputs[0].token_ids) for o in stream]
        assert lengths == sorted(lengths) and len(stream) >= 2, "outputs stream incrementally"
        assert stream[-1].finished and not any(o.finished for o in stream[:-1])
        assert stream[-1].outputs[0].token_ids == want.outputs[0].token_ids
        assert stream[-1].metrics.first_token_time is not None and stream[-1].metrics.finished_time is not None


def test_abort_and_early_exit_free_pages(engine):
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main():
        aborted = []

        async def victim():
            async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, long, "victim"):
                aborted.append(out)
                if len(out.outputs[0].token_ids) == 3:
                    await engine.abort("victim")

        async def leaver():
            async for out in engine.generate({"prompt_token_ids": [8, 9]}, long, "leaver"):
                if len(out.outputs[0].token_ids) >= 2:
                    break  # closing the stream aborts the request

        await asyncio.gather(victim(), leaver())
        return aborted

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    eng = engine.engine
    for _ in range(100):  # the leaver's abort is processed by the engine thread shortly after
        if not eng.has_unfinished_requests():
            break
        asyncio.run(asyncio.sleep(0.02))
    assert not eng.has_unfinished_requests()
    eng.block_manager.check()
    assert eng.block_manager.num_used_pages == 0


def test_bad_request_fails_alone(engine):
    async def main():
        good = asyncio.create_task(_collect(engine, {"prompt_token_ids": [3, 4, 5]}, PARAMS, "good"))
        with pytest.raises(ValueError, match="prompt is empty"):
            await _collect(engine, {"prompt_token_ids": []}, PARAMS, "bad")
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(engine, {"prompt_token_ids": list(range(3, 200))}, PARAMS, "too-long")
        return await good

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12
