"""Same-run A/B of the engine's speed: this checkout against a baseline checkout (another git worktree), on the
default model, single stream and batch 16 (greedy unless `--sampling` says otherwise).

For refactors that must not change speed: each (checkout, batch) pair runs in a fresh process, alternating
checkouts round by round so drift on a shared machine hits both alike; every run warms up on the same requests
twice first (the second time behind a prefix-cache hit, as the timed run), then times `LLM.generate` of `batch`
prompts of 64 fixed random token ids x 128 greedy tokens (EOS ignored) end to end (prefill included: both
checkouts do identical work). Only the public API is used, so any checkout runs.

    git worktree add /tmp/base <commit before the change>
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.ab --baseline /tmp/base   # docs/benchmarks/ab.{json,md}

An engine setting A/B in one checkout: `--baseline .` with `--engine-args` / `--baseline-engine-args`, JSON keyword
arguments of `LLM`, e.g. `--baseline . --baseline-engine-args '{"async_scheduling": false}' --name ab_async`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench.common import OUT_DIR, args_record, command_line, machine_info, machine_line, md_table, write_outputs

_WORKER = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from jaxserve import LLM, SamplingParams
batch, new_tokens, prompt_len = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(None, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=512, precompile=False,
          **json.loads(sys.argv[5]))
rng = np.random.default_rng(0)
prompts = [{"prompt_token_ids": rng.integers(100, 20000, prompt_len).tolist()} for _ in range(batch)]
params = SamplingParams(**({"temperature": 0} | json.loads(sys.argv[6])), max_tokens=new_tokens, ignore_eos=True)
# Compile every shape the timed run uses: the first call its cold prefill, the second the prefill of the same prompt
# behind a prefix-cache hit (a smaller bucket), as the timed run has (left out, that compile was ~0.8 s of a ~1 s
# batch-1 run).
for _ in range(2):
    llm.generate(prompts, params, use_tqdm=False)
t = time.perf_counter()
out = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in out),
                  "first": out[0].outputs[0].token_ids[:16]}))
"""


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--baseline", required=True, help="path of the baseline checkout (git worktree)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engine-args", type=json.loads, default={}, help="JSON keyword arguments of LLM, this side")
    ap.add_argument("--baseline-engine-args", type=json.loads, default={}, help="the same, baseline side")
    ap.add_argument("--sampling", type=json.loads, default={},
                    help='JSON keyword arguments of SamplingParams, both sides (default greedy), e.g. '
                         '\'{"temperature": 0.7, "top_p": 0.9, "seed": 0}\'')
    ap.add_argument("--out-dir", default=OUT_DIR)
    ap.add_argument("--name", default="ab")


def _worker(root: str, args, batch: int, engine_args: dict) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-c", _WORKER, root, str(batch), str(args.new_tokens), str(args.prompt_len),
           json.dumps(engine_args), json.dumps(args.sampling)]
    done = subprocess.run(cmd, env=env, cwd=root, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])


def run(args) -> None:
    roots = {"this checkout": os.getcwd(), "baseline": os.path.abspath(args.baseline)}
    engine_args = {"this checkout": args.engine_args, "baseline": args.baseline_engine_args}
    tok_s: dict[str, dict[int, list[float]]] = {k: {b: [] for b in args.batches} for k in roots}
    first: dict[str, dict[int, list[int]]] = {k: {} for k in roots}
    for r in range(args.rounds):
        order = list(roots.items()) if r % 2 == 0 else list(reversed(roots.items()))
        for batch in args.batches:
            for name, root in order:
                res = _worker(root, args, batch, engine_args[name])
                tok_s[name][batch].append(res["tokens"] / res["seconds"])
                first[name][batch] = res["first"]
                print(f"round {r + 1} batch {batch:3d} {name:14s} {tok_s[name][batch][-1]:8.1f} tok/s", flush=True)
    rows = []
    for batch in args.batches:
        new, base = (statistics.median(tok_s[k][batch]) for k in roots)
        spread = {k: f"{min(tok_s[k][batch]):.1f}–{max(tok_s[k][batch]):.1f}" for k in roots}
        same = first["this checkout"][batch] == first["baseline"][batch]
        rows.append([batch, f"{new:.1f} [{spread['this checkout']}]", f"{base:.1f} [{spread['baseline']}]",
                     f"{new / base:.3f}x", "yes" if same else "NO"])
    meta = machine_info()
    tokens = f"tokens sampled with {json.dumps(args.sampling)}" if args.sampling else "greedy tokens"
    md = "\n\n".join([
        f"# Same-run A/B: this checkout vs baseline ({os.path.basename(roots['baseline'])})",
        f"`{command_line('bench.ab')}`",
        *([f"Engine arguments: this checkout {json.dumps(args.engine_args)}, baseline "
           f"{json.dumps(args.baseline_engine_args)}."] if args.engine_args or args.baseline_engine_args else []),
        md_table(["batch", "this checkout tok/s", "baseline tok/s", "ratio", "same tokens"], rows),
        f"SmolLM2-135M-Instruct (default model), {args.prompt_len}-token prompts, {args.new_tokens} {tokens} each "
        f"(EOS ignored), end to end after two warm-up runs of the same requests; median [min–max] of {args.rounds} "
        "rounds, each run a fresh process, checkouts alternating. " + machine_line(meta),
    ])
    print(md)
    record = {"args": args_record(args), "tok_s": {k: {str(b): v for b, v in d.items()} for k, d in tok_s.items()},
              "machine": meta}
    write_outputs(args.out_dir, args.name, record, md)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    run(ap.parse_args())
