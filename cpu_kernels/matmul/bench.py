"""CPU benchmark: the native FFI matmul against XLA's dot, on SmolLM2-135M's linear maps.

    python -m cpu_kernels.matmul.bench            # ~1-2 min on 2 cores; writes docs/benchmarks/cpu_matmul.{json,md}
    python -m cpu_kernels.matmul.bench --smoke    # tiny shapes, a few seconds, writes nothing

Two tables, at M = 1 (single-stream decode), 16 (a full decode batch), 64 and 256 (prefill chunks) rows:

* **One step's linear maps, weights from memory** (the number that matters): a jitted chain over 30 layers of
  distinct random weights (q, k, v, o, gate, up, down per layer, RMS-normalised residual) plus the tied logits
  projection, 540 MB of f32 weights per call, as in a real decode step where no weight is still in cache.
* **One product, weights hot in cache**: each shape alone, repeated (a 576x576 weight stays in L2/L3), which
  flatters XLA's dot: it shows the kernels' arithmetic, not the streaming a step does.

Times are the minimum and median of interleaved repeats (xla, native, xla, ...). Max |error| is against a float64
numpy product (per shape) or between the two chains (per step).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import matmul as native
from cpu_kernels.bench_util import OUT_DIR, machine_info, machine_line, md_table, time_calls, write_outputs

NUM_LAYERS = 30
# (name, K, N)
SHAPES = [("q, o proj", 576, 576), ("k, v proj", 576, 192), ("gate, up proj", 576, 1536), ("down proj", 1536, 576),
          ("logits (tied embed)", 576, 49152)]
ROWS = (1, 16, 64, 256)


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
    times = time_calls({name: (f, args[name]) for name, f in impls.items()}, rounds, per_sample)
    row = dict(K=K, N=N, M=M, gflop=2 * M * K * N / 1e9, xla_max_abs_err=errs["xla"], native_max_abs_err=errs["native"])
    for name, t in times.items():
        row[f"{name}_ms_min"], row[f"{name}_ms_median"] = t["min_ms"], t["median_ms"]
    return row


def _step_weights(rng) -> tuple[list[dict], np.ndarray]:
    layers = []
    for _ in range(NUM_LAYERS):
        layers.append({name: (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
                       for name, K, N in (("wq", 576, 576), ("wk", 576, 192), ("wv", 576, 192), ("wo", 576, 576),
                                          ("w_gate", 576, 1536), ("w_up", 576, 1536), ("w_down", 1536, 576))})
    return layers, (rng.standard_normal((576, 49152)) / 24).astype(np.float32)


def _chain(x, layers, head, mm):
    """x f32[M, 576] through every layer's seven linear maps, then the logits: f32[M, 49152]."""
    for w in layers:
        q, k, v = mm(x, w["wq"]), mm(x, w["wk"]), mm(x, w["wv"])
        h = x + mm(q, w["wo"]) + 1e-3 * jnp.concatenate([k, v, k], axis=1)
        x = h + mm(jax.nn.silu(mm(h, w["w_gate"])) * mm(h, w["w_up"]), w["w_down"])
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return mm(x, head)


def bench_step(M: int, rounds: int, weights) -> dict:
    layers, head = weights
    x = jnp.asarray(np.random.default_rng(1).standard_normal((M, 576)).astype(np.float32))
    args = {
        "xla": (x, [{k: jnp.asarray(v) for k, v in w.items()} for w in layers], jnp.asarray(head)),
        "native": (x, [{k: native.pack(v) for k, v in w.items()} for w in layers], native.pack(head)),
    }
    impls = {"xla": jax.jit(lambda x, ws, h: _chain(x, ws, h, lambda a, b: a @ b)),
             "native": jax.jit(lambda x, ws, h: _chain(x, ws, h, native.matmul))}
    outs = {name: np.asarray(f(*args[name])) for name, f in impls.items()}
    err = float(np.abs(outs["native"] - outs["xla"]).max())
    times = time_calls({name: (f, args[name]) for name, f in impls.items()}, rounds)
    row = dict(M=M, max_abs_diff=err)
    for name, t in times.items():
        row[f"{name}_ms_min"], row[f"{name}_ms_median"] = t["min_ms"], t["median_ms"]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no output files")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds per case")
    args = parser.parse_args(argv)
    if not native.load():
        raise SystemExit("the native CPU matmul library could not be built (see the warning above)")
    shapes = [("smoke", 64, 100)] if args.smoke else SHAPES
    rows_m = (1, 5) if args.smoke else ROWS
    steps = []
    if not args.smoke:
        weights = _step_weights(np.random.default_rng(0))
        for M in rows_m:
            row = bench_step(M, args.rounds, weights)
            steps.append(row)
            print(f"one step M={M}: xla {row['xla_ms_min']:.1f} ms, native {row['native_ms_min']:.1f} ms (min)",
                  flush=True)
        del weights
    step_table = md_table(
        ["M rows", "XLA ms min (median)", "native ms min (median)", "speedup (min)", "max abs diff"],
        [[r["M"], f"{r['xla_ms_min']:.1f} ({r['xla_ms_median']:.1f})",
          f"{r['native_ms_min']:.1f} ({r['native_ms_median']:.1f})", f"{r['xla_ms_min'] / r['native_ms_min']:.2f}x",
          f"{r['max_abs_diff']:.1e}"] for r in steps])
    rows = []
    for name, K, N in shapes:
        for M in rows_m:
            row = dict(name=name, **bench_case(K, N, M, 2 if args.smoke else args.rounds))
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
    header = ["linear map", "K x N", "M rows", "XLA ms min (median)", "native ms min (median)", "XLA GFLOP/s",
              "native GFLOP/s", "speedup (min)", "native max abs err"]
    table = md_table(header, table_rows)
    print(step_table + "\n\n" + table)
    if args.smoke:
        return
    meta = machine_info()
    markdown = (
        "# CPU matmul: native FFI kernel vs XLA dot\n\n"
        "SmolLM2-135M's linear maps, float32, x f32[M, K] @ w f32[K, N] (native: w packed in 32-column panels). "
        "`python -m cpu_kernels.matmul.bench`.\n\n"
        f"## One step's linear maps ({NUM_LAYERS} layers x 7 + logits), weights from memory\n\n{step_table}\n\n"
        f"## One product, weights hot in cache\n\n{table}\n\n{machine_line(meta)}\n"
    )
    paths = write_outputs(OUT_DIR, "cpu_matmul", dict(meta=meta, rounds=args.rounds, steps=steps, rows=rows), markdown)
    print("wrote " + ", ".join(paths))


if __name__ == "__main__":
    main()
