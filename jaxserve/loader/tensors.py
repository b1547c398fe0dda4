"""A checkpoint's tensors, each read from its file only when asked for: the loaders' common currency.

Reading a whole checkpoint into a dict of arrays holds every tensor on the host at once (and, for a quantized GGUF
served in float, the whole model dequantized to float32) before the weights are even converted. Here a tensor's
shape and stored form are known from the file's header, and its data is read (into fresh memory, not a memory map:
the pages go when the array does) each time `tensors[name]` is evaluated. `loader.weights.to_weights` reads one
tensor, converts it to its stored form, and lets it go, so loading peaks at about the weights as stored plus one
tensor.

    tensors = read_hf_dir(path)[1]          # or read_gguf(path)[1]
    tensors.entry("model.norm.weight").shape    # from the header, nothing read
    w = tensors["model.norm.weight"]            # read now
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Callable

import numpy as np

from jaxserve import quant


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as its file's header describes it."""

    shape: tuple[int, ...]  # HF layout ([out, in] for linear maps)
    read: Callable[[], np.ndarray | quant.BlockQuantized]  # the tensor; a fresh array unless held in memory already
    block: quant.BlockForm | None = None  # set when `read` returns a quant.BlockQuantized: its form


class LazyTensors(Mapping):
    """HF tensor name -> tensor (numpy, or quant.BlockQuantized for GGUF blocks kept as they are), read on access.
    Each access reads again: hold the result while you need it, and no longer."""

    def __init__(self, entries: Mapping[str, TensorEntry]):
        self._entries = dict(entries)

    @classmethod
    def of(cls, tensors: Mapping) -> LazyTensors:
        """`tensors` as a LazyTensors: itself, or in-memory arrays (a test's dict) wrapped as they are."""
        if isinstance(tensors, LazyTensors):
            return tensors
        return cls({
            name: TensorEntry(tuple(t.shape), lambda t=t: t,
                              t.form if isinstance(t, quant.BlockQuantized) else None)
            for name, t in tensors.items()
        })

    def entry(self, name: str) -> TensorEntry:
        return self._entries[name]

    def __getitem__(self, name: str):
        return self._entries[name].read()

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name) -> bool:
        return name in self._entries


def read_file_array(path: str, offset: int, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """`shape` values of `dtype` at byte `offset` of `path`, read into a new array (short files fail clearly)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.fromfile(path, dtype=np.uint8, count=count * dtype.itemsize, offset=offset)
    if raw.size != count * dtype.itemsize:
        raise ValueError(f"{path}: truncated: {count * dtype.itemsize} bytes expected at offset {offset}, "
                         f"{raw.size} there")
    return raw.view(dtype).reshape(shape)
