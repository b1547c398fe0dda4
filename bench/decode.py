"""Decode throughput: jaxserve vs HF transformers on SmolLM2-135M-Instruct (float32, CPU), with a bandwidth roofline.

Both engines run in one process, interleaved round by round. A run: `batch` prompts of fixed random token ids,
greedy, EOS ignored; only decode (the steps after every sequence has its first token) is timed. Roofline: a decode
step streams every fp32 weight once (tied embeddings counted once), so steps/s <= copy bandwidth / weight bytes.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/decode.py      # writes docs/benchmarks/decode.{json,md}
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
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))


def copy_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Bytes/s of np.copyto between preallocated float32 arrays (read + write), median of `reps` after a warm-up."""
    src = np.ones(mib * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return 2 * src.nbytes / statistics.median(times)


def cpu_jiffies() -> list[int]:
    """/proc/stat totals: user nice system idle iowait irq softirq steal."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def git_rev() -> str:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "jaxserve") else "")


def result(prefill_s: float, step_s: list[float], decoded: int, batch: int, tokens: list[list[int]]) -> dict:
    decode_s = sum(step_s)
    return dict(prefill_s=prefill_s, decode_s=decode_s, decode_tokens=decoded, decode_steps=len(step_s),
                tok_s=decoded / decode_s, median_step_ms=1e3 * statistics.median(step_s),
                tok_s_median_step=batch / statistics.median(step_s), tokens=tokens)


def run_jaxserve(eng, prompts: np.ndarray, new_tokens: int, step=None) -> dict:
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    run_jaxserve.n = getattr(run_jaxserve, "n", 0) + 1
    ids = [f"r{run_jaxserve.n}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, {"prompt_token_ids": p.tolist()}, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}

    def engine_step():
        for out in eng.step():
            tokens[out.request_id] = out.outputs[0].token_ids

    step = step or (lambda f: f())
    t0 = time.perf_counter()
    while any(not t for t in tokens.values()):  # prefill: until every prompt has its first token
        engine_step()
    prefill_s, first = time.perf_counter() - t0, sum(map(len, tokens.values()))
    step_s = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        step(engine_step)
        step_s.append(time.perf_counter() - t0)
    decoded = sum(map(len, tokens.values())) - first
    return result(prefill_s, step_s, decoded, len(prompts), [tokens[r] for r in ids])


def run_hf(model, prompts: np.ndarray, new_tokens: int) -> dict:
    import torch

    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=torch.from_numpy(prompts), use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1)
        generated, prefill_s, step_s = [nxt], time.perf_counter() - t0, []
        for _ in range(new_tokens - 1):
            t0 = time.perf_counter()
            out = model(input_ids=nxt[:, None], past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1)
            generated.append(nxt)
            step_s.append(time.perf_counter() - t0)
    return result(prefill_s, step_s, len(prompts) * (new_tokens - 1), len(prompts), torch.stack(generated, 1).tolist())


def profile_steps(eng, prompts: np.ndarray, new_tokens: int) -> dict:
    """Median ms per decode step: all of step(), runner.run, and the compiled executable (call + wait for result)."""
    import jax

    runner, parts = eng.runner, {"step": [], "run": [], "exe": []}
    run, executable = runner.run, runner.executable

    def timed(name, f):
        def call(*args):
            t0 = time.perf_counter()
            out = jax.block_until_ready(f(*args))
            parts[name].append(time.perf_counter() - t0)
            return out

        return call

    runner.run = timed("run", run)  # instance attributes shadow the methods
    runner.executable = lambda *key: timed("exe", executable(*key))
    try:
        run_jaxserve(eng, prompts, new_tokens, step=lambda f: timed("step", f)())
    finally:
        del runner.run, runner.executable
    n = len(parts["step"])  # keep the decode steps (drop the prefill calls)
    a = {k: 1e3 * np.asarray(v[-n:]) for k, v in parts.items()}
    a["io"] = a["run"] - a["exe"]  # host->device transfer and fetch of the results
    a["host"] = a["step"] - a["run"]  # schedule, build inputs, postprocess
    return {**{k: round(float(np.median(v)), 3) for k, v in a.items()}, "step_mean": round(float(a["step"].mean()), 3)}


def stats(xs: list[float]) -> dict:
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
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks"))
    ap.add_argument("--no-profile", action="store_true", help="skip the per-step host/device split")
    args = ap.parse_args()

    import jax
    import torch
    import transformers
    from hf_smollm2 import hf_smollm2_model

    from jaxserve import LLM

    torch.set_num_threads(2)
    load0, cpu0, own0 = os.getloadavg(), cpu_jiffies(), os.times()
    prompts = np.random.default_rng(args.seed).integers(100, 40000, (max(args.batches), args.prompt_len), np.int64)
    eng = LLM(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=2048).llm_engine
    hf = hf_smollm2_model()
    weight_bytes = eng.model_config.num_params * 4

    for b in args.batches:  # warm-up; twice for jaxserve, as the second run's prefill hits the prefix cache
        for _ in range(2):
            run_jaxserve(eng, prompts[:b], args.new_tokens)
        run_hf(hf, prompts[:b], 8)
    compiles = eng.runner.num_compiles

    bw, raw = [copy_bandwidth()], {n: {b: [] for b in args.batches} for n in ("jaxserve", "hf")}
    for r in range(args.reps):
        for b in args.batches:
            for name in raw:
                res = run_jaxserve(eng, prompts[:b], args.new_tokens) if name == "jaxserve" else run_hf(
                    hf, prompts[:b], args.new_tokens)
                raw[name][b].append(res)
                print(f"round {r} batch {b:2d} {name:8s}: decode {res['tok_s']:7.1f} tok/s (median step "
                      f"{res['median_step_ms']:6.2f} ms), prefill {res['prefill_s']:.2f} s", flush=True)
        bw.append(copy_bandwidth())
        assert eng.runner.num_compiles == compiles, f"recompiled in timed runs: {compiles} -> {eng.runner.num_compiles}"
    print(f"num_compiles: {compiles} after warm-up, {eng.runner.num_compiles} after the timed runs")

    bandwidth = stats(bw)
    roofline = bandwidth["median"] / weight_bytes  # decode steps/s if streaming the weights were the only cost
    results = {}
    for b in args.batches:
        j, h = ({k: stats([x[k] for x in raw[n][b]]) for k in ("tok_s", "tok_s_median_step", "prefill_s")} for n in raw)
        results[b] = dict(jaxserve=j, hf=h, speedup=j["tok_s"]["median"] / h["tok_s"]["median"],
                          speedup_median_step=j["tok_s_median_step"]["median"] / h["tok_s_median_step"]["median"],
                          jaxserve_steps_s=j["tok_s"]["median"] / b, pct_roofline=100 * j["tok_s"]["median"] / b / roofline)
    b0 = min(args.batches)
    ours, ref = raw["jaxserve"][b0][0]["tokens"][0], raw["hf"][b0][0]["tokens"][0]
    match = next((i for i, (x, y) in enumerate(zip(ours, ref)) if x != y), min(len(ours), len(ref)))
    profile = None if args.no_profile else {b: profile_steps(eng, prompts[:b], args.new_tokens) for b in args.batches}

    load1, dcpu, own1 = os.getloadavg(), [y - x for x, y in zip(cpu0, cpu_jiffies())], os.times()
    busy_s = (sum(dcpu) - dcpu[3] - dcpu[4]) / os.sysconf("SC_CLK_TCK")
    others = (busy_s - (own1.user + own1.system - own0.user - own0.system)) / (own1.elapsed - own0.elapsed)

    cmd = "HF_HUB_OFFLINE=1 .venv/bin/python bench/decode.py" + "".join(f" {a}" for a in sys.argv[1:])
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    env = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), git=git_rev(),
               python=platform.python_version(), jax=jax.__version__, jaxlib=__import__("jaxlib").__version__,
               numpy=np.__version__, torch=torch.__version__, transformers=transformers.__version__,
               backend=jax.default_backend(), cpu=cpu, cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
               loadavg_before=load0, loadavg_after=load1, steal_pct=100 * dcpu[7] / max(1, sum(dcpu)),
               other_processes_cores=others)
    runs = {n: {b: [{k: v for k, v in x.items() if k != "tokens"} for x in xs] for b, xs in d.items()} for n, d in raw.items()}
    record = dict(command=cmd, env=env, args=vars(args), model="SmolLM2-135M-Instruct (bundled GGUF -> float32)",
                  num_params=eng.model_config.num_params, weight_bytes=weight_bytes, copy_bandwidth_Bps=bandwidth,
                  roofline_steps_s=roofline, results=results, greedy_match=dict(batch=b0, prefix=match, of=len(ours)),
                  num_compiles=dict(after_warmup=compiles, after_timed=eng.runner.num_compiles),
                  profile_ms=profile, runs=runs)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode.json"), "w") as f:
        json.dump(record, f, indent=2)
    md = report(record)
    with open(os.path.join(args.out, "decode.md"), "w") as f:
        f.write(md)
    print("\n" + md)


def report(rec: dict) -> str:
    a, env, prof = rec["args"], rec["env"], rec["profile_ms"]
    head = ("batch", "jaxserve decode tok/s", "HF decode tok/s", "jaxserve / HF", "jaxserve steps/s", "% of roofline",
            "tok/s from median step: jaxserve / HF (ratio)")
    rows = [head, ("---",) * len(head)]
    for b, r in rec["results"].items():
        js, hs = r["jaxserve"]["tok_s_median_step"]["median"], r["hf"]["tok_s_median_step"]["median"]
        rows.append((str(b), fmt(r["jaxserve"]["tok_s"]), fmt(r["hf"]["tok_s"]), f"{r['speedup']:.2f}x",
                     f"{r['jaxserve_steps_s']:.1f}", f"{r['pct_roofline']:.0f}%",
                     f"{js:.1f} / {hs:.1f} ({r['speedup_median_step']:.2f}x)"))
    bw, g = {k: v / 1e9 for k, v in rec["copy_bandwidth_Bps"].items() if k != "all"}, rec["greedy_match"]
    md = ["# Decode throughput: jaxserve vs HF transformers", "",
          f"SmolLM2-135M-Instruct, float32, CPU. Batches of prompts of {a['prompt_len']} random token ids, "
          f"{a['new_tokens']} greedy tokens each (EOS ignored). Decode only: timing starts once every sequence has its "
          f"first token. {a['reps']} interleaved rounds, median [min–max]. tok/s = decode tokens / decode wall time; "
          "the last column uses the median step time instead (less sensitive to bursts of CPU contention).", "",
          *("| " + " | ".join(row) + " |" for row in rows), "",
          f"Copy bandwidth {fmt(bw, 2)} GB/s (read + write); weights {rec['weight_bytes'] / 1e6:.1f} MB per decode "
          f"step -> roofline {rec['roofline_steps_s']:.1f} steps/s ({1e3 / rec['roofline_steps_s']:.1f} ms/step).", "",
          f"Batch-{g['batch']} greedy tokens, first prompt: jaxserve and HF agree on the first {g['prefix']} of {g['of']}.",
          ""]
    if prof:
        keys = list(next(iter(prof.values())))
        md += ["Per decode step, median ms (a separate run): `step` = `eng.step()`, `run` = `runner.run`, `exe` = the "
               "compiled step (call until its result is ready), `io` = run - exe (transfers), `host` = step - run "
               "(schedule, build inputs, postprocess); `step_mean` = mean step.", "",
               "| batch | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        md += [f"| {b} | " + " | ".join(f"{p[k]:.2f}" for k in keys) + " |" for b, p in prof.items()] + [""]
    if env["other_processes_cores"] > 0.1:
        md += ["**Warning:** other processes competed for the CPUs during this run; expect noisy numbers.", ""]
    md += ["Reproduce (from the repository root):", "", f"    {rec['command']}", "",
           f"Machine: {env['cpu']}, {env['cpu_count']} CPUs; load average {env['loadavg_before'][0]:.2f} before, "
           f"{env['loadavg_after'][0]:.2f} after; other processes used {env['other_processes_cores']:.2f} cores on "
           f"average during the run; steal {env['steal_pct']:.1f}%. jaxserve {env['git']}, Python {env['python']}, "
           f"jax/jaxlib {env['jax']}/{env['jaxlib']}, numpy {env['numpy']}, torch {env['torch']} "
           f"({env['torch_threads']} threads), transformers {env['transformers']}. {env['date']}.", ""]
    return "\n".join(md)


if __name__ == "__main__":
    main()
