"""KV capacity: how many sequences, and how long a context, fit a fixed KV memory budget for each KV dtype.

The capacity is the engine's own page accounting (`resolve_num_pages`, `kv_cache_bytes`: values plus the f32
per-token-per-head scales of quantized dtypes; page 0 is the padding sink), so the table is what `LLM(...,
kv_cache_memory_bytes=B, kv_cache_dtype=D)` will hold. `--verify` builds the engine for each dtype at a small budget
and checks the claim by running exactly that many concurrent sequences: all must run at once with no preemption
(a quick CPU-safe check, not a speed measurement). Peers' rows use their formats' bytes per element
(llama.cpp `--cache-type-k/v` f16, q8_0 = 34 B per 32 values, q4_0 = 18 B per 32; vLLM `--kv-cache-dtype` auto at
bf16, fp8 with per-tensor scales) at the same budget.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench kv --budget-gib 1 --verify     # docs/benchmarks/kv.{json,md,png}
"""

from __future__ import annotations

import argparse

from bench import plots
from bench.common import OUT_DIR, args_record, command_line, machine_info, machine_line, md_table, write_outputs

DTYPES = ("float32", "bfloat16", "int8", "fp8")
LLAMACPP_BYTES_PER_VALUE = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
VLLM_BYTES_PER_VALUE = {"bfloat16": 2.0, "fp8": 1.0}  # vLLM's fp8 KV scales are per tensor: no per-token bytes


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--budget-gib", type=float, default=1.0, help="KV memory budget")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), help="jaxserve kv_cache_dtype values")
    ap.add_argument("--contexts", nargs="+", type=int, default=[512, 2048, 8192], help="tokens per sequence")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--model", default=None, help="GGUF or HF dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--verify", action="store_true", help="run the computed number of sequences on the engine")
    ap.add_argument("--verify-budget-mib", type=float, default=16.0, help="small budget for --verify")
    ap.add_argument("--verify-context", type=int, default=64, help="tokens per sequence in --verify")
    ap.add_argument("--out", default=OUT_DIR)
    ap.add_argument("--name", default="kv")


def capacity(model_cfg, budget_bytes: int, kv_cache_dtype: str, page_size: int, contexts: list[int]) -> dict:
    """Pages, tokens and concurrent full-context sequences the budget holds for one jaxserve KV dtype."""
    from jaxserve.config import EngineConfig, kv_storage_dtype
    from jaxserve.factory import resolve_num_pages
    from jaxserve.kv_cache import kv_cache_bytes

    storage = kv_storage_dtype(kv_cache_dtype, "float32")
    cfg = EngineConfig(kv_cache_memory_bytes=budget_bytes, kv_cache_dtype=kv_cache_dtype, page_size=page_size,
                       max_model_len=max(contexts))
    num_pages = resolve_num_pages(cfg, model_cfg, storage)
    usable = num_pages - 1  # page 0 is the padding sink
    per_page = kv_cache_bytes(model_cfg, 1, page_size, storage)
    return dict(storage=storage, bytes_per_token=per_page / page_size, num_pages=num_pages,
                max_tokens=usable * page_size, max_context_one_seq=usable * page_size,
                max_seqs={str(c): usable // -(-c // page_size) for c in contexts})


def llamacpp_capacity(model_cfg, budget_bytes: int, cache_type: str, contexts: list[int],
                      bytes_per_value: dict = LLAMACPP_BYTES_PER_VALUE) -> dict:
    """A peer's capacity from its format's bytes per K/V value (no paging overhead counted)."""
    values_per_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim
    per_token = values_per_token * bytes_per_value[cache_type]
    tokens = int(budget_bytes // per_token)
    return dict(storage=cache_type, bytes_per_token=per_token, max_tokens=tokens, max_context_one_seq=tokens,
                max_seqs={str(c): tokens // c for c in contexts})


def verify(model, kv_cache_dtype: str, budget_bytes: int, context: int, page_size: int) -> dict:
    """Run the computed capacity of `context`-token sequences at once; every one must be running together."""
    from jaxserve import LLM, SamplingParams

    probe = LLM(model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=budget_bytes, page_size=page_size,
                max_model_len=context, max_num_seqs=1, precompile=False).llm_engine
    cap = (probe.config.num_pages - 1) // -(-context // page_size)
    del probe
    eng = LLM(model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=budget_bytes, page_size=page_size,
              max_model_len=context, max_num_seqs=cap, max_num_batched_tokens=max(cap, 256),
              enable_prefix_caching=False, precompile=False).llm_engine
    # Short prompts, long outputs: every sequence is admitted long before the first one finishes.
    prompt_len = max(1, context // 4)
    params = SamplingParams(temperature=0, max_tokens=context - prompt_len, ignore_eos=True)
    for i in range(cap):
        ids = [(100 + 7 * i + j) % 40000 + 10 for j in range(prompt_len)]
        eng.add_request(f"kv{i}", {"prompt_token_ids": ids}, params)
    peak_running = peak_usage = 0.0
    while eng.has_unfinished_requests():
        eng.step()
        s = eng.get_stats()
        peak_running, peak_usage = max(peak_running, s["num_requests_running"]), max(peak_usage, s["kv_cache_usage"])
    s = eng.get_stats()
    return dict(context=context, capacity=cap, peak_running=int(peak_running), peak_kv_usage=peak_usage,
                preemptions=s["num_preemptions"], ok=peak_running == cap and s["num_preemptions"] == 0)


def report(record: dict) -> str:
    a = record["args"]
    ctx = [str(c) for c in a["contexts"]]
    header = ["engine", "KV dtype", "bytes / token", "KV tokens", *(f"seqs @ {c}" for c in ctx)]
    rows = [["jaxserve", d, f"{r['bytes_per_token']:.0f}", r["max_tokens"], *(r["max_seqs"][c] for c in ctx)]
            for d, r in record["jaxserve"].items()]
    for peer, label in (("llamacpp", "llama.cpp (by format)"), ("vllm", "vLLM (by format)")):
        rows += [[label, t, f"{r['bytes_per_token']:.0f}", r["max_tokens"], *(r["max_seqs"][c] for c in ctx)]
                 for t, r in record.get(peer, {}).items()]
    md = [f"# KV capacity at a {a['budget_gib']:g} GiB budget ({record['model']})", "",
          f"Page size {a['page_size']}; seqs @ N = full N-token sequences held at once. jaxserve rows are the "
          "engine's own page accounting (quantized dtypes include their f32 scales per token and head).", "",
          md_table(header, rows), ""]
    if record.get("verify"):
        vrows = [[d, v["context"], v["capacity"], v["peak_running"], f"{100 * v['peak_kv_usage']:.0f}%",
                  v["preemptions"], "yes" if v["ok"] else "NO"] for d, v in record["verify"].items()]
        md += [f"Verified on the engine at {a['verify_budget_mib']:g} MiB:", "",
               md_table(["KV dtype", "context", "computed seqs", "ran at once", "peak KV use", "preemptions", "ok"],
                        vrows), ""]
    md += ["Reproduce:", "", f"    {record['command']}", "", machine_line(record["machine"]), ""]
    return "\n".join(md)


def run(args) -> dict:
    from jaxserve.loader import load_checkpoint

    ckpt = load_checkpoint(args.model)
    cfg, budget = ckpt.config, int(args.budget_gib * 2**30)
    res = {d: capacity(cfg, budget, d, args.page_size, args.contexts) for d in args.dtypes}
    peer = {t: llamacpp_capacity(cfg, budget, t, args.contexts) for t in LLAMACPP_BYTES_PER_VALUE}
    vllm = {t: llamacpp_capacity(cfg, budget, t, args.contexts, VLLM_BYTES_PER_VALUE) for t in VLLM_BYTES_PER_VALUE}
    ver = {}
    if args.verify:
        for d in args.dtypes:
            ver[d] = verify(args.model, d, int(args.verify_budget_mib * 2**20), args.verify_context, args.page_size)
            print(f"[kv] verify {d}: {ver[d]}", flush=True)
    record = dict(command=command_line("bench.kv"), machine=machine_info(), args=args_record(args),
                  model=args.model or "SmolLM2-135M-Instruct", jaxserve=res, llamacpp=peer, vllm=vllm, verify=ver)
    paths = write_outputs(args.out, args.name, record, report(record))
    c = str(args.contexts[len(args.contexts) // 2])
    groups = {f"jaxserve {d}": {f"seqs @ {c}": r["max_seqs"][c]} for d, r in res.items()}
    groups.update({f"llama.cpp {t}": {f"seqs @ {c}": r["max_seqs"][c]} for t, r in peer.items()})
    groups.update({f"vLLM {t}": {f"seqs @ {c}": r["max_seqs"][c]} for t, r in vllm.items()})
    paths += plots.grouped_bars(groups, f"{args.out}/{args.name}.png", ylabel="concurrent sequences",
                                title=f"Sequences of {c} tokens in {args.budget_gib:g} GiB of KV")
    print("\n".join(f"wrote {p}" for p in paths))
    if ver and not all(v["ok"] for v in ver.values()):
        raise SystemExit("kv: the engine did not hold the computed capacity (see the verify table)")
    return record
