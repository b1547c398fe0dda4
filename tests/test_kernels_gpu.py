"""The Pallas kernels compiled for the GPU against their references: cases of the interpret-mode sweeps in
test_rpa_kernel.py, test_spec_verify_kernel.py and test_quant_matmul_kernel.py (which pass interpret=True, so they
never compile for a GPU) run with interpret=False, chosen to cover each kernel's modes with few compiles.

Skipped without a GPU. conftest.py points JAX at the CPU unless told otherwise, so name the GPU:

    JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest -q -n 4 tests/test_kernels_gpu.py

(the `kernels` step of scripts/bench_gpu.sh).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels import spec_verify as sv
from pallas_kernels.quant_matmul import quant_matmul
from pallas_kernels.ragged_paged_attention import reference as rpa_reference
from pallas_kernels.ragged_paged_attention.kernel import BlockSizes as RpaBlockSizes
from pallas_kernels.spec_verify import BlockSizes, reference
from test_quant_matmul_kernel import K, _weight
from test_rpa_kernel import MIXES, TOLERANCE, make_case
from test_spec_verify_kernel import SWEEP, P, Q, _assert_same, _chi_square_pvalue, make_rows

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="needs a GPU (JAX_PLATFORMS=cuda,cpu on a GPU machine)")

# --- ragged paged attention: kernel vs the XLA reference at full f32 precision --------------------------------------

# id: (q_lens, kv_lens, make_case overrides, call overrides)
RPA_CASES = {
    "decode-p16": (*MIXES["decode"], dict(page_size=16), {}),
    "prefill_chunk-p16": (*MIXES["prefill_chunk"], dict(page_size=16), {}),
    "mixed-p8": (*MIXES["mixed"], dict(page_size=8), {}),
    "verify_k1_to_7": (*MIXES["verify_k1_to_7"], {}, {}),
    "large-pages-128": ([20, 1, 1, 4], [150, 129, 32, 260], dict(page_size=128, seed=10), {}),
    "mqa": (*MIXES["mixed"], dict(N=8, K=1, seed=1), {}),
    "group3-padded": (*MIXES["mixed"], dict(N=6, K=2, seed=1), {}),
    "group8": (*MIXES["mixed"], dict(N=16, K=2, seed=1), {}),
    **{f"kv-{d}": (*MIXES["mixed"], dict(kv_dtype=d, seed=2), {}) for d in TOLERANCE if d != "float32"},
    "split4": (*MIXES["verify_and_decode"], dict(seed=3),
               dict(block_sizes=RpaBlockSizes(block_q=8, chunk_pages=4, num_kv_splits=4))),
    "window-cap-int8": (*MIXES["mixed"], dict(kv_dtype="int8", seed=4),
                        dict(sm_scale=0.5, sliding_window=13, soft_cap=3.0,
                             block_sizes=RpaBlockSizes(block_q=4, chunk_pages=1, num_kv_splits=2))),
    "h128-bf16": (*MIXES["verify_and_decode"], dict(N=8, K=2, H=128, page_size=16, kv_dtype="bfloat16", seed=5),
                  dict(sm_scale=128**-0.5)),
}


@pytest.mark.parametrize("case", list(RPA_CASES))
def test_rpa_kernel_matches_reference(case):
    q_lens, kv_lens, case_kw, call_kw = RPA_CASES[case]
    kv_dtype = case_kw.get("kv_dtype", "float32")
    args, _ = make_case(q_lens, kv_lens, **case_kw)
    call_kw = dict(sm_scale=0.125) | call_kw
    block_sizes = call_kw.pop("block_sizes", None)
    assert rpa.select_impl(args[0], args[1]) == "kernel", "the entry should pick the kernel on a GPU"
    out = np.asarray(rpa.ragged_paged_attention(*args, impl="kernel", block_sizes=block_sizes, **call_kw)
                     .astype(jnp.float32))
    with jax.default_matmul_precision("highest"):  # XLA's GPU default for f32 dots is TF32
        ref = np.asarray(rpa_reference.ragged_paged_attention(*args, **call_kw).astype(jnp.float32))
    assert np.isfinite(out).all(), "NaN/inf in the kernel output: a padded or unused slot was read"
    np.testing.assert_allclose(out, ref, atol=TOLERANCE[kv_dtype], rtol=0)
    assert np.all(out[sum(q_lens):] == 0), "padding tokens must produce zeros"


# --- speculative verification: same tokens and accept flags as the reference, tokens distributed as p -------------

SV_SWEEP = [SWEEP[1], SWEEP[3]]  # vocabulary splits, V not a multiple of the block


@pytest.mark.parametrize("V,block_sizes", SV_SWEEP, ids=[f"V{v}-s{b.num_splits}" for v, b in SV_SWEEP])
@pytest.mark.parametrize("draft", ["probabilistic", "one_hot"])
def test_rejection_sample_kernel_matches_reference(V, block_sizes, draft):
    _, p, q, ids, u, g = make_rows(V, seed=V)
    q = q if draft == "probabilistic" else None
    out = sv.rejection_sample(p, q, ids, u, g, impl="kernel", block_sizes=block_sizes)
    _assert_same(out, reference.rejection_sample(p, q, ids, u, g))


@pytest.mark.parametrize("V,block_sizes", SV_SWEEP, ids=[f"V{v}-s{b.num_splits}" for v, b in SV_SWEEP])
def test_verify_one_hot_kernel_matches_reference(V, block_sizes):
    logits, *_, ids, u, g = make_rows(V, seed=V + 1)
    greedy = reference.argmax(logits)
    is_random = jnp.asarray(np.arange(logits.shape[0]) % 4 != 3)
    out = sv.verify_one_hot(logits, greedy, is_random, ids, u, g, impl="kernel", block_sizes=block_sizes)
    _assert_same(out, reference.verify_one_hot(logits, greedy, is_random, ids, u, g))


def test_spec_verify_table_launch_matches_reference():
    """The launches the entry picks by itself (auto impl, table blocks, splits) at SmolLM2's vocabulary."""
    logits, p, q, ids, u, g = make_rows(49152, seed=5, num_random=3)
    assert sv.select_impl(p, q, g) == "kernel"
    _assert_same(sv.rejection_sample(p, q, ids, u, g), reference.rejection_sample(p, q, ids, u, g))
    greedy, is_random = reference.argmax(logits), jnp.ones(ids.shape, bool)
    _assert_same(sv.verify_one_hot(logits, greedy, is_random, ids, u, g),
                 reference.verify_one_hot(logits, greedy, is_random, ids, u, g))


@pytest.mark.parametrize("draft", ["probabilistic", "logits_one_hot"])
def test_spec_verify_kernel_emitted_tokens_follow_p(draft):
    n, V = 20_000, len(P)
    kd, ku, kg = jax.random.split(jax.random.key(11), 3)
    p = jnp.broadcast_to(jnp.asarray(P, jnp.float32), (n, V))
    q = jnp.broadcast_to(jnp.asarray(Q, jnp.float32), (n, V))
    d = jax.random.categorical(kd, jnp.log(q)).astype(jnp.int32)
    u, g = jax.random.uniform(ku, (n,)), jax.random.gumbel(kg, (n, V))
    if draft == "logits_one_hot":
        logits = jnp.log(p)
        token, accepted = sv.verify_one_hot(logits, reference.argmax(logits), jnp.ones((n,), bool), d, u, g,
                                            impl="kernel", block_sizes=BlockSizes(block_v=16))
    else:
        token, accepted = sv.rejection_sample(p, q, d, u, g, impl="kernel", block_sizes=BlockSizes(block_v=16))
    emitted = np.where(np.asarray(accepted), np.asarray(d), np.asarray(token))
    assert _chi_square_pvalue(emitted, P) > 1e-3


# --- dequantizing matmul: kernel vs a float64 product ---------------------------------------------------------------

# f32 operands go through the tensor cores as TF32 (Pallas' Triton default at DEFAULT precision): ~1e-3 relative.
QMM_TOLERANCE = {"float32": 5e-3, "bfloat16": 0.02}  # of max |y|


@pytest.mark.parametrize("bits,group,zeros,rows", [(4, 32, True, 1), (4, 64, False, 17), (8, 32, False, 7),
                                                   (8, 64, True, 40)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quant_matmul_kernel_matches_float64_product(bits, group, zeros, rows, dtype):
    w = _weight(bits, group, zeros, seed=rows)
    x = jnp.asarray(np.random.default_rng(rows).normal(0, 1, (rows, K)), dtype)
    args = (jnp.asarray(w.q), jnp.asarray(w.scales), None if w.zeros is None else jnp.asarray(w.zeros))
    y = quant_matmul(x, *args, bits=bits)
    assert y.dtype == x.dtype
    want = np.asarray(x, np.float64) @ w.dequantize().astype(np.float64)
    np.testing.assert_allclose(np.asarray(y, np.float32), want, atol=QMM_TOLERANCE[dtype] * np.abs(want).max())
