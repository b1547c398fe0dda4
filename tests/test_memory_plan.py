"""GPU memory sizing (`jaxserve.memory_plan`, `EngineConfig.gpu_memory_utilization`).

XLA:CPU reports no memory, so a device that does is stood in for by patching `memory_plan.device_memory` (the one
place the engine asks a device for its memory): the plan then runs as on a GPU, compiling the planning buckets'
steps on the CPU to measure their activations. The deviceless H200 plan is tests/test_step_compile_sm90.py.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

from jaxserve import LLM, SamplingParams, memory_plan
from jaxserve.config import EngineConfig
from jaxserve.factory import page_bytes
from jaxserve.kv_cache import kv_cache_bytes
from jaxserve.memory_plan import MemoryPlan
from tiny_models import make_tiny_model

MIB = 2**20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama_gqa", str(path))
    return str(path)


def _plan(**kw):
    base = dict(device_bytes=1000 * MIB, utilization=0.5, in_use_bytes=10 * MIB, weights_bytes=100 * MIB,
                activation_bytes=40 * MIB, page_bytes=MIB)
    return MemoryPlan(**(base | kw))


def test_the_kv_cache_takes_what_the_budget_leaves():
    plan = _plan()
    assert plan.kv_bytes == 500 * MIB - 10 * MIB - 100 * MIB - 40 * MIB
    assert plan.num_pages == 350
    assert _plan(utilization=0.9).num_pages == 900 - 150, "a larger share buys pages, not weights"
    assert "0.34 GiB of KV pages" in plan.describe()


def test_no_room_for_a_cache_is_an_error_that_says_what_to_change():
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        _plan(utilization=0.15).num_pages  # 150 MiB of budget: the weights and activations alone take it


@pytest.mark.parametrize("u", [0, -0.1, 1.01, True, "0.9"])
def test_the_fraction_is_validated(u):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=u)


def test_the_cpu_reports_no_memory_so_the_default_size_holds(tiny):
    assert memory_plan.device_memory(jax.devices()[0]) is None
    llm = LLM(tiny, max_num_seqs=2, page_size=4, max_model_len=64, precompile=False, gpu_memory_utilization=0.01)
    assert llm.llm_engine.config.num_pages == 1 + 2 * 16, "max_num_seqs full-length sequences, as without it"


@pytest.fixture
def fake_device_memory(monkeypatch):
    """Make every device report `limit` bytes of which `in_use` are taken; returns a setter."""
    state = {}

    def fake(device):
        return state["limit"], state["in_use"]

    monkeypatch.setattr(memory_plan, "device_memory", fake)

    def set_memory(limit, in_use=0):
        state.update(limit=limit, in_use=in_use)

    return set_memory


def test_a_device_with_memory_sizes_the_cache_from_it(tiny, fake_device_memory):
    """The engine's cache is what the plan leaves: budget - in use - weights - the compiled step's activations."""
    fake_device_memory(64 * MIB, in_use=3 * MIB)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=128, precompile=False)
    llm = LLM(tiny, gpu_memory_utilization=0.5, **kw)
    engine = llm.llm_engine
    cfg, mc = engine.config, engine.runner.model_cfg
    weights = memory_plan.tree_bytes(engine.runner.weights)
    per_page = kv_cache_bytes(mc, 1, cfg.page_size, "float32")
    assert page_bytes(cfg, mc, "float32") == per_page
    steps = memory_plan.step_memory(mc, cfg, engine.runner.weights, "float32", memory_plan.planning_buckets(cfg),
                                    backends=engine.runner.backends)
    activations = max(s.activation_bytes for s in steps)
    assert activations > 0
    expected = (32 * MIB - 3 * MIB - weights - activations) // per_page
    assert cfg.num_pages == expected
    assert kv_cache_bytes(mc, cfg.num_pages, cfg.page_size, "float32") <= 32 * MIB - 3 * MIB - weights
    # the cache as allocated matches the plan, and the engine serves from it
    allocated = sum(a.nbytes for a in jax.tree.leaves(engine.runner.kv))
    assert allocated == kv_cache_bytes(mc, cfg.num_pages, cfg.page_size, "float32")
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4

    fake_device_memory(64 * MIB, in_use=3 * MIB)
    more = LLM(tiny, gpu_memory_utilization=0.9, **kw).llm_engine.config.num_pages
    assert more == (int(64 * MIB * 0.9) - 3 * MIB - weights - activations) // per_page, "the extra share: pages"


def test_explicit_sizes_win_over_the_device_memory(tiny, fake_device_memory):
    fake_device_memory(64 * MIB)
    kw = dict(max_num_seqs=2, page_size=4, max_model_len=64, precompile=False)
    assert LLM(tiny, num_pages=40, **kw).llm_engine.config.num_pages == 40
    llm = LLM(tiny, kv_cache_memory_bytes=MIB, **kw)
    mc = llm.llm_engine.runner.model_cfg
    assert llm.llm_engine.config.num_pages == MIB // kv_cache_bytes(mc, 1, 4, "float32")


def test_a_device_too_small_refuses_to_start_with_the_reason(tiny, fake_device_memory):
    fake_device_memory(256 * 1024)  # smaller than the tiny model's weights
    with pytest.raises(ValueError, match="no room for a KV cache"):
        LLM(tiny, max_num_seqs=2, page_size=4, max_model_len=64, precompile=False, gpu_memory_utilization=0.9)


def test_the_step_compiled_for_planning_is_the_engine_s_step(tiny):
    """compile_step builds the executable ModelRunner runs: same argument bytes (weights + cache + packed batch)."""
    llm = LLM(tiny, max_num_seqs=2, page_size=4, max_model_len=64, max_num_batched_tokens=16, precompile=False)
    runner, cfg = llm.llm_engine.runner, llm.llm_engine.config
    (bucket,) = memory_plan.planning_buckets(dataclasses.replace(cfg))
    kv_struct = memory_plan.abstract_tree(runner.kv)
    from jaxserve.runner import compile_step

    compiled = compile_step(runner.model_cfg, cfg, memory_plan.abstract_tree(runner.weights), kv_struct, bucket,
                            backends=runner.backends)
    m = memory_plan.StepMemory.of(bucket, compiled)
    kv_bytes = memory_plan.tree_bytes(runner.kv)
    assert m.argument_bytes >= memory_plan.tree_bytes(runner.weights) + kv_bytes
    assert m.alias_bytes >= kv_bytes, "the donated cache is updated in place"
