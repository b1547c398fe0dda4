"""`jaxserve` command line. Subcommands: serve (gRPC + OpenAI HTTP endpoints), generate (one-shot)."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _engine_flags(args: argparse.Namespace) -> dict:
    """Engine options from the command line (None = not given)."""
    return {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "page_size": args.page_size,
        "num_pages": args.num_pages,
        "enable_prefix_caching": args.enable_prefix_caching,
        "kv_cache_dtype": args.kv_cache_dtype,
        "speculative_config": args.speculative_config,
        "precompile": args.precompile,
    }


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or an HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: float32 on CPU")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3"])
    p.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "draft_model", "model": "PATH", "num_speculative_tokens": 4}\'',
    )
    p.add_argument(
        "--precompile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile every bucket at start (default: on for servers, off for one-shot generate)",
    )


def api_key_from(flag: str | None, environ) -> str | None:
    """The API key to require: `--api-key` if given (with a warning: every local user can read a command line in
    `ps`), else `$JAXSERVE_API_KEY`, the recommended way; None (no key) when neither is set or both are empty."""
    if flag:
        print("jaxserve: warning: --api-key is visible to every local user (ps, /proc); prefer $JAXSERVE_API_KEY", file=sys.stderr)
        return flag
    return environ.get("JAXSERVE_API_KEY") or None


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
    flags = {k: v for k, v in _engine_flags(args).items() if v is not None}
    llm = LLM(args.model, **(flags | {"precompile": bool(args.precompile)}))
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("no prompt: pass --prompt TEXT (repeatable) or pipe prompts on stdin, one per line")
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        for c in out.outputs:
            if args.json:
                record = {"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                print(json.dumps(record))
            else:
                print(f"{out.prompt}{c.text}")
    return 0


def _serve(args: argparse.Namespace, parser_defaults: dict) -> int:
    import asyncio
    import os

    from jaxserve import AsyncLLM
    from jaxserve.config import EngineConfig
    from service.async_engine import ServingEngine
    from service.protocol import ServingLimits
    from service.server import ServerConfig, serve

    # Engine options: the YAML config (if any), then every engine flag given explicitly on the command line.
    flags = _engine_flags(args)
    values = {}
    if args.config:
        import yaml

        with open(args.config) as f:
            values = yaml.safe_load(f) or {}
        EngineConfig.from_dict(values, args.config)  # fail early, naming the file, on unknown or bad options
    given = {k: v for k, v in flags.items() if v is not None and (not args.config or v != parser_defaults.get(k))}
    values.update(given)
    if values.get("precompile") is None:
        values["precompile"] = True  # servers compile every bucket before they report ready
    engine_config = EngineConfig.from_dict({k: v for k, v in values.items() if v is not None}, "engine options")
    limits = ServingLimits(
        max_n=args.max_n,
        max_tokens=args.max_tokens_limit,
        max_in_flight=args.max_in_flight,
        max_message_bytes=args.max_message_bytes,
    )
    name = args.served_model_name
    if name is None:
        name = os.path.splitext(os.path.basename(os.path.normpath(args.model)))[0] if args.model else "SmolLM2-135M-Instruct"
    api_key = api_key_from(args.api_key, os.environ)
    llm = AsyncLLM(args.model, engine_config)
    serving = ServingEngine(llm, name, limits, stall_timeout_s=args.stall_timeout)
    cfg = ServerConfig(
        host=args.host,
        grpc_port=None if args.grpc_port < 0 else args.grpc_port,
        http_port=None if args.http_port < 0 else args.http_port,
        api_key=api_key,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        drain_timeout_s=args.drain_timeout,
    )
    return asyncio.run(serve(serving, cfg))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM inference on JAX/XLA")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details (compiles, KV cache size)")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    _add_engine_args(g)
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

    s = sub.add_parser("serve", help="serve the model over gRPC (jaxserve.v1, KServe v2) and OpenAI-compatible HTTP")
    _add_engine_args(s)
    s.add_argument("--config", default=None, help="engine YAML (configs/engine/*.yaml); flags given explicitly override it")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--grpc-port", type=int, default=50051, help="0 = any free port, -1 = no gRPC server")
    s.add_argument("--http-port", type=int, default=8000, help="0 = any free port, -1 = no HTTP server")
    s.add_argument("--served-model-name", default=None, help="the model name clients use (default: the file name)")
    s.add_argument(
        "--api-key",
        default=None,
        help="require this bearer key on every request but health; visible to other users in `ps`: "
        "prefer setting $JAXSERVE_API_KEY",
    )
    s.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve both endpoints over TLS")
    s.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    s.add_argument("--max-in-flight", type=int, default=256, help="admitted unfinished requests; more get 429 / RESOURCE_EXHAUSTED")
    s.add_argument("--max-n", type=int, default=16, help="largest n per request")
    s.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens per request (default: max_model_len)")
    s.add_argument("--max-message-bytes", type=int, default=16 << 20, help="largest gRPC message / HTTP body")
    s.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish after SIGTERM")
    s.add_argument("--stall-timeout", type=float, default=30.0, help="health turns NOT_SERVING after this long without an engine step")
    s.set_defaults(func=_serve)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.func is _serve:
            return _serve(args, {a.dest: a.default for a in s._actions})
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
