"""The CPU engine's weights and KV cache on huge pages (`jaxserve.hugepages`): collapsed where the kernel can, the
contents unchanged, off with JAXSERVE_HUGE_PAGES=0."""

from __future__ import annotations

import ctypes
import mmap
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import hugepages


def _kernel_collapses() -> bool:
    """Whether this kernel has MADV_COLLAPSE (Linux >= 6.1) and can give an anonymous mapping a huge page."""
    if not sys.platform.startswith("linux"):
        return False
    # private and anonymous, as malloc's big blocks are (a shared mapping is shmem, which has its own THP switch)
    buf = mmap.mmap(-1, 2 * hugepages.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        view = ctypes.c_char.from_buffer(buf)
        addr = ctypes.addressof(view)
        del view  # the export would keep the mapping from closing
        lo = -(-addr // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE  # the whole huge page inside the 4 MiB
        buf[lo - addr] = 1  # populated
        madvise = hugepages._madvise()
        madvise(lo, hugepages.HUGE_PAGE, hugepages.MADV_HUGEPAGE)
        return madvise(lo, hugepages.HUGE_PAGE, hugepages.MADV_COLLAPSE) == 0
    finally:
        buf.close()


needs_collapse = pytest.mark.skipif(not _kernel_collapses(), reason="the kernel cannot MADV_COLLAPSE here")


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps), in bytes."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


@needs_collapse
def test_a_big_cpu_buffer_moves_onto_huge_pages_with_its_contents():
    a = jnp.arange(6 * hugepages.HUGE_PAGE // 4, dtype=jnp.int32) * 3 + 1  # 6 MiB: >= 2 whole huge pages inside
    expected = np.asarray(a).copy()
    ptr = jax.block_until_ready(a).unsafe_buffer_pointer()
    collapsed = hugepages.back_with_huge_pages([a])
    assert collapsed >= 2 * hugepages.HUGE_PAGE
    assert _huge_bytes_at(ptr + a.nbytes // 2) >= hugepages.HUGE_PAGE
    np.testing.assert_array_equal(np.asarray(a), expected)
    np.testing.assert_array_equal(np.asarray(a[::4096] - 1), expected[::4096] - 1)  # an XLA op reads it too


def test_small_buffers_other_values_and_the_switch_do_nothing(monkeypatch):
    assert hugepages.back_with_huge_pages([jnp.ones(16), np.ones(1 << 22), None]) == 0
    monkeypatch.setenv("JAXSERVE_HUGE_PAGES", "0")
    assert hugepages.back_with_huge_pages([jnp.ones(3 * hugepages.HUGE_PAGE // 4)]) == 0


@needs_collapse
def test_the_engine_places_its_kv_cache_and_weights_on_huge_pages():
    from jaxserve import LLM, SamplingParams

    llm = LLM(max_model_len=512, max_num_seqs=4, precompile=False)
    runner = llm.llm_engine.runner
    kv = runner.kv.k
    assert kv.nbytes >= 4 * hugepages.HUGE_PAGE
    assert _huge_bytes_at(kv.unsafe_buffer_pointer() + kv.nbytes // 2) >= hugepages.HUGE_PAGE
    head = runner.weights.lm_head.panels  # the logits projection: the largest weight
    assert _huge_bytes_at(head.unsafe_buffer_pointer() + head.nbytes // 2) >= hugepages.HUGE_PAGE
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    kv = runner.kv.k  # the donated cache came back in the same buffer: still on huge pages after the steps
    assert _huge_bytes_at(kv.unsafe_buffer_pointer() + kv.nbytes // 2) >= hugepages.HUGE_PAGE
