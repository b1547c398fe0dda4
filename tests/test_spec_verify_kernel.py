"""Speculative verification: the Pallas kernel (interpret mode on CPU) against the XLA reference — exact equality of
tokens and accept flags from the same uniforms and Gumbel noise over a sweep of vocabularies, block sizes, splits
and row types — plus a chi-square test that the kernel's emitted tokens follow p, and the entry's validation and
fallback. The maths itself is tested in tests/test_spec_decode.py."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from pallas_kernels import spec_verify as sv
from pallas_kernels.spec_verify import BlockSizes, reference

NEG_INF = -np.inf


def make_rows(V: int, *, seed: int = 0, num_random: int = 8):
    """One row per case the kernel must get right (all at once, as the engine batches them):
    probabilistic draft, p == q (no residual mass), draft token of probability 0 under p, draft token at V - 1 and
    at 0, no draft (plain / bonus draw), greedy (one-hot) p accepting and rejecting, a p that is one-hot on the
    draft token (accept with certainty; the residual is empty), a sparse (truncated) p; then `num_random` random
    rows. Returns logits f32[R, V] (-inf where p is 0), p, q, draft_ids, uniform, gumbel."""
    rng = np.random.default_rng(seed)

    def sparse_logits(keep: float):
        x = rng.normal(0, 2.0, V)
        x[rng.random(V) > keep] = NEG_INF
        x[rng.integers(V)] = 1.0  # at least one token allowed
        return x

    def softmax(x):
        e = np.exp(x - x.max())
        return e / e.sum()

    logits, q, ids = [], [], []
    for case in range(9 + num_random):
        x = sparse_logits(0.5 if case in (2, 8) else 1.0)
        qx = rng.normal(0, 2.0, V)
        d = int(rng.integers(V))
        if case == 1:  # p == q
            qx = x.copy()
        if case == 2:  # draft token impossible under p
            d = int(np.flatnonzero(x == NEG_INF)[0])
        if case == 3:
            d = V - 1
        if case == 4:
            d = 0
        if case == 5:
            d = -1
        if case in (6, 7):  # greedy target: one-hot p at its argmax; draft = argmax (accept) or not (reject)
            best = int(np.argmax(x))
            x = np.where(np.arange(V) == best, 0.0, NEG_INF)
            d = best if case == 6 else (best + 1) % V
        if case == 8:  # p one-hot on the draft token
            x = np.where(np.arange(V) == d, 0.0, NEG_INF)
        logits.append(x)
        q.append(qx)
        ids.append(d)
    R = len(ids)
    logits = np.array(logits, np.float32)
    p = np.array([softmax(x) for x in logits], np.float32)
    q = np.array([softmax(x) for x in np.array(q, np.float32)], np.float32)
    q[1] = p[1]
    # draft tokens are drawn from q in reality; make q(d) > 0 (it is, softmax) and sometimes large
    uniform = rng.random(R).astype(np.float32)
    gumbel = rng.gumbel(size=(R, V)).astype(np.float32)
    return (jnp.asarray(logits), jnp.asarray(p), jnp.asarray(q), jnp.asarray(np.array(ids, np.int32)),
            jnp.asarray(uniform), jnp.asarray(gumbel))


# (V, block sizes): V not a multiple of the block, smaller than one block, with and without vocabulary splits
# (splits whose range is partly or wholly past V included).
SWEEP = [
    (1000, BlockSizes(block_v=128)),
    (1000, BlockSizes(block_v=64, num_splits=4)),
    (777, BlockSizes(block_v=1024)),
    (2053, BlockSizes(block_v=256, num_splits=8)),
    (4099, BlockSizes(block_v=512, num_splits=2)),
]


def _assert_same(kernel_out, reference_out):
    token_k, acc_k = map(np.asarray, kernel_out)
    token_r, acc_r = map(np.asarray, reference_out)
    np.testing.assert_array_equal(token_k, token_r)
    np.testing.assert_array_equal(acc_k, acc_r)
    return token_k, acc_k


@pytest.mark.parametrize("V,block_sizes", SWEEP, ids=[f"V{v}-b{b.block_v}-s{b.num_splits}" for v, b in SWEEP])
@pytest.mark.parametrize("draft", ["probabilistic", "one_hot"])
def test_rejection_sample_kernel_matches_reference(V, block_sizes, draft):
    _, p, q, ids, u, g = make_rows(V, seed=V)
    q = q if draft == "probabilistic" else None
    out = sv.rejection_sample(p, q, ids, u, g, impl="kernel", interpret=True, block_sizes=block_sizes)
    token, accepted = _assert_same(out, reference.rejection_sample(p, q, ids, u, g))
    assert not accepted[5], "a row without a draft was accepted"
    assert accepted[6] and not accepted[7], "greedy target: accept iff the draft is the argmax"
    assert accepted[8], "p one-hot on the draft token must accept"
    assert not accepted[2] and np.asarray(p)[2, token[2]] > 0, "probability-0 draft accepted or emitted"
    assert (np.asarray(p)[np.arange(len(token)), token] > 0).all(), "emitted a token of probability 0"


@pytest.mark.parametrize("V,block_sizes", SWEEP, ids=[f"V{v}-b{b.block_v}-s{b.num_splits}" for v, b in SWEEP])
def test_verify_one_hot_kernel_matches_reference(V, block_sizes):
    logits, *_, ids, u, g = make_rows(V, seed=V + 1)
    R = logits.shape[0]
    greedy = reference.argmax(logits)
    is_random = jnp.asarray(np.arange(R) % 4 != 3)  # every fourth row greedy
    out = sv.verify_one_hot(logits, greedy, is_random, ids, u, g, impl="kernel", interpret=True,
                            block_sizes=block_sizes)
    token, accepted = _assert_same(out, reference.verify_one_hot(logits, greedy, is_random, ids, u, g))
    assert not accepted[5]
    assert (token >= 0).all() and (token < V).all()
    assert np.isfinite(np.asarray(logits)[np.arange(R), token]).all(), "emitted a token outside the truncation"


def test_all_rows_without_drafts_and_all_accepting():
    """Bonus-only batches draw from p exactly like plain Gumbel-max sampling."""
    logits, p, q, _, u, g = make_rows(300, seed=3, num_random=4)
    R = p.shape[0]
    none = jnp.full((R,), reference.NO_DRAFT, jnp.int32)
    bs = BlockSizes(block_v=64, num_splits=2)
    token, accepted = sv.rejection_sample(p, q, none, u, g, impl="kernel", interpret=True, block_sizes=bs)
    np.testing.assert_array_equal(token, reference.argmax(jnp.log(p) + g))
    assert not np.asarray(accepted).any()
    token, _ = sv.verify_one_hot(logits, reference.argmax(logits), jnp.ones((R,), bool), none, u, g,
                                 impl="kernel", interpret=True, block_sizes=bs)
    np.testing.assert_array_equal(token, reference.argmax(logits + g))


def test_table_block_sizes_match_reference():
    """The launches the entry chooses by itself (table blocks, automatic splits) at a real vocabulary size."""
    V = 49152
    logits, p, q, ids, u, g = make_rows(V, seed=5, num_random=3)
    assert sv.block_sizes_for(num_rows=p.shape[0], vocab=V, target_kind="probs").num_splits == 4
    assert sv.block_sizes_for(num_rows=p.shape[0], vocab=V, target_kind="logits").num_splits == 2
    _assert_same(sv.rejection_sample(p, q, ids, u, g, impl="kernel", interpret=True),
                 reference.rejection_sample(p, q, ids, u, g))
    greedy, is_random = reference.argmax(logits), jnp.ones(ids.shape, bool)
    _assert_same(sv.verify_one_hot(logits, greedy, is_random, ids, u, g, impl="kernel", interpret=True),
                 reference.verify_one_hot(logits, greedy, is_random, ids, u, g))


# ---- distribution: the kernel's emitted token follows p ------------------------------------------------------------

P = np.array([0.35, 0.25, 0.2, 0.1, 0.06, 0.04, 0.0, 0.0, 0.0])
Q = np.array([0.05, 0.1, 0.2, 0.3, 0.05, 0.0, 0.3, 0.0, 0.0])  # proposes tokens P never emits
NUM_SAMPLES = 20_000
ALPHA = 1e-3


def _chi_square_pvalue(samples, probs):
    counts = np.bincount(samples, minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled a token of probability 0: {counts}"
    return stats.chisquare(counts[support], probs[support] / probs[support].sum() * len(samples)).pvalue


@pytest.mark.parametrize("draft", ["probabilistic", "one_hot", "logits_one_hot"])
def test_kernel_emitted_tokens_follow_p(draft):
    """NUM_SAMPLES independent verify rows in one launch: d ~ q, then the kernel's (token, accepted); the emitted
    token (d if accepted, else the residual draw) must be distributed as p."""
    n, V = NUM_SAMPLES, len(P)
    kd, ku, kg = jax.random.split(jax.random.key(11), 3)
    p = jnp.broadcast_to(jnp.asarray(P, jnp.float32), (n, V))
    q = jnp.broadcast_to(jnp.asarray(Q, jnp.float32), (n, V))
    d = jax.random.categorical(kd, jnp.log(q)).astype(jnp.int32)
    u = jax.random.uniform(ku, (n,))
    g = jax.random.gumbel(kg, (n, V))
    bs = BlockSizes(block_v=16)
    if draft == "logits_one_hot":
        logits = jnp.log(p)  # -inf where p is 0
        token, accepted = sv.verify_one_hot(logits, reference.argmax(logits), jnp.ones((n,), bool), d, u, g,
                                            impl="kernel", interpret=True, block_sizes=bs)
    else:
        token, accepted = sv.rejection_sample(p, q if draft == "probabilistic" else None, d, u, g,
                                              impl="kernel", interpret=True, block_sizes=bs)
    emitted = np.where(np.asarray(accepted), np.asarray(d), np.asarray(token))
    assert _chi_square_pvalue(emitted, P) > ALPHA


def test_chi_square_catches_a_kernel_without_residual():
    """Control: emitting a plain draw from p on rejection (no residual) is caught by the same test."""
    n, V = NUM_SAMPLES, len(P)
    kd, ku, kg = jax.random.split(jax.random.key(12), 3)
    p = jnp.broadcast_to(jnp.asarray(P, jnp.float32), (n, V))
    q = jnp.broadcast_to(jnp.asarray(Q, jnp.float32), (n, V))
    d = jax.random.categorical(kd, jnp.log(q)).astype(jnp.int32)
    u, g = jax.random.uniform(ku, (n,)), jax.random.gumbel(kg, (n, V))
    none = jnp.full((n,), reference.NO_DRAFT, jnp.int32)
    _, accepted = sv.rejection_sample(p, q, d, u, g, impl="kernel", interpret=True, block_sizes=BlockSizes(16))
    plain, _ = sv.rejection_sample(p, q, none, u, g, impl="kernel", interpret=True, block_sizes=BlockSizes(16))
    emitted = np.where(np.asarray(accepted), np.asarray(d), np.asarray(plain))
    counts = np.bincount(emitted, minlength=V)
    assert counts[P == 0].sum() > 0 or _chi_square_pvalue(emitted, P) < 1e-6


# ---- the entry: validation, impl switch, fallback --------------------------------------------------------------------


def test_entry_validates_inputs():
    _, p, q, ids, u, g = make_rows(64, num_random=1)
    with pytest.raises(ValueError, match="gumbel and draft_probs"):
        sv.rejection_sample(p, q, ids, u, g[:, :-1])
    with pytest.raises(ValueError, match=r"draft_ids and uniform must be \[R\]"):
        sv.rejection_sample(p, q, ids[:-1], u, g)
    with pytest.raises(ValueError, match="draft_ids must be integers"):
        sv.rejection_sample(p, q, ids.astype(jnp.float32), u, g)
    with pytest.raises(ValueError, match="impl must be"):
        sv.rejection_sample(p, q, ids, u, g, impl="triton")
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        sv.rejection_sample(p, q, ids, u, g, impl="kernel", interpret=True, block_sizes=BlockSizes(block_v=100))
    with pytest.raises(ValueError, match="does not cover"):
        sv.rejection_sample(p.astype(jnp.bfloat16), q, ids, u, g, impl="kernel")


def test_auto_uses_reference_on_cpu_and_logs_fallback(caplog):
    logits, p, q, ids, u, g = make_rows(64, num_random=1)
    assert sv.select_impl(p, q, g) == ("kernel" if jax.default_backend() == "gpu" else "reference")
    assert sv.select_impl(p, q, g, interpret=True) == "kernel"
    with caplog.at_level(logging.WARNING, logger="pallas_kernels.spec_verify"):
        assert sv.select_impl(p.astype(jnp.bfloat16), q, g, interpret=True) == "reference"
    assert "bfloat16" in caplog.text
    _assert_same(sv.rejection_sample(p, q, ids, u, g), reference.rejection_sample(p, q, ids, u, g))


def test_block_sizes_split_small_batches_only():
    small = sv.block_sizes_for(num_rows=16, vocab=152064, target_kind="logits")
    large = sv.block_sizes_for(num_rows=256, vocab=152064, target_kind="logits")
    assert small.num_splits > 1 and large.num_splits == 1
    assert 16 * small.num_splits <= 2 * 256
    tiny_vocab = sv.block_sizes_for(num_rows=1, vocab=1000, target_kind="probs")
    assert tiny_vocab.num_splits == 1


# ---- the engine's sampler with the kernel in its verify path ---------------------------------------------------------


def test_sampler_verify_with_kernel_matches_reference(monkeypatch):
    """jaxserve.sampler.sample(draft_ids=...) calls the entry through `jaxserve.ops` (kernel on GPU); forcing the
    kernel (interpret mode) gives the same tokens and accept flags as the reference path, across sampling settings
    and greedy rows."""
    import functools

    from jaxserve import ops, sampler

    R, V = 12, 300
    h = sampler.SamplingInputs.neutral(R, 4)
    h.temperature[:] = [0.0, 0.7, 1.0, 1.3] * 3
    h.top_k[:] = [0, 0, 5, 0] * 3
    h.top_p[:] = [1.0, 0.9, 1.0, 1.0] * 3
    h.seeds[:] = np.arange(R, dtype=np.uint32) * 7919 + 1
    s = jax.tree.map(jnp.asarray, h)
    logits = jax.random.normal(jax.random.key(4), (R, V)) * 2.0
    greedy = np.asarray(reference.argmax(logits))
    draft = np.where(np.arange(R) % 3 == 0, greedy, (greedy + 1 + np.arange(R)) % V).astype(np.int32)
    draft[5] = reference.NO_DRAFT
    draft_ids = jnp.asarray(draft)

    def step(lg, s, d):
        return sampler.sample(lg, s, max_logprobs=1, draft_ids=d)

    expected = jax.jit(step)(logits, s, draft_ids)
    forced = functools.partial(sv.verify_one_hot, impl="kernel", interpret=True, block_sizes=BlockSizes(64, 2))
    monkeypatch.setattr(ops, "verify_one_hot", forced)  # the sampler's door to the kernel
    assert "spec_verify_kernel" in str(jax.make_jaxpr(lambda *a: step(*a))(logits, s, draft_ids))  # fresh trace
    got = jax.jit(lambda *a: step(*a))(logits, s, draft_ids)
    np.testing.assert_array_equal(got.token_ids, expected.token_ids)
    np.testing.assert_array_equal(got.accepted, expected.accepted)
    assert np.asarray(expected.accepted).any() and not np.asarray(expected.accepted).all()
