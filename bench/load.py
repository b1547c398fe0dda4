"""Host memory of loading the default model: peak RSS and time of reading the checkpoint into the weights as stored,
this checkout against a baseline checkout (another git worktree), per storage scheme.

Each (checkout, scheme) loads in a fresh process: `load_checkpoint` + `to_weights` (the factory's load, before the
weights go to a device); the peak RSS is `ru_maxrss` less the RSS after imports, so it is what the load itself
held at its worst. "float32 model" is the model's size in float32, what a load that widens the whole checkpoint to
float32 holds at least; "stored" is the weights as the engine keeps them.

    git worktree add /tmp/base <commit before the change>
    .venv/bin/python -m bench load --baseline /tmp/base    # docs/benchmarks/load_memory.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.common import OUT_DIR, args_record, command_line, machine_info, machine_line, md_table, write_outputs

# (label, dtype, quantization): float32 on the CPU, the GPU's bf16, two of the quantized schemes
SCHEMES = {
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "int8": ("float32", "int8"),
    "gguf": ("float32", "gguf"),
}

_WORKER = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
import jax
import jax.numpy as jnp
from jaxserve.loader import load_checkpoint
from jaxserve.loader.weights import to_weights

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

base = rss()
t = time.perf_counter()
ck = load_checkpoint(None, sys.argv[3])
w = to_weights(ck.config, ck.tensors, jnp.dtype(sys.argv[2]), ck.path, ck.quantization)
seconds = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
c = ck.config
stored = sum(a.nbytes for a in jax.tree.leaves(w))
D, V, F, L = c.hidden_size, c.vocab_size, c.intermediate_size, c.num_layers
n = V * D * (1 if c.tie_word_embeddings else 2) + D + L * (2 * D + D * c.num_heads * c.head_dim * 2
    + 2 * D * c.num_kv_heads * c.head_dim + 3 * D * F)
print(json.dumps({"seconds": seconds, "peak": peak - base, "stored": stored, "float32_model": 4 * n}))
"""


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--baseline", required=True, help="path of the baseline checkout (git worktree)")
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    ap.add_argument("--out-dir", default=OUT_DIR)
    ap.add_argument("--name", default="load_memory")


def _worker(root: str, scheme: str) -> dict:
    dtype, quantization = SCHEMES[scheme]
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _WORKER, root, dtype, quantization], env=env, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"load worker failed in {root} ({scheme}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args) -> None:
    roots = {"this checkout": os.getcwd(), "baseline": os.path.abspath(args.baseline)}
    results: dict[str, dict[str, dict]] = {k: {} for k in roots}
    for scheme in args.schemes:
        for name, root in roots.items():
            r = results[name][scheme] = _worker(root, scheme)
            print(f"{scheme:9s} {name:14s} peak {r['peak'] / 2**20:7.0f} MiB  stored {r['stored'] / 2**20:6.0f} MiB"
                  f"  {r['seconds']:5.1f} s", flush=True)
    mib = 2**20
    rows = []
    for scheme in args.schemes:
        this, base = results["this checkout"][scheme], results["baseline"][scheme]
        rows.append([scheme, f"{this['stored'] / mib:.0f}", f"{this['float32_model'] / mib:.0f}",
                     f"{base['peak'] / mib:.0f}", f"{this['peak'] / mib:.0f}",
                     f"{this['peak'] / this['stored']:.2f}", f"{base['seconds']:.1f}", f"{this['seconds']:.1f}"])
    table = md_table(["scheme", "stored MiB", "float32 model MiB", "baseline peak MiB", "peak MiB",
                      "peak / stored", "baseline s", "s"], rows)
    meta = machine_info()
    md = (f"# Host memory of loading the default model (SmolLM2-135M, Q4_1 GGUF)\n\n{machine_line(meta)}\n\n"
          f"`{command_line('bench.load')}`; baseline: `{args.baseline}`\n\n{table}\n\n"
          "Peak: the most resident memory the load added (ru_maxrss less the RSS after imports). A load that streams "
          "the checkpoint holds about the weights as stored plus one tensor; one that widens the whole model to "
          "float32 first holds at least the float32 model.\n")
    paths = write_outputs(args.out_dir, args.name, {"args": args_record(args), "machine": meta,
                                                    "results": results}, md)
    print(md)
    print("wrote", *paths)
