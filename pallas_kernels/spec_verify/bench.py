"""GPU benchmark of the speculative-verification kernel against the XLA reference.

    python -m pallas_kernels.spec_verify.bench            # on a GPU, ~1-3 min; writes
                                                          # docs/benchmarks/spec_verify_kernel.{json,md}
    python -m pallas_kernels.spec_verify.bench --tune     # also times every block_v in TUNE_BLOCKS per shape
    python -m pallas_kernels.spec_verify.bench --smoke    # tiny shapes, interpret mode, any machine

For R verify rows in {16, 64, 256} x V in {32000, 49152, 128256, 152064} and each draft form (the sampler's
one-hot verify from logits; probabilities with a probabilistic draft; probabilities with one-hot drafts): kernel
and reference time, whether both give identical tokens and accept flags, and the kernel's achieved bandwidth =
bytes it must read (R x V x 4 per streamed array) / time, against the HBM bandwidth measured on the same device.

Status: only the --smoke mode has been run (CPU, interpret mode: its times say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform

import jax
import jax.numpy as jnp

from pallas_kernels.bench_timing import time_call
from pallas_kernels.spec_verify import block_sizes_for, reference, rejection_sample, verify_one_hot
from pallas_kernels.spec_verify.kernel import BlockSizes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = (16, 64, 256)
VOCABS = (32000, 49152, 128256, 152064)
FORMS = ("logits-one_hot", "probs-probabilistic", "probs-one_hot")
STREAMS = {"logits-one_hot": 2, "probs-probabilistic": 3, "probs-one_hot": 2}  # f32 arrays of [R, V] read
TUNE_BLOCKS = (1024, 2048, 4096, 8192)


def _inputs(form: str, R: int, V: int, key) -> list:
    kl, kq, kd, ku, kg = jax.random.split(key, 5)
    logits = 3.0 * jax.random.normal(kl, (R, V), jnp.float32)
    g = jax.random.gumbel(kg, (R, V), jnp.float32)
    u = jax.random.uniform(ku, (R,), jnp.float32)
    ids = jnp.where(jnp.arange(R) % 4 == 3, reference.NO_DRAFT,
                    jax.random.randint(kd, (R,), 0, V, jnp.int32))  # every 4th row: the bonus position
    if form == "logits-one_hot":
        return [logits, reference.argmax(logits), jnp.arange(R) % 8 != 7, ids, u, g]  # every 8th row greedy
    p = jax.nn.softmax(logits, axis=-1)
    if form == "probs-probabilistic":
        q = jax.nn.softmax(logits + jax.random.normal(kq, (R, V), jnp.float32), axis=-1)
        return [p, q, ids, u, g]
    return [p, None, ids, u, g]


def _fns(form: str, interpret: bool, block_sizes: BlockSizes | None = None):
    """(kernel, reference), both jitted, taking the inputs' non-None arrays."""
    if form == "logits-one_hot":
        return (jax.jit(lambda *a: verify_one_hot(*a, impl="kernel", interpret=interpret, block_sizes=block_sizes)),
                jax.jit(reference.verify_one_hot))
    if form == "probs-probabilistic":
        return (jax.jit(lambda *a: rejection_sample(*a, impl="kernel", interpret=interpret,
                                                    block_sizes=block_sizes)),
                jax.jit(reference.rejection_sample))
    return (jax.jit(lambda p, d, u, g: rejection_sample(p, None, d, u, g, impl="kernel", interpret=interpret,
                                                        block_sizes=block_sizes)),
            jax.jit(lambda p, d, u, g: reference.rejection_sample(p, None, d, u, g)))


def _time(f, args) -> float:
    return time_call(f, args, min_seconds=0.2, max_iters=500)


def measure_hbm_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Bytes/s of a read-only reduction over num_bytes (the kernel only reads big arrays)."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    seconds = _time(jax.jit(jnp.sum), [x])
    del x
    return num_bytes / seconds


def run(smoke: bool, tune: bool) -> dict:
    interpret = smoke
    device = jax.devices()[0]
    results = {"device": getattr(device, "device_kind", str(device)), "backend": jax.default_backend(),
               "jax": jax.__version__, "python": platform.python_version(), "interpret": interpret, "rows": []}
    if not smoke:
        results["hbm_read_GBps"] = measure_hbm_bandwidth() / 1e9
    shapes = [(4, 1000), (16, 3001)] if smoke else [(r, v) for r in ROWS for v in VOCABS]
    key = jax.random.key(0)
    for form in FORMS:
        for R, V in shapes:
            kind = form.split("-")[0]
            args = [a for a in _inputs(form, R, V, key) if a is not None]
            bs = block_sizes_for(num_rows=R, vocab=V, target_kind=kind)
            kernel, ref = _fns(form, interpret)
            (tk, ak), (tr, ar) = kernel(*args), ref(*args)
            identical = bool(jnp.array_equal(tk, tr) and jnp.array_equal(ak, ar))
            t_kernel, t_ref = _time(kernel, args), _time(ref, args)
            num_bytes = STREAMS[form] * R * V * 4
            row = {"form": form, "rows": R, "vocab": V, "block_sizes": dataclasses.asdict(bs),
                   "kernel_us": t_kernel * 1e6, "reference_us": t_ref * 1e6, "speedup": t_ref / t_kernel,
                   "kernel_GBps": num_bytes / t_kernel / 1e9, "identical_to_reference": identical}
            if not smoke:
                row["fraction_of_hbm"] = row["kernel_GBps"] / results["hbm_read_GBps"]
            if tune and not smoke:
                row["tune_us"] = {}
                for bv in TUNE_BLOCKS:
                    for warps in (4, 8):
                        trial = dataclasses.replace(bs, block_v=bv, num_warps=warps)
                        f, _ = _fns(form, False, trial)
                        row["tune_us"][f"block_v={bv},warps={warps}"] = _time(f, args) * 1e6
            results["rows"].append(row)
            print(f"{form:20s} R={R:4d} V={V:6d} kernel {row['kernel_us']:9.1f} us  ref {row['reference_us']:9.1f} us"
                  f"  x{row['speedup']:5.2f}  {row['kernel_GBps']:7.1f} GB/s  identical={identical}", flush=True)
            del args
    return results


def markdown(results: dict) -> str:
    lines = [
        "# Speculative verification kernel vs XLA reference",
        "",
        f"Device: {results['device']} ({results['backend']}), JAX {results['jax']}, Python {results['python']}"
        + (" — INTERPRET MODE (smoke run, times meaningless)" if results["interpret"] else ""),
        "",
    ]
    if "hbm_read_GBps" in results:
        lines += [f"Measured HBM read bandwidth (reduction over 2 GiB): {results['hbm_read_GBps']:.0f} GB/s.", ""]
    lines += [
        "Forms: logits-one_hot = the sampler's verify (scaled logits, n-gram / greedy drafts; every 8th row greedy); "
        "probs-probabilistic = p and q given; probs-one_hot = p given, one-hot drafts. Every 4th row has no draft. "
        "GB/s = R x V x 4 bytes x streamed arrays / kernel time.",
        "",
        "| form | R | V | block_v x splits | kernel us | reference us | speedup | kernel GB/s | % of HBM | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        frac = r.get("fraction_of_hbm")
        bs = r["block_sizes"]
        lines.append(
            f"| {r['form']} | {r['rows']} | {r['vocab']} | {bs['block_v']} x {bs['num_splits']} | {r['kernel_us']:.1f} "
            f"| {r['reference_us']:.1f} | {r['speedup']:.2f}x | {r['kernel_GBps']:.0f} "
            f"| {'' if frac is None else f'{100 * frac:.0f}%'} | {r['identical_to_reference']} |"
        )
    tuned = [r for r in results["rows"] if "tune_us" in r]
    if tuned:
        lines += ["", "Block-size sweep (us):", ""]
        for r in tuned:
            best = min(r["tune_us"], key=r["tune_us"].get)
            lines.append(f"- {r['form']} R={r['rows']} V={r['vocab']}: best {best} ({r['tune_us'][best]:.1f}); "
                         + ", ".join(f"{k}: {v:.1f}" for k, v in r["tune_us"].items()))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (no GPU needed)")
    parser.add_argument("--tune", action="store_true", help="also time each block_v / num_warps per shape (GPU)")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks"), help="output folder")
    args = parser.parse_args()
    if not args.smoke and jax.default_backend() != "gpu":
        raise SystemExit(f"no GPU (backend {jax.default_backend()}): run on a GPU, or use --smoke")
    results = run(args.smoke, args.tune)
    name = "spec_verify_kernel_smoke" if args.smoke else "spec_verify_kernel"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
