"""Huge pages for the CPU engine's big buffers: the weights and the KV cache (Linux, best effort).

A decode step on the CPU reads every weight and, in every layer, a few rows from each sequence's KV pages; with 4 KB
pages those reads touch thousands of distinct pages a step, each a TLB miss (a two-dimensional page walk under a
hypervisor). `back_with_huge_pages` asks the kernel to move the whole 2 MB pages inside each buffer onto huge pages
now (`MADV_COLLAPSE`, Linux >= 6.1; `MADV_HUGEPAGE` first, so they stay huge). Contents are unchanged; where the
kernel cannot (another OS, an older kernel, no free huge pages) nothing happens.

Measured (2026-12-08, default model, 2-core AMD EPYC Zen 4 VM, two engines in one process, alternating, 10 rounds):
weights and KV cache collapsed, batch-1 decode gguf 1.11x, bf16 1.06x; the KV cache alone gguf 1.055x (every round
>= 1.03x); batch 16 1.01x. Collapsing copies the pages once, ~2-3 s per GiB at engine start.
`JAXSERVE_HUGE_PAGES=0` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import sys

import jax

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25

_libc = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("JAXSERVE_HUGE_PAGES", "1") != "0"


def back_with_huge_pages(arrays) -> int:
    """The whole 2 MB pages inside the buffers of `arrays` (jax.Arrays on CPU devices; others are skipped) moved
    onto huge pages. Returns the bytes collapsed (0 where unsupported or turned off); never raises."""
    if not enabled():
        return 0
    madvise = _madvise()
    collapsed = 0
    for a in arrays:
        if not isinstance(a, jax.Array) or a.nbytes < HUGE_PAGE:
            continue
        for shard in a.addressable_shards:
            if shard.device.platform != "cpu":
                continue
            try:
                start = shard.data.unsafe_buffer_pointer()
            except Exception:  # noqa: BLE001 - a buffer without a host pointer: nothing to do
                continue
            lo = -(-start // HUGE_PAGE) * HUGE_PAGE
            hi = (start + shard.data.nbytes) // HUGE_PAGE * HUGE_PAGE
            if hi <= lo:
                continue
            madvise(lo, hi - lo, MADV_HUGEPAGE)
            if madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
                collapsed += hi - lo
            elif ctypes.get_errno() == 22:  # EINVAL: this kernel has no MADV_COLLAPSE; the rest would fail alike
                return collapsed
    return collapsed
