"""The engine half of the `jaxserve` command line: the engine flags every subcommand shares, and `generate`.

`jaxserve serve` lives in `service.cli`, which builds on this parser (`build_parser`, `add_engine_args`,
`engine_flags`, `run`) and is what the `jaxserve` console script runs: the servers sit above the engine, and
`jaxserve` never imports `service` (tests/test_package_structure.py checks it). `python -m jaxserve.cli generate`
works without the serving stack installed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from jaxserve.config import QUANTIZATION_SCHEMES


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def engine_flags(args: argparse.Namespace) -> dict:
    """Engine options from the command line (None = not given)."""
    return {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "page_size": args.page_size,
        "num_pages": args.num_pages,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enable_prefix_caching": args.enable_prefix_caching,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.quantization,
        "speculative_config": args.speculative_config,
        "precompile": args.precompile,
        "async_scheduling": args.async_scheduling,
        "mesh": args.mesh,
    }


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file or an HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: float32 on CPU")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="share of a GPU's memory (0, 1] for weights, activations and the KV cache, which fills what "
                   "is left unless --num-pages is given (default 0.9; ignored on the CPU)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--kv-cache-dtype", default=None,
                   choices=["auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3"])
    p.add_argument("--quantization", default=None, choices=list(QUANTIZATION_SCHEMES),
                   help="how linear weights are stored: none (the dtype), bf16, int8 (per channel), int4 / int4-g64 "
                   "(groups of 32 / 64), gguf (a GGUF's own blocks); default: gguf for a quantized GGUF, else none")
    p.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "draft_model", "model": "PATH", "num_speculative_tokens": 4}\'',
    )
    p.add_argument("--mesh", default=None,
                   help="device mesh: a preset (single, tp2, pp2_tp2, dp2, ...) or a configs/mesh/*.yaml file; "
                   "dp = engine replicas, pp = pipeline stages, tp = tensor parallel (README: Parallelism)")
    p.add_argument(
        "--precompile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile every bucket at start (default: on for servers, off for one-shot generate)",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and dispatch step N+1 while step N runs, its sampled tokens fed on the device (default: on "
        "where supported; with n-gram or draft-model speculation for the steps that do not speculate; not with "
        "EAGLE-3 or pipeline stages)",
    )


def _generate(args: argparse.Namespace) -> int:
    from jaxserve import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    flags = {k: v for k, v in engine_flags(args).items() if v is not None}
    llm = LLM(args.model, **(flags | {"precompile": bool(args.precompile)}))
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("no prompt: pass --prompt TEXT (repeatable) or pipe prompts on stdin, one per line")
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        for c in out.outputs:
            if args.json:
                record = {"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids,
                          "finish_reason": c.finish_reason}
                print(json.dumps(record))
            else:
                print(f"{out.prompt}{c.text}")
    return 0


def build_parser(epilog: str | None = None) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The `jaxserve` parser with `generate`, and its subparsers (service.cli adds `serve` to them). Every
    subcommand sets `func(args) -> exit status`."""
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM inference on JAX/XLA", epilog=epilog)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details (compiles, KV cache size)")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="prompt text (repeatable); default: read lines from stdin")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--json", action="store_true", help="one JSON record per output")
    g.set_defaults(func=_generate)
    return parser, sub


def run(args: argparse.Namespace) -> int:
    """Run the parsed subcommand; a request or configuration error prints one line and exits 2."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser, _ = build_parser(epilog="`jaxserve serve` (gRPC + OpenAI HTTP) comes from the serving package: "
                             "the `jaxserve` script, or python -m service serve")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
