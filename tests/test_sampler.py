"""Statistical tests of the on-device sampler: with fixed keys and many draws, each setting samples exactly the
distribution it claims (chi-square goodness of fit), and seeded rows ignore their batch companions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve.sampler import MAX_BANNED, SamplingInputs, apply_penalties, sample

V = 8
LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
N = 20000

_sample = jax.jit(sample, static_argnames="max_logprobs")


def _inputs(n, history_len=4, **rows):
    a = SamplingInputs.neutral(n, history_len)
    a.seeds = np.arange(n, dtype=np.uint32) * 7919 + 1
    for k, v in rows.items():
        getattr(a, k)[...] = v
    return jax.tree.map(jnp.asarray, a)


def _draw(logits=LOGITS, n=N, **rows):
    out = _sample(jnp.asarray(np.tile(logits, (n, 1))), _inputs(n, **rows), max_logprobs=3)
    return np.asarray(out.token_ids)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _assert_distribution(tokens, probs):
    counts = np.bincount(tokens, minlength=V)
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts}"
    expected = probs[support].astype(np.float64)
    expected = expected / expected.sum() * len(tokens)
    p = stats.chisquare(counts[support], expected).pvalue
    assert p > 1e-3, f"counts {counts} do not fit {np.round(probs, 4)} (p={p:.2e})"


def test_greedy_is_argmax():
    assert (_draw(n=64, temperature=0.0) == 0).all()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 1000)).astype(np.float32)
    x[1, [3, 700]] = 10.0  # ties resolve to the first index, as np.argmax does
    from jaxserve.sampler import argmax

    assert np.asarray(argmax(jnp.asarray(x))).tolist() == np.argmax(x, axis=-1).tolist()


@pytest.mark.parametrize("t", [0.5, 1.0, 2.0])
def test_temperature(t):
    _assert_distribution(_draw(temperature=t), _softmax(LOGITS / t))


def test_top_k():
    probs = _softmax(LOGITS)
    probs[3:] = 0
    _assert_distribution(_draw(temperature=1.0, top_k=3), probs / probs.sum())


def test_top_p():
    base = _softmax(LOGITS)  # cumulative: .39 .63 .77 .86 ...
    probs = base.copy()
    probs[3:] = 0  # mass before token 2 is .63 < .7, before token 3 is .77 >= .7
    _assert_distribution(_draw(temperature=1.0, top_p=0.7), probs / probs.sum())


def test_min_p():
    base = _softmax(LOGITS)
    probs = np.where(base >= 0.2 * base[0], base, 0)
    _assert_distribution(_draw(temperature=1.0, min_p=0.2), probs / probs.sum())


def test_top_k_and_temperature_combine():
    probs = _softmax(LOGITS / 0.7)
    probs[2:] = 0
    _assert_distribution(_draw(temperature=0.7, top_k=2), probs / probs.sum())


def test_penalties_match_formula():
    logits = np.array([[2.0, -1.0, 0.5, 1.0, -2.0, 0.0, 0.3, 0.1]], np.float32)
    hist = np.array([[0, 1, 3, 3, 5, -1]], np.int32)
    is_out = np.array([[False, False, True, True, True, False]])
    a = SamplingInputs.neutral(1, hist.shape[1])
    a.history, a.history_is_output = hist, is_out
    a.repetition_penalty[:] = 1.5
    a.frequency_penalty[:] = 0.25
    a.presence_penalty[:] = 0.5
    got = np.asarray(apply_penalties(jnp.asarray(logits), jax.tree.map(jnp.asarray, a)))
    want = logits.copy()[0]
    for tok in (0, 1, 3, 5):  # seen in prompt or output
        want[tok] = want[tok] / 1.5 if want[tok] > 0 else want[tok] * 1.5
    counts = {3: 2, 5: 1}
    for tok, c in counts.items():
        want[tok] -= 0.25 * c + 0.5
    np.testing.assert_allclose(got[0], want, rtol=1e-6)


def test_penalised_distribution():
    hist = np.array([0, 0, 1, -1], np.int32)
    is_out = np.array([True, True, True, False])
    shifted = LOGITS.copy()
    shifted[0] -= 0.4 * 2 + 0.3
    shifted[1] -= 0.4 * 1 + 0.3
    tokens = _draw(temperature=1.0, frequency_penalty=0.4, presence_penalty=0.3, history=hist, history_is_output=is_out)
    _assert_distribution(tokens, _softmax(shifted))


def test_banned_tokens_never_drawn():
    banned = np.full(MAX_BANNED, -1, np.int32)
    banned[:2] = [0, 1]
    tokens = _draw(n=4000, temperature=1.0, banned=banned)
    probs = _softmax(LOGITS)
    probs[:2] = 0
    _assert_distribution(tokens, probs / probs.sum())
    assert (_draw(n=8, temperature=0.0, banned=banned) == 2).all()


def test_seeded_row_ignores_companions():
    """A row's draw depends only on its own seed and logits, not on the other rows of the batch."""
    rng = np.random.default_rng(0)
    batch = rng.normal(size=(6, V)).astype(np.float32)
    batch[2] = LOGITS
    a = SamplingInputs.neutral(6, 4)
    a.temperature[:] = rng.uniform(0.5, 1.5, 6)
    a.temperature[2] = 1.0
    a.top_p[:] = rng.uniform(0.5, 1.0, 6)
    a.top_p[2] = 1.0
    results = []
    for trial in range(3):
        a.seeds[:] = rng.integers(0, 2**32, 6, dtype=np.uint32)
        a.seeds[2] = 12345
        other = rng.normal(size=(6, V)).astype(np.float32)
        other[2] = LOGITS
        out = _sample(jnp.asarray(other), jax.tree.map(jnp.asarray, a), max_logprobs=0)
        results.append(int(out.token_ids[2]))
    assert len(set(results)) == 1


def test_logprobs_are_raw_and_ranked():
    out = _sample(
        jnp.asarray(np.tile(LOGITS, (3, 1))),
        _inputs(3, temperature=[0.0, 1.0, 1.0], top_k=[0, 1, 0], wants_logprobs=[True, False, False]),
        max_logprobs=3,
    )
    raw = LOGITS - np.log(np.exp(LOGITS).sum())
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.tile(raw[:3], (3, 1)), rtol=1e-5)
    assert np.asarray(out.top_ids).tolist() == [[0, 1, 2]] * 3
    for r in range(3):
        t = int(out.token_ids[r])
        assert np.isclose(float(out.logprobs[r]), raw[t], rtol=1e-5)
        assert int(out.ranks[r]) == t + 1  # LOGITS is sorted, so rank = index + 1
