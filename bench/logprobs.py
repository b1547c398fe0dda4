"""Per-step output cost of logprobs: n sequences x many tokens with and without `logprobs`, this checkout side by
side with a baseline checkout (another git worktree) in the same run.

Each step hands back cumulative RequestOutputs; building them must cost what the step's new tokens cost, not what
the whole output so far costs. Run one worker per (checkout, logprobs) pair in a fresh process, alternating:

    git worktree add /tmp/base <commit>   # e.g. the commit before the incremental-logprobs change (8f6af02)
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.logprobs --baseline /tmp/base   # docs/benchmarks/logprobs.{json,md}

Default model: a tiny random Llama (vocab 300) so the model step is cheap and the host-side output work shows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.common import OUT_DIR, args_record, command_line, machine_info, machine_line, md_table, write_outputs

_WORKER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(1, os.path.join(os.environ["JAXSERVE_ROOT"], "tests"))
from jaxserve import LLM, SamplingParams
from tiny_models import make_tiny_model
n, max_tokens, lp, model = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
if not os.path.exists(os.path.join(model, "config.json")):
    make_tiny_model("llama_gqa", model)
llm = LLM(model, max_num_seqs=n, max_num_batched_tokens=64, page_size=16, max_model_len=max_tokens + 64,
          precompile=False)
p = SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=max_tokens, ignore_eos=True,
                   logprobs=None if lp == "none" else int(lp))
llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=4), use_tqdm=False)  # compile
t = time.perf_counter()
out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, p, use_tqdm=False)
print(json.dumps({"seconds": time.perf_counter() - t, "tokens": sum(len(c.token_ids) for c in out[0].outputs)}))
"""


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--baseline", help="path of a baseline checkout (git worktree) to run side by side")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=500)
    ap.add_argument("--logprobs", type=int, default=20)
    ap.add_argument("--model", default="/tmp/jaxserve-bench-tiny", help="checkpoint dir (made if missing: tiny)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out-dir", default=OUT_DIR)


def _worker(root: str, args, lp: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXSERVE_ROOT=os.getcwd())
    cmd = [sys.executable, "-c", _WORKER, root, str(args.n), str(args.max_tokens), lp, args.model]
    return json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def run(args) -> None:
    roots = {"this checkout": os.getcwd()} | ({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})
    results: dict[str, dict[str, list[float]]] = {k: {"none": [], str(args.logprobs): []} for k in roots}
    for r in range(args.rounds):
        for name, root in (roots.items() if r % 2 == 0 else reversed(list(roots.items()))):
            for lp in results[name]:
                res = _worker(root, args, lp)
                results[name][lp].append(res["seconds"])
                print(f"round {r + 1} {name:14s} logprobs={lp:4s} {res['seconds']:7.2f} s ({res['tokens']} tokens)",
                      flush=True)
    rows = []
    for name, by_lp in results.items():
        plain, with_lp = min(by_lp["none"]), min(by_lp[str(args.logprobs)])
        rows.append([name, f"{plain:.2f}", f"{with_lp:.2f}", f"{with_lp / plain:.2f}x"])
    meta = machine_info()
    md = "\n\n".join([
        f"# logprobs output cost: n={args.n} x {args.max_tokens} tokens, logprobs={args.logprobs}",
        f"`{command_line('bench.logprobs')}`",
        md_table(["checkout", "no logprobs (s)", f"logprobs={args.logprobs} (s)", "ratio"], rows),
        "Best of the rounds, each in a fresh process after one warm-up request. " + machine_line(meta),
    ])
    print(md)
    write_outputs(args.out_dir, "logprobs", {"args": args_record(args), "seconds": results, "machine": meta}, md)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    run(ap.parse_args())
