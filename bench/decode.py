"""Decode throughput: jaxserve vs HF transformers on SmolLM2-135M-Instruct (float32, CPU), plus a bandwidth roofline.

Both engines run in the same process, interleaved round by round. Each run: `batch` prompts of PROMPT_LEN fixed
random token ids, NEW_TOKENS greedy tokens each (EOS ignored); only decode (the steps after every sequence has its
first token) is timed. Roofline: one decode step streams every fp32 weight once (tied embeddings counted once), so
steps/s <= copy bandwidth / weight bytes.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/decode.py            # writes docs/benchmarks/decode.{json,md}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def copy_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Bytes/s of np.copyto between two preallocated float32 arrays (read + write counted)."""
    src = np.ones(mib * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # warm-up (page faults)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return 2 * src.nbytes / statistics.median(times)


def cpu_times() -> list[int]:
    """Aggregate /proc/stat jiffies: user nice system idle iowait irq softirq steal."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def git_rev() -> str:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "jaxserve"], cwd=root, capture_output=True, text=True)
        return rev.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "?"


def run_jaxserve(eng, prompts: np.ndarray, new_tokens: int, step_hook=None) -> dict:
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ids = [f"r{run_jaxserve.n}-{i}" for i in range(len(prompts))]
    run_jaxserve.n += 1
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, {"prompt_token_ids": p.tolist()}, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}

    def step():
        for out in eng.step():
            tokens[out.request_id] = out.outputs[0].token_ids

    t0 = time.perf_counter()
    while any(len(t) < 1 for t in tokens.values()):
        step()
    t1 = time.perf_counter()
    first = sum(len(t) for t in tokens.values())
    steps = 0
    while eng.has_unfinished_requests():
        step() if step_hook is None else step_hook(step)
        steps += 1
    t2 = time.perf_counter()
    decoded = sum(len(t) for t in tokens.values()) - first
    return dict(prefill_s=t1 - t0, decode_s=t2 - t1, decode_tokens=decoded, decode_steps=steps,
                tok_s=decoded / (t2 - t1), tokens=[tokens[r] for r in ids])


run_jaxserve.n = 0


def run_hf(model, prompts: np.ndarray, new_tokens: int) -> dict:
    import torch

    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=torch.from_numpy(prompts.astype(np.int64)), use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1)
        generated = [nxt]
        t1 = time.perf_counter()
        past = out.past_key_values
        for _ in range(new_tokens - 1):
            out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1)
            generated.append(nxt)
        t2 = time.perf_counter()
    decoded = len(prompts) * (new_tokens - 1)
    toks = torch.stack(generated, 1).tolist()
    return dict(prefill_s=t1 - t0, decode_s=t2 - t1, decode_tokens=decoded, decode_steps=new_tokens - 1,
                tok_s=decoded / (t2 - t1), tokens=toks)


def profile_steps(eng, prompts: np.ndarray, new_tokens: int) -> dict:
    """Per decode step, ms: whole step() vs runner.run, split into executable call (dispatch) and compute wait;
    `io` = the rest of run (host->device transfer, fetch), `host` = step - run (schedule, build, postprocess)."""
    import jax

    runner = eng.runner
    parts = {k: [] for k in ("step", "run", "dispatch", "wait")}
    run, executable = runner.run, runner.executable

    def timed_executable(bucket):
        exe = executable(bucket)

        def call(*args):
            t0 = time.perf_counter()
            out = exe(*args)
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            parts["dispatch"].append(t1 - t0)
            parts["wait"].append(time.perf_counter() - t1)
            return out

        return call

    def timed_run(*args):
        t0 = time.perf_counter()
        out = run(*args)
        parts["run"].append(time.perf_counter() - t0)
        return out

    def hook(step):
        t0 = time.perf_counter()
        step()
        parts["step"].append(time.perf_counter() - t0)

    runner.run, runner.executable = timed_run, timed_executable  # instance attributes shadow the methods
    try:
        run_jaxserve(eng, prompts, new_tokens, step_hook=hook)
    finally:
        del runner.run, runner.executable
    n = len(parts["step"])  # decode steps only: drop the prefill calls recorded before the hook starts
    a = {k: 1e3 * np.asarray(v[-n:]) for k, v in parts.items()}
    a["io"] = a["run"] - a["dispatch"] - a["wait"]
    a["host"] = a["step"] - a["run"]
    out = {f"{k}_ms": round(float(np.median(v)), 3) for k, v in a.items()}
    out["step_mean_ms"] = round(float(a["step"].mean()), 3)
    return out


def summary(xs: list[float]) -> dict:
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs), all=xs)


def fmt(s: dict, nd: int = 1) -> str:
    return f"{s['median']:.{nd}f} [{s['min']:.{nd}f}–{s['max']:.{nd}f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks"))
    ap.add_argument("--no-profile", action="store_true", help="skip the per-step host/device split")
    args = ap.parse_args()

    import jax
    import torch
    import transformers

    from hf_smollm2 import hf_smollm2_model
    from jaxserve import LLM

    torch.set_num_threads(2)
    load0, cpu0, own0 = os.getloadavg(), cpu_times(), os.times()
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(100, 40000, size=(max(args.batches), args.prompt_len), dtype=np.int64)

    llm = LLM(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=2048)
    eng = llm.llm_engine
    hf = hf_smollm2_model()
    weight_bytes = eng.model_config.num_params * 4

    for b in args.batches:  # warm-up: compile every bucket these runs touch (twice: the 2nd hits the prefix cache)
        for _ in range(2):
            run_jaxserve(eng, prompts[:b], args.new_tokens)
        run_hf(hf, prompts[:b], 8)
    compiles = eng.runner.num_compiles

    bw = [copy_bandwidth()]
    raw: dict[str, dict[int, list[dict]]] = {"jaxserve": {b: [] for b in args.batches}, "hf": {b: [] for b in args.batches}}
    for r in range(args.reps):
        for b in args.batches:
            for name in ("jaxserve", "hf"):
                res = run_jaxserve(eng, prompts[:b], args.new_tokens) if name == "jaxserve" else run_hf(hf, prompts[:b], args.new_tokens)
                raw[name][b].append(res)
                print(f"round {r} batch {b:2d} {name:8s}: decode {res['tok_s']:8.1f} tok/s  prefill {res['prefill_s']:.2f} s", flush=True)
        bw.append(copy_bandwidth())
        assert eng.runner.num_compiles == compiles, f"recompiled during timed runs ({compiles} -> {eng.runner.num_compiles})"
    print(f"num_compiles: {compiles} after warm-up, {eng.runner.num_compiles} after timed runs")

    bandwidth = summary(bw)
    roofline = bandwidth["median"] / weight_bytes  # decode steps/s (= batch-1 tok/s) if weight streaming is the bound
    results = {}
    for b in args.batches:
        j = summary([x["tok_s"] for x in raw["jaxserve"][b]])
        h = summary([x["tok_s"] for x in raw["hf"][b]])
        results[b] = dict(jaxserve_tok_s=j, hf_tok_s=h, speedup=j["median"] / h["median"],
                          jaxserve_steps_s=j["median"] / b, pct_roofline=100 * j["median"] / b / roofline,
                          jaxserve_prefill_s=summary([x["prefill_s"] for x in raw["jaxserve"][b]]),
                          hf_prefill_s=summary([x["prefill_s"] for x in raw["hf"][b]]))

    b0 = min(args.batches)  # greedy agreement on the first prompt
    ours, ref = raw["jaxserve"][b0][0]["tokens"][0], raw["hf"][b0][0]["tokens"][0]
    match = next((i for i, (a, c) in enumerate(zip(ours, ref)) if a != c), min(len(ours), len(ref)))
    print(f"batch-1 greedy tokens: jaxserve and HF agree on the first {match} of {len(ours)}")

    profile = None
    if not args.no_profile:
        profile = {b: profile_steps(eng, prompts[:b], args.new_tokens) for b in args.batches}
    load1, dcpu = os.getloadavg(), [b - a for a, b in zip(cpu0, cpu_times())]
    steal_pct = 100 * dcpu[7] / max(1, sum(dcpu))
    own1, hz = os.times(), os.sysconf("SC_CLK_TCK")
    busy_s = (sum(dcpu) - dcpu[3] - dcpu[4]) / hz  # all CPUs, excluding idle and iowait
    others_cores = (busy_s - (own1.user + own1.system - own0.user - own0.system)) / (own1.elapsed - own0.elapsed)

    rows = [("batch", "jaxserve decode tok/s", "HF decode tok/s", "jaxserve / HF", "jaxserve steps/s", "% of roofline")]
    for b, r in results.items():
        rows.append((str(b), fmt(r["jaxserve_tok_s"]), fmt(r["hf_tok_s"]), f"{r['speedup']:.2f}x",
                     f"{r['jaxserve_steps_s']:.1f}", f"{r['pct_roofline']:.0f}%"))
    table = "\n".join("| " + " | ".join(row) + " |" for row in rows[:1] + [tuple("---" for _ in rows[0])] + rows[1:])
    roof_line = (f"copy bandwidth {fmt({k: v / 1e9 for k, v in bandwidth.items() if k != 'all'}, 2)} GB/s, "
                 f"weights {weight_bytes / 1e6:.1f} MB/step -> roofline {roofline:.1f} steps/s")
    print("\n" + table + "\n\n" + roof_line)
    if profile:
        for b, p in profile.items():
            print(f"profile batch {b}: {p}")

    cmd = "HF_HUB_OFFLINE=1 .venv/bin/python bench/decode.py" + "".join(f" {a}" for a in sys.argv[1:])
    env = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), python=platform.python_version(),
               jax=jax.__version__, jaxlib=__import__("jaxlib").__version__, numpy=np.__version__, torch=torch.__version__,
               transformers=transformers.__version__, backend=jax.default_backend(), cpu_count=os.cpu_count(),
               cpu=next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
               loadavg_before=load0, loadavg_after=load1, cpu_steal_pct=steal_pct, other_processes_cores=others_cores,
               git=git_rev(), torch_threads=torch.get_num_threads())
    strip = lambda runs: [{k: v for k, v in x.items() if k != "tokens"} for x in runs]  # noqa: E731
    record = dict(command=cmd, env=env, args=vars(args), model="SmolLM2-135M-Instruct (GGUF, dequantized to float32)",
                  num_params=eng.model_config.num_params, weight_bytes=weight_bytes, copy_bandwidth_Bps=bandwidth,
                  roofline_steps_s=roofline, results=results, greedy_match_batch1=dict(matching_prefix=match, of=len(ours)),
                  num_compiles=dict(after_warmup=compiles, after_timed=eng.runner.num_compiles), profile_ms=profile,
                  runs={n: {b: strip(v) for b, v in d.items()} for n, d in raw.items()})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode.json"), "w") as f:
        json.dump(record, f, indent=2)
    md = [f"# Decode throughput: jaxserve vs HF transformers\n",
          f"SmolLM2-135M-Instruct, float32, CPU. Prompts of {args.prompt_len} random token ids, {args.new_tokens} greedy "
          f"tokens (EOS ignored); decode only (prefill excluded). {args.reps} interleaved rounds: median [min–max].\n",
          table, "", roof_line + ".", "",
          f"Batch-1 greedy tokens: jaxserve and HF agree on the first {match} of {len(ours)}.", ""]
    if profile:
        md += ["Per decode step (medians, ms; separate untimed run): `step` = whole `eng.step()`, `run` = `runner.run`, "
               "`dispatch` = executable call, `wait` = compute after dispatch, `io` = run - dispatch - wait (transfers), "
               "`host` = step - run (schedule, build inputs, postprocess).", "",
               "| batch | " + " | ".join(profile[args.batches[0]]) + " |", "|---" * (len(profile[args.batches[0]]) + 1) + "|"]
        md += [f"| {b} | " + " | ".join(f"{v:.2f}" for v in p.values()) + " |" for b, p in profile.items()]
        md.append("")
    md += ["Reproduce:", "", f"    {cmd}", "",
           f"Machine: {env['cpu']}, {env['cpu_count']} CPUs; load average before/after {load0[0]:.2f}/{load1[0]:.2f}, "
           f"CPU steal {steal_pct:.1f}%, other processes used "
           f"{others_cores:.2f} cores on average during the run. jaxserve at {env['git']}. "
           f"Python {env['python']}, jax {env['jax']}, jaxlib {env['jaxlib']}, numpy {env['numpy']}, torch {env['torch']} "
           f"({env['torch_threads']} threads), transformers {env['transformers']}. {env['date']}.", ""]
    with open(os.path.join(args.out, "decode.md"), "w") as f:
        f.write("\n".join(md))


if __name__ == "__main__":
    main()
