"""Offline throughput on ShareGPT: jaxserve continuous batching vs the same engine forced to static batches vs HF
transformers `generate` with static batches, in one run, on SmolLM2-135M-Instruct (float32).

Every request is the first human turn of a ShareGPT conversation and generates exactly the token count of the
reference reply (EOS ignored), so all engines do the same useful work. Static batching: `--batch-size` requests at
a time, the next batch starts when the whole batch is done; HF pads left and generates the batch's longest output
for every row (only the useful tokens are counted). HF is slow on CPU, so it runs on the first `--hf-requests`
requests (whole batches) and is compared by rate.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.throughput      # writes docs/benchmarks/throughput.{json,md}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

from bench.sharegpt import BenchRequest, sample_requests

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT_DIR = os.path.join(ROOT, "docs", "benchmarks")


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
            mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(r.prompt_token_ids) for r in group])[:, None]).long()
            new = max(r.output_len for r in group)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16, help="static batch size, and max_num_seqs for jaxserve")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--hf-requests", type=int, default=64, help="0 skips HF")
    ap.add_argument("--out", default=OUT_DIR)
    args = ap.parse_args()

    from jaxserve import LLM

    llm = LLM(max_model_len=2048, max_num_seqs=args.batch_size, max_num_batched_tokens=args.max_num_batched_tokens)
    reqs = sample_requests(llm.get_tokenizer(), args.num_requests, seed=args.seed)
    results = {}
    print(f"{len(reqs)} requests: {sum(len(r.prompt_token_ids) for r in reqs)} prompt tokens, "
          f"{sum(r.output_len for r in reqs)} output tokens", flush=True)
    results["jaxserve_continuous"] = run_jaxserve(llm, reqs, None)
    print("continuous", results["jaxserve_continuous"], flush=True)
    results["jaxserve_static"] = run_jaxserve(llm, reqs, args.batch_size)
    print("static", results["jaxserve_static"], flush=True)
    if args.hf_requests:
        hf_reqs = reqs[: args.hf_requests]
        results["hf_static"] = run_hf(hf_reqs, args.batch_size)
        print("hf", results["hf_static"], flush=True)
        # Same-subset jaxserve rate, for a like-for-like ratio against HF.
        results["jaxserve_continuous_hf_subset"] = run_jaxserve(llm, hf_reqs, None)

    import jax

    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="HF_HUB_OFFLINE=1 .venv/bin/python -m bench.throughput " + " ".join(sys.argv[1:]),
        args=vars(args),
        machine=dict(cpu=platform.processor() or platform.machine(), cpus=os.cpu_count(), python=platform.python_version()),
        jax=jax.__version__,
        load_avg=os.getloadavg(),
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "throughput.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=2)
    write_markdown(os.path.join(args.out, "throughput.md"), meta, results)
    print(open(os.path.join(args.out, "throughput.md")).read())


def write_markdown(path: str, meta: dict, results: dict) -> None:
    rows = [
        ("jaxserve, continuous batching", "jaxserve_continuous"),
        ("jaxserve, static batches", "jaxserve_static"),
        ("jaxserve, continuous (HF's subset)", "jaxserve_continuous_hf_subset"),
        ("HF transformers generate, static batches", "hf_static"),
    ]
    lines = [
        "# Offline throughput on ShareGPT (SmolLM2-135M-Instruct, float32, CPU)",
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
    if "hf_static" in results:
        h, j = results["hf_static"], results["jaxserve_continuous_hf_subset"]
        lines.append(f"jaxserve continuous / HF static (same {h['requests']} requests): "
                     f"**{j['output_tok_s'] / h['output_tok_s']:.2f}x** output tok/s "
                     f"(HF generated {h['generated_tokens']} tokens to deliver {h['output_tokens']}).")
    lines += ["", f"Reproduce: `{meta['command']}`", "",
              f"Machine: {meta['machine']}, jax {meta['jax']}, load average at the end {meta['load_avg']}. {meta['date']}."]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
