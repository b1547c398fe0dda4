"""Matmul on CPU for small row counts: the native FFI kernel (`kernel.cc`) over pre-packed weights, stored as f32,
bf16, int8 or 4-bit.

A weight is logically w f32[K, N]. Packing it (once, on the host, when weights are placed) gives a `PackedLinear` in
the kernel's layout: panels of 32 columns, each a sequential stream over K, zero-padded past N.

    format  made by                                   panels (the one array)    dequantized w[k, n]
    f32     pack(w f32[K, N])                         f32[P, K, 32]             w
    bf16    pack(w bf16[K, N])                        bf16[P, K, 32]            the bf16 widened exactly
    int8    pack_quantized(q int8, scales, zeros)     int8[P, K / G, B]         q * scales[k // G, n] + zeros[k // G, n]
    int4    pack_quantized(q 0..15, ..., bits=4)      uint8[P, K / G, B]        the same, q 4-bit

P = ceil(N / 32). bf16 panels hold their k rows in pairs, [P, K // 2, 32 columns, 2 k] (an odd K's last row after
them), the two weights of a column that vdpbf16ps multiplies together in one 32-bit lane.
A PackedLinear has exactly one array (pytree leaf), `panels`: the integer formats interleave each
group's scales and zeros with its quants, so a panel is one sequential stream. Per panel and group of G along K, B
bytes: the group's 32 scales, then its 32 zeros (only with zeros), then its quants (G / 4 x 128 bytes for int8, x 64
for int4). Scales and zeros (f32[K // G, N]; zeros None = none added) are stored as f16 when every one of them is
exactly an f16 (a GGUF block's are), else as f32 (`scale_bytes` 2 or 4, static, like `has_zeros`, `group` and `n`):
the kernel widens them exactly, so the results are the same bits either way. The quants hold 4 consecutive k of a
column together (vpdpbusd's 32-bit lanes): int8 is [G / 4, 32 columns, 4 k] of the bytes of q + 128 (stored as int8
bits, read as uint8); 4-bit is [G / 4, 16, 4 k] bytes, byte [j, i] holding column j at k = 4 kq + i in its low nibble
and column j + 16 in its high one. K must be a multiple of 32 and G of 16. Dequantization is float32 arithmetic, the
product rounded, then the sum (not an FMA).

`matmul(x, packed)` computes `x @ w` for x f32[M, K] with one `jax.ffi.ffi_call`.
  * f32: each output element is an in-order FMA chain over K against the exact weights.
  * bf16: x rounded to bf16 (`round_to_bf16`), as a bf16 GEMM computes; each output element is a chain of exact
    products summed in f32, k pair by k pair (vdpbf16ps; or, where this CPU issues vdpbf16ps at under half its FMA
    rate, two FMAs per pair in vdpbf16ps's order on widened weights for products of more than 4 rows: the same
    bits; `JAXSERVE_MATMUL_BF16=fma|dpbf16` forces one).
  * int8, int4 (as llama.cpp does): x is quantized per row and block of 32 k to int8 with one f32 scale d per block
    (`quantize_activations`), products are exact integer dot products (vpdpbusd), and scales are applied once per
    block: y approximates `fake_quant_activations(x) @ unpack()`, float rounding aside.
Each row is computed the same way whatever M is, so a row's result does not depend on its batch companions. Like the
attention kernel, the library is built on first use (`cpu_kernels.build`) and `matmul` falls back to XLA (with one
warning) when it cannot be built: `activations(x, format) @ unpack()`, the kernel's semantics, and the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from cpu_kernels.build import build_library, load_cpu_target

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel.cc")
PANEL = 32  # columns per packed panel (kNr in kernel.cc)
BLOCK = 32  # k per activation quantization block (kBlock in kernel.cc)
# format -> (FFI target, handler symbol in kernel.cc)
TARGETS = {"f32": ("jaxserve_matmul", "JaxserveMatmul"),
           "bf16": ("jaxserve_matmul_bf16", "JaxserveMatmulBf16"),
           "int8": ("jaxserve_matmul_int8", "JaxserveMatmulInt8"),
           "int4": ("jaxserve_matmul_int4", "JaxserveMatmulInt4")}
TARGET = TARGETS["f32"][0]
_FORMAT_OF_DTYPE = {np.dtype(np.float32): "f32", np.dtype(ml_dtypes.bfloat16): "bf16", np.dtype(np.int8): "int8",
                    np.dtype(np.uint8): "int4"}


BF16_PATHS = ("fma", "dpbf16")  # JAXSERVE_MATMUL_BF16: force one bf16 path (unset or empty: measured per CPU)


def check_env() -> None:
    """A JAXSERVE_MATMUL_BF16 the kernel would not understand is an error, not silently the default."""
    choice = os.environ.get("JAXSERVE_MATMUL_BF16", "")
    if choice and choice not in BF16_PATHS:
        raise ValueError(f"JAXSERVE_MATMUL_BF16={choice!r}: expected one of {', '.join(BF16_PATHS)} (or unset)")


@functools.cache
def load() -> bool:
    """Build (or find in the cache), load and register the native library's targets; False, with one warning, on
    failure."""
    check_env()
    return all(load_cpu_target(build_library, SOURCE, symbol, target, "native CPU matmul unavailable, using XLA dots")
               for target, symbol in TARGETS.values())


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedLinear:
    """A linear weight [K, N] in the native kernel's layout (module docstring): one array, `panels`. `n` (the true
    column count), `group` (G, 0 for the float formats), `scale_bytes` (2: f16 scales and zeros, 4: f32, 0 for the
    float formats) and `has_zeros` are static; the format follows from the panels' dtype."""

    panels: jax.Array  # f32 | bf16 [P, K, 32], int8 | uint8 (int4) [P, K / G, bytes per group]
    n: int = dataclasses.field(metadata=dict(static=True))
    group: int = dataclasses.field(default=0, metadata=dict(static=True))
    scale_bytes: int = dataclasses.field(default=0, metadata=dict(static=True))
    has_zeros: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def format(self) -> str:
        """"f32" | "bf16" | "int8" | "int4"."""
        return _FORMAT_OF_DTYPE[np.dtype(self.panels.dtype)]

    @property
    def quantized(self) -> bool:
        return self.group > 0

    @property
    def shape(self) -> tuple[int, int]:
        return (self.panels.shape[1] * (self.group if self.quantized else 1), self.n)

    @property
    def nbytes(self) -> int:
        """Bytes the kernel streams (scales, zeros and padding included)."""
        return self.panels.size * self.panels.dtype.itemsize

    def _head_bytes(self) -> int:
        return PANEL * self.scale_bytes * (2 if self.has_zeros else 1)

    def _head(self, i: int) -> jax.Array:  # f32[P, K // G, 32]: i = 0 the scales, 1 the zeros
        """One part of the groups' heads, widened to f32 (exact from f16). Traceable."""
        P, groups, _ = self.panels.shape
        sb = self.scale_bytes
        raw = jax.lax.bitcast_convert_type(self.panels, jnp.uint8)[..., i * PANEL * sb:(i + 1) * PANEL * sb]
        dtype = jnp.float16 if sb == 2 else jnp.float32
        return jax.lax.bitcast_convert_type(raw.reshape(P, groups, PANEL, sb), dtype).astype(jnp.float32)

    @property
    def scales(self) -> jax.Array | None:
        """f32[P, K // G, 32] (int8, int4; decoded from `panels`), or None (float formats)."""
        return self._head(0) if self.quantized else None

    @property
    def zeros(self) -> jax.Array | None:
        """f32[P, K // G, 32] (int8, int4 with zeros; decoded from `panels`), or None."""
        return self._head(1) if self.quantized and self.has_zeros else None

    def unpack(self) -> jax.Array:  # f32[K, N]
        """The dequantized weight, as the kernel computes it (traceable): the reference and the XLA fallback."""
        K, _ = self.shape
        P = self.panels.shape[0]
        w = self.panels
        if self.quantized:  # the quants after each group's head -> [P, K / 4, bytes per 4 k]
            w = jax.lax.bitcast_convert_type(w, jnp.uint8)[..., self._head_bytes():].reshape(P, K // 4, -1)
        if self.format == "bf16":  # [P, K // 2, 32, 2 k] (then an odd K's last row) -> [P, K, 32]
            even = K - K % 2
            pairs = jnp.swapaxes(w[:, :even].reshape(P, K // 2, PANEL, 2), 2, 3).reshape(P, even, PANEL)
            w = jnp.concatenate([pairs, w[:, even:]], axis=1)
        if self.format == "int8":  # [P, K / 4, 32 columns, 4 k] bytes of q + 128 -> q [P, K, 32]
            w = w.reshape(P, K // 4, PANEL, 4)
            w = jnp.swapaxes(w, 2, 3).reshape(P, K, PANEL).astype(jnp.int32) - 128
        elif self.format == "int4":  # [P, K / 4, 16, 4 k] -> [P, K, 16] -> columns j (low), j + 16 (high)
            w = jnp.swapaxes(w.reshape(P, K // 4, PANEL // 2, 4), 2, 3).reshape(P, K, PANEL // 2)
            w = jnp.concatenate([w & 15, w >> 4], axis=-1)  # [P, K, 32]
        w = w.astype(jnp.float32)
        if self.quantized:
            w = _rounded_product(w, jnp.repeat(self.scales, self.group, axis=1))
            if self.has_zeros:
                w = w + jnp.repeat(self.zeros, self.group, axis=1)
        return jnp.transpose(w, (1, 0, 2)).reshape(K, P * PANEL)[:, : self.n]


def _rounded_product(q: jax.Array, s: jax.Array) -> jax.Array:
    """q * s rounded to f32, for integers |q| <= 255 (f32) and f32 scales s, in a form that stays one rounding even
    when the sum that follows is contracted into an FMA (XLA:CPU always lets LLVM fuse a multiply and an add).

    s = hi + lo with hi the top 12 bits of s's significand and lo the other 12 (exact): q * hi and q * lo are exact
    in f32 (<= 20 bits), so their sum, rounded once, is q * s rounded once, fused or not; and the sum with the
    zeros that follows adds an add's result, which nothing can contract. (Exact unless q * lo underflows: scales
    below ~1e-30.)"""
    hi = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(s, jnp.uint32) & jnp.uint32(0xFFFFF000),
                                      jnp.float32)
    return q * hi + q * (s - hi)


def _panels(a: np.ndarray) -> np.ndarray:
    """[R, N] -> [ceil(N / 32), R, 32], zero-padded past N."""
    R, N = a.shape
    P = -(-N // PANEL)
    padded = np.zeros((R, P * PANEL), a.dtype)
    padded[:, :N] = a
    return np.ascontiguousarray(padded.reshape(R, P, PANEL).transpose(1, 0, 2))


def pack(w) -> PackedLinear:
    """w: f32[K, N] or bf16[K, N] (numpy or jax) -> PackedLinear of the same format. Done once, on the host."""
    w = np.asarray(w)
    if w.ndim != 2 or w.dtype not in (np.float32, ml_dtypes.bfloat16):
        raise ValueError(f"pack takes an f32[K, N] or bf16[K, N] weight (got {w.shape} {w.dtype}); "
                         "use pack_quantized for int8 and 4-bit weights")
    panels = _panels(w)  # [P, K, 32]
    if w.dtype == ml_dtypes.bfloat16:  # k pairs interleaved per column: [P, K // 2, 32, 2], then an odd K's last row
        P, K, _ = panels.shape
        pairs = panels[:, : K - K % 2].reshape(P, K // 2, 2, PANEL).transpose(0, 1, 3, 2).reshape(P, -1, PANEL)
        panels = np.concatenate([pairs, panels[:, K - K % 2:]], axis=1)
    return PackedLinear(panels=jnp.asarray(np.ascontiguousarray(panels)), n=w.shape[1])


def pack_quantized(q, scales, zeros=None, bits: int = 8, *, scale_dtype=None) -> PackedLinear:
    """Integer weight -> PackedLinear (int8 or int4) with w[k, n] = q[k, n] * scales[k // G, n] + zeros[k // G, n].

    q: int8[K, N] (bits 8) or uint8[K, N] holding 0..15 (bits 4); scales, zeros: f32[K // G, N] (zeros None = 0),
    G = K // scales.shape[0] dividing K. Numpy or jax arrays; done once, on the host. Scales and zeros are stored as
    f16 when all of them are exactly f16 values, else as f32 (the same results either way); `scale_dtype` np.float32
    forces f32, np.float16 demands f16 (ValueError if inexact)."""
    q, scales = np.asarray(q), np.asarray(scales)
    if bits not in (4, 8):
        raise ValueError(f"bits must be 8 or 4 (got {bits})")
    dtype = np.int8 if bits == 8 else np.uint8
    if q.ndim != 2 or q.dtype != dtype:
        raise ValueError(f"pack_quantized(bits={bits}) takes q {np.dtype(dtype).name}[K, N] (got {q.shape} {q.dtype})")
    K, N = q.shape
    if K % BLOCK:
        raise ValueError(f"pack_quantized needs K a multiple of {BLOCK} (the activation block; got K = {K})")
    if bits == 4 and q.size and q.max() > 15:
        raise ValueError(f"4-bit values must be 0..15 (got {q.max()})")
    if scales.ndim != 2 or scales.dtype != np.float32 or scales.shape[1] != N or scales.shape[0] < 1 \
            or K % scales.shape[0]:
        raise ValueError(f"scales must be f32[K // G, {N}] with G dividing K = {K} (got {scales.shape} {scales.dtype})")
    if (K // scales.shape[0]) % 16:
        raise ValueError(f"the group G = K // scales.shape[0] must be a multiple of 16 (got {K // scales.shape[0]})")
    if zeros is not None:
        zeros = np.asarray(zeros)
        if zeros.shape != scales.shape or zeros.dtype != np.float32:
            raise ValueError(f"zeros must be f32{list(scales.shape)} like scales, or None (got {zeros.shape} "
                             f"{zeros.dtype})")
    panels = _panels(q)  # [P, K, 32]
    P, groups = panels.shape[0], scales.shape[0]
    if bits == 8:  # the bytes of q + 128, [P, K / 4, 32 columns, 4 k]
        panels = (panels.view(np.uint8) ^ 0x80).reshape(P, K // 4, 4, PANEL).transpose(0, 1, 3, 2)
    else:  # byte j: column j low, column j + 16 high; then [P, K / 4, 16, 4 k]
        panels = panels[..., :16] | (panels[..., 16:] << 4)
        panels = panels.reshape(P, K // 4, 4, PANEL // 2).transpose(0, 1, 3, 2)
    quants = np.ascontiguousarray(panels).reshape(P, groups, -1)  # [P, K / G, G / 4 x 128 or 64 bytes]
    heads = [scales] if zeros is None else [scales, zeros]
    exact = all(_f16_exact(a) for a in heads)
    dtype = np.dtype(scale_dtype) if scale_dtype is not None else np.dtype(np.float16 if exact else np.float32)
    if dtype not in (np.float16, np.float32) or (dtype == np.float16 and not exact):
        raise ValueError(f"scale_dtype must be None, float32, or float16 with every scale and zero exactly an f16 "
                         f"(got {dtype}, exact: {exact})")
    heads = [_panels(a.astype(dtype)).view(np.uint8) for a in heads]  # [P, K / G, 32 x 2 or 4 bytes]
    panels = np.concatenate([*heads, quants], axis=-1).view(np.int8 if bits == 8 else np.uint8)
    return PackedLinear(panels=jnp.asarray(panels), n=N, group=K // groups, scale_bytes=np.dtype(dtype).itemsize,
                        has_zeros=zeros is not None)


def _f16_exact(a: np.ndarray) -> bool:
    """Every value of f32 `a` is exactly an f16 (no rounding, no overflow; a NaN is not)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.array_equal(a.astype(np.float16).astype(np.float32), a))


def quantize_activations(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x f32[M, K] (K a multiple of 32) -> (xq int8[M, K], d f32[M, K // 32]): per row and block of 32 k,
    d = max|x| / 127 and xq = round_half_even(x / d) in [-127, 127] (x times the f32 reciprocal 1 / d; 0 where d = 0).
    The very f32 operations of kernel.cc's QuantizeRow, so both agree bit for bit. Traceable."""
    M, K = x.shape
    if K % BLOCK:
        raise ValueError(f"quantize_activations needs K a multiple of {BLOCK} (got x {x.shape})")
    xb = x.reshape(M, K // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(xb), axis=-1)  # [M, K / 32]
    # Divide by an array of 127s behind an optimization barrier: XLA:CPU turns a division by a (broadcast) scalar
    # into a product with its reciprocal, which is not the same f32 result; the kernel divides.
    d = amax / jax.lax.optimization_barrier(jnp.full_like(amax, 127))
    inv = jnp.where(d > 0, 1 / jnp.where(d > 0, d, 1), 0).astype(jnp.float32)
    xq = jnp.clip(jnp.round(xb * inv[..., None]), -127, 127).astype(jnp.int8)
    return xq.reshape(M, K), d


def fake_quant_activations(x: jax.Array) -> jax.Array:
    """x f32[M, K] -> f32[M, K]: xq * d, the activations the integer formats multiply (`quantize_activations`)."""
    M, K = x.shape
    xq, d = quantize_activations(x)
    return (xq.reshape(M, K // BLOCK, BLOCK).astype(jnp.float32) * d[..., None]).reshape(M, K)


def round_to_bf16(x: jax.Array) -> jax.Array:
    """x f32 -> f32 holding x rounded to bf16 (nearest even), subnormals flushed to a signed zero: the activations
    the bf16 format multiplies (kernel.cc's RoundToBf16). Traceable."""
    u = functools.partial(jnp.asarray, dtype=jnp.uint32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    top = u(0xFFFF0000)
    rounded = (bits + u(0x7FFF) + ((bits >> 16) & u(1))) & top
    nan = (bits & u(0x7FFFFFFF)) > u(0x7F800000)
    tiny = (bits & u(0x7F800000)) == u(0)
    out = jnp.where(nan, (bits | u(0x00400000)) & top, jnp.where(tiny, bits & u(0x80000000), rounded))
    return jax.lax.bitcast_convert_type(out, jnp.float32)


def activations(x: jax.Array, fmt: str) -> jax.Array:
    """What the kernel multiplies for a weight of format `fmt`: x itself (f32), x rounded to bf16 (bf16), or x
    quantized per block of 32 (int8, int4: `fake_quant_activations`). Traceable."""
    if fmt == "bf16":
        return round_to_bf16(x)
    return fake_quant_activations(x) if fmt in ("int8", "int4") else x


def matmul(x: jax.Array, w: PackedLinear) -> jax.Array:
    """x: f32[M, K] @ w (packed [K, N], any format) -> f32[M, N]; for int8 and int4, x quantized per block of 32
    (module docstring). Traceable."""
    K, N = w.shape
    if x.ndim != 2 or x.shape[1] != K or x.dtype != jnp.float32:
        raise ValueError(f"matmul takes x f32[M, {K}] (got {x.shape} {x.dtype})")
    if not load():
        return activations(x, w.format) @ w.unpack()
    call = jax.ffi.ffi_call(TARGETS[w.format][0], jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32),
                            vmap_method="sequential")
    if not w.quantized:
        return call(x, w.panels)
    return call(x, w.panels, scale_bytes=np.int32(w.scale_bytes), has_zeros=bool(w.has_zeros))
