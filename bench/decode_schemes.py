"""Decode latency per weight scheme (`python -m bench latency --schemes ...`, docs/benchmarks/decode_schemes.*): one
jaxserve engine per `quantization=` scheme, each beside llama.cpp on the GGUF of the matching width (SCHEME_PEERS),
all held at once and timed in interleaved rounds, batch 1 and batch 16 through llama.cpp's low-level `llama_decode`
loop (one batch of every sequence's next token per step, greedy argmax in numpy). The roofline is per scheme: the
bytes its linear maps take as the runner holds them (scales, zeros and the native kernel's padding included) plus the
KV cache. The timing helpers are `bench.decode`'s.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from bench.decode import LlamaCppLoop, copy_bandwidth, cpu_jiffies, fmt, run_jaxserve, stats

# --schemes: the llama.cpp GGUF (bench.peers.GGUF_VARIANTS) each jaxserve weight scheme is timed against, and the
# issue-19 goals: jaxserve / llama.cpp decode tok/s at batch 1 and at batch 16, and % of the scheme's own bandwidth
# roofline at batch 1. float32 has no llama.cpp twin (F16 is shown for scale, no ratio goal).
SCHEME_PEERS = {"none": "F16", "bf16": "F16", "int8": "Q8_0", "int4": "Q4_1", "int4-g64": "Q4_1", "gguf": "Q4_1",
                "gguf:Q8_0": "Q8_0", "gguf:Q4_0": "Q4_0", "gguf:Q4_1": "Q4_1", "gguf:Q4_K": "Q4_K"}
RATIO_GOAL = {1: 1.0, 16: 1.5}
ROOFLINE_GOAL_PCT = 80


def run_schemes(args) -> dict:
    """--schemes: one jaxserve engine per weight scheme and llama.cpp on each matching GGUF, interleaved rounds."""
    import jax

    from bench import peers, plots
    from bench.common import args_record, machine_info, write_outputs
    from bench.weight_quant import streamed_weights
    from jaxserve import LLM

    unknown = [s for s in args.schemes if s not in SCHEME_PEERS]
    if unknown:
        raise ValueError(f"unknown --schemes {unknown}: expected some of {', '.join(SCHEME_PEERS)}")
    deep = getattr(args, "num_layers", None)
    if deep is not None and deep < 1:
        raise ValueError(f"--num-layers must be at least 1, got {deep}")
    model, model_name = None, "SmolLM2-135M-Instruct"
    if deep:  # the default model's dimensions, `deep` layers of random weights: no GGUF, so no llama.cpp twin
        if gguf_schemes := [s for s in args.schemes if s.startswith("gguf")]:
            raise ValueError(f"--num-layers: {gguf_schemes} need a GGUF file; the deep model has none")
        model, why = peers.deep_model_dir(deep)
        if model is None:
            raise RuntimeError(f"--num-layers: {why}")
        model_name = f"SmolLM2-135M's dimensions with {deep} layers of random weights (bf16 checkpoint)"
    name = args.name or ("decode_schemes" if not deep else f"decode_schemes_{deep}layers")
    B, P = max(args.batches), args.prompt_len
    # the copy that sets the roofline: from DRAM when the weights do not fit the cache either
    copy_mib = 1024 if deep else 256
    load0, cpu0, own0 = os.getloadavg(), cpu_jiffies(), os.times()
    prompts = np.random.default_rng(args.seed).integers(100, 40000, (B, P), np.int64)
    max_len = P + args.new_tokens + 16
    threads = os.cpu_count() or 2
    skipped, jax_engines, weights, gguf = {}, {}, {}, {}
    for scheme in args.schemes:
        variant = scheme.partition(":")[2]
        path = None
        if variant:
            path, why = peers.gguf_variant(variant)
            if path is None:
                skipped[scheme] = f"jaxserve {scheme}: {why}"
                continue
        eng = LLM(path or model, quantization=scheme.partition(":")[0], max_model_len=max_len, max_num_seqs=max(16, B),
                  max_num_batched_tokens=max(2048, B * P), precompile=False,
                  kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto")).llm_engine
        nbytes, params, forms = streamed_weights(eng.runner.weights)
        mc = eng.model_config
        weights[scheme] = dict(bytes=nbytes, bits_per_weight=8 * nbytes / params, stored_as=forms,
                               kv_dtype=eng.runner.kv_dtype.name,
                               kv_bytes_per_token=2 * mc.num_layers * mc.num_kv_heads * mc.head_dim
                               * eng.runner.kv_dtype.itemsize,
                               f16_kv_bytes_per_token=2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2)
        jax_engines[scheme] = eng
    lc_runs = {}
    if deep:
        skipped["llamacpp"] = "llama.cpp not run: the deep random-weight model has no GGUF file"
    elif "llamacpp" not in args.peers:
        skipped["llamacpp"] = "llama.cpp not requested (--peers)"
    elif why := peers.llamacpp_missing():
        skipped["llamacpp"] = why
    else:
        for v in dict.fromkeys(SCHEME_PEERS[s] for s in jax_engines):
            path, why = peers.gguf_variant(v)
            if path is None:
                skipped[f"llama.cpp {v}"] = f"llama.cpp {v}: {why}"
                continue
            census = peers.gguf_census(path)
            gguf[v] = dict(file=os.path.basename(path), bytes=census["matrix_bytes"], types=census["types"],
                           bits_per_weight=8 * census["matrix_bytes"] / census["matrix_params"])
            lc_runs[v] = LlamaCppLoop(path, B, max_len, B * P, threads)
    for why in skipped.values():
        print(f"[latency] {why}", flush=True)

    runners = {}  # interleaved in this order every round: each scheme, then its llama.cpp file the first time
    for scheme, eng in jax_engines.items():
        runners[f"jaxserve {scheme}"] = lambda b, n, eng=eng: run_jaxserve(eng, prompts[:b], n)
        v = SCHEME_PEERS[scheme]
        if v in lc_runs:
            runners.setdefault(f"llama.cpp {v}", lambda b, n, lc=lc_runs[v]: lc.run(prompts[:b], n))
    for b in args.batches:  # warm-up: compiles every bucket the timed runs use
        for scheme, eng in jax_engines.items():
            run_jaxserve(eng, prompts[:b], args.new_tokens)
        for f in runners.values():
            f(b, 8)
    compiles = {s: e.runner.num_compiles for s, e in jax_engines.items()}

    bw, raw = [copy_bandwidth(copy_mib)], {n: {b: [] for b in args.batches} for n in runners}
    for r in range(args.reps):
        for b in args.batches:
            for n, f in runners.items():
                res = f(b, args.new_tokens)
                raw[n][b].append(res)
                print(f"round {r} batch {b:2d} {n:20s}: decode {res['tok_s']:7.1f} tok/s (median step "
                      f"{res['median_step_ms']:6.2f} ms), prefill {res['prefill_s']:.2f} s", flush=True)
        bw.append(copy_bandwidth(copy_mib))
    recompiled = {s: (compiles[s], e.runner.num_compiles) for s, e in jax_engines.items()
                  if e.runner.num_compiles != compiles[s]}
    if recompiled:
        raise RuntimeError(f"jaxserve recompiled during the timed runs (before, after): {recompiled}")

    bandwidth, mean_ctx = stats(bw), P + args.new_tokens / 2
    results = []
    for scheme in jax_engines:
        v = SCHEME_PEERS[scheme]
        for b in args.batches:
            w = weights[scheme]
            roof_steps = roofline_steps(bandwidth["median"], w["bytes"], w["kv_bytes_per_token"], b, mean_ctx)
            j = stats([x["tok_s"] for x in raw[f"jaxserve {scheme}"][b]])
            peer = raw.get(f"llama.cpp {v}", {}).get(b)
            p = stats([x["tok_s"] for x in peer]) if peer else None
            row = dict(scheme=scheme, batch=b, peer=v if p else None, jaxserve_tok_s=j, llamacpp_tok_s=p,
                       ratio=j["median"] / p["median"] if p else None, roofline_tok_s=b * roof_steps,
                       pct_roofline=100 * j["median"] / (b * roof_steps))
            if p:  # llama.cpp's own roofline: its file's 2-D tensors plus an f16 KV cache
                lc_roof = roofline_steps(bandwidth["median"], gguf[v]["bytes"], w["f16_kv_bytes_per_token"], b,
                                         mean_ctx)
                row["llamacpp_pct_roofline"] = 100 * p["median"] / (b * lc_roof)
            row["goal"] = goal_check(row)
            results.append(row)

    load1, dcpu, own1 = os.getloadavg(), [y - x for x, y in zip(cpu0, cpu_jiffies())], os.times()
    busy_s = (sum(dcpu) - dcpu[3] - dcpu[4]) / os.sysconf("SC_CLK_TCK")
    others = (busy_s - (own1.user + own1.system - own0.user - own0.system)) / (own1.elapsed - own0.elapsed)
    argv = sys.argv[sys.argv.index("latency") + 1:] if "latency" in sys.argv else sys.argv[1:]
    env = dict(machine_info(), backend=jax.default_backend(), loadavg_before=load0, loadavg_after=load1,
               steal_pct=100 * dcpu[7] / max(1, sum(dcpu)), other_processes_cores=others)
    record = dict(command="HF_HUB_OFFLINE=1 .venv/bin/python -m bench latency" + "".join(f" {a}" for a in argv),
                  model=model_name, copy_mib=copy_mib, env=env, args=args_record(args),
                  copy_bandwidth_Bps=bandwidth, weights=weights, gguf=gguf,
                  results=results, skipped=skipped, num_compiles=compiles,
                  runs={n: {b: [{k: v for k, v in x.items() if k != "tokens"} for x in xs] for b, xs in d.items()}
                        for n, d in raw.items()})
    md = report_schemes(record)
    write_outputs(args.out, name, record, md)
    bars = {f"{r['scheme']} b{r['batch']}": r["jaxserve_tok_s"]["median"] for r in results}
    bars.update({f"lc {r['peer']} b{r['batch']}": r["llamacpp_tok_s"]["median"] for r in results if r["peer"]})
    plots.bars(bars, os.path.join(args.out, f"{name}.png"), title="Decode tok/s per weight scheme (median)",
               ylabel="tokens/s")
    print("\n" + md)
    return record


def roofline_steps(bandwidth: float, weight_bytes: float, kv_bytes_per_token: float, batch: int,
                   context: float) -> float:
    """Decode steps/s if a step only streamed every weight once and each sequence's KV cache at `context` tokens."""
    return bandwidth / (weight_bytes + batch * context * kv_bytes_per_token)


def goal_check(row: dict) -> str:
    """'yes', 'no (...)' naming each missed goal, or '–' where the scheme has no goal at this batch."""
    misses, has_goal = [], False
    want = RATIO_GOAL.get(row["batch"])
    if want is not None and row["scheme"] != "none" and row["ratio"] is not None:
        has_goal = True
        if row["ratio"] < want:
            misses.append(f"{row['ratio']:.2f}x < {want:.1f}x")
    if row["batch"] == 1:
        has_goal = True
        if row["pct_roofline"] < ROOFLINE_GOAL_PCT:
            misses.append(f"{row['pct_roofline']:.0f}% < {ROOFLINE_GOAL_PCT}% roofline")
    if not has_goal:
        return "–"
    return "yes" if not misses else "no (" + "; ".join(misses) + ")"


def report_schemes(rec: dict) -> str:
    a, env, w, g = rec["args"], rec["env"], rec["weights"], rec["gguf"]
    head = ["scheme", "stored as", "bits/weight", "batch", "jaxserve tok/s", "llama.cpp file", "llama.cpp tok/s",
            "jaxserve / llama.cpp", "weight MB / step", "roofline tok/s", "% of roofline",
            "llama.cpp % of its roofline", "goal met?"]
    rows = []
    for r in rec["results"]:
        s = r["scheme"]
        rows.append([s, w[s]["stored_as"], f"{w[s]['bits_per_weight']:.2f}", str(r["batch"]), fmt(r["jaxserve_tok_s"]),
                     r["peer"] or "–", fmt(r["llamacpp_tok_s"]) if r["peer"] else "–",
                     f"{r['ratio']:.2f}x" if r["ratio"] else "–", f"{w[s]['bytes'] / 1e6:.1f}",
                     f"{r['roofline_tok_s']:.0f}", f"{r['pct_roofline']:.0f}%",
                     f"{r['llamacpp_pct_roofline']:.0f}%" if r.get("llamacpp_pct_roofline") else "–", r["goal"]])
    bw = {k: v / 1e9 for k, v in rec["copy_bandwidth_Bps"].items() if k != "all"}
    md = ["# Decode latency per weight scheme: jaxserve vs llama.cpp", "",
          f"{rec.get('model', 'SmolLM2-135M-Instruct')}, {env['backend']}. Batches of prompts of {a['prompt_len']} "
          "random token ids, "
          f"{a['new_tokens']} greedy tokens each (EOS ignored); decode only (timing starts once every sequence has its "
          f"first token). {a['reps']} interleaved rounds (every engine once per round), median [min–max]; "
          "tok/s = decode tokens / decode wall time.", "",
          "| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(x) + " |" for x in rows), "",
          f"Goals (issue 19): jaxserve / llama.cpp >= {RATIO_GOAL[1]:.1f}x at batch 1 and >= {RATIO_GOAL[16]:.1f}x at "
          f"batch 16 against the file of the same width (bf16 - F16, int8 - Q8_0, every 4-bit scheme - the shipped "
          f"Q4_1 file, gguf:X - X), and >= {ROOFLINE_GOAL_PCT}% of the scheme's own roofline at batch 1. none "
          "(float32) has no llama.cpp twin: F16 is shown for scale.", "",
          f"Roofline tok/s = batch x copy bandwidth / (weight bytes + batch x KV bytes at the mean decode context "
          f"{a['prompt_len'] + a['new_tokens'] // 2}); copy bandwidth {fmt(bw, 2)} GB/s (read + write, np.copyto of "
          f"{rec.get('copy_mib', 256)} MiB). "
          "Weight bytes: the seven linear maps per layer and the logits projection as the runner holds them (the "
          "native kernel's panels, scales, zeros, padding); llama.cpp's: its file's 2-D tensors, f16 KV. "
          "jaxserve's KV cache: " + ", ".join(sorted({x.get("kv_dtype", "float32") for x in w.values()}))
          + f" (kv_cache_dtype={a.get('kv_cache_dtype', 'auto')}).", "",
          "llama.cpp: llama-cpp-python's low-level loop (`LlamaCppLoop`: one context with a sequence slot per "
          f"prompt, one `llama_decode` per step for every sequence, greedy argmax in numpy), {env['cpu_count']} "
          "threads, flash attention off, at batch 1 too (HF and vLLM have no quantized twin here and are not run in "
          "this mode). Files: "
          + "; ".join(f"{v} = {x['file']} ({', '.join(f'{t} x {c}' for t, c in x['types'].items())})"
                      for v, x in g.items()) + ".", ""]
    md += [f"- {why}" for why in rec["skipped"].values()] + ([""] if rec["skipped"] else [])
    if env["other_processes_cores"] > 0.1:
        md += [f"**Warning:** other processes used {env['other_processes_cores']:.2f} cores on average during this "
               "run; expect noisy numbers.", ""]
    md += ["Reproduce (from the repository root):", "", f"    {rec['command']}", "",
           f"Machine: {env['cpu']}, {env['cpu_count']} CPUs; load average {env['loadavg_before'][0]:.2f} before, "
           f"{env['loadavg_after'][0]:.2f} after; steal {env['steal_pct']:.1f}%. jaxserve {env['git']}, Python "
           f"{env['python']}, " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
           + f". {env['date']}.", ""]
    return "\n".join(md)
