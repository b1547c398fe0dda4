"""bench/collectives.py and bench/hlo.py: the HLO parser counts and sizes collectives (a handmade module with a loop,
a conditional, async pairs, tuples and every replica-group syntax), the ring formulas, the pipeline arithmetic, and
on one real compiled tp2 step of a tiny model: two all-reduces of the hidden state per layer plus one for the
embedding, and the benchmark's form of the step (abstract placement, scanned layers, XLA attention) has exactly the
collectives of the real CPU engine's (real weights, unrolled layers, its default attention). And the sm_90 compile
of a real tp step gathers no weight.

jax fixes its device count when it starts, so the compiled steps come from one subprocess with 2 simulated CPU
devices (XLA_FLAGS=--xla_force_host_platform_device_count=2) that prints a JSON report.
"""

import json
import os
import subprocess
import sys

import pytest

from bench.collectives import pipeline_rows
from bench.hlo import Collective, bytes_sent_per_device, group_size, parse_collectives, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HANDMADE = """HloModule jit_step_fn, is_scheduled=true, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %h = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %ar = f32[8,16]{1,0} all-reduce(%h), replica_groups={{0,1,2,3}}, to_apply=%add, metadata={op_name="f/attention/dot"}
  %ar.1 = f32[8,16]{1,0} all-reduce(%ar), replica_groups=mesh['a'=1,'b'=4] {'b'}, metadata={op_name="f/mlp/dot"}
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %ar.1)
}

%cond (p.1: (s32[], f32[8,16])) -> pred[] {
  %p.1 = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

%sort_branch (a: bf16[4,32]) -> bf16[4,64] {
  %a = bf16[4,32]{1,0} parameter(0)
  ROOT %ag = bf16[4,64]{1,0} all-gather(%a), replica_groups=[2,2]<=[4], dimensions={1}, metadata={op_name="f/sort"}
}

%skip_branch (b: bf16[4,32]) -> bf16[4,64] {
  %b = bf16[4,32]{1,0} parameter(0)
  ROOT %z = bf16[4,64]{1,0} broadcast(%b), dimensions={}
}

ENTRY %main.1_spmd (init: (s32[], f32[8,16]), y: f32[8,16], z: bf16[16,32], q: f32[4]) -> f32[16] {
  %init = (s32[], f32[8,16]{1,0}) parameter(0)
  %y = f32[8,16]{1,0} parameter(1)
  %z = bf16[16,32]{1,0} parameter(2)
  %q = f32[4]{0} parameter(3)
  %v = f32[10]{0} parameter(4)
  %k = pred[] parameter(5)
  %m = bf16[4,32]{1,0} parameter(6)
  %w = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = f32[2,16]{1,0} reduce-scatter(%y), replica_groups={{0,1,2,3}}, dimensions={0}, metadata={op_name="f/gather"}
  %ars = bf16[16,32]{1,0} all-reduce-start(%z), replica_groups={}, to_apply=%add, metadata={op_name="f/reduce_sum"}
  %ard = bf16[16,32]{1,0} all-reduce-done(%ars), metadata={op_name="jit(step_fn)/reduce_sum"}
  %ags = (f32[4]{0}, f32[16]{0}) all-gather-start(%q), channel_id=6, replica_groups={{0,1,2,3}}, dimensions={0}
  %agd = f32[16]{0} all-gather-done(%ags)
  %cp = f32[10]{0} collective-permute(%v), channel_id=7, source_target_pairs={{0,1},{1,0}}
  %c = bf16[4,64]{1,0} conditional(%k, %m, %m), true_computation=%sort_branch, false_computation=%skip_branch
  %tar = (f32[16]{0}, f32[16]{0}) all-reduce(%agd, %agd), channel_id=8, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %r = f32[16]{0} add(%agd, %agd)
}
"""


def by_kind(cs: list[Collective]) -> dict[str, list[Collective]]:
    out: dict[str, list[Collective]] = {}
    for c in cs:
        out.setdefault(c.kind, []).append(c)
    return out


def test_ring_formulas_for_known_shapes():
    # SmolLM2 tp3 decode16: the hidden state f32[16, 576] all-reduced over 3 devices
    assert bytes_sent_per_device("all-reduce", 16 * 576 * 4, 3) == pytest.approx(2 * 2 / 3 * 36864) == 49152
    assert bytes_sent_per_device("all-gather", 16 * 49152 * 4, 3) == pytest.approx(2 / 3 * 3145728)
    assert bytes_sent_per_device("reduce-scatter", 1024, 8) == 896
    assert bytes_sent_per_device("all-to-all", 1024, 4) == 768
    assert bytes_sent_per_device("collective-permute", 40, 2) == 40
    assert bytes_sent_per_device("all-reduce", 1 << 20, 1) == 0  # one device moves nothing
    with pytest.raises(ValueError, match="unknown collective"):
        bytes_sent_per_device("broadcast", 1, 2)


def test_replica_group_syntaxes():
    assert group_size("replica_groups={{0,1,2},{3,4,5}}, to_apply=%a", 6) == 3
    assert group_size("replica_groups=[2,4]<=[8], dimensions={0}", 8) == 4
    assert group_size("replica_groups=[4,2]<=[2,4]T(1,0), x", 8) == 2
    assert group_size("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use_global", 8) == 4
    assert group_size("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}, x", 8) == 8
    assert group_size("replica_groups={}, to_apply=%a", 8) == 8
    assert group_size("source_target_pairs={{0,1},{1,2},{2,0}}", 8) == 3


def test_parser_counts_and_sizes_a_handmade_module():
    cs = by_kind(parse_collectives(HANDMADE))
    assert sorted(cs) == ["all-gather", "all-reduce", "collective-permute", "reduce-scatter"]
    layer = sorted((c for c in cs["all-reduce"] if c.in_layers), key=lambda c: c.op_name)
    assert [(c.shape, c.group_size, c.count, c.conditional_count) for c in layer] == [
        ("f32[8,16]", 4, 3, 0), ("f32[8,16]", 4, 3, 0)]  # both in the loop body: trip count 3
    assert layer[0].bytes_per_device == 2 * 3 / 4 * 512
    rest = {c.shape: c for c in cs["all-reduce"] if not c.in_layers}
    assert rest["bf16[16,32]"].count == 1 and rest["bf16[16,32]"].group_size == 4  # async pair once; {} = all 4
    assert rest["bf16[16,32]"].buffer_bytes == 1024
    assert rest["(f32[16], f32[16])"].buffer_bytes == 128 and rest["(f32[16], f32[16])"].group_size == 2
    (rs,) = cs["reduce-scatter"]
    assert rs.buffer_bytes == 4 * 128 and rs.bytes_per_device == 384  # result f32[2,16] is a quarter of the operand
    gathers = {c.shape: c for c in cs["all-gather"]}
    assert gathers["f32[16]"].buffer_bytes == 64 and gathers["f32[16]"].count == 1  # sized by the -done
    sort = gathers["bf16[4,64]"]
    assert (sort.count, sort.conditional_count, sort.group_size, sort.buffer_bytes) == (0, 1, 2, 512)
    (cp,) = cs["collective-permute"]
    assert (cp.buffer_bytes, cp.group_size, cp.bytes_per_device) == (40, 2, 40)

    s = summarize(parse_collectives(HANDMADE), num_tokens=8, num_layers=3)
    assert s["num_in_layers"] == 6 and s["num_outside_layers"] == 5 and s["num_conditional"] == 1
    assert s["bytes_in_layers"] == 6 * 768
    assert s["bytes_per_token_per_layer"] == 6 * 768 / 8 / 3
    assert s["bytes_conditional"] == 256
    assert s["bytes_per_step"] == 6 * 768 + 384 + 1536 + 48 + 40 + 128  # tuple all-reduce: 2 (2-1)/2 x 128


def test_pipeline_boundary_bytes_and_bubble():
    rows = {(r["pp"], r["bucket"]): r for r in pipeline_rows("llama3-8b")}
    r = rows[(2, "decode16")]
    assert r["bytes_per_boundary_per_step"] == 16 * 4096 * 2  # T x D x bf16, once per step in M micro-batches
    assert r["bubble"] == pytest.approx(1 / 3) and r["transfers_per_step"] == 2
    assert rows[(4, "prefill512")]["bytes_per_step"] == 3 * 512 * 4096 * 2
    assert rows[(4, "prefill512")]["bubble"] == pytest.approx(3 / 7)


_SCRIPT = r"""
import dataclasses, json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import jax
from tiny_models import make_tiny_model
from bench.collectives import build_runner
from bench.hlo import parse_collectives
from jaxserve import LLM
from jaxserve.batch import choose_bucket
from jaxserve.loader import read_model_config
from jaxserve.sharding import MeshConfig

assert len(jax.devices()) == 2
path = os.path.join(sys.argv[2], "llama_gqa")
make_tiny_model("llama_gqa", path)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=64)


def collectives(runner):
    cfg = runner.engine_cfg
    bucket = choose_bucket(4, 1, cfg.token_buckets, cfg.page_buckets, cfg.max_num_seqs)
    return bucket.num_tokens, [dataclasses.asdict(c) | dict(in_layers=c.in_layers, sent=c.bytes_per_device)
                               for c in parse_collectives(runner.executable(bucket).as_text())]


report = {}
llm = LLM(path, mesh="tp2", precompile=False, num_pages=20, **ENGINE)  # the CPU engine: unrolled layers
assert not llm.llm_engine.runner.scan_layers
report["engine"] = collectives(llm.llm_engine.runner)
runner, _ = build_runner(read_model_config(path), MeshConfig.preset("tp2"), "float32", engine=ENGINE)
assert runner.scan_layers  # the benchmark's form: abstract weights, one scanned layer body, XLA attention
report["abstract"] = collectives(runner)
report["hidden"] = llm.llm_engine.model_config.hidden_size
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", _SCRIPT, ROOT, str(tmp_path_factory.mktemp("coll"))], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def _always(cs):
    return sorted((c["kind"], c["shape"], c["group_size"], c["count"], c["in_layers"]) for c in cs if c["count"])


def _conditional(cs):
    return sorted((c["kind"], c["shape"], c["group_size"], c["conditional_count"]) for c in cs
                  if c["conditional_count"])


def test_real_tp2_step_has_two_hidden_all_reduces_per_layer_plus_the_embedding(compiled):
    T, cs = compiled["engine"]
    D = compiled["hidden"]
    hidden = [c for c in cs if c["kind"] == "all-reduce" and c["shape"] == f"f32[{T},{D}]" and c["count"]]
    assert sum(c["count"] for c in hidden if c["in_layers"]) == 2 * 2  # o and down projections, 2 layers
    assert sum(c["count"] for c in hidden if not c["in_layers"]) == 1  # the vocabulary-parallel embedding
    for c in hidden:
        assert c["group_size"] == 2 and c["sent"] == 2 * (2 - 1) / 2 * T * D * 4  # the ring all-reduce of f32[T, D]


def test_the_benchmarks_abstract_scanned_step_has_the_engines_collectives(compiled):
    # the while loop's trip count multiplies the scanned body's collectives; abstract placement, the scanned
    # layers and the XLA attention (under shard_map, on local heads) change none of them
    assert _always(compiled["abstract"][1]) == _always(compiled["engine"][1])
    assert _conditional(compiled["abstract"][1]) == _conditional(compiled["engine"][1])


def test_sm90_tensor_parallel_step_never_gathers_a_weight():
    """The engine's real tp3 step on SmolLM2, compiled for virtual H200s (deviceless sm_90, bf16) at every bench
    bucket: every collective that always runs is an all-reduce of at most the residual stream [T, D] (XLA's GPU
    partitioner, left to itself, all-gathered the whole embedding table for a decode of one token:
    `sharding.vocab_lookup` is the fix this guards)."""
    from sm90_aot import PLUGIN_DIR

    if not os.path.isdir(os.path.join(PLUGIN_DIR, "jax_plugins")):
        pytest.fail(f"no CUDA PJRT plugin in {PLUGIN_DIR}: run scripts/setup.sh --test")
    from bench.collectives import run_child

    (rec,) = run_child("cuda", ["smollm2"], ["tp3"], None)
    D = rec["hidden_size"]
    assert set(rec["buckets"]) == {"decode1", "decode16", "prefill512"}
    for name, b in rec["buckets"].items():
        always = [c for c in b["collectives"] if c["count"]]
        assert always and {c["kind"] for c in always} == {"all-reduce"}, (name, always)
        assert max(c["buffer_bytes"] for c in always) <= b["num_tokens"] * D * 2, name  # bf16 [T, D]
        assert b["summary"]["num_in_layers"] == 2 * rec["num_layers"]
