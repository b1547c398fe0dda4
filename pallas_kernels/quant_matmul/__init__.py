"""y = x @ dequantize(w) for group-wise quantized weights, as one Pallas GPU kernel (Triton lowering).

Why a kernel: XLA's GPU compiler fuses a plain int8 -> bf16 convert into its GEMM's operand, but not a group-wise
scale (a multiply by a broadcast) or a 4-bit unpack: it writes the whole dequantized weight to memory first
(tests/test_quant_compile_sm90.py measures it), which costs more bandwidth than bf16 weights would. Decode streams
every weight once per step, so the kernel dequantizes in registers instead.

Weights (the layout of `jaxserve.quant.QuantizedLinear`, passed as plain arrays; pallas_kernels imports nothing
from jaxserve): w[k, n] = q[k, n] * scales[k // G, n] + zeros[k // G, n].
  * bits 8: q int8 [K, N].
  * bits 4: q uint8 [K / 2, N]; byte [g G / 2 + j, n] holds k = g G + j in its low nibble and k = g G + G / 2 + j
    in its high nibble, so one group is two contiguous [G / 2, N] halves of the same bytes.

Work decomposition: grid (M / block_m, N / block_n). A program loops over the K / G groups: it loads the group's
q bytes [G or G / 2, block_n] once, dequantizes them (one FMA per value, in f32, then the activations' dtype), and
accumulates x[:, group] @ w_group in f32 (a tensor-core dot). Rows are padded to block_m (>= 16, the dot's
minimum) by `quant_matmul`; N must be a multiple of block_n.

Status: checked against `reference` in Pallas interpret mode on CPU (tests/test_quant_matmul_kernel.py) and compiled
for sm_90 without a GPU (tests/test_quant_compile_sm90.py). It has NOT yet been run on a GPU; the block sizes are a
judgement, not a measurement.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MIN_GROUP = 32  # the dot's K per half-group must be >= 16
BLOCK_N = 64
NUM_WARPS = 4


def reference(x, q, scales, zeros, *, bits: int) -> jax.Array:
    """The semantics: dequantize (f32), then the dot in f32; result in x's dtype. x [M, K]."""
    K, N = x.shape[1], q.shape[1]
    G = K // scales.shape[0]
    if bits == 4:
        h = q.reshape(K // G, G // 2, N)
        v = jnp.stack([h & 15, h >> 4], axis=1).reshape(K, N)
    else:
        v = q
    w = v.astype(jnp.float32).reshape(K // G, G, N) * scales[:, None, :]
    if zeros is not None:
        w = w + zeros[:, None, :]
    return jnp.dot(x.astype(jnp.float32), w.reshape(K, N)).astype(x.dtype)


def unsupported_reason(x, q, scales, *, bits: int, block_n: int = BLOCK_N) -> str | None:
    """Why the kernel does not cover this product, or None when it does."""
    K, N = x.shape[1], q.shape[1]
    G = K // scales.shape[0]
    if G < MIN_GROUP or G % 16:
        return f"group {G} < {MIN_GROUP} or not a multiple of 16"
    if N % block_n:
        return f"N = {N} is not a multiple of block_n = {block_n}"
    if bits not in (4, 8):
        return f"bits {bits}"
    return None


def _kernel(x_ref, q_ref, s_ref, *rest, bits: int, group: int, num_groups: int, has_zeros: bool):
    z_ref, o_ref = rest if has_zeros else (None, rest[0])
    half = group // 2
    dtype = x_ref.dtype

    def dequant(v, g):  # v [rows, block_n] integers of group g -> weights in the activations' dtype
        w = v.astype(jnp.float32) * s_ref[pl.ds(g, 1), :]
        if has_zeros:
            w = w + z_ref[pl.ds(g, 1), :]
        return w.astype(dtype)

    def dot(a, b):  # tensor cores, f32 accumulation
        return jnp.dot(a, b, preferred_element_type=jnp.float32)

    def body(g, acc):
        if bits == 4:
            b = q_ref[pl.ds(g * half, half), :]  # uint8 [G / 2, block_n]
            lo, hi = dequant(b & 15, g), dequant(b >> 4, g)
            acc += dot(x_ref[:, pl.ds(g * group, half)], lo)
            return acc + dot(x_ref[:, pl.ds(g * group + half, half)], hi)
        return acc + dot(x_ref[:, pl.ds(g * group, group)], dequant(q_ref[pl.ds(g * group, group), :], g))

    acc = lax.fori_loop(0, num_groups, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("bits", "block_m", "block_n", "interpret"))
def _call(x, q, scales, zeros, *, bits: int, block_m: int, block_n: int, interpret: bool):
    M, K = x.shape
    N = q.shape[1]
    G = K // scales.shape[0]
    Kq = q.shape[0]
    row = lambda i, j: (i, 0)  # noqa: E731
    col = lambda i, j: (0, j)  # noqa: E731
    in_specs = [pl.BlockSpec((block_m, K), row), pl.BlockSpec((Kq, block_n), col),
                pl.BlockSpec((K // G, block_n), col)]
    args = [x, q, scales]
    if zeros is not None:
        in_specs.append(pl.BlockSpec((K // G, block_n), col))
        args.append(zeros)
    return pl.pallas_call(
        functools.partial(_kernel, bits=bits, group=G, num_groups=K // G, has_zeros=zeros is not None),
        grid=(M // block_m, N // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((M, N), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
        interpret=interpret,
        name="quant_matmul",
    )(*args)


def quant_matmul(x, q, scales, zeros=None, *, bits: int, interpret: bool = False, block_n: int = BLOCK_N):
    """x [M, K] (bf16 / f16 / f32) @ the quantized weight -> [M, N] in x's dtype, on the kernel. Raises where
    `unsupported_reason` says it does not apply."""
    reason = unsupported_reason(x, q, scales, bits=bits, block_n=block_n)
    if reason is not None:
        raise ValueError(f"quant_matmul: {reason}")
    M = x.shape[0]
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    padded = -(-M // block_m) * block_m
    if padded != M:
        x = jnp.pad(x, ((0, padded - M), (0, 0)))
    return _call(x, q, scales, zeros, bits=bits, block_m=block_m, block_n=block_n, interpret=interpret)[:M]
