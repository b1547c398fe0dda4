"""Timing shared by the kernel benchmarks (`*/bench.py`)."""

from __future__ import annotations

import statistics
import time

import jax


def time_call(f, args, *, min_seconds: float, max_iters: int) -> float:
    """Seconds per call of f(*args): median of 5 timed batches after a warm-up (the launch queue stays full)."""
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    once = max(time.perf_counter() - t, 1e-6)
    iters = max(1, min(max_iters, int(min_seconds / once)))
    samples = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t) / iters)
    return statistics.median(samples)
