"""Pipeline parallelism on CPU: the default model over 2 simulated CPU devices as 2 pipeline stages, three ways, in
one process and interleaved rounds:

- `single`: one device, no pipeline (the reference the outputs must equal);
- `pp2 micro-batches`: `LLMEngine` alone, each step split into 2 micro-batches that overlap within the step, the
  pipeline drained at every step's end;
- `pp2 virtual engines`: `PipelineEngine`, 2 virtual engines with a step each in flight across steps.

Every engine generates the same batch (random 64-token prompts, greedy, EOS ignored) after a warm-up pass that
compiles its shapes; output tok/s is the median over rounds. The simulated devices share this machine's cores
(XLA's CPU client runs each device's work on the same thread pool), so the single device is no target here: the
comparison is how much of the pipeline's idle time each pp2 schedule recovers.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.pipeline      # docs/benchmarks/pipeline.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.common import OUT_DIR, ROOT, args_record, command_line, machine_info, machine_line, md_table, write_outputs

_WORKER = r"""
import json, statistics, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import jax
from jaxserve import SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.pipeline_engine import PipelineEngine

batch, new_tokens, prompt_len, rounds = (int(a) for a in sys.argv[2:6])
assert len(jax.devices()) == 2
base = dict(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256, precompile=False)
engines = {
    "single": LLMEngine(None, EngineConfig(**base)),
    "pp2 micro-batches": LLMEngine(None, EngineConfig(**base, mesh="pp2")),
    "pp2 virtual engines": PipelineEngine(None, EngineConfig(**base, mesh="pp2")),
}
rng = np.random.default_rng(0)
prompts = [{"prompt_token_ids": rng.integers(100, 20000, prompt_len).tolist()} for _ in range(batch)]
params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)


def generate(eng, tag):
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", p, params)
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        steps += 1
    return [done[f"{tag}-{i}"] for i in range(len(prompts))], steps


seconds = {name: [] for name in engines}
tokens, steps = {}, {}
for name, eng in engines.items():
    tokens[name], steps[name] = generate(eng, "warmup")
for r in range(rounds):
    for name, eng in engines.items():
        t = time.perf_counter()
        generate(eng, f"r{r}")
        seconds[name].append(time.perf_counter() - t)
print(json.dumps({"seconds": seconds, "same_tokens": {n: tokens[n] == tokens["single"] for n in engines},
                  "engine_steps": steps, "output_tokens": batch * new_tokens}))
"""


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out-dir", default=OUT_DIR)
    ap.add_argument("--name", default="pipeline")


def run(args) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    cmd = [sys.executable, "-c", _WORKER, ROOT, str(args.batch), str(args.new_tokens), str(args.prompt_len),
           str(args.rounds)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True)
    res = json.loads(done.stdout.splitlines()[-1])
    summary = {}
    for name, secs in res["seconds"].items():
        med = sorted(secs)[len(secs) // 2]
        summary[name] = dict(median_seconds=med, tok_s=res["output_tokens"] / med, all_seconds=secs,
                             engine_steps=res["engine_steps"][name], same_tokens_as_single=res["same_tokens"][name])
    ref = summary["pp2 micro-batches"]["tok_s"]
    record = dict(command=command_line("bench.pipeline"), machine=machine_info(), args=args_record(args),
                  results=summary, virtual_over_microbatches=summary["pp2 virtual engines"]["tok_s"] / ref,
                  virtual_over_single=summary["pp2 virtual engines"]["tok_s"] / summary["single"]["tok_s"])
    md = report(record)
    print(md)
    for p in write_outputs(args.out_dir, args.name, record, md):
        print(f"wrote {p}")
    return record


def report(record: dict) -> str:
    a = record["args"]
    rows = [[name, f"{r['tok_s']:.1f}", f"{r['median_seconds']:.2f}", " / ".join(f"{x:.2f}" for x in r["all_seconds"]),
             r["engine_steps"], "yes" if r["same_tokens_as_single"] else "NO"] for name, r in record["results"].items()]
    return "\n".join([
        "# Pipeline parallelism on 2 simulated CPU devices: micro-batches within a step vs virtual engines", "",
        f"SmolLM2-135M-Instruct (30 layers, 15 per stage), {a['batch']} prompts of {a['prompt_len']} random tokens x "
        f"{a['new_tokens']} greedy tokens (EOS ignored), warm-up pass first, {a['rounds']} interleaved rounds.", "",
        md_table(["engine", "output tok/s (median)", "median s", "each round s", "engine steps per batch",
                  "tokens equal single"], rows), "",
        f"Virtual engines / micro-batches: **{record['virtual_over_microbatches']:.2f}x**; virtual engines / one "
        f"device: {record['virtual_over_single']:.2f}x. Both pp2 engines give the single device's tokens. The "
        "micro-batch schedule drains the pipeline at every step's end and re-reads each stage's weights per "
        "micro-batch; the virtual engines keep a batch in each stage and, while one virtual engine's step runs, "
        "the host settles the other's outputs and builds its next step (the engine takes twice the steps, each "
        "half the batch). The two devices are simulated on the same 2 CPU cores, so this measures scheduling, "
        "not what a second GPU adds.", "",
        "Reproduce:", "", f"    {record['command']}", "", machine_line(record["machine"]), ""])


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    run(p.parse_args())
