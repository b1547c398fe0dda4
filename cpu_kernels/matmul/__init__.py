"""Dense f32 matmul on CPU for small row counts: the native FFI kernel (`kernel.cc`) over pre-packed weights.

`pack(w)` turns a weight f32[K, N] into the kernel's layout, a `PackedLinear` holding f32[ceil(N/32), K, 32]
(32-column panels, each a sequential stream, zero-padded past N). `matmul(x, packed)` computes `x @ w` for
x f32[M, K] with one `jax.ffi.ffi_call`; each output element is the same in-order FMA chain over K whatever M is, so
a row's result does not depend on its batch companions. Like the attention kernel, the library is built on first use
(`cpu_kernels.build`) and `matmul` falls back to an XLA dot against the unpacked weight (with one warning) when it
cannot be built.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import build_library, load_cpu_target

TARGET = "jaxserve_matmul"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel.cc")
PANEL = 32  # columns per packed panel (kNr in kernel.cc)


@functools.cache
def load() -> bool:
    """Build (or find in the cache), load and register the native library; False, with one warning, on failure."""
    return load_cpu_target(build_library, SOURCE, "JaxserveMatmul", TARGET,
                           "native CPU matmul unavailable, using XLA dots")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedLinear:
    """A linear weight [K, N] in the native kernel's layout. `n` (the true column count) is static."""

    panels: jax.Array  # f32[ceil(N / 32), K, 32]
    n: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.panels.shape[1], self.n)

    def unpack(self) -> jax.Array:  # f32[K, N]
        P, K, _ = self.panels.shape
        return jnp.transpose(self.panels, (1, 0, 2)).reshape(K, P * PANEL)[:, : self.n]


def pack(w) -> PackedLinear:
    """w: f32[K, N] (numpy or jax) -> PackedLinear. Done once, on the host, when weights are placed."""
    w = np.asarray(w)
    if w.ndim != 2 or w.dtype != np.float32:
        raise ValueError(f"pack takes an f32[K, N] weight (got {w.shape} {w.dtype})")
    K, N = w.shape
    P = -(-N // PANEL)
    padded = np.zeros((K, P * PANEL), np.float32)
    padded[:, :N] = w
    panels = np.ascontiguousarray(padded.reshape(K, P, PANEL).transpose(1, 0, 2))
    return PackedLinear(panels=jnp.asarray(panels), n=N)


def matmul(x: jax.Array, w: PackedLinear) -> jax.Array:
    """x: f32[M, K] @ w (packed [K, N]) -> f32[M, N]. Traceable."""
    K, N = w.shape
    if x.ndim != 2 or x.shape[1] != K or x.dtype != jnp.float32:
        raise ValueError(f"matmul takes x f32[M, {K}] (got {x.shape} {x.dtype})")
    if not load():
        return x @ w.unpack()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32), vmap_method="sequential")
    return call(x, w.panels)
