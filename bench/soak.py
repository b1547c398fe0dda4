"""Chaos soak: hundreds of concurrent streams with cancels, deadlines and disconnects against a `jaxserve serve`
process.

One `jaxserve serve` child process (bench.servers) runs with its KV cache squeezed (so preemption is constant) and
n-gram speculation on. The soak then keeps `concurrency` requests in flight for `duration_s` over OpenAI HTTP
(/v1/completions and /v1/chat/completions, streaming and not), jaxserve.v1 gRPC Generate and KServe v2
ModelStreamInfer, with random prompt and output lengths, greedy and sampled, and `chaos_fraction` of them ended
early (bench.soak_clients: cancel mid-stream, short deadline, socket reset / channel close, Abort RPC).
Before the load, a reference pass sends every greedy (prompt, max_tokens) combination alone; afterwards it checks:
  - every request ended exactly once: completed, cancelled or a clean error (counted), no protocol violation;
  - no error but overload (every request is valid), and no completed greedy output differs from its reference
    (the engine is batch-invariant: batching, preemption and speculation must not change a greedy token);
  - no leak: once idle, /metrics shows no running, waiting or in-flight request and no KV page in use;
  - the server's RSS grew < rss_growth_limit from the end of warm-up to the end of the load (psutil samples);
  - still healthy: /health 200, gRPC health SERVING, the references still reproduce, SIGTERM drains and exits 0;
  - the squeeze worked (preemptions > 0) and speculation ran (draft tokens > 0).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench soak --duration 600   # writes docs/benchmarks/soak.{json,md}

Exits non-zero when a check fails. tests/test_soak.py runs the same harness for ~20 s on a tiny random model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, replace

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
from bench.soak_clients import CHAOS_KINDS, OUTCOMES, GrpcClients, HttpClient, Plan, Result

PROTOCOLS = ("http-completions", "http-chat", "grpc", "kserve")


@dataclass(frozen=True, kw_only=True)
class SoakConfig:
    duration_s: float = 600.0  # of load; then the in-flight requests end and the checks run
    concurrency: int = 256  # requests kept in flight
    chaos_fraction: float = 0.3  # of requests ended early (cancel / deadline / disconnect / abort)
    greedy_fraction: float = 0.5  # of requests at temperature 0, checked against the reference
    protocol_weights: tuple[float, ...] = (3, 2, 3, 1)  # http-completions, http-chat, grpc, kserve
    http_stream_fraction: float = 0.7
    num_prompts: int = 12  # distinct prompts (reused, so the prefix cache hits and evicts)
    prompt_chars: tuple[int, int] = (32, 1600)  # random prompt lengths, in characters
    prompt_source: str = "sharegpt"  # sharegpt (first turns, cut to length) | synthetic (repetitive words)
    greedy_lengths: tuple[int, ...] = (16, 48)  # max_tokens of greedy requests: each (prompt, length) has a reference
    max_output_len: int = 128  # sampled requests: max_tokens uniform in [1, this]
    # Sampled requests with top_p 0.9 / top_k 40. Off by default: a step with one such row sorts every row of the
    # padded batch over the vocabulary (sampler._truncate), ~10x slower on CPU for SmolLM2 (docs/reliability.md).
    truncation_fraction: float = 0.0
    deadline_s: tuple[float, float] = (0.2, 30.0)  # under full load most expire in the queue, some mid-stream
    chaos_delay_s: tuple[float, float] = (0.05, 20.0)  # disconnect / non-streaming cancel after this long
    chaos_chunks: tuple[int, int] = (1, 6)  # cancel / abort after this many streamed chunks
    warmup_s: float = 60.0  # RSS baseline: the end of this first stretch of load
    sample_interval_s: float = 2.0
    hang_timeout_s: float = 900.0  # a request without an end after this long is a violation
    idle_timeout_s: float = 120.0  # for the gauges to reach zero after the load
    recheck_prompts: int = 4  # prompts whose references are sent again after the soak
    rss_growth_limit: float = 0.05
    seed: int = 0


@dataclass
class Reference:
    text: str
    finish_reason: str | None
    completion_tokens: int | None
    token_ids: list[int] | None = None


# ---------------------------------------------------------------- prompts and plans


def make_prompts(cfg: SoakConfig) -> list[str]:
    """`num_prompts` distinct prompts, each cut (at a space) to a length drawn uniformly from `prompt_chars`."""
    rng = random.Random(cfg.seed)
    lo, hi = cfg.prompt_chars
    if cfg.prompt_source == "sharegpt":
        from jaxserve.datasets.sharegpt import load_conversations

        # ASCII only, so that characters bound tokens (~4 per token; code ~3): prompt + max_tokens fits the context.
        texts = [p for p, _ in load_conversations() if len(p) >= lo and p.isascii()]
        rng.shuffle(texts)
    elif cfg.prompt_source == "synthetic":
        words = "the a cat dog sat ran on in red blue one two three four five stop go up down left right".split()
        texts = [" ".join(rng.choice(words) for _ in range(hi)) for _ in range(cfg.num_prompts * 2)]
    else:
        raise ValueError(f"prompt_source must be sharegpt or synthetic (got {cfg.prompt_source!r})")
    out: list[str] = []
    pool = iter(texts)
    while len(out) < cfg.num_prompts:
        target = rng.randint(lo, hi)
        text = next((t for t in pool if len(t) >= target), None)
        if text is None:
            raise ValueError(f"only {len(out)} prompts of {lo}..{hi} characters in {cfg.prompt_source}; "
                             "lower num_prompts or the lengths")
        cut = text[:target]
        cut = cut[: cut.rfind(" ")] if " " in cut[lo // 2 :] else cut
        if cut.strip() and cut not in out:
            out.append(cut)
    return out


def make_plan(cfg: SoakConfig, rng: random.Random, n: int, prompts: list[str]) -> Plan:
    protocol = rng.choices(PROTOCOLS, weights=cfg.protocol_weights)[0]
    stream = protocol in ("grpc", "kserve") or rng.random() < cfg.http_stream_fraction
    greedy = rng.random() < cfg.greedy_fraction
    i = rng.randrange(len(prompts))
    kinds = CHAOS_KINDS[protocol.split("-")[0]]
    chaos = rng.choice(kinds) if rng.random() < cfg.chaos_fraction else None
    plan = Plan(id=f"soak-{n}", protocol=protocol, stream=stream, prompt=prompts[i], prompt_index=i,
                max_tokens=rng.choice(cfg.greedy_lengths) if greedy else rng.randint(1, cfg.max_output_len),
                greedy=greedy, ignore_eos=protocol != "http-chat" or not greedy, chaos=chaos,
                chaos_chunks=rng.randint(*cfg.chaos_chunks), chaos_delay_s=rng.uniform(*cfg.chaos_delay_s),
                deadline_s=rng.uniform(*cfg.deadline_s))
    if not greedy:
        truncate = rng.random() < cfg.truncation_fraction
        plan = replace(plan, temperature=round(rng.uniform(0.5, 1.2), 2),
                       seed=rng.choice((None, rng.randrange(1 << 31))),
                       top_p=0.9 if truncate else 1.0, top_k=rng.choice((0, 40)) if truncate else 0)
    return plan


def reference_plans(prompts: list[str], lengths: tuple[int, ...], indices=None) -> list[Plan]:
    """The greedy combinations, alone: jaxserve.v1 for the text family (token ids and text), HTTP for chat."""
    plans = []
    for i in range(len(prompts)) if indices is None else indices:
        for m in lengths:
            for protocol, ignore_eos in (("grpc", True), ("http-chat", False)):
                plans.append(Plan(id=f"ref-{protocol}-{i}-{m}-{time.monotonic_ns()}", protocol=protocol, stream=False,
                                  prompt=prompts[i], prompt_index=i, max_tokens=m, greedy=True, ignore_eos=ignore_eos))
    return plans


def ref_key(plan: Plan) -> tuple:
    return plan.family, plan.prompt_index, plan.max_tokens, plan.ignore_eos


def diff(got: Reference, want: Reference) -> str | None:
    """How a greedy output differs from its reference, or None when equal."""
    if None not in (got.token_ids, want.token_ids) and got.token_ids != want.token_ids:
        k = next((j for j, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b),
                 min(len(got.token_ids), len(want.token_ids)))
        return f"token {k} differs: {got.token_ids[k:k + 4]} vs reference {want.token_ids[k:k + 4]}"
    if got.text != want.text:
        k = next((j for j, (a, b) in enumerate(zip(got.text, want.text)) if a != b), min(len(got.text), len(want.text)))
        return f"text differs at character {k}: {got.text[k:k + 30]!r} vs reference {want.text[k:k + 30]!r}"
    if got.finish_reason != want.finish_reason:
        return f"finish_reason {got.finish_reason!r} vs reference {want.finish_reason!r}"
    if None not in (got.completion_tokens, want.completion_tokens) and got.completion_tokens != want.completion_tokens:
        return f"{got.completion_tokens} tokens vs reference {want.completion_tokens}"
    return None


def as_reference(res: Result) -> Reference:
    return Reference(res.text, res.finish_reason, res.completion_tokens, res.token_ids)


# ---------------------------------------------------------------- the server's side: metrics, health, RSS


def scrape(base_url: str) -> dict[str, float]:
    """/metrics as {"name" or "name{label=value}": value} (counters under their _total names)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def metric_sum(m: dict, prefix: str) -> float:
    return sum(v for k, v in m.items() if k == prefix or k.startswith(prefix + "{"))


IDLE_GAUGES = ("jaxserve_num_requests_running", "jaxserve_num_requests_waiting", "jaxserve_num_requests_in_flight",
               "jaxserve_kv_cache_usage_perc")


async def wait_idle(base_url: str, timeout_s: float) -> tuple[dict, float]:
    """The metrics once every IDLE_GAUGES is 0 (or the last scrape at the timeout), and the seconds it took."""
    t0 = time.monotonic()
    while True:
        m = await asyncio.to_thread(scrape, base_url)
        if all(m.get(g, 1.0) == 0 for g in IDLE_GAUGES) or time.monotonic() - t0 > timeout_s:
            return m, time.monotonic() - t0
        await asyncio.sleep(0.5)


async def health(base_url: str, grpc_target: str) -> dict:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def http_status():
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    out = {"http": await asyncio.to_thread(http_status)}
    async with grpc.aio.insecure_channel(grpc_target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "jaxserve.v1.Generation"):
            r = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
            out[f"grpc {service or '(server)'}"] = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    return out


class Sampler:
    """Every `interval_s`: the server process's resident memory (psutil) and its load gauges (/metrics)."""

    def __init__(self, pid: int | None, base_url: str, interval_s: float):
        import psutil

        self.proc = psutil.Process(pid) if pid else None
        self.base_url, self.interval_s = base_url, interval_s
        self.rss: list[tuple[float, int]] = []  # (s since the load started, bytes)
        self.gauges: list[tuple[float, dict]] = []
        self._task = None

    async def _run(self, t0: float) -> None:
        while True:
            if self.proc is not None:
                self.rss.append((time.monotonic() - t0, self.proc.memory_info().rss))
            m = await asyncio.to_thread(scrape, self.base_url)
            self.gauges.append((time.monotonic() - t0, {g: m.get(g) for g in IDLE_GAUGES}))
            await asyncio.sleep(self.interval_s)

    def start(self, t0: float) -> None:
        self._task = asyncio.ensure_future(self._run(t0))

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    def rss_median(self, lo: float, hi: float) -> float:
        xs = [b for t, b in self.rss if lo <= t <= hi]
        return statistics.median(xs) if xs else float("nan")

    def gauge(self, name: str) -> list[float]:
        return [g[name] for _, g in self.gauges if g.get(name) is not None]


# ---------------------------------------------------------------- the soak


async def run_plans(clients: dict, plans: list[Plan], concurrency: int) -> list[Result]:
    gate = asyncio.Semaphore(concurrency)

    async def one(p):
        async with gate:
            return await send(clients, p)

    return list(await asyncio.gather(*(one(p) for p in plans)))


async def send(clients: dict, plan: Plan) -> Result:
    client = clients["grpc"] if plan.protocol in ("grpc", "kserve") else clients["http"]
    try:
        return await client(plan)
    except Exception as e:  # noqa: BLE001 - e.g. the connection refused: this request's violation, not the soak's end
        return Result(plan).end("violation", f"{type(e).__name__}: {e}")


async def references(clients: dict, prompts: list[str], cfg: SoakConfig, indices=None) -> tuple[dict, list[Result]]:
    results = await run_plans(clients, reference_plans(prompts, cfg.greedy_lengths, indices), 1)
    refs = {ref_key(r.plan): as_reference(r) for r in results if r.outcome == "completed"}
    return refs, [r for r in results if r.outcome != "completed"]


async def soak(cfg: SoakConfig, base_url: str, grpc_target: str, model: str, pid: int, log=print) -> dict:
    """Run the reference pass, the load and the checks against a running server; returns the record (see report)."""
    prompts = make_prompts(cfg)
    async with HttpClient(base_url, model, cfg.hang_timeout_s) as http, \
            GrpcClients(grpc_target, model, cfg.hang_timeout_s) as grpc_clients:
        clients = {"http": http, "grpc": grpc_clients}
        t = time.monotonic()
        refs, ref_failures = await references(clients, prompts, cfg)
        ref_s = time.monotonic() - t
        log(f"[soak] reference pass: {len(refs)} greedy references in {ref_s:.1f} s"
            + (f"; {len(ref_failures)} FAILED: {ref_failures[0].detail}" if ref_failures else ""))
        before = await asyncio.to_thread(scrape, base_url)

        rng = random.Random(cfg.seed)
        results: list[Result] = []
        in_flight = 0
        counter = iter(range(1 << 62))
        sampler = Sampler(pid, base_url, cfg.sample_interval_s)
        t0 = time.monotonic()
        stop_at = t0 + cfg.duration_s
        sampler.start(t0)

        async def worker():
            nonlocal in_flight
            while time.monotonic() < stop_at:
                plan = make_plan(cfg, rng, next(counter), prompts)
                in_flight += 1
                results.append(await send(clients, plan))
                in_flight -= 1

        async def progress():
            while True:
                await asyncio.sleep(max(5.0, cfg.duration_s / 20))
                c = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
                rss = f", server RSS {sampler.rss[-1][1] / 2**20:.0f} MiB" if sampler.rss else ""
                log(f"[soak] {time.monotonic() - t0:6.0f} s: {len(results)} ended {c}, {in_flight} in flight{rss}")

        reporter = asyncio.ensure_future(progress())
        # Start the streams over the first second rather than all in one instant.
        workers = []
        for i in range(cfg.concurrency):
            workers.append(asyncio.ensure_future(worker()))
            await asyncio.sleep(1.0 / cfg.concurrency)
        await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
        load_s = time.monotonic() - t0
        await sampler.stop()
        log(f"[soak] load over after {load_s:.0f} s; waiting for {in_flight} in-flight requests to end")
        await asyncio.gather(*workers)
        reporter.cancel()
        tail_s = time.monotonic() - t0 - load_s

        idle, idle_s = await wait_idle(base_url, cfg.idle_timeout_s)
        rechecked, recheck_failures = await references(clients, prompts, cfg,
                                                       range(min(cfg.recheck_prompts, len(prompts))))
        healthy = await health(base_url, grpc_target)

    window = max(3 * cfg.sample_interval_s, min(10.0, cfg.warmup_s / 2))
    rss_base = sampler.rss_median(cfg.warmup_s - window, cfg.warmup_s)
    rss_end = sampler.rss_median(load_s - window, load_s)
    return dict(
        prompts=prompts, refs=refs, reference_s=ref_s,
        reference_failures=[f"{r.plan.id}: {r.outcome} {r.detail}" for r in ref_failures + recheck_failures],
        recheck_mismatches=[f"{k}: {diff(v, refs[k])}" for k, v in rechecked.items() if k in refs and diff(v, refs[k])],
        rechecked=len(rechecked), load_s=load_s, tail_s=tail_s, idle_s=idle_s, results=results,
        before=before, after=idle, health=healthy, gauges=sampler.gauges, rss_samples=sampler.rss,
        rss=dict(base=rss_base, end=rss_end, peak=max((b for _, b in sampler.rss), default=float("nan")),
                 growth=rss_end / rss_base - 1 if rss_base else float("nan"), window_s=window),
        peak_in_flight=max(sampler.gauge("jaxserve_num_requests_in_flight"), default=0),
        mean_running=statistics.fmean(sampler.gauge("jaxserve_num_requests_running") or [0]),
    )


# ---------------------------------------------------------------- checks and report


def _overload(detail: str) -> bool:
    return detail.startswith(("HTTP 429", "gRPC RESOURCE_EXHAUSTED")) or "at capacity" in detail


def analyse(raw: dict, cfg: SoakConfig, exit_code: int | None) -> dict:
    """Counts per protocol and outcome, greedy comparisons, server counters, and the pass/fail checks."""
    results, refs, before, after = raw["results"], raw["refs"], raw["before"], raw["after"]
    by_protocol = {p: {o: 0 for o in ("sent", *OUTCOMES, "greedy_compared", "greedy_differ")} for p in PROTOCOLS}
    chaos, details, mismatches, unreferenced = {}, {}, [], 0
    for r in results:
        row = by_protocol[r.plan.protocol]
        row["sent"] += 1
        row[r.outcome or "violation"] += 1
        if r.plan.chaos:
            chaos.setdefault(r.plan.chaos, {o: 0 for o in OUTCOMES})[r.outcome or "violation"] += 1
        if r.outcome in ("error", "violation", "cancelled"):
            key = f"{r.outcome}: {r.detail.split(':')[0][:60]}"
            details[key] = details.get(key, 0) + 1
        if r.plan.greedy and r.outcome == "completed" and r.detail != "raw, unchecked":
            ref = refs.get(ref_key(r.plan))
            if ref is None:
                unreferenced += 1
                continue
            row["greedy_compared"] += 1
            why = diff(as_reference(r), ref)
            if why:
                row["greedy_differ"] += 1
                mismatches.append(f"{r.plan.id} ({r.plan.protocol}, prompt {r.plan.prompt_index}, "
                                  f"max_tokens {r.plan.max_tokens}): {why}")
    total = {k: sum(row[k] for row in by_protocol.values()) for k in next(iter(by_protocol.values()))}
    violations = [f"{r.plan.id} ({r.plan.protocol}, chaos {r.plan.chaos}): {r.detail}"
                  for r in results if r.outcome == "violation" or r.outcome is None]
    errors = [f"{r.plan.id} ({r.plan.protocol}): {r.detail}"
              for r in results if r.outcome == "error" and not _overload(r.detail)]

    def delta(name: str) -> float:
        return metric_sum(after, name) - metric_sum(before, name)

    server = dict(
        admitted=delta("jaxserve_requests_total"), finished=delta("jaxserve_request_success_total"),
        finished_by_reason={k.split("=")[1].rstrip("}"): v - before.get(k, 0.0) for k, v in after.items()
                            if k.startswith("jaxserve_request_success_total{")},
        rejected=delta("jaxserve_requests_rejected_total"), preemptions=delta("jaxserve_num_preemptions_total"),
        draft_tokens=delta("jaxserve_spec_decode_num_draft_tokens_total"),
        accepted_tokens=delta("jaxserve_spec_decode_num_accepted_tokens_total"),
        generation_tokens=delta("jaxserve_generation_tokens_total"),
        idle={g: after.get(g) for g in IDLE_GAUGES}, peak_in_flight=raw["peak_in_flight"],
        mean_running=raw["mean_running"],
    )
    server_completed = server["finished_by_reason"].get("length", 0) + server["finished_by_reason"].get("stop", 0)
    rss, h = raw["rss"], raw["health"]
    mib = 2**20
    checks = [
        ("every request ended exactly once", all(r.num_ends == 1 for r in results),
         f"{total['sent']} requests: {total['completed']} completed, {total['cancelled']} cancelled, "
         f"{total['error']} clean errors, {total['violation']} violations"),
        ("no protocol violation", not violations, "; ".join(violations[:3]) or "none"),
        ("no error but overload", not errors, "; ".join(errors[:3]) or "none"),
        ("greedy outputs equal the reference", not mismatches and not unreferenced and not raw["reference_failures"],
         f"{total['greedy_compared']} compared, {len(mismatches)} differ"
         + (f"; {unreferenced} without a reference" if unreferenced else "")
         + (f"; reference failures: {raw['reference_failures'][:2]}" if raw["reference_failures"] else "")
         + (f"; {mismatches[0]}" if mismatches else "")),
        ("no leaked requests or KV pages", all(after.get(g) == 0 for g in IDLE_GAUGES),
         ", ".join(f"{g.removeprefix('jaxserve_')} {after.get(g)}" for g in IDLE_GAUGES)
         + f" after {raw['idle_s']:.1f} s"),
        (f"RSS growth < {100 * cfg.rss_growth_limit:g}% after warm-up", rss["growth"] < cfg.rss_growth_limit,
         f"{rss['base'] / mib:.0f} MiB at {cfg.warmup_s:g} s -> {rss['end'] / mib:.0f} MiB at the end "
         f"({100 * rss['growth']:+.2f}%), peak {rss['peak'] / mib:.0f} MiB"),
        ("server healthy afterwards", h.get("http") == 200 and all(v == "SERVING" for k, v in h.items() if k != "http"),
         ", ".join(f"{k} {v}" for k, v in h.items())),
        ("references reproduce after the soak", not raw["recheck_mismatches"] and raw["rechecked"] > 0,
         f"{raw['rechecked']} rechecked" + (f"; {raw['recheck_mismatches'][0]}" if raw["recheck_mismatches"] else "")),
        ("KV squeezed: preemptions > 0", server["preemptions"] > 0, f"{server['preemptions']:.0f} preemptions"),
        ("speculation ran: draft tokens > 0", server["draft_tokens"] > 0,
         f"{server['accepted_tokens']:.0f} of {server['draft_tokens']:.0f} draft tokens accepted"),
        (f"load reached: server in-flight peak >= 0.8 x {cfg.concurrency}",
         server["peak_in_flight"] >= 0.8 * cfg.concurrency,
         f"peak {server['peak_in_flight']:.0f} in flight, {server['mean_running']:.1f} running on average"),
        ("server counts consistent", server["admitted"] <= total["sent"] and server["finished"] <= server["admitted"]
         and server_completed >= total["completed"],
         f"{server['admitted']:.0f} admitted of {total['sent']} sent, {server['finished']:.0f} finished "
         f"({server_completed:.0f} length/stop >= {total['completed']} completed by clients)"),
    ]
    if exit_code is not None:
        checks.append(("SIGTERM drains and exits 0", exit_code == 0, f"exit status {exit_code}"))
    return dict(
        checks=[dict(check=c, ok=bool(ok), detail=d) for c, ok, d in checks], passed=all(ok for _, ok, _ in checks),
        totals=total, by_protocol=by_protocol, chaos=chaos, outcome_details=details, server=server,
        violations=violations[:20], errors=errors[:20], mismatches=mismatches[:20], rss=rss,
        load_s=raw["load_s"], tail_s=raw["tail_s"], reference_s=raw["reference_s"], references=len(refs),
        prompt_chars=[len(p) for p in raw["prompts"]], health=h,
        rss_samples=raw["rss_samples"], gauges=raw["gauges"],
    )


def checks_table(summary: dict) -> str:
    return md_table(["check", "result", "detail"],
                    [[c["check"], "pass" if c["ok"] else "**FAIL**", c["detail"]] for c in summary["checks"]])


def report(record: dict) -> str:
    s, cfg = record["summary"], record["config"]
    rows = [[p, *(row[k] for k in ("sent", "completed", "cancelled", "error", "violation", "greedy_compared",
                                   "greedy_differ"))] for p, row in s["by_protocol"].items()]
    t = s["totals"]
    rows.append(["all", *(t[k] for k in ("sent", "completed", "cancelled", "error", "violation", "greedy_compared",
                                         "greedy_differ"))])
    chaos = [[k, sum(v.values()), *(v[o] for o in OUTCOMES)] for k, v in sorted(s["chaos"].items())]
    srv = s["server"]
    md = [f"# Chaos soak: {cfg['concurrency']} concurrent streams for {s['load_s']:.0f} s", "",
          f"Server: `jaxserve serve {' '.join(record['server_args'])}`. "
          f"{100 * cfg['chaos_fraction']:g}% of requests ended early, {100 * cfg['greedy_fraction']:g}% greedy "
          f"(checked "
          f"against {s['references']} references sent alone before the load), {len(s['prompt_chars'])} prompts of "
          f"{min(s['prompt_chars'])}-{max(s['prompt_chars'])} characters ({cfg['prompt_source']}), sampled max_tokens "
          f"1-{cfg['max_output_len']}, greedy max_tokens {' or '.join(map(str, cfg['greedy_lengths']))}. "
          f"Load {s['load_s']:.0f} s, then "
          f"{s['tail_s']:.0f} s for the last requests to end.", "",
          checks_table(s), "",
          md_table(["protocol", "sent", "completed", "cancelled", "clean errors", "violations", "greedy compared",
                    "greedy differ"], rows), "",
          "Early endings by kind (what the request then counted as):", "",
          md_table(["chaos", "requests", *OUTCOMES], chaos), "",
          f"Server counters over the load: {srv['admitted']:.0f} admitted, finished by reason "
          f"{ {k: int(v) for k, v in srv['finished_by_reason'].items()} }, {srv['rejected']:.0f} rejected, "
          f"{srv['preemptions']:.0f} preemptions, {srv['generation_tokens']:.0f} tokens generated "
          f"({srv['generation_tokens'] / (s['load_s'] + s['tail_s']):.0f} tok/s over load and tail), "
          f"n-gram drafts {srv['accepted_tokens']:.0f} / "
          f"{srv['draft_tokens']:.0f} accepted; peak {srv['peak_in_flight']:.0f} requests in flight, "
          f"{srv['mean_running']:.1f} running on average.", ""]
    md += ["Reproduce:", "", f"    {record['command']}", "", machine_line(record["machine"]), ""]
    return "\n".join(md)


# ---------------------------------------------------------------- running it


def server_args(args) -> list[str]:
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens})
    out = ["--num-pages", str(args.num_pages), "--page-size", str(args.page_size),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--speculative-config", spec,
           "--max-in-flight", str(2 * args.concurrency + 16)]
    return (["--model", args.model] if args.model else []) + out + list(args.server_arg or [])


def run_soak(cfg: SoakConfig, args, log_dir: str = LOG_DIR, log=print) -> tuple[dict, list[str]]:
    """Start `jaxserve serve` (bench.servers), soak it, stop it with SIGTERM; (summary, server flags)."""
    from bench import servers

    flags = server_args(args)
    srv, why = servers.start("jaxserve", max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                             log_dir=log_dir, timeout_s=args.server_timeout, jaxserve_args=flags)
    if srv is None:
        raise SystemExit(f"soak: the server did not start: {why}")
    try:
        raw = asyncio.run(soak(cfg, srv.url, srv.grpc_target, srv.model, srv.proc.pid, log))
    finally:
        srv.stop()
    shown = ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len), *flags]
    return analyse(raw, cfg, srv.proc.returncode), shown


def config_from_args(args) -> SoakConfig:
    return SoakConfig(duration_s=args.duration, concurrency=args.concurrency, chaos_fraction=args.chaos_fraction,
                      greedy_fraction=args.greedy_fraction, num_prompts=args.num_prompts,
                      prompt_chars=tuple(args.prompt_chars), prompt_source=args.prompt_source,
                      greedy_lengths=tuple(args.greedy_lengths), max_output_len=args.max_output_len,
                      truncation_fraction=args.truncation_fraction,
                      warmup_s=args.warmup if args.warmup is not None else min(60.0, 0.2 * args.duration),
                      recheck_prompts=args.recheck_prompts, seed=args.seed)


def add_args(ap: argparse.ArgumentParser) -> None:
    d = SoakConfig()
    ap.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=d.concurrency, help="requests kept in flight")
    ap.add_argument("--chaos-fraction", type=float, default=d.chaos_fraction)
    ap.add_argument("--greedy-fraction", type=float, default=d.greedy_fraction)
    ap.add_argument("--num-prompts", type=int, default=d.num_prompts)
    ap.add_argument("--prompt-source", choices=["sharegpt", "synthetic"], default=d.prompt_source)
    ap.add_argument("--prompt-chars", type=int, nargs=2, default=list(d.prompt_chars), metavar=("MIN", "MAX"))
    ap.add_argument("--greedy-lengths", type=int, nargs="+", default=list(d.greedy_lengths))
    ap.add_argument("--max-output-len", type=int, default=d.max_output_len)
    ap.add_argument("--truncation-fraction", type=float, default=d.truncation_fraction,
                    help="of sampled requests with top_p 0.9 / top_k 40 (slow on CPU: see docs/reliability.md)")
    ap.add_argument("--warmup", type=float, default=None,
                    help="s of load before the RSS baseline (default: 20%%, <= 60)")
    ap.add_argument("--recheck-prompts", type=int, default=d.recheck_prompts)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=160, help="KV pages, squeezed so that preemption is constant")
    ap.add_argument("--num-speculative-tokens", type=int, default=4, help="n-gram speculation depth")
    ap.add_argument("--server-arg", action="append", help="one more `jaxserve serve` argument (repeatable)")
    ap.add_argument("--server-timeout", type=float, default=1800, help="s to wait for the server to be healthy")
    ap.add_argument("--out", default=OUT_DIR)
    ap.add_argument("--name", default="soak", help="output file stem")


def run(args) -> dict:
    cfg = config_from_args(args)
    summary, flags = run_soak(cfg, args)
    record = dict(command=command_line("bench.soak"), machine=machine_info(), args=args_record(args),
                  config=asdict(cfg), server_args=flags, summary=summary)
    paths = write_outputs(args.out, args.name, record, report(record))
    print(checks_table(summary))
    print("\n".join(f"wrote {p}" for p in paths))
    if not summary["passed"]:
        failed = [c["check"] for c in summary["checks"] if not c["ok"]]
        raise SystemExit(f"soak: {len(failed)} check(s) failed: {', '.join(failed)}")
    return record


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    run(p.parse_args())
    sys.exit(0)
