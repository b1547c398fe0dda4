"""CPU benchmark: the native FFI matmul against XLA's dot, on SmolLM2-135M's linear maps.

    python -m cpu_kernels.matmul.bench            # ~1-2 min on 2 cores; writes docs/benchmarks/cpu_matmul.{json,md}
    python -m cpu_kernels.matmul.bench --smoke    # tiny shapes, a few seconds, writes nothing

One row per (weight shape, M rows): q/o projections 576x576, k/v 576x192, gate/up 576x1536, down 1536x576 and the
tied logits projection 576x49152, at M = 1 (single-stream decode), 16 (a full decode batch), 64 and 256 (prefill
chunks). Times are the minimum and median of interleaved repeats (xla, native, xla, ...); the "one step" rows add
up a whole forward's linear maps (30 layers x 7 + the logits) from the per-shape minima. Max |error| is against a
float64 numpy product.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import OUT_DIR, machine_info, machine_line, md_table, write_outputs
from cpu_kernels import matmul as native

NUM_LAYERS = 30
# (name, K, N, uses per step)
SHAPES = [("q, o proj", 576, 576, 2 * NUM_LAYERS), ("k, v proj", 576, 192, 2 * NUM_LAYERS),
          ("gate, up proj", 576, 1536, 2 * NUM_LAYERS), ("down proj", 1536, 576, NUM_LAYERS),
          ("logits (tied embed)", 576, 49152, 1)]
ROWS = (1, 16, 64, 256)


def _timer(f, args, repeats_per_sample: int):
    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(repeats_per_sample):
            out = f(*args)
        out.block_until_ready()
        return (time.perf_counter() - t0) / repeats_per_sample

    return run


def bench_case(K: int, N: int, M: int, rounds: int) -> dict:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    args = {"xla": (jnp.asarray(x), jnp.asarray(w)), "native": (jnp.asarray(x), native.pack(w))}
    impls = {"xla": jax.jit(lambda a, b: a @ b), "native": jax.jit(native.matmul)}
    ref = x.astype(np.float64) @ w.astype(np.float64)
    errs = {name: float(np.abs(np.asarray(f(*args[name])) - ref).max()) for name, f in impls.items()}
    probe = time.perf_counter()
    impls["xla"](*args["xla"]).block_until_ready()
    per_sample = max(1, int(0.05 / max(time.perf_counter() - probe, 1e-6)))
    timers = {name: _timer(f, args[name], per_sample) for name, f in impls.items()}
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(rounds):
        for name, run in timers.items():
            times[name].append(run())
    row = dict(K=K, N=N, M=M, gflop=2 * M * K * N / 1e9, xla_max_abs_err=errs["xla"], native_max_abs_err=errs["native"])
    for name, ts in times.items():
        row[f"{name}_ms_min"] = min(ts) * 1e3
        row[f"{name}_ms_median"] = float(np.median(ts)) * 1e3
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no output files")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds per case")
    args = parser.parse_args(argv)
    if not native.load():
        raise SystemExit("the native CPU matmul library could not be built (see the warning above)")
    shapes = [("smoke", 64, 100, 1)] if args.smoke else SHAPES
    rows_m = (1, 5) if args.smoke else ROWS
    rows = []
    for name, K, N, uses in shapes:
        for M in rows_m:
            row = dict(name=name, uses_per_step=uses, **bench_case(K, N, M, 2 if args.smoke else args.rounds))
            rows.append(row)
            print(f"{name} {K}x{N} M={M}: xla {row['xla_ms_min']:.3f} ms, native {row['native_ms_min']:.3f} ms (min)",
                  flush=True)
    table_rows = [
        [r["name"], f"{r['K']}x{r['N']}", r["M"], f"{r['xla_ms_min']:.3f} ({r['xla_ms_median']:.3f})",
         f"{r['native_ms_min']:.3f} ({r['native_ms_median']:.3f})", f"{r['gflop'] / r['xla_ms_min'] * 1e3:.0f}",
         f"{r['gflop'] / r['native_ms_min'] * 1e3:.0f}", f"{r['xla_ms_min'] / r['native_ms_min']:.2f}x",
         f"{r['native_max_abs_err']:.1e}"]
        for r in rows
    ]
    steps = {}
    for M in rows_m:
        per = [r for r in rows if r["M"] == M]
        steps[M] = {impl: sum(r[f"{impl}_ms_min"] * r["uses_per_step"] for r in per) for impl in ("xla", "native")}
        table_rows.append([f"**one step** ({NUM_LAYERS} layers x 7 + logits)", "", M, f"{steps[M]['xla']:.1f}",
                           f"{steps[M]['native']:.1f}", "", "", f"{steps[M]['xla'] / steps[M]['native']:.2f}x", ""])
    header = ["linear map", "K x N", "M rows", "XLA ms min (median)", "native ms min (median)", "XLA GFLOP/s",
              "native GFLOP/s", "speedup (min)", "native max abs err"]
    table = md_table(header, table_rows)
    print(table)
    if args.smoke:
        return
    meta = machine_info()
    markdown = (
        "# CPU matmul: native FFI kernel vs XLA dot\n\n"
        "SmolLM2-135M's linear maps, float32, x f32[M, K] @ w f32[K, N] (native: w packed in 32-column panels). "
        "`python -m cpu_kernels.matmul.bench`.\n\n"
        f"{table}\n\n{machine_line(meta)}\n"
    )
    paths = write_outputs(OUT_DIR, "cpu_matmul", dict(meta=meta, rounds=args.rounds, rows=rows, steps=steps), markdown)
    print("wrote " + ", ".join(paths))


if __name__ == "__main__":
    main()
