"""Weights in fewer bytes: the quantization schemes, their one representation, and GGUF blocks repacked into it.

Decode streams every weight once per step, so bytes per weight set the single-stream ceiling. A scheme says how the
linear weights (the seven per layer and the logits projection) are stored; norms, biases and the embedding used
for token lookup stay in the model dtype, and so do activations, except at a linear map's input, which is rounded to
what its weights multiply: bf16 for bf16 weights (what a bf16 GEMM computes; the native CPU kernel's vdpbf16ps),
int8 per block of 32 for the integer schemes on the native CPU path (as llama.cpp does).

    scheme     stored as                                                   from
    none       the model dtype                                              any checkpoint
    bf16       bfloat16                                                     a float checkpoint, rounded at load
    int8       int8, one scale per output channel (symmetric)               a float checkpoint, quantized at load
    int4       4-bit, a scale and a zero per group of 32 inputs (affine)    a float checkpoint, quantized at load
    int4-g64   the same, groups of 64
    gguf       the GGUF file's own blocks, repacked exactly (no float detour): Q4_0, Q4_1, Q4_K as 4-bit;
               Q8_0, Q5_0, Q5_1, Q5_K, Q6_K as int8 (5- and 6-bit values widened to a byte)

Every integer scheme is one `QuantizedLinear`: w[k, n] = q[k, n] * scales[k // G, n] + zeros[k // G, n], q int8 or
4-bit, scales and zeros float32 (the 4-bit quantizer rounds them to float16 values, which the native kernel then
stores in 2 bytes, as GGUF's Q4_0 / Q4_1 / Q8_0 blocks store theirs), groups of G along the input dimension. That
form holds each GGUF block format exactly (a Q4_K sub-block's d * sc and dmin * m are exact float32 products; Q4_0's
d * (q - 8) is q * d - 8 d), so the XLA reference (`QuantizedLinear.dequantize`, then a dot) and the native CPU
kernels (`cpu_kernels.matmul`, packed by `ops.pack_linear_weights`) compute with the very values the file holds.

Why not qwix (JAX's quantization library): its `QArray` stores w = (q - zero_point) * scale, which cannot hold
GGUF's affine blocks exactly (zero_point = -m / d needs a division that rounds, and fails where d = 0), and its
entry point rewrites flax modules' dot_generals, while jaxserve's model is pure functions whose native CPU path needs
its own panel layout anyway. The quantizers here are a dozen lines of numpy each.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import QUANTIZATION_SCHEMES

SCHEMES = QUANTIZATION_SCHEMES  # validated by EngineConfig
INT4_GROUPS = {"int4": 32, "int4-g64": 64}


@jax.tree_util.register_dataclass
@dataclass
class QuantizedLinear:
    """A linear weight [..., K, N] ([in, out]; leading axes = stacked layers) as integers with group-wise scales:
    w[k, n] = q[k, n] * scales[k // G, n] + zeros[k // G, n] (float32 arithmetic: the product rounded, then the sum).

    4-bit values (0..15) are stored two per byte along K, each group's first half in the low nibbles and its second
    half in the high ones: byte [g * G / 2 + j, n] holds k = g * G + j (low) and k = g * G + G / 2 + j (high), so
    a kernel reads one group as two contiguous [G / 2, N] halves of the same bytes."""

    q: jax.Array  # int8 [..., K, N] (bits 8) | uint8 [..., K // 2, N] (bits 4)
    scales: jax.Array  # f32 [..., K // G, N]
    zeros: jax.Array | None  # f32 [..., K // G, N]; None = 0
    bits: int = dataclasses.field(metadata=dict(static=True))
    # what `ops.linear` runs (set when the runner places the weights, from `ops.Backends.matmul`): "xla" (dequantize,
    # then XLA's dot), "xla-q8" (the same after rounding the activations to int8 per block of 32: the CPU's
    # semantics, those of the native kernel, as in llama.cpp) or "pallas" (the GPU kernel)
    kernel: str = dataclasses.field(default="xla", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, k, n = self.q.shape
        return (*lead, k * (2 if self.bits == 4 else 1), n)

    @property
    def group(self) -> int:
        return self.shape[-2] // self.scales.shape[-2]

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (self.q, self.scales, self.zeros) if a is not None)

    def values(self):
        """The integer values [..., K, N] (4-bit unpacked to uint8 0..15), numpy or jax like `q`."""
        if self.bits == 8:
            return self.q
        xp = np if isinstance(self.q, np.ndarray) else jnp
        *lead, half, n = self.q.shape
        q = self.q.reshape(*lead, 2 * half // self.group, self.group // 2, n)  # [..., groups, G / 2, N]
        return xp.stack([q & 15, q >> 4], axis=-3).reshape(*lead, 2 * half, n)

    def dequantize(self, dtype=jnp.float32):
        """The float weight [..., K, N] (numpy in, numpy out; traceable on jax arrays)."""
        xp = np if isinstance(self.q, np.ndarray) else jnp
        *lead, K, N = self.shape
        G = self.group
        w = self.values().astype(xp.float32).reshape(*lead, K // G, G, N) * self.scales[..., :, None, :]
        if self.zeros is not None:
            w = w + self.zeros[..., :, None, :]
        return w.reshape(*lead, K, N).astype(dtype)


def from_values(values: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, bits: int) -> QuantizedLinear:
    """Host integer values [..., K, N] (int8, or 0..15 for bits 4) -> QuantizedLinear (4-bit packed along K)."""
    if bits == 4:
        *lead, K, N = values.shape
        G = K // scales.shape[-2]
        v = values.astype(np.uint8).reshape(*lead, K // G, 2, G // 2, N)  # each group's two halves
        q = (v[..., 0, :, :] | (v[..., 1, :, :] << 4)).reshape(*lead, K // 2, N)
    elif bits == 8:
        q = values.astype(np.int8)
    else:
        raise ValueError(f"bits must be 4 or 8 (got {bits})")
    zeros = None if zeros is None else np.ascontiguousarray(zeros, np.float32)
    return QuantizedLinear(np.ascontiguousarray(q), np.ascontiguousarray(scales, np.float32), zeros, bits)


# --- quantizing float weights ---------------------------------------------------------------------------------


def _f16_values(a: np.ndarray, up: bool) -> np.ndarray:
    """f32 values -> the nearest float16 value at or above them (`up`) or at or below them, kept as f32 (left as
    they are where float16 does not reach). Scales and zeros that are float16 values are stored in 2 bytes each by
    the native kernel, as GGUF's blocks store theirs; rounding the scale up and the zero down keeps every weight of
    the group within the 2^bits levels, so the error stays within half a step."""
    r = a.astype(np.float16)
    off = (r < a) if up else (r > a)
    r = np.where(off, np.nextafter(r, np.float16(np.inf if up else -np.inf)), r).astype(np.float32)
    return np.where(np.isfinite(r), r, a)


def quantize_int8(w: np.ndarray) -> QuantizedLinear:
    """f[..., K, N] -> int8 with one symmetric scale per output channel (absmax / 127, round to nearest). One
    scale per column: float32 costs nothing next to the values."""
    w = np.asarray(w, np.float32)
    scale = np.maximum(w.max(axis=-2, keepdims=True), -w.min(axis=-2, keepdims=True)) / 127
    inv = np.divide(1, scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.multiply(w, inv)  # one float temporary, rounded and clipped in place (loading holds one tensor's worth)
    np.clip(np.rint(q, out=q), -127, 127, out=q)
    return from_values(q, scale, None, 8)


def quantize_int4(w: np.ndarray, group: int) -> QuantizedLinear:
    """f[..., K, N] -> 4-bit with an affine scale and zero per group of `group` inputs (min..max over 16 levels;
    scale and zero rounded to float16, as in GGUF's Q4_1)."""
    w = np.asarray(w, np.float32)
    *lead, K, N = w.shape
    if K % group:
        raise ValueError(f"int4 with groups of {group} needs the input dimension to be a multiple of it (got {K})")
    g = w.reshape(*lead, K // group, group, N)
    lo, hi = g.min(axis=-2), g.max(axis=-2)
    lo = _f16_values(lo, up=False)
    scale = _f16_values((hi - lo) / 15, up=True)
    inv = np.divide(1, scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.subtract(g, lo[..., None, :])  # one float temporary, scaled, rounded and clipped in place
    q *= inv[..., None, :]
    np.clip(np.rint(q, out=q), 0, 15, out=q)
    q = q.reshape(*lead, K, N)
    return from_values(q, scale, lo, 4)


def quantize_linear(w: np.ndarray, scheme: str):
    """A float linear weight [..., K, N] stored as `scheme` (a bfloat16 array, or a QuantizedLinear)."""
    if scheme == "bf16":
        return np.asarray(w, np.float32).astype(jnp.bfloat16)
    if scheme == "int8":
        return quantize_int8(w)
    if scheme in INT4_GROUPS:
        return quantize_int4(w, INT4_GROUPS[scheme])
    raise ValueError(f"quantize_linear: no float quantizer for scheme {scheme!r}")


# --- GGUF blocks ----------------------------------------------------------------------------------------------

# A GGUF quantized tensor [rows, cols] is rows of blocks along cols (the input dimension). Per type: values per
# block, bytes per block, and the (bits, group) of its exact repacking.
GGUF_BLOCKS = {
    "Q4_0": (32, 18, 4, 32), "Q4_1": (32, 20, 4, 32), "Q4_K": (256, 144, 4, 32),
    "Q8_0": (32, 34, 8, 32), "Q5_0": (32, 22, 8, 32), "Q5_1": (32, 24, 8, 32),
    "Q5_K": (256, 176, 8, 32), "Q6_K": (256, 210, 8, 16),
}
_GGUF_NO_ZEROS = ("Q8_0", "Q5_0", "Q6_K")  # symmetric formats: w = q * scale


@dataclass(frozen=True)
class BlockForm:
    """How a BlockQuantized stores its values: what stacking layers must agree on, known before any data is read."""

    bits: int
    group: int
    zeros: bool  # has a zero per group

    @staticmethod
    def of_gguf(ggml_type: str) -> BlockForm:
        _, _, bits, group = GGUF_BLOCKS[ggml_type]
        return BlockForm(bits, group, ggml_type not in _GGUF_NO_ZEROS)

    @staticmethod
    def common(forms) -> BlockForm:
        """The form that holds every one of `forms` exactly: the widest storage, the smallest group, zeros if any
        has them (for stacking layers whose files chose different block types: values are widened, scales
        repeated, zeros of 0 added)."""
        forms = list(forms)
        return BlockForm(max(f.bits for f in forms), math.gcd(*(f.group for f in forms)), any(f.zeros for f in forms))


@dataclass
class BlockQuantized:
    """A GGUF tensor's exact values in HF layout [out, in] (host numpy): w[o, i] = values[o, i] * scales[o, i // G]
    + zeros[o, i // G]. What the GGUF loader returns for quantized tensors when blocks are kept."""

    values: np.ndarray  # int8 (bits 8) | uint8 0..15 (bits 4) [out, in]
    scales: np.ndarray  # f32 [out, in // G]
    zeros: np.ndarray | None  # f32 [out, in // G]
    bits: int
    ggml_type: str  # the file's block type, e.g. "Q4_1"

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape

    @property
    def group(self) -> int:
        return self.values.shape[1] // self.scales.shape[1]

    def dequantize(self) -> np.ndarray:  # f32 [out, in]
        rows, cols = self.shape
        G = self.group
        w = self.values.astype(np.float32).reshape(rows, cols // G, G)
        w *= self.scales[:, :, None]  # in place: the embedding table is 113 MB in float32
        if self.zeros is not None:
            w += self.zeros[:, :, None]
        return w.reshape(rows, cols)

    def map_rows(self, fn) -> BlockQuantized:
        """The same tensor with `fn` (a permutation of the leading axis) applied to values, scales and zeros."""
        return dataclasses.replace(self, values=fn(self.values), scales=fn(self.scales),
                                   zeros=None if self.zeros is None else fn(self.zeros))

    @property
    def form(self) -> BlockForm:
        return BlockForm(self.bits, self.group, self.zeros is not None)

    def linear(self, form: BlockForm | None = None) -> QuantizedLinear:
        """This weight as the model holds it: a QuantizedLinear [in, out], in `form` (default its own; one that
        holds it, `BlockForm.common`, to stack it with other layers)."""
        form = form or self.form
        r = self.group // form.group
        if self.group % form.group or form.bits < self.bits or (self.zeros is not None and not form.zeros):
            raise ValueError(f"cannot hold {self.ggml_type} ({self.form}) as {form}")
        rep = (lambda a: np.repeat(a, r, axis=1)) if r > 1 else (lambda a: a)  # noqa: E731
        values = self.values.astype(np.int8) if form.bits == 8 else self.values
        zeros = None
        if form.zeros:
            zeros = rep(self.zeros).T if self.zeros is not None else np.zeros(rep(self.scales).T.shape, np.float32)
        return from_values(values.T, rep(self.scales).T, zeros, form.bits)


def decode_gguf_blocks(data: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> BlockQuantized:
    """Raw GGUF tensor bytes (uint8, any shape with rows first) of `ggml_type` for a weight [out, in] -> its exact
    values, scales and zeros. The block layouts are ggml's (ggml-common.h)."""
    block, nbytes, bits, group = GGUF_BLOCKS[ggml_type]
    rows, cols = shape
    if cols % block:
        raise ValueError(f"{ggml_type} tensor with {cols} columns: not a multiple of its {block}-value blocks")
    b = np.ascontiguousarray(data, np.uint8).reshape(rows * cols // block, nbytes)
    f16 = lambda a: a.view(np.float16).astype(np.float32)  # noqa: E731  (2 bytes per block -> f32)
    nib = lambda a: np.stack([a & 15, a >> 4], axis=-2)  # noqa: E731  (bytes [..., n] -> low half, high half)
    zeros = None
    if ggml_type in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = f16(b[:, 0:2])  # [B, 1]
        off = 4 if ggml_type in ("Q4_1", "Q5_1") else 2
        high = None
        if ggml_type.startswith("Q5"):  # 32 fifth bits, then the low nibbles
            high = np.unpackbits(b[:, off:off + 4], axis=1, bitorder="little").astype(np.uint8) << 4  # [B, 32]
            off += 4
        q = nib(b[:, off:off + 16]).reshape(-1, 32)  # values j and j + 16 share byte j
        if high is not None:
            q = q | high
        if ggml_type in ("Q4_1", "Q5_1"):
            scales, zeros = d, f16(b[:, 2:4])
        elif ggml_type == "Q4_0":  # d * (q - 8) = q * d + (-8 d), both exact in f32
            scales, zeros = d, -8 * d
        else:  # Q5_0: d * (q - 16), held as int8 q - 16
            q, scales = q.astype(np.int8) - 16, d
    elif ggml_type == "Q8_0":
        scales, q = f16(b[:, 0:2]), b[:, 2:].view(np.int8)
    elif ggml_type in ("Q4_K", "Q5_K"):  # 256 values: 8 sub-blocks of 32, 6-bit scales and mins
        d, dmin = f16(b[:, 0:2]), f16(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])  # [B, 8] each
        scales, zeros = d * sc, -(dmin * mn)
        if ggml_type == "Q4_K":  # 4 chunks of 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high
            q = nib(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 256)
        else:  # 32 bytes of fifth bits (bit s of byte j -> sub-block s, value j), then 4 chunks of low nibbles
            high = np.unpackbits(b[:, 16:48].reshape(-1, 32, 1), axis=2, bitorder="little")  # [B, 32, 8]
            low = nib(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
            q = low | (high.transpose(0, 2, 1) << 4)
        q = q.reshape(-1, 256)
    elif ggml_type == "Q6_K":  # 256 values: 16 sub-blocks of 16, int8 scales, d * sc * (q - 32)
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), f16(b[:, 208:210])
        ql = ql.reshape(-1, 2, 64)  # two halves of 128 values
        qh = qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)  # [B, 2, 4, 32]
        low = np.concatenate([ql & 15, ql >> 4], axis=-1).reshape(-1, 2, 4, 32)
        q = (low | ((qh & 3) << 4)).astype(np.int8) - 32
        q = q.reshape(-1, 256)
        scales = d * sc.astype(np.float32)
    else:
        raise ValueError(f"GGUF block type {ggml_type} is not supported")
    values = q.reshape(rows, cols)
    scales = np.ascontiguousarray(scales, np.float32).reshape(rows, cols // group)
    zeros = None if zeros is None else np.ascontiguousarray(zeros, np.float32).reshape(rows, cols // group)
    return BlockQuantized(values.astype(np.int8 if bits == 8 else np.uint8), scales, zeros, bits, ggml_type)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of a Q4_K / Q5_K block -> (scales, mins) f32[B, 8], 6 bits each: sub-blocks 0-3 in the
    low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11 plus the top 2 bits of 0-7."""
    a, m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 63, (hi & 15) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([m & 63, (hi >> 4) | ((m >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def concat_columns(ws: list):
    """Linear weights of one input, [K, N_i] each (host arrays of one dtype, or QuantizedLinears of one bits, group
    and zeros-or-not), side by side -> one weight [K, sum N_i] in the same stored form; None when the forms differ
    (e.g. a GGUF layer whose value projection uses another block type). Exact: columns are only moved."""
    cat = lambda arrays: np.concatenate([np.asarray(a) for a in arrays], axis=-1)  # noqa: E731
    if all(isinstance(w, QuantizedLinear) for w in ws):
        a = ws[0]
        if any(w.bits != a.bits or w.group != a.group or (w.zeros is None) != (a.zeros is None) for w in ws):
            return None
        zeros = None if a.zeros is None else cat([w.zeros for w in ws])
        return QuantizedLinear(cat([w.q for w in ws]), cat([w.scales for w in ws]), zeros, a.bits, a.kernel)
    if any(isinstance(w, QuantizedLinear) for w in ws) or len({np.asarray(w).dtype for w in ws}) != 1:
        return None
    return cat(ws)


def linear_bytes(weights) -> int:
    """Bytes of a (stacked) Weights tree's linear maps as stored: what a decode step streams, logits included."""
    maps = [getattr(weights.layers, f) for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
    return sum(m.nbytes for m in maps + [weights.lm_head if weights.lm_head is not None else weights.embed])


def with_kernel(weights, kernel: str):
    """`weights` with every QuantizedLinear marked to run on `kernel` ("xla" | "xla-q8" | "pallas")."""
    return jax.tree.map(lambda w: dataclasses.replace(w, kernel=kernel) if isinstance(w, QuantizedLinear) else w,
                        weights, is_leaf=lambda w: isinstance(w, QuantizedLinear))


def describe(weights) -> str:
    """'int4 g32 x 180, int8 g32 x 31, ...': the stored forms of a Weights tree's linear maps (for the start log)."""
    counts: dict[str, int] = {}
    for leaf in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QuantizedLinear)):
        if isinstance(leaf, QuantizedLinear):
            key = f"int{leaf.bits} g{leaf.group}"
            counts[key] = counts.get(key, 0) + (leaf.q.shape[0] if leaf.q.ndim == 3 else 1)
        elif getattr(leaf, "ndim", 0) >= 2 and leaf.dtype == jnp.bfloat16:
            counts["bf16"] = counts.get("bf16", 0) + (leaf.shape[0] if leaf.ndim == 3 else 1)
    return ", ".join(f"{k} x {v}" for k, v in counts.items()) or "float"
