"""The engine's whole step compiles for an H200 (sm_90) without a GPU, and its memory plan fits the H200.

Deviceless AOT (harness: tests/sm90_aot.py): `runner.compile_step`, the step `ModelRunner` jits, is compiled from
abstract bf16 weights and KV caches placed on a deviceless H200, for buckets of `configs/engine/gpu-h200.yaml`,
with the Pallas kernels inside (ragged paged attention; spec verify with speculation), scanned layers, bf16 and
int8 KV. Each compile's memory analysis (argument, output, alias, temp bytes) is reported; `python
tests/test_step_compile_sm90.py --table` prints the table docs/gpu.md shows (with the CUDA plugin on PYTHONPATH).

Models: a small Llama (head dim 64, the kernels' shapes) for the bucket sweep, and the default model's shapes
(SmolLM2-135M) at the largest buckets, whose activations, weights and KV cache must fit 0.9 of 141 GB.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from sm90_aot import h200_sharding, run_compile_child, tracing_as_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_CONFIG = os.path.join(ROOT, "configs", "engine", "gpu-h200.yaml")
H200_BYTES = 141 * 10**9
NGRAM = dict(method="ngram", num_speculative_tokens=4)
MODELS = {
    "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=64),
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                    num_kv_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True),
}


def model_config(name: str):
    from jaxserve.config import ModelConfig

    return ModelConfig(architecture="llama", rms_norm_eps=1e-5, rope_theta=100000.0, **MODELS[name])


def engine_config(spec: bool):
    from jaxserve.config import EngineConfig

    cfg = EngineConfig.from_yaml(GPU_CONFIG)
    return cfg.replace(speculative_config=NGRAM) if spec else cfg


def configs() -> list[dict]:
    """(model, speculation, KV dtype, tokens, pages, verify rows): the small model over the GPU config's smallest,
    a decode-sized and the largest bucket, then with speculation and int8 KV; the default model at its largest."""
    small = [dict(model="small", spec=False, kv="bfloat16", tokens=t, pages=p, rows=0)
             for t, p in ((16, 64), (256, 64), (2048, 512), (8192, 512))]
    small += [dict(model="small", spec=True, kv="bfloat16", tokens=8192, pages=512, rows=8192),
              dict(model="small", spec=False, kv="int8", tokens=8192, pages=512, rows=0)]
    default = [dict(model="smollm2", spec=s, kv="bfloat16", tokens=8192, pages=512, rows=8192 if s else 0)
               for s in (False, True)]
    return small + default


def config_id(c: dict) -> str:
    return f"{c['model']}-T{c['tokens']}-P{c['pages']}-{c['kv']}{'-verify' if c['rows'] else ''}" + (
        "-spec" if c["spec"] else "")


def _compile(c: dict, sharding) -> dict:
    """(child) Compile one configuration's step for the H200; its memory analysis and which kernels it holds."""
    import time

    from jaxserve import memory_plan, ops
    from jaxserve.batch import choose_bucket
    from jaxserve.runner import compile_step

    mc, ec = model_config(c["model"]), engine_config(c["spec"])
    bucket = choose_bucket(c["tokens"], c["pages"], ec.token_buckets, ec.page_buckets, ec.max_num_seqs,
                           1 + ec.num_speculative_tokens, c["rows"])
    weights = memory_plan.abstract_weights(mc, "bfloat16", sharding)
    kv = memory_plan.abstract_kv(mc, 1 + ec.max_pages_per_seq, ec.page_size, c["kv"], sharding)
    backends = ops.Backends(attention="pallas", matmul="pallas")  # what resolve_backends gives on a GPU
    start = time.perf_counter()
    result = dict(id=config_id(c), bucket=[bucket.num_tokens, bucket.num_seqs, bucket.max_pages, bucket.num_rows],
                  kv_bytes=memory_plan.tree_bytes(kv), weights_bytes=memory_plan.tree_bytes(weights))
    try:
        with tracing_as_gpu():
            compiled = compile_step(mc, ec, weights, kv, bucket, backends=backends, placement=sharding)
        text = compiled.as_text()
        m = memory_plan.StepMemory.of(bucket, compiled)
        result.update(ok=True, error="", argument=m.argument_bytes, output=m.output_bytes, alias=m.alias_bytes,
                      temp=m.temp_bytes, code=m.code_bytes,
                      kernels=[k for k in ("ragged_paged_attention", "spec_verify") if k in text])
    except Exception as e:  # noqa: BLE001 - reported per config
        result.update(ok=False, error=f"{type(e).__name__}: {e}"[:3000])
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def step_memory_of(r: dict):
    from jaxserve.batch import Bucket
    from jaxserve.memory_plan import StepMemory

    return StepMemory(Bucket(*r["bucket"]), r["argument"], r["output"], r["alias"], r["temp"], r["code"])


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    from jaxserve.memory_plan import memory_table

    out = run_compile_child(__file__, timeout=900)
    print("\n" + memory_table([(k, step_memory_of(r)) for k, r in out.items() if r["ok"]]))
    return out


@pytest.mark.parametrize("config", configs(), ids=config_id)
def test_step_compiles_for_sm90_with_the_kernels(config, results):
    r = results[config_id(config)]
    assert r["ok"], f"{r['id']} did not compile for sm_90:\n{r['error']}"
    assert "ragged_paged_attention" in r["kernels"], "the step runs no Pallas attention kernel"
    assert ("spec_verify" in r["kernels"]) == config["spec"], r["kernels"]
    # the donated cache is updated in place: its buffers are the outputs' (else the GPU would hold it twice)
    assert r["alias"] >= r["kv_bytes"], (r["alias"], r["kv_bytes"])
    assert r["argument"] >= r["weights_bytes"] + r["kv_bytes"]
    assert r["temp"] > 0


def test_planning_buckets_bound_the_activations(results):
    """memory_plan.planning_buckets (the largest tokens and pages) has the largest activations of the sweep."""
    from jaxserve.memory_plan import planning_buckets

    plain = [step_memory_of(r) for c in configs() if c["model"] == "small" and not c["spec"] and c["kv"] == "bfloat16"
             for r in [results[config_id(c)]]]
    (largest,) = planning_buckets(engine_config(False))
    (planned,) = [m for m in plain if m.bucket == largest]
    peak = max(plain, key=lambda m: m.activation_bytes)
    assert planned.activation_bytes >= peak.activation_bytes, (planned, peak)  # ties allowed


def test_default_model_fits_an_h200(results):
    """SmolLM2-135M on gpu-h200.yaml (bf16, with n-gram speculation's verify rows too): weights + the largest
    step's activations + a KV cache for every sequence at full length fit 0.9 of an H200's 141 GB."""
    from jaxserve.factory import page_bytes
    from jaxserve.memory_plan import MemoryPlan

    mc, ec = model_config("smollm2"), engine_config(True)
    steps = [results[config_id(c)] for c in configs() if c["model"] == "smollm2"]
    plan = MemoryPlan(device_bytes=H200_BYTES, utilization=ec.gpu_memory_utilization, in_use_bytes=0,
                      weights_bytes=steps[0]["weights_bytes"],
                      activation_bytes=max(step_memory_of(r).activation_bytes for r in steps),
                      page_bytes=page_bytes(ec, mc, "bfloat16"))
    print("\n" + plan.describe())
    assert plan.num_pages >= 1 + ec.max_num_seqs * ec.max_pages_per_seq
    used = plan.weights_bytes + plan.activation_bytes + plan.num_pages * plan.page_bytes
    assert used <= 0.9 * H200_BYTES


def _child() -> None:
    sharding = h200_sharding()
    results = [_compile(c, sharding) for c in configs()]
    if "--table" in sys.argv:
        from jaxserve.memory_plan import memory_table

        print(memory_table([(r["id"], step_memory_of(r)) for r in results if r["ok"]]))
    for r in results:
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    _child()
