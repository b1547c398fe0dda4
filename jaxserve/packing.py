"""Pack a step's many small host arrays into one int32 buffer and unpack them inside jit; the same for outputs.

A host->device transfer has a fixed cost (~50 µs on CPU) per array; a step has ~20 small arrays, which at batch 1
is ~5% of a decode step. Packing makes it one transfer (floats travel as bit patterns); unpacking is static
slicing and bitcasts, free inside the executable. The sampler's outputs travel back the same way: every output
column side by side in one i32[R, C] array, one fetch.

Both layouts are derived from the typed step data itself, never written by hand: `Layout.of(tree)` and
`RowLayout.of(tree)` take a pytree of arrays (the registered dataclasses `StepInputs`, `SamplingInputs`,
`SamplerOutput`, ... or `jax.ShapeDtypeStruct`s of them) and record each leaf's place, shape and dtype plus the
tree's structure, so unpacking rebuilds the same dataclasses. Layouts are hashable: static jit arguments.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_DTYPES = ("int32", "uint32", "bool", "float32")  # floats and uint32 travel as their int32 bit patterns


@dataclass(frozen=True)
class Field:
    name: str  # the leaf's path in the tree, e.g. ".sampling.top_k" (for error messages)
    shape: tuple[int, ...]
    dtype: str
    offset: int

    @functools.cached_property  # read per leaf per step: computed once
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _leaves(tree) -> tuple[list[tuple[str, Any]], Any]:
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in with_paths], treedef


def _dtype_name(name: str, leaf) -> str:
    dtype = np.dtype(leaf.dtype).name
    if dtype not in _DTYPES:
        raise TypeError(f"cannot pack {name} of dtype {dtype}")
    return dtype


def _to_int32(a, dtype: str):
    """Host or traced array -> its int32 payload (bit patterns for float32 / uint32, 0/1 for bool)."""
    xp = np if isinstance(a, np.ndarray) else jnp
    if dtype in ("float32", "uint32"):
        return a.astype(dtype).view(np.int32) if xp is np else jax.lax.bitcast_convert_type(a.astype(dtype), jnp.int32)
    return a.astype(np.int32)


def _from_int32(a, dtype: str):
    if dtype in ("float32", "uint32"):
        if isinstance(a, np.ndarray):
            return np.ascontiguousarray(a).view(dtype)
        return jax.lax.bitcast_convert_type(a, jnp.dtype(dtype))
    return a != 0 if dtype == "bool" else a


@dataclass(frozen=True)
class Layout:
    """Where each leaf of a pytree of arrays lives in one flat int32 buffer (the step's single transfer)."""

    fields: tuple[Field, ...]
    size: int
    treedef: Any  # the tree's structure (hashable): `unpack` rebuilds the same dataclasses

    @staticmethod
    def of(tree) -> "Layout":
        fields, n = [], 0
        leaves, treedef = _leaves(tree)
        for name, leaf in leaves:
            f = Field(name, tuple(leaf.shape), _dtype_name(name, leaf), n)
            n += f.size
            fields.append(f)
        return Layout(tuple(fields), n, treedef)

    def pack(self, tree) -> np.ndarray:
        """Host side: a tree of numpy arrays with this layout's structure and shapes -> i32[size]."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)  # once per step: no key paths (the fields have names)
        if treedef != self.treedef:
            raise ValueError(f"tree structure {treedef} does not match the layout's {self.treedef}")
        buf = np.empty(self.size, np.int32)
        for f, leaf in zip(self.fields, leaves):
            a = np.asarray(leaf)
            if a.shape != f.shape:
                raise ValueError(f"{f.name}: shape {a.shape}, layout expects {f.shape}")
            buf[f.offset : f.offset + f.size] = _to_int32(a.reshape(-1), f.dtype)
        return buf

    def unpack(self, buf: jax.Array):
        """Inside jit: i32[size] -> the tree, every leaf with its own shape and dtype."""
        leaves = [_from_int32(buf[f.offset : f.offset + f.size], f.dtype).reshape(f.shape) for f in self.fields]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


@dataclass(frozen=True)
class RowLayout:
    """Columns of a pytree whose leaves all have R rows ([R] or [R, k]), side by side in one i32[R, C].

    Only the column widths are recorded, not R: one layout serves every bucket's row count."""

    fields: tuple[Field, ...]  # shape = the per-row shape, offset = first column
    width: int
    treedef: Any

    @staticmethod
    def of(tree) -> "RowLayout":
        fields, c = [], 0
        leaves, treedef = _leaves(tree)
        for name, leaf in leaves:
            if len(leaf.shape) not in (1, 2):
                raise ValueError(f"{name}: shape {tuple(leaf.shape)}; row outputs are [R] or [R, k]")
            f = Field(name, tuple(leaf.shape[1:]), _dtype_name(name, leaf), c)
            c += f.size
            fields.append(f)
        return RowLayout(tuple(fields), c, treedef)

    def pack(self, tree) -> jax.Array:
        """Inside jit: the tree -> i32[R, C]."""
        leaves = jax.tree_util.tree_leaves(tree)
        cols = [_to_int32(a.reshape(a.shape[0], -1), f.dtype) for f, a in zip(self.fields, leaves)]
        return jnp.concatenate(cols, axis=1)

    def unpack(self, a: np.ndarray):
        """Host side: the fetched i32[R, C] -> the tree of numpy arrays (views where the dtype allows)."""
        R = a.shape[0]
        leaves = [
            _from_int32(a[:, f.offset : f.offset + f.size], f.dtype).reshape((R, *f.shape)) for f in self.fields
        ]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)
