"""CPU benchmark: the native FFI attention kernel against the XLA reference it replaces.

    python -m cpu_kernels.ragged_paged_attention.bench            # ~1-3 min on 2 cores; writes
                                                                  # docs/benchmarks/cpu_attention.{json,md}
    python -m cpu_kernels.ragged_paged_attention.bench --smoke    # tiny shapes, a few seconds, writes nothing

Shapes are SmolLM2-135M's attention per layer (9 query heads, 3 kv heads, head dim 64, page size 16), float32
queries, float32 or int8 KV: decode batches of 16 and 64 sequences with mixed contexts (uniform in 50..1500 tokens,
fixed seed), and a 512-token prefill chunk whose sequence reaches 1024 tokens. Each call is one layer; the table
reports ms per call x 30 layers (one model step's attention), the minimum and median of interleaved repeats
(reference, native, reference, ...), since other jobs share the machine; and the native result's max |error|
against the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import ragged_paged_attention as native
from cpu_kernels.bench_util import OUT_DIR, machine_info, machine_line, md_table, time_calls, write_outputs
from pallas_kernels.ragged_paged_attention import reference

NUM_LAYERS = 30


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    q_lens: tuple[int, ...]  # new query tokens per sequence
    kv_lens: tuple[int, ...]  # keys per sequence (including the new tokens)
    kv_dtype: str = "float32"
    num_q_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    page_size: int = 16


def _shapes(smoke: bool) -> list[Shape]:
    rng = np.random.default_rng(0)
    if smoke:
        return [Shape("smoke decode", (1,) * 4, (40, 7, 64, 33)), Shape("smoke prefill int8", (32,), (48,), "int8")]
    out = []
    for S in (16, 64):
        ctx = tuple(int(x) for x in rng.integers(50, 1501, S))
        for dtype in ("float32", "int8"):
            out.append(Shape(f"decode S={S} ctx 50..1500 (sum {sum(ctx)})", (1,) * S, ctx, dtype))
    for dtype in ("float32", "int8"):
        out.append(Shape("prefill 512-token chunk at ctx 1024", (512,), (1024,), dtype))
    return out


def make_inputs(shape: Shape, seed: int = 0):
    """(args, sm_scale) for `attend`, with unused pages NaN-filled so a leak would show as a NaN error."""
    rng = np.random.default_rng(seed)
    ps, K, H, N = shape.page_size, shape.num_kv_heads, shape.head_dim, shape.num_q_heads
    S = len(shape.q_lens)
    max_pages = -(-max(shape.kv_lens) // ps)
    P = 1 + sum(-(-L // ps) for L in shape.kv_lens)
    tables = np.zeros((S, max_pages), np.int32)  # padded entries -> page 0, the padding sink
    nxt = 1
    for s, L in enumerate(shape.kv_lens):
        n = -(-L // ps)
        tables[s, :n] = np.arange(nxt, nxt + n)
        nxt += n
    k = rng.standard_normal((P, ps, K, H), np.float32)
    v = rng.standard_normal((P, ps, K, H), np.float32)
    k[0] = v[0] = np.nan
    T = sum(shape.q_lens)
    q = jnp.asarray(rng.standard_normal((T, N, H), np.float32))
    cu = np.concatenate([[0], np.cumsum(shape.q_lens)]).astype(np.int32)
    seq, pos, is_real = reference.token_metadata(jnp.asarray(cu), jnp.asarray(shape.kv_lens, jnp.int32),
                                                 jnp.int32(S), T)
    if shape.kv_dtype in native.QUANTIZED_KV_DTYPES:
        kq, ks = reference.quantize_kv(jnp.asarray(k).reshape(-1, K, H), shape.kv_dtype)
        vq, vs = reference.quantize_kv(jnp.asarray(v).reshape(-1, K, H), shape.kv_dtype)
        kv = (kq.reshape(k.shape), vq.reshape(v.shape), ks.reshape(P, ps, K), vs.reshape(P, ps, K))
    else:
        kv = (jnp.asarray(k, shape.kv_dtype), jnp.asarray(v, shape.kv_dtype), None, None)
    k_pages, v_pages, k_scales, v_scales = kv
    args = (q, k_pages, v_pages, jnp.asarray(tables), seq, pos, is_real, k_scales, v_scales)
    return args, 1.0 / np.sqrt(H)


def bench_shape(shape: Shape, rounds: int) -> dict:
    args, sm_scale = make_inputs(shape)
    impls = {
        "xla": jax.jit(lambda *a: reference.attend(*a, sm_scale=sm_scale)),
        "native": jax.jit(lambda *a: native.attend(*a, sm_scale=sm_scale)),
    }
    outs = {name: f(*args).block_until_ready() for name, f in impls.items()}  # compile + warm up
    err = float(jnp.max(jnp.abs(outs["native"].astype(jnp.float32) - outs["xla"].astype(jnp.float32))))
    probe = time.perf_counter()
    impls["xla"](*args).block_until_ready()
    per_sample = max(1, int(0.05 / max(time.perf_counter() - probe, 1e-6)))
    times = time_calls({name: (f, args) for name, f in impls.items()}, rounds, per_sample)
    row = dict(shape=dataclasses.asdict(shape), max_abs_err=err)
    for name, t in times.items():
        row[f"{name}_ms_x{NUM_LAYERS}_min"] = t["min_ms"] * NUM_LAYERS
        row[f"{name}_ms_x{NUM_LAYERS}_median"] = t["median_ms"] * NUM_LAYERS
    row["speedup_min"] = row[f"xla_ms_x{NUM_LAYERS}_min"] / row[f"native_ms_x{NUM_LAYERS}_min"]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no output files")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per shape")
    args = parser.parse_args(argv)
    if not native.load():
        raise SystemExit("the native CPU attention library could not be built (see the warning above)")
    rows = []
    for shape in _shapes(args.smoke):
        row = bench_shape(shape, 2 if args.smoke else args.rounds)
        rows.append(row)
        print(f"{shape.name} {shape.kv_dtype}: xla {row[f'xla_ms_x{NUM_LAYERS}_min']:.1f} ms, native "
              f"{row[f'native_ms_x{NUM_LAYERS}_min']:.1f} ms (x{NUM_LAYERS} layers, min), err {row['max_abs_err']:.2e}",
              flush=True)
    header = ["shape", "KV", "tokens", f"XLA ms x{NUM_LAYERS} min (median)", f"native ms x{NUM_LAYERS} min (median)",
              "speedup (min)", "max abs err"]
    table = md_table(header, [
        [r["shape"]["name"], r["shape"]["kv_dtype"], sum(r["shape"]["q_lens"]),
         f"{r[f'xla_ms_x{NUM_LAYERS}_min']:.1f} ({r[f'xla_ms_x{NUM_LAYERS}_median']:.1f})",
         f"{r[f'native_ms_x{NUM_LAYERS}_min']:.1f} ({r[f'native_ms_x{NUM_LAYERS}_median']:.1f})",
         f"{r['speedup_min']:.1f}x", f"{r['max_abs_err']:.1e}"]
        for r in rows
    ])
    print(table)
    if args.smoke:
        return
    meta = machine_info()
    markdown = (
        "# CPU attention: native FFI kernel vs XLA reference\n\n"
        "SmolLM2-135M attention (9 query heads, 3 kv heads, head dim 64, page size 16), float32 queries; one call "
        f"is one layer, reported x{NUM_LAYERS} layers. `python -m cpu_kernels.ragged_paged_attention.bench`.\n\n"
        f"{table}\n\n{machine_line(meta)}\n"
    )
    paths = write_outputs(OUT_DIR, "cpu_attention", dict(meta=meta, rounds=args.rounds, rows=rows), markdown)
    print("wrote " + ", ".join(paths))


if __name__ == "__main__":
    main()
