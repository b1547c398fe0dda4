"""The `jaxserve` command (console script): jaxserve.cli's parser (`generate`, engine flags) plus `serve`.

`serve` lives here, not in jaxserve/cli.py, because it wires the engine to the servers: the serving package imports
the engine, never the reverse. `python -m service serve ...` is the same command without the console script.

Engine options for `serve` come from `--config` (an engine YAML, read by `EngineConfig.from_yaml`, which names the
file in its errors), then from every engine flag given explicitly on the command line. With a config, a flag left
at its parser default counts as not given, so the YAML's value stands.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

from jaxserve import distributed
from jaxserve.cli import add_engine_args, build_parser, engine_flags, run

# The sizes EngineConfig derives other fields from (token and page buckets).
_BUDGETS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size")


def api_key_from(flag: str | None, environ) -> str | None:
    """The API key to require: `--api-key` if given (with a warning: every local user can read a command line in
    `ps`), else `$JAXSERVE_API_KEY`, the recommended way; None (no key) when neither is set or both are empty."""
    if flag:
        print("jaxserve: warning: --api-key is visible to every local user (ps, /proc); prefer $JAXSERVE_API_KEY",
              file=sys.stderr)
        return flag
    return environ.get("JAXSERVE_API_KEY") or None


def _config_values(path: str) -> dict:
    """The options an engine YAML sets, as EngineConfig.from_dict values. `EngineConfig.from_yaml` reads and
    validates the file; of its fields, the budgets are kept and any other only where it differs from the config the
    budgets alone give. A field the file leaves to be derived (buckets from the budgets) is thus derived again from
    the budgets the flags may change, instead of being frozen at the file's."""
    from jaxserve.config import EngineConfig

    cfg = EngineConfig.from_yaml(path)
    base = EngineConfig.from_dict({k: getattr(cfg, k) for k in _BUDGETS}, path)
    return {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.name in _BUDGETS or getattr(cfg, f.name) != getattr(base, f.name)
    }


def engine_config_from(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The EngineConfig `serve` runs: `--config`, overridden by the engine flags given explicitly."""
    from jaxserve.config import EngineConfig

    flags = engine_flags(args)
    values = _config_values(args.config) if args.config else {}
    given = {k: v for k, v in flags.items() if v is not None and (not args.config or v != parser.get_default(k))}
    values.update(given)
    if values.get("precompile") is None:
        values["precompile"] = True  # servers compile every bucket before they report ready
    return EngineConfig.from_dict({k: v for k, v in values.items() if v is not None}, "engine options")


_HOST_DEVICES = "--xla_force_host_platform_device_count"


def simulate_host_devices(mesh, environ, num_processes: int = 1) -> bool:
    """Give a CPU-only run the `mesh.num_devices` devices a multi-device mesh needs (its share of them, with several
    processes): append `--xla_force_host_platform_device_count=N` to `$XLA_FLAGS`, which only the host (CPU)
    platform reads, so an accelerator run is unaffected. Only while jax has not created its backends yet (they read
    the flag once) and the flag is not set already; True if it was set. Otherwise a mesh too big fails at start,
    naming the mesh."""
    from jax._src import xla_bridge

    flags = environ.get("XLA_FLAGS", "")
    per_process = 0 if mesh is None else -(-mesh.num_devices // max(1, num_processes))
    if per_process < 2 or _HOST_DEVICES in flags or xla_bridge.backends_are_initialized():
        return False
    environ["XLA_FLAGS"] = f"{flags} {_HOST_DEVICES}={per_process}".strip()
    return True


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import asyncio

    from jaxserve import AsyncLLM
    from service.async_engine import ServingEngine
    from service.protocol import ServingLimits
    from service.server import ServerConfig, serve

    engine_config = engine_config_from(args, parser)
    limits = ServingLimits(
        max_n=args.max_n,
        max_tokens=args.max_tokens_limit,
        max_in_flight=args.max_in_flight,
        max_message_bytes=args.max_message_bytes,
    )
    name = args.served_model_name
    if name is None:
        name = (os.path.splitext(os.path.basename(os.path.normpath(args.model)))[0] if args.model
                else "SmolLM2-135M-Instruct")
    api_key = api_key_from(args.api_key, os.environ)
    num_processes = args.num_processes or int(os.environ.get(distributed.ENV_NUM_PROCESSES, "1"))
    simulate_host_devices(engine_config.mesh, os.environ, num_processes)
    try:
        ctx = distributed.initialize_from_args(args)  # multi-host: before any jax computation
    except ValueError as e:
        parser.error(str(e))
    if ctx is not None and not ctx.is_leader:
        # a follower: no servers; it runs the leader's steps until the leader shuts down (or dies: exit 1)
        try:
            distributed.follow_engine(args.model, engine_config)
        except ConnectionError as e:
            print(f"jaxserve serve: process {ctx.process_id}: {e}", file=sys.stderr)
            return 1
        return 0
    llm = AsyncLLM(args.model, engine_config, distributed_context=ctx)
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


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="serve the model over gRPC (jaxserve.v1, KServe v2) and OpenAI-compatible HTTP")
    add_engine_args(s)
    s.add_argument("--config", default=None,
                   help="engine YAML (configs/engine/*.yaml); flags given explicitly override it")
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
    s.add_argument("--max-in-flight", type=int, default=256,
                   help="admitted unfinished requests; more get 429 / RESOURCE_EXHAUSTED")
    s.add_argument("--max-n", type=int, default=16, help="largest n per request")
    s.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens per request (default: max_model_len)")
    s.add_argument("--max-message-bytes", type=int, default=16 << 20, help="largest gRPC message / HTTP body")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    s.add_argument("--stall-timeout", type=float, default=30.0,
                   help="health turns NOT_SERVING after this long without an engine step")
    distributed.add_cli_args(s)
    s.set_defaults(func=functools.partial(_serve, parser=s))
    return s


def main(argv: list[str] | None = None) -> int:
    parser, sub = build_parser()
    add_serve_parser(sub)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
