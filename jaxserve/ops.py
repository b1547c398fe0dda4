"""The one door to the kernels: the only module of jaxserve (and of service/, training/, bench/) that imports
`pallas_kernels` or `cpu_kernels`.

Why one door: which implementation of attention, of a linear map, of KV quantization or of speculative verification
runs is a deployment choice (GPU Pallas kernels, native C++ CPU kernels through XLA's FFI, or the XLA references
that specify them all). Making that choice in one place, once, keeps the model, the sampler and the cache free of
kernel imports and of process state: the engine resolves its `EngineConfig` fields into a `Backends` value at
start (`resolve_backends`), and that frozen, hashable value travels to the model as a static argument, so what a
step traces depends on its arguments only, never on environment variables read at trace time.

`Backends` holds concrete choices, never "auto":
- `attention`: "pallas" (a GPU: the Pallas kernel where it covers the shapes, the XLA reference otherwise, which
  `pallas_kernels` logs once per reason), "native" (the C++ kernel on the CPU), "xla" (the XLA reference).
- `matmul`: "native" (linear weights are packed with `pack_linear` when placed; `linear` then runs the C++ matmul),
  "pallas" (a GPU: group-wise quantized weights are marked `kernel="pallas"` when placed; `linear` then runs the
  Pallas dequantizing matmul where it covers the shapes) or "xla" (plain dots). The weights' form carries this
  choice into the step, so `linear` needs no argument.

`attend` and `linear` reach the kernel modules through their attributes at call time, so a test can swap a kernel
entry point; the sampler calls `ops.verify_one_hot` the same way.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from cpu_kernels import kv_write as _cpu_kv_write
from cpu_kernels import matmul as _cpu_matmul
from cpu_kernels import ragged_paged_attention as _cpu_rpa
from cpu_kernels import row_stats as _cpu_row_stats
from jaxserve import sharding
from jaxserve.config import BACKEND_ENV, EngineConfig
from jaxserve.quant import QuantizedLinear, concat_columns
from pallas_kernels import quant_matmul as _quant_matmul
from pallas_kernels import ragged_paged_attention as _rpa
from pallas_kernels import spec_verify as _spec_verify
from pallas_kernels.ragged_paged_attention import reference as _rpa_reference
from pallas_kernels.spec_verify import reference as _spec_verify_reference

# --- backends ---------------------------------------------------------------------------------------------------

ATTENTION_BACKENDS = ("pallas", "native", "xla")  # resolved values of Backends.attention
MATMUL_BACKENDS = ("native", "xla", "pallas")  # resolved values of Backends.matmul


@dataclass(frozen=True, kw_only=True)
class Backends:
    """The kernels a step runs, resolved once from the engine's config (`resolve_backends`); static under jit."""

    attention: str  # one of ATTENTION_BACKENDS
    matmul: str  # one of MATMUL_BACKENDS
    mesh: Any = None  # a jax.sharding.Mesh with a "tp" axis > 1: attention runs per tensor-parallel shard of heads

    def __post_init__(self):
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"Backends.attention must be one of {', '.join(ATTENTION_BACKENDS)} "
                             f"(got {self.attention!r}); resolve 'auto' with resolve_backends")
        if self.matmul not in MATMUL_BACKENDS:
            raise ValueError(f"Backends.matmul must be one of {', '.join(MATMUL_BACKENDS)} (got {self.matmul!r}); "
                             "resolve 'auto' with resolve_backends")

    @property
    def native_cpu(self) -> bool:
        """Whether the step runs jaxserve's native CPU kernels (its attention is the native one); the sampler's
        per-row maximum, argmax and normaliser then run natively too (`cpu_kernels.row_stats`)."""
        return self.attention == "native"

    @property
    def native_single_device(self) -> bool:
        """The native CPU kernels on one device: the step may also run its norms' reductions and its KV write as
        custom calls (under a tensor-parallel mesh the partitioner would have to place them)."""
        return self.native_cpu and self.mesh is None

    @classmethod
    def default(cls, *, packed_weights: bool = False) -> Backends:
        """For callers that run the model without an engine (training, tests): attention as a default `EngineConfig`
        resolves it (the field from $JAXSERVE_ATTENTION_BACKEND, else auto), matmul as the weights already are
        (packed with `pack_linear`: native). Resolved when called: under jit, at trace time."""
        return cls(attention=resolve_attention_backend(EngineConfig().attention_backend),
                   matmul="native" if packed_weights else "xla")


def native_attention_available() -> bool:
    """Whether the native CPU attention library builds and loads (built once, cached; one warning if not)."""
    return _cpu_rpa.load()


def native_matmul_available() -> bool:
    """Whether the native CPU matmul library builds and loads (built once, cached; one warning if not)."""
    return _cpu_matmul.load()


def resolve_attention_backend(choice: str) -> str:
    """'auto' | 'xla' | 'native' -> one of ATTENTION_BACKENDS on this JAX backend; raises for impossible choices."""
    platform = jax.default_backend()
    field = f"attention_backend={choice} (${BACKEND_ENV['attention_backend']} when the field is unset)"
    if choice == "xla":
        return "xla"
    if choice == "native":
        if platform != "cpu":
            raise ValueError(f"{field} needs the CPU backend (running on {platform}); use auto or xla")
        if not native_attention_available():
            raise RuntimeError(f"{field} but the native CPU attention library could not be built or loaded (see the "
                               "warning above); install g++ or use auto / xla")
        return "native"
    if choice != "auto":
        raise ValueError(f"attention_backend must be one of auto, xla, native (got {choice!r})")
    if platform == "gpu":
        return "pallas"
    return "native" if platform == "cpu" and native_attention_available() else "xla"


def resolve_matmul_backend(choice: str, dtype, scan_layers: bool) -> str:
    """'auto' | 'xla' | 'native' -> one of MATMUL_BACKENDS. The native matmul needs the CPU, float32 activations and
    unrolled layers (it packs each layer's weights); auto takes it when all hold and the library loads, native
    raises saying which condition fails. On a GPU, auto is "pallas"."""
    if choice not in ("auto", "xla", "native"):
        raise ValueError(f"matmul_backend must be one of auto, xla, native (got {choice!r})")
    if choice == "xla":
        return "xla"
    platform = jax.default_backend()
    why_not = (f"the backend is {platform}, not cpu" if platform != "cpu"
               else f"dtype is {jnp.dtype(dtype).name}, not float32" if jnp.dtype(dtype) != jnp.float32
               else "layers are scanned (scan_layers=True)" if scan_layers else None)
    if choice == "native":
        field = f"matmul_backend=native (${BACKEND_ENV['matmul_backend']} when the field is unset)"
        if why_not:
            raise ValueError(f"{field} cannot be used: {why_not}; use auto or xla")
        if not native_matmul_available():
            raise RuntimeError(f"{field} but the native CPU matmul library could not be built or loaded (see the "
                               "warning above); install g++ or use auto / xla")
        return "native"
    if platform == "gpu":
        return "pallas"  # only quantized weights with groups use it (XLA fuses plain and per-channel converts)
    return "native" if why_not is None and native_matmul_available() else "xla"


def resolve_backends(engine_cfg: EngineConfig, dtype, scan_layers: bool, mesh=None) -> Backends:
    """The engine's backend fields made concrete for this process: `dtype` is the weights' dtype, `scan_layers`
    whether the layers run as one scanned body (the resolved `EngineConfig.scan_layers`), `mesh` the engine's
    `jax.sharding.Mesh` (None: one device). Call once, at start. Under tensor parallelism linear maps are XLA dots
    (GSPMD partitions them; the native matmul's packed panels are not sharded)."""
    tp = sharding.tensor_parallel_size(mesh) > 1
    if tp and engine_cfg.matmul_backend == "native":
        raise ValueError("matmul_backend=native cannot be used with a tensor-parallel mesh; use auto or xla")
    return Backends(
        attention=resolve_attention_backend(engine_cfg.attention_backend),
        matmul="xla" if tp else resolve_matmul_backend(engine_cfg.matmul_backend, dtype, scan_layers),
        mesh=mesh if tp else None,
    )


# --- attention --------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclass
class TokenMetadata:
    """Per-token facts of a ragged batch, computed once per step and shared by every layer."""

    seq: jax.Array  # i32[T]  sequence index of each token
    pos: jax.Array  # i32[T]  absolute position
    is_real: jax.Array  # bool[T]


def token_metadata(
    cu_q_lens: jax.Array,  # i32[S + 1]
    seq_lens: jax.Array,  # i32[S]
    num_seqs: jax.Array,  # i32[]
    num_tokens: int,
) -> TokenMetadata:
    return TokenMetadata(*_rpa_reference.token_metadata(cu_q_lens, seq_lens, num_seqs, num_tokens))


def attend(
    q: jax.Array,  # f[T, N, H]
    k_pages: jax.Array,  # [P, page_size, K, H]  a page pool: float, or int8 / float8_e4m3fn with scales
    v_pages: jax.Array,  # [P, page_size, K, H]
    block_tables: jax.Array,  # i32[S, max_pages]  pages of the pool
    seq_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[]
    meta: TokenMetadata,  # the same batch per token (`token_metadata`)
    k_scales: jax.Array | None = None,  # f32[P, page_size, K]  quantized pools only
    v_scales: jax.Array | None = None,  # f32[P, page_size, K]
    *,
    sm_scale: float,
    backends: Backends,
) -> jax.Array:  # f[T, N, H]
    """Ragged paged attention (semantics: `pallas_kernels.ragged_paged_attention.reference.attend`) on the kernel
    `backends.attention` names. The Pallas kernel takes the per-sequence form of the batch, the CPU paths the
    per-token `meta`."""
    if backends.mesh is not None:  # tensor parallel: each shard attends over its own heads (jaxserve.sharding)
        local = dataclasses.replace(backends, mesh=None)

        def shard(q, k, v, ks, vs, block_tables, seq_lens, cu_q_lens, num_seqs, meta):
            return attend(q, k, v, block_tables, seq_lens, cu_q_lens, num_seqs, meta, ks, vs, sm_scale=sm_scale,
                          backends=local)

        return sharding.heads_shard_map(backends.mesh, shard, q, k_pages, v_pages, k_scales, v_scales,
                                        block_tables, seq_lens, cu_q_lens, num_seqs, meta)
    if backends.attention == "pallas" and _rpa.select_impl(q, k_pages) == "kernel":
        return _rpa.ragged_paged_attention(
            q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs, k_scales, v_scales,
            sm_scale=sm_scale, impl="kernel",
        )
    run = _cpu_rpa.attend if backends.attention == "native" else _rpa_reference.attend
    return run(q, k_pages, v_pages, block_tables, meta.seq, meta.pos, meta.is_real, k_scales, v_scales,
               sm_scale=sm_scale)


# --- linear maps ------------------------------------------------------------------------------------------------

PackedLinear = _cpu_matmul.PackedLinear  # a weight [K, N] in the native matmul's panel layout


def pack_linear(w) -> PackedLinear:
    """A linear weight [K, N] -> PackedLinear, for `Backends.matmul == 'native'`. Host-side, once. `w`: a float32
    or bfloat16 array, or a `QuantizedLinear` (int8 or 4-bit, group-wise scales), each packed in its own format."""
    if isinstance(w, QuantizedLinear):
        return _cpu_matmul.pack_quantized(w.values(), w.scales, w.zeros, bits=w.bits)
    return _cpu_matmul.pack(w)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class FusedLinear:
    """Linear maps of one input run as one native matmul: `w` packs them side by side ([K, sum(sizes)]), `sizes`
    are their output widths. Built at pack time (`pack_linears`); `linears` splits the product. Each column is
    computed by the same operations as in its own matmul, so the outputs are bit for bit the separate ones."""

    w: PackedLinear
    sizes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))


def pack_linears(ws: list) -> list:
    """Host-side, once: linear weights of one input -> what `linears` takes for them, in the same order. When
    their stored forms agree (`quant.concat_columns`): a `FusedLinear` first, then None for the others (one call
    instead of len(ws): at decode each call costs a dispatch and a pass over a small matrix); else each packed."""
    fused = concat_columns(ws) if len(ws) > 1 else None
    if fused is None:
        return [pack_linear(w) for w in ws]
    return [FusedLinear(pack_linear(fused), tuple(int(w.shape[-1]) for w in ws))] + [None] * (len(ws) - 1)


def linears(x: jax.Array, *ws) -> tuple[jax.Array, ...]:
    """`linear(x, w)` for each w: weights from `pack_linears` (a FusedLinear, then Nones) run as one matmul whose
    output is split; any other forms one by one."""
    if isinstance(ws[0], FusedLinear):
        f = ws[0]
        if len(ws) != len(f.sizes) or any(w is not None for w in ws[1:]):
            raise ValueError(f"a FusedLinear of {len(f.sizes)} maps must come with {len(f.sizes) - 1} Nones")
        y = _cpu_matmul.matmul(x, f.w)
        return tuple(jnp.split(y, list(itertools.accumulate(f.sizes[:-1])), axis=-1))
    return tuple(linear(x, w) for w in ws)


def linear(x: jax.Array, w) -> jax.Array:
    """x: f[T, in] @ w [in, out] -> f[T, out]. `w` is an array (an XLA dot; a bfloat16 weight multiplies x
    rounded to bfloat16, in float32), a `QuantizedLinear` (the XLA reference: dequantize, then the dot) or a
    `PackedLinear` (the native CPU matmul, which itself falls back to a dot, with one warning, if its library cannot
    be loaded)."""
    if isinstance(w, PackedLinear):
        return _cpu_matmul.matmul(x, w)
    if isinstance(w, QuantizedLinear):
        if w.kernel == "pallas" and _quant_matmul.unsupported_reason(x, w.q, w.scales, bits=w.bits) is None:
            return _quant_matmul.quant_matmul(x, w.q, w.scales, w.zeros, bits=w.bits)
        if w.kernel == "xla-q8":  # what the native CPU kernel computes: activations rounded to int8 per 32 inputs
            x = _cpu_matmul.fake_quant_activations(x)
        if w.scales.shape[-2] == 1 and w.zeros is None and w.bits == 8:
            # one scale per output channel: scale the product, so the dot reads the int8 weight itself (XLA's GPU
            # compiler fuses the convert into the GEMM; a scaled operand would be written out as a whole bf16 copy)
            return (x @ w.q.astype(x.dtype)) * w.scales[0].astype(x.dtype)
        return x @ w.dequantize(x.dtype)
    if w.dtype == jnp.bfloat16 and x.dtype == jnp.float32:
        # a bf16 weight multiplies x rounded to bf16, products summed in f32: what a bf16 GEMM computes, and the
        # native kernel's semantics (`cpu_kernels.matmul.activations`), so both backends serve the same model
        return _cpu_matmul.activations(x, "bf16") @ w.astype(jnp.float32)
    return x @ w.astype(x.dtype)


# --- sampling ---------------------------------------------------------------------------------------------------

# logits f32[R, V] -> (max, first argmax, log-sum-exp below the max, holds NaN / +inf), each [R]: one native CPU pass
# (XLA twin when the library cannot be built); the sampler uses it when `Backends.native_cpu`
row_stats = _cpu_row_stats.row_stats

# x f32[R, D] -> each row's sum of squares in a fixed order whatever R (one native CPU pass; XLA's sum when the
# library cannot be built): RMSNorm's reduction when the step runs the native CPU kernels (`layers.rms_norm`)
row_sum_squares = _cpu_row_stats.sum_squares


# --- the KV write -----------------------------------------------------------------------------------------------


def native_kv_write(cache: jax.Array, rows: jax.Array, layer: jax.Array, slots: jax.Array) -> jax.Array | None:
    """rows [T, K, H] into cache [L, P, ps, K, H] at (layer, slots[t]) by the native in-place copy
    (`cpu_kernels.kv_write`), or None when the library cannot be built (the caller scatters). For the cache dtypes
    XLA:CPU cannot scatter in place (bf16, f16, fp8: `kv_cache.write_kv`)."""
    return _cpu_kv_write.kv_write(cache, rows, layer, slots) if _cpu_kv_write.load() else None


# --- KV quantization ------------------------------------------------------------------------------------------

QUANT_MAX = _rpa_reference.QUANT_MAX  # quantized KV dtype name -> the largest magnitude it stores
quantize_kv = _rpa_reference.quantize_kv  # f[..., H] -> (values [..., H] in dtype, f32[...] scales)

# --- speculative verification ---------------------------------------------------------------------------------

NO_DRAFT = _spec_verify_reference.NO_DRAFT
accepted_length = _spec_verify_reference.accepted_length

# On the Pallas kernel where it covers the inputs (a GPU), the XLA reference elsewhere; `impl=` overrides.
verify_one_hot = _spec_verify.verify_one_hot
rejection_sample = _spec_verify.rejection_sample

# The XLA references themselves: the specification (`spec_decode.rejection` re-exports them).
reference_verify_one_hot = _spec_verify_reference.verify_one_hot
reference_rejection_sample = _spec_verify_reference.rejection_sample
