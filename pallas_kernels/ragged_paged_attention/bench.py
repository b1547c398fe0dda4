"""GPU benchmark of the ragged paged attention kernel against the XLA reference.

    python -m pallas_kernels.ragged_paged_attention.bench            # on a GPU, ~2-4 min; writes
                                                                     # docs/benchmarks/attention_kernel.{json,md}
    python -m pallas_kernels.ragged_paged_attention.bench --quick --peak-gbps 4800   # 4 decode shapes, shorter
                                                                     # timings (scripts/bench_gpu.sh on an H200)
    python -m pallas_kernels.ragged_paged_attention.bench --smoke    # tiny shapes, interpret mode, any machine

For each shape (Llama-3-8B attention per layer: 32 query heads, 8 kv heads, head dim 128, bf16, page size 16):
the kernel's and the reference's time, the kernel's max error against the reference, and the kernel's achieved
bandwidth = unique bytes it must move (the KV history of every sequence, scales, queries, outputs) / time, as a
fraction of the HBM bandwidth measured on the same device (best of a device-to-device copy and a reduction) and,
with --peak-gbps, of the datasheet's.
Prefill shapes also report attention TFLOP/s (causal: only visible query-key pairs count).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.bench_timing import time_call
from pallas_kernels.ragged_paged_attention import block_sizes_for, ragged_paged_attention, reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    q_lens: tuple[int, ...]  # new query tokens per sequence
    kv_lens: tuple[int, ...]  # keys per sequence (including the new tokens)
    kv_dtype: str = "bfloat16"
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16


def _shapes(smoke: bool, quick: bool) -> list[Shape]:
    if smoke:
        return [
            Shape("smoke decode", (1,) * 4, (40, 7, 64, 33), num_q_heads=4, num_kv_heads=2, head_dim=64),
            Shape("smoke mixed int8", (9, 1, 1), (9, 50, 17), "int8", num_q_heads=4, num_kv_heads=2, head_dim=64),
        ]
    if quick:  # decode, the bandwidth-bound case: plain, large batch, quantized, and one that splits the keys
        return [
            Shape("decode S=64 ctx=4096", (1,) * 64, (4096,) * 64),
            Shape("decode S=128 ctx=4096", (1,) * 128, (4096,) * 128),
            Shape("decode S=64 ctx=4096 int8", (1,) * 64, (4096,) * 64, "int8"),
            Shape("decode S=8 ctx=8192 (KV split)", (1,) * 8, (8192,) * 8),
        ]
    out = []
    for S in (32, 64, 128):
        for ctx in (2048, 4096):
            out.append(Shape(f"decode S={S} ctx={ctx}", (1,) * S, (ctx,) * S))
    out.append(Shape("decode S=64 ctx=4096 int8", (1,) * 64, (4096,) * 64, "int8"))
    out.append(Shape("decode S=64 ctx=4096 fp8", (1,) * 64, (4096,) * 64, "float8_e4m3fn"))
    out.append(Shape("decode S=8 ctx=8192 (KV split)", (1,) * 8, (8192,) * 8))
    out.append(Shape("verify S=32 K=3 ctx=2048", (4,) * 32, (2048,) * 32))
    out.append(Shape("mixed 512-token chunk + 63 decodes ctx=2048", (512,) + (1,) * 63, (2048,) * 64))
    out.append(Shape("prefill 4 x 1024", (1024,) * 4, (1024,) * 4))
    out.append(Shape("prefill 1 x 4096", (4096,), (4096,)))
    return out


def _inputs(shape: Shape, key) -> tuple[list, float, float]:
    """Device inputs (pages scattered over a permuted pool) + (unique bytes moved, visible query-key pairs)."""
    S, K, H, ps = len(shape.q_lens), shape.num_kv_heads, shape.head_dim, shape.page_size
    pages_per_seq = [-(-L // ps) for L in shape.kv_lens]
    max_pages = max(pages_per_seq)
    num_pages = 1 + sum(pages_per_seq)
    perm = np.random.default_rng(0).permutation(np.arange(1, num_pages)).astype(np.int32)
    tables = np.zeros((S, max_pages), np.int32)
    start = 0
    for s, n in enumerate(pages_per_seq):
        tables[s, :n] = perm[start : start + n]
        start += n
    T = sum(shape.q_lens)
    kq, kk, kv, ks = jax.random.split(key, 4)
    q = jax.random.normal(kq, (T, shape.num_q_heads, H), jnp.bfloat16)
    pool = (num_pages, ps, K, H)
    quantized = shape.kv_dtype in reference.QUANT_MAX
    if quantized:
        k_pages, k_scales = reference.quantize_kv(jax.random.normal(kk, (num_pages * ps, K, H)), shape.kv_dtype)
        v_pages, v_scales = reference.quantize_kv(jax.random.normal(kv, (num_pages * ps, K, H)), shape.kv_dtype)
        k_pages, v_pages = k_pages.reshape(pool), v_pages.reshape(pool)
        k_scales, v_scales = k_scales.reshape(pool[:3]), v_scales.reshape(pool[:3])
    else:
        k_pages = jax.random.normal(kk, pool, shape.kv_dtype)
        v_pages = jax.random.normal(kv, pool, shape.kv_dtype)
        k_scales = v_scales = None
    cu = np.concatenate([[0], np.cumsum(shape.q_lens)]).astype(np.int32)
    args = [q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(np.array(shape.kv_lens, np.int32)),
            jnp.asarray(cu), jnp.int32(S), k_scales, v_scales]
    per_token_head = 2 * (H * jnp.dtype(shape.kv_dtype).itemsize + (4 if quantized else 0))  # K and V (+ scales)
    kv_bytes = sum(shape.kv_lens) * K * per_token_head
    q_out_bytes = 2 * T * shape.num_q_heads * H * 2
    pairs = sum(sum(L - n + i + 1 for i in range(n)) for n, L in zip(shape.q_lens, shape.kv_lens))
    return args, float(kv_bytes + q_out_bytes), float(pairs)


def _time(f, args, min_seconds: float = 0.3) -> float:
    return time_call(f, args, min_seconds=min_seconds, max_iters=200)


def measure_hbm_bandwidth(num_bytes: int = 4 << 30) -> dict:
    """Bytes/s of a device-to-device copy (read + write counted) and of a sum (read only)."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)  # elementwise: one read and one write per element
    total = jax.jit(lambda a: jnp.sum(a))
    t_copy = _time(copy, [x])
    t_sum = _time(total, [x])
    del x
    return {"copy_GBps": 2 * num_bytes / t_copy / 1e9, "read_GBps": num_bytes / t_sum / 1e9}


def run(smoke: bool, quick: bool = False, peak_gbps: float | None = None) -> dict:
    interpret = smoke
    min_seconds = 0.1 if quick else 0.3
    device = jax.devices()[0]
    results = {
        "device": getattr(device, "device_kind", str(device)),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "interpret": interpret,
        "peak_GBps": peak_gbps,
        "shapes": [],
    }
    if not smoke:
        results["hbm"] = measure_hbm_bandwidth()
        peak = max(results["hbm"].values())
        results["hbm"]["measured_GBps"] = peak
    key = jax.random.key(0)
    for shape in _shapes(smoke, quick):
        args, num_bytes, pairs = _inputs(shape, key)
        H = shape.head_dim
        sm_scale = H**-0.5
        impl = "kernel"
        kernel = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=sm_scale, impl=impl, interpret=interpret))
        ref = jax.jit(lambda *a: reference.ragged_paged_attention(*a, sm_scale=sm_scale))
        out_k, out_r = kernel(*args), ref(*args)
        err = float(jnp.max(jnp.abs(out_k.astype(jnp.float32) - out_r.astype(jnp.float32))))
        finite = bool(jnp.isfinite(out_k.astype(jnp.float32)).all())
        t_kernel, t_ref = _time(kernel, args, min_seconds), _time(ref, args, min_seconds)
        T, S = sum(shape.q_lens), len(shape.q_lens)
        bs = block_sizes_for(num_tokens=T, num_seqs=S, num_q_heads=shape.num_q_heads,
                             num_kv_heads=shape.num_kv_heads, head_dim=H, page_size=shape.page_size,
                             max_pages=args[3].shape[1])
        row = {
            **dataclasses.asdict(shape),
            "q_lens": f"{len(shape.q_lens)} seqs, {T} tokens",
            "kv_lens": f"max {max(shape.kv_lens)}, total {sum(shape.kv_lens)}",
            "block_sizes": dataclasses.asdict(bs),
            "kernel_us": t_kernel * 1e6,
            "reference_us": t_ref * 1e6,
            "speedup": t_ref / t_kernel,
            "kernel_GBps": num_bytes / t_kernel / 1e9,
            "kernel_TFLOPs": 4 * pairs * shape.num_q_heads * H / t_kernel / 1e12,
            "max_abs_err_vs_reference": err,
            "finite": finite,
        }
        if not smoke:
            row["fraction_of_measured_hbm"] = row["kernel_GBps"] / results["hbm"]["measured_GBps"]
        if peak_gbps:
            row["fraction_of_peak"] = row["kernel_GBps"] / peak_gbps
        results["shapes"].append(row)
        print(f"{shape.name:48s} kernel {row['kernel_us']:9.1f} us  ref {row['reference_us']:9.1f} us  "
              f"x{row['speedup']:5.2f}  {row['kernel_GBps']:7.1f} GB/s  err {err:.2e}", flush=True)
        del args, out_k, out_r
    return results


def markdown(results: dict) -> str:
    hbm = results.get("hbm")
    lines = [
        "# Ragged paged attention kernel vs XLA reference",
        "",
        f"Device: {results['device']} ({results['backend']}), JAX {results['jax']}, Python {results['python']}"
        + (" — INTERPRET MODE (smoke run, times meaningless)" if results["interpret"] else ""),
        "",
    ]
    if hbm:
        lines += [f"Measured HBM bandwidth: copy {hbm['copy_GBps']:.0f} GB/s, read {hbm['read_GBps']:.0f} GB/s "
                  f"-> {hbm['measured_GBps']:.0f} GB/s used as 100%.", ""]
    peak = results.get("peak_GBps")
    if peak:
        lines += [f"Datasheet peak: {peak:.0f} GB/s (% of peak).", ""]
    lines += [
        "Attention per layer: 32 query / 8 kv heads, head dim 128, page size 16 (smoke: small). Bandwidth = unique "
        "bytes (KV history + scales + q + out) / kernel time.",
        "",
        "| shape | KV | kernel us | reference us | speedup | kernel GB/s | % of HBM | % of peak | TFLOP/s | max err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pct(r, key):
        return "" if r.get(key) is None else f"{100 * r[key]:.0f}%"

    for r in results["shapes"]:
        lines.append(
            f"| {r['name']} | {r['kv_dtype']} | {r['kernel_us']:.1f} | {r['reference_us']:.1f} | {r['speedup']:.2f}x "
            f"| {r['kernel_GBps']:.0f} | {pct(r, 'fraction_of_measured_hbm')} | {pct(r, 'fraction_of_peak')} "
            f"| {r['kernel_TFLOPs']:.1f} | {r['max_abs_err_vs_reference']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (no GPU needed)")
    parser.add_argument("--quick", action="store_true",
                        help="4 decode shapes, shorter timings (the scripts/bench_gpu.sh step)")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="the device's datasheet HBM bandwidth in GB/s (H200: 4800): adds a %% of peak column")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks"), help="output folder")
    args = parser.parse_args()
    if not args.smoke and jax.default_backend() != "gpu":
        raise SystemExit(f"no GPU (backend {jax.default_backend()}): run on a GPU, or use --smoke")
    results = run(args.smoke, args.quick, args.peak_gbps)
    name = "attention_kernel_smoke" if args.smoke else "attention_kernel"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
