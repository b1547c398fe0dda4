"""Pipeline parallelism (and tensor parallelism on the KV-head counts the other tests do not cover) on 8 simulated
CPU devices: a pipelined engine gives the single-device engine's greedy tokens and logprobs (1e-5) on a mixed batch
with chunked prefill and preemption, with and without n-gram speculation, on tiny 4-layer models with 1, 3 and 8 KV
heads; each stage holds only its layers (weights and KV cache) on its own devices; pp virtual engines keep pp steps
in flight (and aborts amid them leak nothing); no step recompiles after warm-up; impossible meshes fail at start
naming the field.

jax fixes its device count when it starts, so everything runs in one subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8; the tests read its JSON report.
"""

import pytest

from multidevice import run_on_devices

_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import jax
import numpy as np
from tiny_models import VARIANTS, make_tiny_model
from jaxserve import LLM, SamplingParams

assert len(jax.devices()) == 8
tmp = sys.argv[2]
VARIANTS.update(
    kv1=dict(arch="llama", num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=4),
    kv3=dict(arch="llama", hidden_size=72, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=4),
    kv8=dict(arch="qwen2", num_attention_heads=8, num_key_value_heads=8, head_dim=8, num_hidden_layers=4,
             tie_word_embeddings=True),
)
KW = dict(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32), page_size=4, max_model_len=64,
          num_pages=20, precompile=False)
rng = np.random.default_rng(0)
prompts = [{"prompt_token_ids": rng.integers(3, 250, int(rng.integers(3, 40))).tolist()} for _ in range(6)]
prompts.append({"prompt_token_ids": [7, 8, 9, 10, 11] * 5})  # repetitive: n-gram drafts get accepted
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
SPEC = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
        "draft": {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}}
report = {}


def summary(llm):
    eng = llm.llm_engine
    in_flight, step = [], eng.step

    def counted_step():  # steps in flight after each step (PipelineEngine: one per busy virtual engine)
        out = step()
        in_flight.append(sum(p is not None for p in getattr(eng, "_pending", [])))
        return out

    eng.step = counted_step
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    del eng.step
    stats = eng.get_stats()
    return dict(tokens=[o.outputs[0].token_ids for o in outs],
                logprobs=[[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                          for o in outs],
                preemptions=stats["num_preemptions"],
                accepted=int(stats.get("spec_decode_num_accepted_tokens", 0)),
                engine=type(eng).__name__, max_in_flight=max(in_flight),
                routed=getattr(eng, "num_routed", None), pages_in_use=eng.block_manager.num_used_pages
                if hasattr(eng, "block_manager") else None)


def placement(runner):
    # per stage: its layers in the KV cache, the devices its KV and weights live on, per-device KV bytes
    stages = getattr(runner, "stages", [runner])
    return [dict(kv_layers=s.kv.k.shape[0],
                 kv_devices=sorted(d.id for d in s.kv.k.sharding.device_set),
                 weight_devices=sorted({d.id for w in jax.tree.leaves(s.weights) for d in w.sharding.device_set}),
                 kv_shard_bytes=sorted({sh.data.nbytes for sh in s.kv.k.addressable_shards}),
                 kv_bytes=s.kv.k.nbytes,
                 has_embed=s.weights.embed is not None, has_head=s.weights.final_norm is not None)
            for s in stages]


CASES = {"kv1": ("pp2+ngram", "pp4"), "kv3": ("tp3", "pp2+draft"), "kv8": ("pp2_tp2", "tp8")}
for variant, meshes in CASES.items():
    path = os.path.join(tmp, variant)
    make_tiny_model(variant, path)
    r = report[variant] = {"single": summary(LLM(path, **KW))}
    for name in meshes:
        mesh, _, spec = name.partition("+")
        # a draft model: the target itself (every greedy draft is accepted), whole on the mesh's first device
        spec = SPEC[spec] | ({"model": path} if spec == "draft" else {}) if spec else None
        llm = LLM(path, mesh=mesh, speculative_config=spec, **KW)
        r[name] = summary(llm)
        r[name]["placement"] = placement(llm.llm_engine.runner)
        r[name]["kv_heads"] = llm.llm_engine.model_config.num_kv_heads

# EAGLE-3 on a pipeline: its features come from layers on both stages (aux ids 1 | 3, 5 of 5 layers on pp2) and the
# head runs on the last stage's devices; greedy output equals one device's, drafts get accepted
from test_eagle3 import make_eagle_pair
eagle_target, head, plain = make_eagle_pair(tmp, lambda path: summary(LLM(path, **KW)))
eagle = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "adaptive": False}
llm = LLM(eagle_target, mesh="pp2", speculative_config=eagle, **KW)
report["eagle3"] = {"single": plain, "pp2+eagle3": summary(llm)}
report["eagle3"]["pp2+eagle3"]["stage_hidden_ids"] = [list(s.hidden_layer_ids) for s in llm.llm_engine.runner.stages]

# warm-up compiles every bucket of every stage; running never compiles again
llm = LLM(os.path.join(tmp, "kv1"), mesh="pp2", **(KW | {"precompile": True}))
runner = llm.llm_engine.runner
report["compiles"] = dict(after_warmup=runner.num_compiles, buckets=len(runner.all_buckets()),
                          stages=len(runner.stages))
llm.generate(prompts, greedy, use_tqdm=False)
report["compiles"]["after_run"] = runner.num_compiles

# aborts while virtual engines have steps in flight: pages all come back, the others' outputs are unchanged
llm = LLM(os.path.join(tmp, "kv1"), mesh="pp2", **KW)
eng = llm.llm_engine
for i, p in enumerate(prompts):
    eng.add_request(str(i), p, greedy)
finished, steps = {}, 0
while eng.has_unfinished_requests():
    for o in eng.step():
        if o.finished:
            finished[o.request_id] = o.outputs[0].token_ids
    steps += 1
    if steps in (3, 6):  # one request of each virtual engine, mid-flight
        for rid in (str(steps // 3 - 1), str(steps // 3 + 3)):
            eng.abort_request(rid)
    eng.block_manager.check()
report["aborts"] = dict(finished={k: v for k, v in finished.items()}, pages_in_use=eng.block_manager.num_used_pages,
                        aborted=sorted(str(i) for i in range(len(prompts)) if str(i) not in finished))

errors = {}
for variant, mesh in (("kv1", "pp8"), ("kv3", "tp2")):
    try:
        LLM(os.path.join(tmp, variant), mesh=mesh, **KW)
        errors[mesh] = None
    except Exception as e:
        errors[mesh] = f"{type(e).__name__}: {e}"
report["errors"] = errors
print(json.dumps(report))
"""

CASES = {"kv1": ("pp2+ngram", "pp4"), "kv3": ("tp3", "pp2+draft"), "kv8": ("pp2_tp2", "tp8")}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_on_devices(_SCRIPT, str(tmp_path_factory.mktemp("pp")), timeout=900)


@pytest.mark.parametrize("variant,mesh", [(v, m) for v, ms in CASES.items() for m in ms])
def test_sharded_engine_equals_one_device(report, variant, mesh):
    single, sharded = report[variant]["single"], report[variant][mesh]
    assert sharded["tokens"] == single["tokens"]
    for a, b in zip(sharded["logprobs"], single["logprobs"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert sharded["preemptions"] > 0  # the batch was squeezed: preemption and recompute ran sharded too
    if "+" in mesh:
        assert sharded["accepted"] > 0


def test_eagle3_on_a_pipeline_equals_one_device(report):
    single, sharded = report["eagle3"]["single"], report["eagle3"]["pp2+eagle3"]
    assert sharded["stage_hidden_ids"] == [[1], [0, 2]]  # layer 1 on stage 0; 3 and the final output on stage 1
    assert sharded["tokens"] == single["tokens"]
    for a, b in zip(sharded["logprobs"], single["logprobs"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert sharded["accepted"] > 0 and sharded["engine"] == "LLMEngine"


@pytest.mark.parametrize("variant,mesh", [("kv1", "pp2+ngram"), ("kv1", "pp4"), ("kv8", "pp2_tp2")])
def test_virtual_engines_keep_pp_steps_in_flight(report, variant, mesh):
    """pp virtual engines (PipelineEngine): the requests are spread over them and up to pp steps are in flight at
    once, so the stages overlap across steps; a draft model keeps the within-step micro-batches (LLMEngine)."""
    r, pp = report[variant][mesh], int(mesh[2])
    # (pp4 on 20 pages: the squeezed cache leaves at most 3 of its 4 virtual engines with work at once)
    assert r["engine"] == "PipelineEngine" and r["max_in_flight"] == min(pp, 3)
    assert len(r["routed"]) == pp and all(n > 0 for n in r["routed"])
    assert r["pages_in_use"] == 0
    assert report["kv3"]["pp2+draft"]["engine"] == "LLMEngine"


def test_aborts_with_steps_in_flight_leak_nothing(report):
    a = report["aborts"]
    assert a["pages_in_use"] == 0 and len(a["aborted"]) == 4
    single = report["kv1"]["single"]["tokens"]
    for rid, tokens in a["finished"].items():  # the requests that ran on undisturbed
        assert tokens == single[int(rid)]


def test_each_stage_holds_its_layers_on_its_own_devices(report):
    # 4 layers over 2 stages of one device each: stage s has layers 2s, 2s+1 and their KV on device s
    pp2 = report["kv1"]["pp2+ngram"]["placement"]
    assert [s["kv_layers"] for s in pp2] == [2, 2]
    assert [s["kv_devices"] for s in pp2] == [[0], [1]] and [s["weight_devices"] for s in pp2] == [[0], [1]]
    assert [(s["has_embed"], s["has_head"]) for s in pp2] == [(True, False), (False, True)]
    pp4 = report["kv1"]["pp4"]["placement"]
    assert [s["kv_layers"] for s in pp4] == [1, 1, 1, 1] and [s["kv_devices"] for s in pp4] == [[0], [1], [2], [3]]
    # pp2 x tp2, 8 KV heads: stage s on devices 2s, 2s+1, each device holding half the heads of its stage's layers
    st = report["kv8"]["pp2_tp2"]["placement"]
    assert [s["kv_devices"] for s in st] == [[0, 1], [2, 3]]
    assert all(s["kv_shard_bytes"] == [s["kv_bytes"] // 2] for s in st)
    # tied embeddings (kv8): the last stage keeps the embedding for its logits; untied (kv1): only the first has it
    assert [s["has_embed"] for s in st] == [True, True]
    assert [s["has_embed"] for s in pp4] == [True, False, False, False]


def test_kv_heads_with_tensor_parallelism(report):
    # 3 KV heads, 9 query heads: tp3 gives each shard one; 8 KV heads over tp8: one each, no replication
    assert report["kv3"]["tp3"]["kv_heads"] == 3 and report["kv8"]["tp8"]["kv_heads"] == 8
    tp8 = report["kv8"]["tp8"]["placement"][0]
    assert tp8["kv_shard_bytes"] == [tp8["kv_bytes"] // 8]


def test_pipelined_engine_never_recompiles_after_warmup(report):
    c = report["compiles"]
    assert c["after_warmup"] == c["buckets"] * c["stages"]
    assert c["after_run"] == c["after_warmup"]


def test_impossible_meshes_fail_at_start_naming_the_field(report):
    e = report["errors"]
    assert e["pp8"].startswith("ValueError") and "mesh.pp=8 exceeds the model's 4 layers" in e["pp8"]
    assert e["tp2"].startswith("ValueError") and "mesh.tp=2 must divide the model's 9 attention heads" in e["tp2"]


def test_stage_layer_bounds_are_contiguous_and_balanced():
    from jaxserve.model.llama import stage_layer_bounds

    assert stage_layer_bounds(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert stage_layer_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="mesh.pp=5 exceeds the model's 4 layers"):
        stage_layer_bounds(4, 5)


@pytest.mark.parametrize("tokens,groups,want", [
    ([10, 1, 1, 1], 2, [1, 3]),  # a long prefill chunk alone, the decodes together
    ([1, 1, 1, 1], 2, [2, 2]),
    ([1, 1, 10], 2, [2, 1]),
    ([3, 3, 3, 3], 4, [1, 1, 1, 1]),
    ([100, 1], 2, [1, 1]),
    ([5], 2, [1]),  # fewer sequences than stages: fewer micro-batches
    ([], 2, []),
])
def test_microbatches_split_whole_sequences_by_tokens(tokens, groups, want):
    from jaxserve.pipeline import split_microbatches

    assert split_microbatches(tokens, groups) == want
