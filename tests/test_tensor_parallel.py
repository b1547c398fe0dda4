"""Tensor parallelism on 8 simulated CPU devices: a sharded engine gives the single-device engine's greedy tokens and
logprobs (1e-5) on a mixed batch with chunked prefill and preemption, with and without n-gram speculation, on tiny
models with 1, 2 and 4 KV heads (KV heads replicated where tp exceeds them); the compiled step has exactly two
all-reduces of the hidden state per layer plus one for the vocabulary-parallel embedding; no step recompiles after
warm-up; impossible meshes fail at start naming the field.

jax fixes its device count when it starts, so everything runs in one subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8; the tests read its JSON report.
"""

import pytest

from multidevice import run_on_devices

_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import jax
import numpy as np
from tiny_models import make_tiny_model
from jaxserve import LLM, SamplingParams

assert len(jax.devices()) == 8
tmp = sys.argv[2]
KW = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=64, num_pages=20, precompile=False)
rng = np.random.default_rng(0)
prompts = [{"prompt_token_ids": rng.integers(3, 250, int(rng.integers(3, 40))).tolist()} for _ in range(6)]
motif = [7, 8, 9, 10, 11]
prompts.append({"prompt_token_ids": motif * 5})  # repetitive: n-gram drafts get accepted
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
report = {}


def summary(llm):
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    return dict(tokens=[o.outputs[0].token_ids for o in outs],
                logprobs=[[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                          for o in outs],
                preemptions=llm.llm_engine.scheduler.num_preemptions)


for variant in ("llama_gqa", "llama_mqa", "llama_tied", "qwen2_bias"):
    path = os.path.join(tmp, variant)
    make_tiny_model(variant, path)
    r = report[variant] = {"single": summary(LLM(path, **KW))}
    for mesh in ("tp2", "tp4"):
        llm = LLM(path, mesh=mesh, **KW)
        r[mesh] = summary(llm)
        r[mesh]["kv_heads"] = llm.llm_engine.model_config.num_kv_heads
        r[mesh]["kv_spec"] = list(llm.llm_engine.runner.kv.k.sharding.spec)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(path, mesh="tp2", speculative_config=spec, **KW)
    r["tp2_ngram"] = summary(llm)
    r["tp2_ngram"]["accepted"] = sum(llm.llm_engine.spec.metrics.num_accepted)

# EAGLE-3 and a draft model on a tensor-parallel target (the head replicated beside the target's features; the
# draft model whole on the target's first device): greedy output equals one device's, drafts get accepted
from test_eagle3 import make_eagle_pair
eagle_target, head, plain = make_eagle_pair(tmp, lambda path: summary(LLM(path, **KW)))
report["eagle3"] = {"single": plain}
eagle = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "adaptive": False}
llm = LLM(eagle_target, mesh="tp2", speculative_config=eagle, **KW)
report["eagle3"]["tp2"] = summary(llm)
report["eagle3"]["tp2"]["accepted"] = sum(llm.llm_engine.spec.metrics.num_accepted)
draft = {"method": "draft_model", "model": os.path.join(tmp, "llama_gqa"), "num_speculative_tokens": 3,
         "adaptive": False}  # the target as its own draft: every greedy draft is accepted
llm = LLM(os.path.join(tmp, "llama_gqa"), mesh="tp2", speculative_config=draft, **KW)
report["llama_gqa"]["tp2_draft"] = summary(llm)
report["llama_gqa"]["tp2_draft"]["accepted"] = sum(llm.llm_engine.spec.metrics.num_accepted)
report["llama_gqa"]["tp2_draft"]["draft_devices"] = sorted(
    d.id for d in llm.llm_engine.proposer.runner.kv.k.sharding.device_set)

# collectives of one compiled decode step, and no recompiles after warm-up
path = os.path.join(tmp, "llama_gqa")
llm = LLM(path, mesh="tp2", **(KW | {"precompile": True}))
runner = llm.llm_engine.runner
hlo = runner.executable(runner.all_buckets()[0]).as_text()
D = llm.llm_engine.model_config.hidden_size
report["hlo"] = dict(
    layers=llm.llm_engine.model_config.num_layers,
    hidden_all_reduces=len(re.findall(rf"= f32\[1,{D}\]\S* all-reduce\(", hlo)),
    compiles_after_warmup=runner.num_compiles,
)
llm.generate(prompts, greedy, use_tqdm=False)
report["hlo"]["compiles_after_run"] = runner.num_compiles

errors = {}
for variant, mesh in (("llama_gqa", "tp8"), ("llama_mqa", "tp3")):
    try:
        LLM(os.path.join(tmp, variant), mesh=mesh, **KW)
        errors[mesh] = None
    except Exception as e:
        errors[mesh] = f"{type(e).__name__}: {e}"
report["errors"] = errors
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_on_devices(_SCRIPT, str(tmp_path_factory.mktemp("tp")), timeout=900)


@pytest.mark.parametrize("variant", ["llama_gqa", "llama_mqa", "llama_tied", "qwen2_bias"])
@pytest.mark.parametrize("mesh", ["tp2", "tp4", "tp2_ngram"])
def test_sharded_engine_equals_one_device(report, variant, mesh):
    single, sharded = report[variant]["single"], report[variant][mesh]
    assert sharded["tokens"] == single["tokens"]
    for a, b in zip(sharded["logprobs"], single["logprobs"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert sharded["preemptions"] > 0  # the batch was squeezed: preemption and recompute ran sharded too


def test_kv_heads_are_sharded_or_replicated_like_vllm(report):
    # 4 query heads; KV heads 2 (gqa), 1 (mqa), 4 (tied): tp2 shards 2 and 4 and replicates 1 -> 2 copies, tp4
    # replicates to one KV head per shard
    assert [report[v]["tp2"]["kv_heads"] for v in ("llama_gqa", "llama_mqa", "llama_tied")] == [2, 2, 4]
    assert [report[v]["tp4"]["kv_heads"] for v in ("llama_gqa", "llama_mqa", "llama_tied")] == [4, 4, 4]
    for v in ("llama_gqa", "llama_mqa"):
        for m in ("tp2", "tp4"):
            spec = report[v][m]["kv_spec"]  # [L, P, page_size, K, H]: sharded on K only (trailing None may be dropped)
            assert spec + [None] * (5 - len(spec)) == [None, None, None, "tp", None]


@pytest.mark.parametrize("case", ["eagle3", "draft_model"])
def test_model_speculation_on_the_sharded_target_equals_one_device(report, case):
    single, sharded = ((report["eagle3"]["single"], report["eagle3"]["tp2"]) if case == "eagle3"
                       else (report["llama_gqa"]["single"], report["llama_gqa"]["tp2_draft"]))
    assert sharded["tokens"] == single["tokens"]
    for a, b in zip(sharded["logprobs"], single["logprobs"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert sharded["accepted"] > 0
    if case == "draft_model":
        assert sharded["draft_devices"] == [0]  # whole, on the target's first device


def test_ngram_speculation_runs_on_the_sharded_target(report):
    assert all(report[v]["tp2_ngram"]["accepted"] > 0 for v in ("llama_gqa", "llama_mqa", "llama_tied", "qwen2_bias"))


def test_compiled_step_has_two_all_reduces_per_layer_and_never_recompiles(report):
    h = report["hlo"]
    assert h["hidden_all_reduces"] == 2 * h["layers"] + 1  # o and down projections per layer, plus the embedding
    assert h["compiles_after_run"] == h["compiles_after_warmup"]


def test_impossible_meshes_fail_at_start_naming_the_field(report):
    e = report["errors"]
    assert e["tp8"].startswith("ValueError") and "mesh.tp=8 must divide the model's 4 attention heads" in e["tp8"]
    assert e["tp3"].startswith("ValueError") and "mesh.tp=3 must divide the model's 4 attention heads" in e["tp3"]
