"""Matmul on CPU for small row counts: the native FFI kernel (`kernel.cc`) over pre-packed weights, stored as f32,
bf16, int8 or 4-bit.

A weight is logically w f32[K, N]. Packing it (once, on the host, when weights are placed) gives a `PackedLinear` in
the kernel's layout: panels of 32 columns, each a sequential stream over K, zero-padded past N.

    format  made by                                   panels                 dequantized w[k, n]
    f32     pack(w f32[K, N])                         f32[P, K, 32]          w
    bf16    pack(w bf16[K, N])                        bf16[P, K, 32]         the bf16 widened exactly
    int8    pack_quantized(q int8, scales, zeros)     int8[P, K / 4, 128]    q * scales[k // G, n] + zeros[k // G, n]
    int4    pack_quantized(q 0..15, ..., bits=4)      uint8[P, K / 4, 64]    the same, q 4-bit

P = ceil(N / 32). Scales and zeros (f32[K // G, N], groups of G along K; zeros None = none added) become f32[P, K // G,
32]. The integer formats hold 4 consecutive k of a column together (vpdpbusd's 32-bit lanes): an int8 panel is
[K / 4, 32 columns, 4 k] of the bytes of q + 128 (stored as int8 bits, read as uint8); a 4-bit panel is [K / 4, 16,
4 k] bytes, byte [j, i] holding column j at k = 4 kq + i in its low nibble and column j + 16 in its high one. K must be
a multiple of 32 and G of 16. Dequantization is float32 arithmetic, the product rounded, then the sum (not an FMA).

`matmul(x, packed)` computes `x @ w` for x f32[M, K] with one `jax.ffi.ffi_call`.
  * f32, bf16: each output element is an in-order FMA chain over K against the exact weights.
  * int8, int4 (as llama.cpp does): x is quantized per row and block of 32 k to int8 with one f32 scale d per block
    (`quantize_activations`), products are exact integer dot products (vpdpbusd), and scales are applied once per
    block: y approximates `fake_quant_activations(x) @ unpack()`, float rounding aside.
Each row is computed the same way whatever M is, so a row's result does not depend on its batch companions. Like the
attention kernel, the library is built on first use (`cpu_kernels.build`) and `matmul` falls back to XLA (with one
warning) when it cannot be built: `x @ unpack()` for the float formats, `fake_quant_activations(x) @ unpack()` for the
integer ones (the kernel's semantics). `unpack()` is also the reference.
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


@functools.cache
def load() -> bool:
    """Build (or find in the cache), load and register the native library's targets; False, with one warning, on
    failure."""
    return all(load_cpu_target(build_library, SOURCE, symbol, target, "native CPU matmul unavailable, using XLA dots")
               for target, symbol in TARGETS.values())


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedLinear:
    """A linear weight [K, N] in the native kernel's layout (module docstring). `n` (the true column count) and
    `group` (G, 0 for the float formats) are static; the format follows from the panels' dtype."""

    panels: jax.Array  # f32 | bf16 [P, K, 32], int8 [P, K / 4, 128] or uint8 [P, K / 4, 64] (int4)
    n: int = dataclasses.field(metadata=dict(static=True))
    scales: jax.Array | None = None  # f32[P, K // G, 32] (int8, int4)
    zeros: jax.Array | None = None  # f32[P, K // G, 32], or None: no zeros
    group: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def format(self) -> str:
        """"f32" | "bf16" | "int8" | "int4"."""
        return _FORMAT_OF_DTYPE[np.dtype(self.panels.dtype)]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.panels.shape[1] * (4 if self.scales is not None else 1), self.n)

    @property
    def nbytes(self) -> int:
        """Bytes the kernel streams: panels, scales and zeros (padding included)."""
        return sum(a.size * a.dtype.itemsize for a in (self.panels, self.scales, self.zeros) if a is not None)

    def unpack(self) -> jax.Array:  # f32[K, N]
        """The dequantized weight, as the kernel computes it (traceable): the reference and the XLA fallback."""
        K, _ = self.shape
        P = self.panels.shape[0]
        w = self.panels
        if self.format == "int8":  # [P, K / 4, 32 columns, 4 k] bytes of q + 128 -> q [P, K, 32]
            w = jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(P, K // 4, PANEL, 4)
            w = jnp.swapaxes(w, 2, 3).reshape(P, K, PANEL).astype(jnp.int32) - 128
        elif self.format == "int4":  # [P, K / 4, 16, 4 k] -> [P, K, 16] -> columns j (low), j + 16 (high)
            w = jnp.swapaxes(w.reshape(P, K // 4, PANEL // 2, 4), 2, 3).reshape(P, K, PANEL // 2)
            w = jnp.concatenate([w & 15, w >> 4], axis=-1)  # [P, K, 32]
        w = w.astype(jnp.float32)
        if self.scales is not None:
            w = _rounded_product(w, jnp.repeat(self.scales, self.group, axis=1))
            if self.zeros is not None:
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
    return PackedLinear(panels=jnp.asarray(_panels(w)), n=w.shape[1])


def pack_quantized(q, scales, zeros=None, bits: int = 8) -> PackedLinear:
    """Integer weight -> PackedLinear (int8 or int4) with w[k, n] = q[k, n] * scales[k // G, n] + zeros[k // G, n].

    q: int8[K, N] (bits 8) or uint8[K, N] holding 0..15 (bits 4); scales, zeros: f32[K // G, N] (zeros None = 0),
    G = K // scales.shape[0] dividing K. Numpy or jax arrays; done once, on the host."""
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
    P = panels.shape[0]
    if bits == 8:  # the bytes of q + 128, [P, K / 4, 32 columns, 4 k]
        panels = (panels.view(np.uint8) ^ 0x80).reshape(P, K // 4, 4, PANEL).transpose(0, 1, 3, 2)
        panels = np.ascontiguousarray(panels).reshape(P, K // 4, 4 * PANEL).view(np.int8)
    else:  # byte j: column j low, column j + 16 high; then [P, K / 4, 16, 4 k]
        panels = panels[..., :16] | (panels[..., 16:] << 4)
        panels = np.ascontiguousarray(panels.reshape(P, K // 4, 4, PANEL // 2).transpose(0, 1, 3, 2))
        panels = panels.reshape(P, K // 4, 2 * PANEL)
    return PackedLinear(panels=jnp.asarray(panels), n=N, scales=jnp.asarray(_panels(scales)),
                        zeros=None if zeros is None else jnp.asarray(_panels(zeros)), group=K // scales.shape[0])


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


def matmul(x: jax.Array, w: PackedLinear) -> jax.Array:
    """x: f32[M, K] @ w (packed [K, N], any format) -> f32[M, N]; for int8 and int4, x quantized per block of 32
    (module docstring). Traceable."""
    K, N = w.shape
    if x.ndim != 2 or x.shape[1] != K or x.dtype != jnp.float32:
        raise ValueError(f"matmul takes x f32[M, {K}] (got {x.shape} {x.dtype})")
    if not load():
        return (x if w.scales is None else fake_quant_activations(x)) @ w.unpack()
    call = jax.ffi.ffi_call(TARGETS[w.format][0], jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32),
                            vmap_method="sequential")
    if w.scales is None:
        return call(x, w.panels)
    zeros = jnp.zeros((0,), jnp.float32) if w.zeros is None else w.zeros
    return call(x, w.panels, w.scales, zeros)
