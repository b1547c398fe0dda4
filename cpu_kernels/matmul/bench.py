"""CPU benchmark: the native FFI matmul (f32, bf16, int8, 4-bit weights) against XLA's dot, on SmolLM2-135M's
linear maps.

    python -m cpu_kernels.matmul.bench            # ~3-4 min on 2 cores; writes docs/benchmarks/cpu_matmul.{json,md}
    python -m cpu_kernels.matmul.bench --smoke    # tiny shapes, a few seconds, writes nothing
    python -m cpu_kernels.matmul.bench --cold     # M = 1 against cold weights, per shape (~20 s), writes nothing

Two tables (and, with --cold, a third alone):

* **One step's linear maps, weights from memory** (the number that matters), at M = 1 (single-stream decode), 16 (a
  full decode batch) and 64 (a prefill chunk) rows, per weight format: a jitted chain over 30 layers of distinct
  random weights (q, k, v, o, gate, up, down per layer, RMS-normalised residual) plus the tied logits projection
  (540 MB in f32, 135 MB in int8), as in a real decode step where no weight is still in cache. The formats' native
  chains run interleaved (f32, bf16, ..., f32, bf16, ...), then XLA's versions, interleaved (a dot against f32
  weights, or against `unpack()` of the packed weight: the fallback). Bandwidth is the packed bytes (values, scales,
  zeros) over the median time, against the copy bandwidth (np.copyto, read + write, as bench/decode.py measures it).
* **One product, weights hot in cache**, f32: each shape alone, repeated (a 576x576 weight stays in L2/L3), which
  flatters XLA's dot: it shows the kernels' arithmetic, not the streaming a step does.

* **M = 1, cold weights, per shape** (`--cold`, `bench_cold`): one jitted chain of M = 1 products over 30 distinct
  copies of a shape (4 for the logits), as the per-call number behind the first table; us per call and GB/s.

Times are the median (and minimum) of interleaved repeats. Max |error| is against a float64 numpy product (per shape)
or between the native and XLA chains of the same weights (per step).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from cpu_kernels import bench_util as util
from cpu_kernels import matmul as native

NUM_LAYERS = 30
# (name, K, N)
SHAPES = [("q, o proj", 576, 576), ("k, v proj", 576, 192), ("gate, up proj", 576, 1536), ("down proj", 1536, 576),
          ("logits (tied embed)", 576, 49152)]
ROWS = (1, 16, 64, 256)
STEP_ROWS = (1, 16, 64)
# Numbers before the integer formats' activation quantization, and before bf16's vdpbf16ps, quoted in the doc.
BEFORE = ("Before (int8 / int4 widened to f32 in registers, f32 FMAs; commit 3b3778c, copy bandwidth 22.2 GB/s), "
          "native ms median per step: M = 1: int8 G = K 11.4, int8 G = 32 12.7, int4 G = 32 + zeros 11.0 (41-54% of "
          "copy bandwidth); M = 16: 37.6, 42.4, 41.3; M = 64: 112.5, 113.1, 123.1 (f32: 26.1, 51.3, 114.7). "
          "bf16 before vdpbf16ps (weights widened exactly in registers, f32 FMAs on float activations; the previous "
          "run of this benchmark, on a loaded machine): M = 1 / 16 / 64: 14.3 / 68.5 / 259.7 ms, against f32's "
          "23.1 / 73.7 / 240.0 in the same run.")
# weight format label -> (format, group G (0: one group = K), zeros)
STEP_FORMATS = {"f32": ("f32", 0, False), "bf16": ("bf16", 0, False), "int8, G = K": ("int8", 0, False),
                "int8, G = 32": ("int8", 32, False), "int4, G = 32 + zeros": ("int4", 32, True)}


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
    times = util.time_calls({name: (f, args[name]) for name, f in impls.items()}, rounds, per_sample)
    row = dict(K=K, N=N, M=M, gflop=2 * M * K * N / 1e9, xla_max_abs_err=errs["xla"], native_max_abs_err=errs["native"])
    for name, t in times.items():
        row[f"{name}_ms_min"], row[f"{name}_ms_median"] = t["min_ms"], t["median_ms"]
    return row


def _random_weight(rng, K: int, N: int, fmt: str, group: int, zeros: bool,
                   f16_heads: bool = False) -> native.PackedLinear:
    """A random packed weight of about N(0, 1 / K) entries in `fmt` (values, scales and zeros drawn directly);
    `f16_heads`: scales and zeros exactly representable in f16 (as a GGUF file's are), so they pack in 2 bytes."""
    if fmt in ("f32", "bf16"):
        w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
        return native.pack(w if fmt == "f32" else w.astype(ml_dtypes.bfloat16))
    G = group or K
    if fmt == "int8":
        q, spread, mid = rng.integers(-127, 128, (K, N)).astype(np.int8), 73.0, 0.0
    else:
        q, spread, mid = rng.integers(0, 16, (K, N)).astype(np.uint8), 4.6, 7.5
    head = (lambda a: a.astype(np.float16).astype(np.float32)) if f16_heads else (lambda a: a)  # noqa: E731
    s = head((rng.uniform(0.8, 1.2, (K // G, N)) / (spread * np.sqrt(K))).astype(np.float32))
    z = head((-mid * s).astype(np.float32)) if zeros else None
    return native.pack_quantized(q, s, z, bits=8 if fmt == "int8" else 4)


def _step_weights(rng, fmt: str, group: int, zeros: bool) -> tuple[list[dict], native.PackedLinear]:
    layers = [{name: _random_weight(rng, K, N, fmt, group, zeros)
               for name, K, N in (("wq", 576, 576), ("wk", 576, 192), ("wv", 576, 192), ("wo", 576, 576),
                                  ("w_gate", 576, 1536), ("w_up", 576, 1536), ("w_down", 1536, 576))}
              for _ in range(NUM_LAYERS)]
    return layers, _random_weight(rng, 576, 49152, fmt, group, zeros)


def _chain(x, layers, head, mm):
    """x f32[M, 576] through every layer's seven linear maps, then the logits: f32[M, 49152]."""
    for w in layers:
        q, k, v = mm(x, w["wq"]), mm(x, w["wk"]), mm(x, w["wv"])
        h = x + mm(q, w["wo"]) + 1e-3 * jnp.concatenate([k, v, k], axis=1)
        x = h + mm(jax.nn.silu(mm(h, w["w_gate"])) * mm(h, w["w_up"]), w["w_down"])
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return mm(x, head)


def _xla_matmul(x, w: native.PackedLinear):
    """What `matmul` computes, in XLA (its fallback): x @ unpack(), x rounded to bf16 (bf16) or quantized per block
    (int8, int4) first."""
    return native.activations(x, w.format) @ w.unpack()


def bench_steps(M: int, rounds: int, weights: dict) -> list[dict]:
    """One step's linear maps at M rows for every format in `weights` {label: (layers, head)}, native and XLA (a dot
    against f32 weights as given, or the fallback `_xla_matmul`), all interleaved."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((M, 576)).astype(np.float32))
    native_step = jax.jit(lambda x, ws, h: _chain(x, ws, h, native.matmul))
    xla_step = jax.jit(lambda x, ws, h: _chain(x, ws, h, _xla_matmul))
    xla_f32_step = jax.jit(lambda x, ws, h: _chain(x, ws, h, lambda a, b: a @ b))
    calls = {}
    for label, (layers, head) in weights.items():
        calls[("native", label)] = (native_step, (x, layers, head))
        if label == "f32":  # XLA's plain dot against the unpacked f32 weights (what runs without the kernel)
            layers, head = ([{k: v.unpack() for k, v in w.items()} for w in layers], head.unpack())
            calls[("xla", label)] = (xla_f32_step, (x, layers, head))
        else:
            calls[("xla", label)] = (xla_step, (x, layers, head))
    outs = {key: np.asarray(f(*args)) for key, (f, args) in calls.items()}  # also the warm-up
    # Two interleaved groups, native then XLA: the XLA fallback's dequantized temporaries (hundreds of MB per call,
    # page faults and frees) slow whatever runs next, which would penalise the native calls interleaved with them.
    times = {}
    for impl in ("native", "xla"):
        times.update(util.time_calls({key: call for key, call in calls.items() if key[0] == impl}, rounds))
    rows = []
    for label, (layers, head) in weights.items():
        nbytes = sum(w.nbytes for layer in layers for w in layer.values()) + head.nbytes
        nat, xla = times[("native", label)], times[("xla", label)]
        rows.append(dict(format=label, M=M, packed_bytes=nbytes, native_ms_median=nat["median_ms"],
                         native_ms_min=nat["min_ms"], xla_ms_median=xla["median_ms"], xla_ms_min=xla["min_ms"],
                         native_GBps=nbytes / nat["median_ms"] / 1e6,
                         max_abs_diff=float(np.abs(outs[("native", label)] - outs[("xla", label)]).max())))
    return rows


# Cold weights at M = 1: (K, N, formats, copies). 30 distinct copies per shape (> 30 MB: out of every cache); the
# logits shape is 28 MB a copy, so 4 copies are as cold and pack in seconds.
COLD_SHAPES = [(576, 960, None, 30), (576, 576, None, 30), (576, 3072, None, 30), (1536, 576, None, 30),
               (576, 49152, ("int8, G = 32",), 4)]
COLD_FORMATS = {"bf16": ("bf16", 0, False), "int8, G = 32": ("int8", 32, False),
                "int4, G = 32 + zeros": ("int4", 32, True)}


def bench_cold(rounds: int) -> list[dict]:
    """M = 1 products against cold weights: per shape and format, one jitted chain over distinct copies (each
    call's input depends on the previous output through one scalar, as in a step); us per call and GB/s (packed
    bytes / time), all cases interleaved."""
    rng = np.random.default_rng(0)

    def chain(x, ws):
        for w in ws:
            y = native.matmul(x, w)
            x = x * (1 + 1e-9 * y[:, :1])
        return x

    f = jax.jit(chain)
    calls, info = {}, {}
    for K, N, fmts, copies in COLD_SHAPES:
        for label in fmts or COLD_FORMATS:
            ws = [_random_weight(rng, K, N, *COLD_FORMATS[label], f16_heads=True) for _ in range(copies)]
            x = jnp.asarray(rng.standard_normal((1, K)).astype(np.float32))
            calls[(K, N, label)] = (f, (x, ws))
            info[(K, N, label)] = (copies, sum(w.nbytes for w in ws))
    for fn, args in calls.values():
        fn(*args).block_until_ready()  # compile and warm up
    times = util.time_calls(calls, rounds)
    rows = []
    for (K, N, label), t in times.items():
        copies, nbytes = info[(K, N, label)]
        rows.append(dict(K=K, N=N, format=label, copies=copies, bytes_per_call=nbytes // copies,
                         us_per_call=t["median_ms"] * 1e3 / copies, us_per_call_min=t["min_ms"] * 1e3 / copies,
                         GBps=nbytes / t["median_ms"] / 1e6))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no output files")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds per case")
    parser.add_argument("--cold", action="store_true", help="only M = 1 products against cold weights (a table)")
    args = parser.parse_args(argv)
    if not native.load():
        raise SystemExit("the native CPU matmul library could not be built (see the warning above)")
    if args.cold:
        rows = bench_cold(args.rounds)
        print(util.md_table(["K x N", "weights", "copies", "KB per call", "us per call median (min)", "GB/s"],
                            [[f"{r['K']}x{r['N']}", r["format"], r["copies"], f"{r['bytes_per_call'] / 1e3:.0f}",
                              f"{r['us_per_call']:.1f} ({r['us_per_call_min']:.1f})", f"{r['GBps']:.1f}"]
                             for r in rows]))
        print(f"copy bandwidth {util.copy_bandwidth() / 1e9:.1f} GB/s")
        return
    shapes = [("smoke", 64, 100)] if args.smoke else SHAPES
    rows_m = (1, 5) if args.smoke else ROWS
    steps, bandwidth = [], []
    if not args.smoke:
        rng = np.random.default_rng(0)
        weights = {label: _step_weights(rng, *spec) for label, spec in STEP_FORMATS.items()}
        for M in STEP_ROWS:
            bandwidth.append(util.copy_bandwidth())
            for row in bench_steps(M, args.rounds, weights):
                steps.append(row)
                print(f"one step M={M} {row['format']}: native {row['native_ms_median']:.1f} ms, "
                      f"{row['native_GBps']:.1f} GB/s; xla {row['xla_ms_median']:.1f} ms (medians)", flush=True)
        bandwidth.append(util.copy_bandwidth())
        del weights
    copy_GBps = statistics.median(bandwidth) / 1e9 if bandwidth else float("nan")
    f32_ms = {r["M"]: r["native_ms_median"] for r in steps if r["format"] == "f32"}
    step_table = util.md_table(
        ["weights", "M rows", "packed MB", "native ms median (min)", "native GB/s", "% of copy bandwidth",
         "vs native f32", "XLA ms median (min)", "native vs XLA", "max abs diff"],
        [[r["format"], r["M"], f"{r['packed_bytes'] / 1e6:.0f}",
          f"{r['native_ms_median']:.1f} ({r['native_ms_min']:.1f})",
          f"{r['native_GBps']:.1f}", f"{100 * r['native_GBps'] / copy_GBps:.0f}%",
          f"{f32_ms[r['M']] / r['native_ms_median']:.2f}x", f"{r['xla_ms_median']:.1f} ({r['xla_ms_min']:.1f})",
          f"{r['xla_ms_median'] / r['native_ms_median']:.2f}x", f"{r['max_abs_diff']:.1e}"] for r in steps])
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
    table = util.md_table(header, table_rows)
    print(step_table + "\n\n" + table)
    if args.smoke:
        return
    meta = util.machine_info()
    markdown = (
        "# CPU matmul: native FFI kernel vs XLA dot\n\n"
        "SmolLM2-135M's linear maps, x f32[M, K] @ w[K, N], w packed in 32-column panels as f32, bf16, int8 or 4-bit "
        "(scales and zeros per group of G along K, f16 when exact, else f32, interleaved with the quants). "
        "f32: the f32 FMA loop. bf16: activations rounded to bf16, vdpbf16ps on panels holding each column's k pairs "
        "together (exact products summed in f32). int8 and int4: **activations quantized per row and block of 32 k "
        "to int8 (d = max|x| / 127), as "
        "llama.cpp does**, integer dot products with vpdpbusd (4 k per 32-bit lane), scales and zeros applied per "
        "block of 32 in f32: y approximates `fake_quant_activations(x) @ unpack()` (relative error vs unquantized "
        "activations ~0.5%). `python -m cpu_kernels.matmul.bench`.\n\n"
        f"{BEFORE}\n\n"
        f"## One step's linear maps ({NUM_LAYERS} layers x 7 + logits), weights from memory\n\n"
        "Medians (minimum) of interleaved rounds over all formats (native, then XLA). "
        "GB/s = packed bytes (values + scales + zeros) / "
        f"median time; copy bandwidth {copy_GBps:.1f} GB/s (np.copyto read + write, median of "
        f"{len(bandwidth)} measurements between the row counts). XLA = a dot against f32 weights (row f32) or "
        "against `unpack()` (the fallback; for bf16, int8 and int4 of the rounded or quantized activations), in the "
        "same jitted chain. "
        "Max abs diff = native vs XLA at the chain's end (30 layers of random weights amplify rounding differences; "
        "the per-product agreement is tested in tests/test_cpu_matmul_quant.py).\n\n"
        f"{step_table}\n\n"
        f"## One product, weights hot in cache (f32)\n\n{table}\n\n{util.machine_line(meta)}\n"
    )
    record = dict(meta=meta, rounds=args.rounds, copy_bandwidth_GBps=copy_GBps, copy_bandwidth_samples=bandwidth,
                  steps=steps, rows=rows)
    paths = util.write_outputs(util.OUT_DIR, "cpu_matmul", record, markdown)
    print("wrote " + ", ".join(paths))


if __name__ == "__main__":
    main()
