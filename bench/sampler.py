"""Sampler cost per step on one device: `jaxserve.sampler.sample` alone, jitted, on a padded batch of random logits
(16 rows x V = 49152, the default model's vocabulary), per sampling mix, this checkout side by side with a baseline
checkout (another git worktree) in the same run, and the seconds each side takes to compile the sampler and its
speculative-verify variant (no compilation cache).

Issue 20: with any row using top-p / top-k, the sorted truncation sorted every row of the batch over the vocabulary
twice; the threshold search replaces it. Each checkout runs in its own fresh process, alternating rounds:

    git worktree add --detach /tmp/base 31914ad   # the sampler before the threshold search
    .venv/bin/python -m bench.sampler --baseline /tmp/base   # -> docs/benchmarks/sampler.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.common import OUT_DIR, args_record, command_line, machine_info, machine_line, md_table, write_outputs

# name -> per-row settings (numpy broadcasting over the rows); "one row" mixes set row 0 only
MIXES = {
    "greedy": {},
    "temperature 1": dict(temperature=1.0),
    "top_p 0.9": dict(temperature=1.0, top_p=0.9),
    "top_k 50": dict(temperature=1.0, top_k=50),
    "top_k 50 + top_p 0.9": dict(temperature=1.0, top_k=50, top_p=0.9),
    "min_p 0.05": dict(temperature=1.0, min_p=0.05),
    "greedy, one row top_p 0.9": dict(temperature=[1.0], top_p=[0.9]),
    "greedy + logprobs 20": dict(wants_logprobs=True),
    "verify, temperature 1": dict(verify=True, temperature=1.0),
}

_WORKER = r"""
import functools, json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from jaxserve.sampler import SamplingInputs, sample
rows, vocab, calls, mixes = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
logits = jnp.asarray(np.random.default_rng(0).normal(size=(rows, vocab)).astype(np.float32) * 4)
drafts = jnp.asarray(np.random.default_rng(1).integers(0, vocab, rows), jnp.int32)
steps = {False: functools.partial(sample, max_logprobs=20),
         True: functools.partial(sample, max_logprobs=20, draft_ids=drafts)}  # a speculative verify step
out, compile_s = {}, {}
for name, settings in mixes.items():
    a = SamplingInputs.neutral(rows, 64)
    a.seeds[:] = np.arange(rows, dtype=np.uint32) * 7919 + 1
    for field, v in settings.items():
        if field != "verify":
            v = np.asarray(v)
            getattr(a, field)[: v.size if v.ndim else rows] = v
    s = jax.tree.map(jnp.asarray, a)
    verify = bool(settings.get("verify"))
    if verify not in compile_s:  # one executable for every mix of its kind: compiled (no cache) by the first
        lowered = jax.jit(steps[verify]).lower(logits, s)
        t = time.perf_counter()
        steps[verify] = lowered.compile()
        compile_s[verify] = time.perf_counter() - t
    step = steps[verify]
    jax.block_until_ready(step(logits, s))
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(step(logits, s))
        times.append(time.perf_counter() - t)
    out[name] = dict(median_ms=statistics.median(times) * 1e3, min_ms=min(times) * 1e3)
out["compile"] = {"sample_s": compile_s[False], "verify_s": compile_s[True]}
print(json.dumps(out))
"""


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--baseline", help="path of a baseline checkout (git worktree) to run side by side")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--calls", type=int, default=20, help="timed calls per mix, per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out-dir", default=OUT_DIR)


def _worker(root: str, args) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-c", _WORKER, root, str(args.rows), str(args.vocab), str(args.calls), json.dumps(MIXES)]
    return json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def run(args) -> None:
    roots = {"this checkout": os.getcwd()} | ({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})
    results: dict[str, list[dict]] = {name: [] for name in roots}
    for r in range(args.rounds):
        for name, root in roots.items():
            results[name].append(_worker(root, args))
            print(f"round {r} {name}: " + ", ".join(f"{m} {results[name][-1][m]['median_ms']:.1f} ms"
                                                    for m in MIXES), flush=True)
    best = {name: {m: min(rnd[m]["median_ms"] for rnd in rounds) for m in MIXES} for name, rounds in results.items()}
    header = ["mix"] + [f"{name} (ms)" for name in roots] + (["speed-up"] if args.baseline else [])
    rows = []
    for m in MIXES:
        row = [m] + [f"{best[name][m]:.1f}" for name in roots]
        if args.baseline:
            row.append(f"{best['baseline'][m] / best['this checkout'][m]:.1f}x")
        rows.append(row)
    compile_s = {name: {k: min(rnd["compile"][k] for rnd in rounds) for k in ("sample_s", "verify_s")}
                 for name, rounds in results.items()}
    for k, label in (("sample_s", "compile: sample (s)"), ("verify_s", "compile: verify (s)")):
        row = [label] + [f"{compile_s[name][k]:.2f}" for name in roots]
        if args.baseline:
            row.append(f"{compile_s['baseline'][k] / compile_s['this checkout'][k]:.1f}x")
        rows.append(row)
    meta = machine_info()
    md = "\n\n".join([
        f"# sampler: one jitted `sample` call, {args.rows} rows x V={args.vocab}, max_logprobs=20",
        f"`{command_line('bench.sampler')}`",
        md_table(header, rows),
        "Milliseconds per call on one CPU device: the median of the calls in a round, best of the rounds, each "
        "checkout in a fresh process (one compile serves every mix). Rows are all set as the mix says, except "
        "'one row': row 0 samples with top_p 0.9, the other 15 are greedy (the padded batch of issue 20). "
        "'verify' is a speculative verify step (a random draft token per row, `draft_ids`), its own executable. "
        "Compile rows: seconds to compile each executable from its lowered form (no compilation cache), best of "
        "the rounds. " + machine_line(meta),
    ])
    print(md)
    write_outputs(args.out_dir, "sampler", {"args": args_record(args), "mixes": MIXES, "ms": results,
                                            "best_median_ms": best, "machine": meta}, md)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    run(ap.parse_args())
