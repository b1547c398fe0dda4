"""Collectives per step: what tensor parallelism moves between devices, read from the engine's compiled step.

For each model (the default SmolLM2-135M-Instruct, from its GGUF's metadata, and a Llama-3-8B-shaped config) and
each tensor-parallel mesh it accepts, the engine's real step (`ModelRunner.executable(bucket)`, the same
`runner.step_fn` the engine runs) is compiled for a decode bucket of 1 and of 16 sequences and a 512-token
prefill chunk. The compiled, SPMD-partitioned HLO is parsed: every all-reduce / all-gather / reduce-scatter /
collective-permute / all-to-all with its shape, dtype, device group and how often it runs per step (loop trip
counts multiply; ops inside a `conditional` branch count apart: they run only when a batch needs that branch, e.g.
the sampler's top-k / top-p sort). Bytes each device sends use the ring formulas (all-reduce 2(n-1)/n x buffer,
all-gather and reduce-scatter (n-1)/n x the full buffer, all-to-all (n-1)/n, collective-permute the buffer), and
each collective's cost at an interconnect is bytes / bandwidth + a per-collective latency floor (`INTERCONNECTS`).
Next to it: one H200's compute time for the same per-device step, estimated (no GPU has run this engine yet) as
weight bytes / HBM bandwidth, or FLOPs / peak for the prefill chunk, whichever is longer.

Two compile targets, each in a child process (jax fixes its devices at start):
- `cpu`: 9 simulated CPU devices (`--xla_force_host_platform_device_count`), the engine's CPU dtype (float32).
- `cuda`: a deviceless sm_90 compile for virtual H200s (the CUDA PJRT plugin in `.venv/cuda-aot`, as
  `tests/sm90_aot.py` uses it; skipped when absent), bfloat16: the HLO XLA's GPU compiler would run.
Only the partitioned HLO shows collectives: `jit(...).lower()` text is StableHLO with sharding annotations and no
collectives, so every step is `.compile()`d. Weights and the KV cache are placed abstractly (ShapeDtypeStructs
carrying the real shardings, `abstract_placement`), so the 8B shapes compile without allocating 16 GB, at their
full layer count (the layers are one scanned loop body, `scan_layers=True` as on a GPU; tests check that the
unrolled CPU form has the same collectives).

Pipeline and data parallelism are computed, not compiled (stages are separate executables): a pipeline boundary
moves the residual stream f[T, D] once per micro-batch, the bubble is (pp-1)/(M+pp-1), and data-parallel replicas
exchange nothing per step.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench collectives     # docs/benchmarks/collectives.{json,md}
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys

from bench.common import OUT_DIR, ROOT, args_record, command_line, machine_info, machine_line, md_table, write_outputs
from bench.hlo import Collective, parse_collectives, summarize

NUM_CPU_DEVICES = 9  # SmolLM2's 9 query heads allow tp 3 and 9 only (3 KV heads): 9 devices cover both
CUDA_AOT_DIR = os.environ.get("JAXSERVE_CUDA_AOT_DIR", os.path.join(ROOT, ".venv", "cuda-aot"))

# Per-GPU one-direction bandwidth (bytes/s) and an assumed latency floor per collective (s). The floors are
# assumptions of the order NCCL shows for small messages, not measurements: ~5-10 us on NVLink, ~20-30 us over
# PCIe, more across a network.
INTERCONNECTS = {
    "NVLink 4": dict(bandwidth=450e9, latency=8e-6, note="H100/H200 SXM, 900 GB/s bidirectional"),
    "PCIe Gen5 x16": dict(bandwidth=64e9, latency=25e-6, note="GPU to GPU through the host's PCIe"),
    "400 Gb/s IB": dict(bandwidth=50e9, latency=40e-6, note="one NDR InfiniBand / 400 GbE port per GPU"),
    "100 Gb/s Ethernet": dict(bandwidth=12.5e9, latency=60e-6, note="RoCE / 100 GbE"),
}
H200_HBM_BANDWIDTH = 4.8e12  # bytes/s (spec)
H200_BF16_FLOPS = 989e12  # dense bf16 peak (spec); measured matrix work on these machines reaches ~790e12

MODELS = ("smollm2", "llama3-8b")
BUCKETS = {"decode1": 1, "decode16": 16, "prefill512": 512}  # name -> tokens in the step (all real)
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024, page_size=16)

def llama3_8b_config():
    """Llama-3-8B's dimensions (random weights are enough: only the compiled HLO is inspected)."""
    from jaxserve.config import ModelConfig, RopeScaling

    return ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=8192,
                       rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, original_max_position_embeddings=8192))


def model_config(name: str):
    if name == "smollm2":
        from jaxserve.loader import read_model_config

        return read_model_config(None)  # the installed GGUF's metadata (no weights are read)
    if name == "llama3-8b":
        return llama3_8b_config()
    raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")


def interconnect_seconds(collectives: list[Collective], link: dict, conditional: bool = False) -> float:
    """Serial time of a step's collectives on one link: per execution bytes / bandwidth + the latency floor."""
    attr = "conditional_count" if conditional else "count"
    return sum(getattr(c, attr) * (c.bytes_per_device / link["bandwidth"] + link["latency"]) for c in collectives)


# ---------------------------------------------------------------- compiling the engine's step (child process)


def abstract_weights(cfg, dtype):
    """The model's host weights as ShapeDtypeStructs (stacked layers), laid out as `loader.weights.to_weights`
    builds them: linear weights [in, out], KV heads as the config counts them (already replicated for tp)."""
    import jax

    from jaxserve.model.llama import LayerWeights, Weights

    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    NH, KH = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def s(*shape):
        return jax.ShapeDtypeStruct(shape, dtype)

    bias = dict(bq=s(L, NH), bk=s(L, KH), bv=s(L, KH)) if cfg.attention_bias else {}
    qk = dict(q_norm=s(L, cfg.head_dim), k_norm=s(L, cfg.head_dim)) if cfg.qk_norm else {}
    layers = LayerWeights(attn_norm=s(L, D), wq=s(L, D, NH), wk=s(L, D, KH), wv=s(L, D, KH), wo=s(L, NH, D),
                          mlp_norm=s(L, D), w_gate=s(L, D, F), w_up=s(L, D, F), w_down=s(L, F, D), **bias, **qk)
    return Weights(embed=s(V, D), layers=layers, final_norm=s(D), lm_head=None if cfg.tie_word_embeddings else s(D, V))


@contextlib.contextmanager
def abstract_placement():
    """While active, `jax.device_put(tree, shardings)` returns ShapeDtypeStructs carrying those shardings instead of
    copying, so a `ModelRunner` built inside holds abstract weights and KV cache: its `executable(bucket)` lowers and
    compiles the engine's step exactly as for real arrays, with nothing allocated on the devices."""
    import jax

    real = jax.device_put

    def place(x, device=None, *args, **kwargs):
        if isinstance(device, jax.sharding.Sharding):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), x)
        if device is None or isinstance(device, jax.Device):
            return real(x, device, *args, **kwargs)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), x, device)

    jax.device_put = place
    try:
        yield
    finally:
        jax.device_put = real


def build_runner(model_cfg, mesh_cfg, dtype: str, devices=None, *, scan_layers: bool = True, engine=ENGINE):
    """A `ModelRunner` of the engine with abstract weights for `model_cfg` on `mesh_cfg` (checked and resolved the
    engine's way: `factory.check_mesh`, KV heads replicated, `factory.resolve_config`), its mesh over `devices`
    (default: this process's). Raises the engine's own error for a mesh the model does not accept."""
    import jax.numpy as jnp

    from jaxserve import factory, sharding
    from jaxserve.config import EngineConfig
    from jaxserve.runner import ModelRunner

    pages = -(-engine["max_model_len"] // engine["page_size"]) + 1  # one full sequence: the cache is abstract anyway
    ecfg = EngineConfig(**engine, mesh=mesh_cfg, dtype=dtype, scan_layers=scan_layers, attention_backend="xla",
                        matmul_backend="xla", num_pages=pages, precompile=False)
    mesh, r = factory.check_mesh(ecfg, model_cfg)
    if devices is not None:
        mesh = sharding.make_mesh(ecfg.mesh, devices)
    cfg = dataclasses.replace(model_cfg, num_kv_heads=model_cfg.num_kv_heads * r)
    ecfg, backends = factory.resolve_config(ecfg, cfg, mesh)
    with abstract_placement():
        runner = ModelRunner(cfg, ecfg, abstract_weights(cfg, jnp.dtype(dtype)), dtype, backends=backends, mesh=mesh)
    return runner, r


def weight_elements_per_device(runner) -> dict:
    """Weight elements one device holds, from the placed shards: all, the decoder layers', the logits projection's
    (`lm_head`, or the tied embedding)."""
    import jax

    def shard_elements(tree):
        return sum(math.prod(a.sharding.shard_shape(a.shape)) for a in jax.tree.leaves(tree))

    w = runner.weights
    return dict(all=shard_elements(w), layers=shard_elements(w.layers),
                head=shard_elements(w.lm_head if w.lm_head is not None else w.embed))


def step_buckets(runner) -> dict:
    from jaxserve.batch import choose_bucket

    cfg = runner.engine_cfg
    pages = cfg.page_buckets[-1]
    return {name: choose_bucket(t, pages, cfg.token_buckets, cfg.page_buckets, cfg.max_num_seqs)
            for name, t in BUCKETS.items()}


def measure(model: str, mesh_name: str, target: str, dtype: str, devices=None, dump_dir: str | None = None) -> dict:
    """Compile the engine's step for every bucket on one (model, mesh) and parse its collectives."""
    import time

    from jaxserve.sharding import MeshConfig

    cfg = model_config(model)
    mesh_cfg = MeshConfig.from_value(mesh_name)
    rec = dict(model=model, mesh=mesh_name, target=target, dtype=dtype, tp=mesh_cfg.tp, num_layers=cfg.num_layers,
               hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size)
    try:
        runner, replicas = build_runner(cfg, mesh_cfg, dtype, devices)
    except (ValueError, NotImplementedError) as e:
        return rec | dict(error=f"{type(e).__name__}: {e}")
    rec |= dict(kv_head_replicas=replicas, kv_heads_stored=runner.model_cfg.num_kv_heads,
                weight_elements_per_device=weight_elements_per_device(runner), buckets={})
    for name, bucket in step_buckets(runner).items():
        t0 = time.perf_counter()
        text = runner.executable(bucket).as_text()
        seconds = time.perf_counter() - t0
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)
            with open(os.path.join(dump_dir, f"{target}_{model}_{mesh_name}_{name}.hlo"), "w") as f:
                f.write(text)
        coll = parse_collectives(text)
        rec["buckets"][name] = dict(
            num_tokens=bucket.num_tokens, num_rows=bucket.rows, compile_seconds=round(seconds, 1),
            summary=summarize(coll, bucket.num_tokens, cfg.num_layers),
            collectives=[dataclasses.asdict(c) | dict(bytes_per_device=c.bytes_per_device, in_layers=c.in_layers)
                         for c in sorted(coll, key=lambda c: (not c.in_layers, -c.count * c.bytes_per_device))])
        print(f"[collectives] {target} {model} {mesh_name} {name}: {len(coll)} distinct, "
              f"{rec['buckets'][name]['summary']['num_collectives']} per step, compiled in {seconds:.1f} s",
              file=sys.stderr, flush=True)
    return rec


def accepted_tp(cfg, max_devices: int) -> list[int]:
    """The tp sizes up to `max_devices` the engine accepts for this model (`sharding.kv_head_replicas`)."""
    from jaxserve.sharding import MeshConfig, kv_head_replicas

    out = []
    for tp in range(1, max_devices + 1):
        try:
            kv_head_replicas(MeshConfig(tp=tp), cfg.num_heads, cfg.num_kv_heads)
            out.append(tp)
        except ValueError:
            pass
    return out


def mesh_names(model: str) -> list[str]:
    """configs/mesh/ presets without pp or dp (those are computed, not compiled), then any other tp the model
    accepts up to the simulated devices (SmolLM2: tp3, tp9)."""
    from jaxserve.sharding import MeshConfig

    names = sorted((f[:-5] for f in os.listdir(os.path.join(ROOT, "configs", "mesh")) if f.endswith(".yaml")),
                   key=lambda n: (MeshConfig.preset(n).num_devices, n))
    tp_only = [n for n in names if MeshConfig.preset(n).dp == MeshConfig.preset(n).pp == 1]
    extra = [f"tp{t}" for t in accepted_tp(model_config(model), NUM_CPU_DEVICES) if t > 1 and f"tp{t}" not in tp_only]
    return tp_only + extra


def child_main(spec: dict) -> None:
    """In a fresh process: the devices of the target, then one JSON line per (model, mesh)."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # every executable compiled here, text intact
    devices = None
    if spec["target"] == "cuda":
        from jax.experimental import topologies

        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from sm90_aot import H200_TARGET_CONFIG

        devices = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET_CONFIG,
                                               topology=f"1x1x{NUM_CPU_DEVICES}").devices
    for model in spec["models"]:
        for mesh in spec.get("meshes") or mesh_names(model):
            rec = measure(model, mesh, spec["target"], spec["dtype"], devices, spec.get("dump_dir"))
            print(json.dumps(rec), flush=True)


def run_child(target: str, models: list[str], meshes: list[str] | None, dump_dir: str | None) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={NUM_CPU_DEVICES}")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, CUDA_AOT_DIR if target == "cuda" else None,
                                                    env.get("PYTHONPATH")) if p)
    spec = dict(target=target, models=models, meshes=meshes, dump_dir=dump_dir,
                dtype="float32" if target == "cpu" else "bfloat16")
    proc = subprocess.run([sys.executable, "-m", "bench.collectives", "--child", json.dumps(spec)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"collectives: the {target} child failed (rc {proc.returncode}); see its stderr above")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


# ---------------------------------------------------------------- costs and reports


def compute_seconds(rec: dict, bucket: dict) -> float:
    """One H200's time for this step on one device's share, estimated: weights read once (HBM bandwidth) or the
    matmul FLOPs (2 x layer weights x tokens + 2 x LM head x rows), whichever is longer. KV reads are left out."""
    e = rec["weight_elements_per_device"]
    flops = 2 * e["layers"] * bucket["num_tokens"] + 2 * e["head"] * bucket["num_rows"]
    return max(2 * e["all"] / H200_HBM_BANDWIDTH, flops / H200_BF16_FLOPS)  # bf16 weights on a GPU


def costs(rec: dict) -> dict:
    out = {}
    for name, b in rec.get("buckets", {}).items():
        coll = [Collective(**{f.name: c[f.name] for f in dataclasses.fields(Collective)}) for c in b["collectives"]]
        out[name] = dict(compute_seconds_h200=compute_seconds(rec, b), interconnect_seconds={
            link: interconnect_seconds(coll, spec) for link, spec in INTERCONNECTS.items()},
            conditional_seconds={link: interconnect_seconds(coll, spec, True) for link, spec in INTERCONNECTS.items()})
    return out


def pipeline_rows(model: str, dtype_bytes_gpu: int = 2) -> list[dict]:
    """Pipeline parallelism, computed: the residual stream f[T, D] crosses each of the pp-1 stage boundaries once
    per micro-batch (T / M tokens each), so T x D x dtype bytes per boundary per step; bubble (pp-1)/(M+pp-1), M = pp.
    Step time vs one device: decode re-reads each stage's weights per micro-batch ((M+pp-1)/pp of one device's
    weight reads, memory bound); a compute-bound prefill splits evenly ((M+pp-1)/(M pp))."""
    cfg = model_config(model)
    rows = []
    for pp in (2, 4):
        if pp > cfg.num_layers:
            continue
        m = pp
        for name, t in BUCKETS.items():
            boundary = t * cfg.hidden_size * dtype_bytes_gpu
            rows.append(dict(model=model, pp=pp, microbatches=m, bucket=name, num_tokens=t,
                             bytes_per_boundary_per_step=boundary, bytes_per_step=boundary * (pp - 1),
                             transfers_per_step=m * (pp - 1), bytes_per_token_per_boundary=cfg.hidden_size
                             * dtype_bytes_gpu, bubble=(pp - 1) / (m + pp - 1),
                             decode_step_vs_one_device=(m + pp - 1) / pp,
                             prefill_step_vs_one_device=(m + pp - 1) / (m * pp),
                             link_seconds={link: boundary * (pp - 1) / s["bandwidth"] + m * (pp - 1) * s["latency"]
                                           for link, s in INTERCONNECTS.items()}))
    return rows


def _b(x: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= k:
            return f"{x / k:.1f} {unit}"
    return f"{x:.0f} B"


def _us(s: float) -> str:
    return f"{s * 1e6:.0f}" if s >= 1e-5 else f"{s * 1e6:.1f}"


def headline_rows(records: list[dict], bucket_names=("decode1", "decode16", "prefill512")) -> list[list]:
    rows = []
    for rec in records:
        if "error" in rec:
            continue
        c = costs(rec)
        for name in bucket_names:
            if name not in rec["buckets"]:
                continue
            s = rec["buckets"][name]["summary"]
            comp = c[name]["compute_seconds_h200"]
            links = [f"{_us(t)} ({t / comp:.0%})" if rec["tp"] > 1 else "–"
                     for t in c[name]["interconnect_seconds"].values()]
            rows.append([rec["model"], rec["mesh"], name, f"{s['num_collectives']} ({s['num_in_layers']})",
                         _b(s["bytes_per_step"]), _b(s["bytes_per_token_per_layer"]), _us(comp), *links])
    return rows


def report(record: dict) -> str:
    links = list(INTERCONNECTS)
    md = ["# Collectives per step: tensor parallelism, read from the compiled step", ""]
    for target, recs in record["targets"].items():
        label = {"cpu": f"{NUM_CPU_DEVICES} simulated CPU devices, float32 (the CPU engine's dtype)",
                 "cuda": "deviceless sm_90 compile for virtual H200s, bfloat16 (XLA's GPU compiler; not run)"}[target]
        md += [f"## Target `{target}`: {label}", "",
               "Collectives per step (of which in the decoder layers), bytes each device sends per step (ring "
               "formulas), bytes per token per layer, then the time of the step's collectives at each interconnect "
               "in µs (as a share of the compute estimate). Compute: one H200 running one device's share of the "
               "step, bf16, estimated from weight bytes / 4.8 TB/s or FLOPs / 989 TFLOP/s (no GPU has run this).",
               "", md_table(["model", "mesh", "bucket", "collectives (in layers)", "bytes / device / step",
                             "bytes / token / layer", "compute est. µs", *(f"{lk} µs" for lk in links)],
                            headline_rows(recs)), ""]
        refused = [f"- `{r['model']}` `{r['mesh']}`: {r['error']}" for r in recs if "error" in r]
        if refused:
            md += ["Refused by the engine (its own start-up check):", "", *refused, ""]
        cond = []
        for r in recs:
            for name, b in r.get("buckets", {}).items():
                s = b["summary"]
                if s["num_conditional"]:
                    cond.append([r["model"], r["mesh"], name, s["num_conditional"], _b(s["bytes_conditional"]),
                                 *(_us(t) for t in costs(r)[name]["conditional_seconds"].values())])
        if cond:
            md += ["Inside the sampler's conditional branches (they run only when a row needs top-k / top-p / min-p "
                   "truncation, random sampling or logprobs; greedy steps without logprobs skip them):", "",
                   md_table(["model", "mesh", "bucket", "collectives", "bytes / device", *(f"{lk} µs" for lk in links)],
                            cond), ""]
        detail = next((r for r in recs if r.get("tp", 1) > 1 and "buckets" in r), None)
        if detail:
            b = detail["buckets"]["decode16"]
            md += [f"Every collective of `{detail['model']}` `{detail['mesh']}` decode16 (per step; conditional = "
                   "inside a sampler branch):", "",
                   md_table(["kind", "shape", "group", "per step", "conditional", "bytes / device each", "op_name"],
                            [[c["kind"], c["shape"], c["group_size"], c["count"], c["conditional_count"],
                              _b(c["bytes_per_device"]), c["op_name"][-70:]] for c in b["collectives"]]), ""]
    pp = record["pipeline"]
    md += ["## Pipeline parallelism (computed: stages are separate executables)", "",
           "The residual stream f[T, D] (bf16 on a GPU) crosses each of the pp-1 stage boundaries once per "
           "micro-batch; M = pp micro-batches per step; link time = bytes / bandwidth + M (pp-1) latency floors. "
           "Step time vs one device: decode is memory bound and each micro-batch re-reads its stage's weights; "
           "prefill is compute bound and splits evenly. These rows are the micro-batch schedule (a draft model, or "
           "pipelines inside data-parallel replicas); `PipelineEngine`'s virtual engines send each batch through "
           "once (one transfer per boundary, each stage's weights read once per batch) and leave no bubble while "
           "pp virtual engines have work.", "",
           md_table(["model", "pp", "bucket", "bytes / boundary / step", "bytes / token / boundary", "bubble",
                     "decode step vs 1 device", "prefill step vs 1 device", *(f"{lk} µs" for lk in links)],
                    [[r["model"], r["pp"], r["bucket"], _b(r["bytes_per_boundary_per_step"]),
                      _b(r["bytes_per_token_per_boundary"]), f"{r['bubble']:.0%}",
                      f"{r['decode_step_vs_one_device']:.2f}x",
                      f"{r['prefill_step_vs_one_device']:.2f}x", *(_us(t) for t in r["link_seconds"].values())]
                     for r in pp]), "",
           "Data parallelism: replicas exchange nothing per step (0 bytes); each holds the whole model.", "",
           "Interconnects assumed (per GPU, one direction; latency floors per collective are assumptions):", "",
           md_table(["link", "GB/s", "latency µs", "note"],
                    [[k, f"{v['bandwidth'] / 1e9:g}", f"{v['latency'] * 1e6:g}", v["note"]]
                     for k, v in INTERCONNECTS.items()]), "",
           "Reproduce:", "", f"    {record['command']}", "", machine_line(record["machine"]), ""]
    return "\n".join(md)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--targets", nargs="+", default=["cpu", "cuda"], choices=["cpu", "cuda"],
                    help="cuda needs the CUDA PJRT plugin in .venv/cuda-aot (scripts/setup.sh --test); skipped "
                         "if absent")
    ap.add_argument("--meshes", nargs="+", default=None,
                    help="mesh presets (default: configs/mesh/ tp presets plus each model's other accepted tp)")
    ap.add_argument("--dump-hlo", default=None, help="also write every compiled step's HLO text to this folder")
    ap.add_argument("--out", default=OUT_DIR)
    ap.add_argument("--name", default="collectives")


def run(args) -> dict:
    targets = {}
    for target in args.targets:
        if target == "cuda" and not os.path.isdir(os.path.join(CUDA_AOT_DIR, "jax_plugins")):
            print(f"[collectives] no CUDA PJRT plugin in {CUDA_AOT_DIR} (scripts/setup.sh --test): cuda skipped")
            continue
        targets[target] = run_child(target, args.models, args.meshes, args.dump_hlo)
    for recs in targets.values():
        for r in recs:
            if "buckets" in r:
                r["costs"] = costs(r)
    record = dict(command=command_line("bench.collectives"), machine=machine_info(), args=args_record(args),
                  engine=ENGINE, interconnects=INTERCONNECTS, h200=dict(hbm_bandwidth=H200_HBM_BANDWIDTH,
                                                                        bf16_flops=H200_BF16_FLOPS),
                  targets=targets, pipeline=[r for m in args.models for r in pipeline_rows(m)])
    md = report(record)
    print(md)
    paths = write_outputs(args.out, args.name, record, md)
    print("\n".join(f"wrote {p}" for p in paths))
    return record


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:
        p = argparse.ArgumentParser(prog="python -m bench.collectives", description=__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        add_args(p)
        run(p.parse_args())
