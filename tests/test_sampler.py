"""Statistical tests of the on-device sampler: with fixed keys and many draws, each setting samples exactly the
distribution it claims (chi-square goodness of fit), and seeded rows ignore their batch companions."""

import functools

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
    observed = counts[support]
    # Chi-square is only valid for bins expecting >= 5 draws: pool the rarest tokens into one bin expecting >= 5
    # (a single token expecting 0.6 draws and drawn 4 times would otherwise decide the test alone).
    order = np.argsort(expected)
    num_pooled = int(np.searchsorted(np.cumsum(expected[order]), 5.0)) + 1 if expected.min() < 5 else 0
    if num_pooled > 1:
        pooled, rest = order[:num_pooled], order[num_pooled:]
        observed = np.append(observed[rest], observed[pooled].sum())
        expected = np.append(expected[rest], expected[pooled].sum())
    p = stats.chisquare(observed, expected).pvalue
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


def test_threefry_is_jax_randoms_hash():
    """The sampler's noise hash, written out for one fused kernel, is Threefry-2x32: the Random123 known answers,
    and the bits `jax.random` gives for the same keys (so seeded requests draw what they drew before)."""
    from jaxserve.sampler import _gumbel, _row_key, _threefry2x32, _uniform

    u32 = lambda *v: tuple(jnp.uint32(x) for x in v)  # noqa: E731
    for key, count, want in [
        ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
        ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
        ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
    ]:
        assert tuple(int(x) for x in _threefry2x32(u32(*key), u32(*count))) == want
    seeds = jnp.asarray([0, 1, 7919, 2**31, 2**32 - 1], jnp.uint32)
    ids = jnp.arange(700, dtype=jnp.int32)[None]

    def row_bits(seed):
        key = jax.random.fold_in(jax.random.key(seed), 0)
        return jax.vmap(lambda v: jax.random.key_data(jax.random.fold_in(key, v))[1])(ids[0])

    u = ((jax.vmap(row_bits)(seeds) >> 9).astype(jnp.float32) + 0.5) / (1 << 23)
    np.testing.assert_array_equal(np.asarray(_gumbel(_row_key(seeds, 0), ids)), np.asarray(-jnp.log(-jnp.log(u))))
    with jax.threefry_partitionable(True):
        want = jax.vmap(lambda sd: jax.random.uniform(jax.random.fold_in(jax.random.key(sd), 1)))(seeds)
    np.testing.assert_array_equal(np.asarray(_uniform(seeds)), np.asarray(want))


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


def _sorted_truncation(scaled, top_k, top_p, min_p, slack=0.0):
    """The definition `_truncate` must equal, on one row in float64: sort descending (ties by lower id), keep
    position j iff j < top_k (0 = off), the mass before j is < top_p + slack, and p_j >= min_p * p_max; position 0
    always."""
    order = np.lexsort((np.arange(len(scaled)), -scaled))
    p = np.exp(scaled - scaled.max())
    p = p / p.sum()
    ps = p[order]
    j = np.arange(len(scaled))
    keep_sorted = ((j < (top_k or len(scaled))) & (np.cumsum(ps) - ps < top_p + slack)) | (j == 0)
    keep = np.zeros(len(scaled), bool)
    keep[order] = keep_sorted
    return keep & (p >= min_p * p.max()) & np.isfinite(scaled)  # -inf stays out


def _truncation_rows(rng, V):
    """Rows that reach every path of `_truncate`: prefixes ending among the first candidates and beyond them
    (bisection), ties straddling the cut (id order decides), -inf entries, flat rows."""
    rows = []
    for top_k in (0, 1, 5, 127, 128, 129, 700):
        for top_p in (1.0, 0.3, 0.9, 0.999):
            for kind in ("normal", "ties", "flat", "masked"):
                x = rng.normal(size=V) * (4.0 if kind != "flat" else 0.05)
                if kind == "ties":  # few distinct values: long runs of equal logits
                    x = np.round(x) * 0.5
                if kind == "masked":
                    x[rng.random(V) < 0.5] = -np.inf
                rows.append((x.astype(np.float32), top_k, top_p, 0.05 if kind == "normal" and top_k == 0 else 0.0))
    return rows


def test_truncation_equals_the_sorted_definition():
    """`_truncate` finds the kept set without sorting (candidates, then a bisection over float keys, then a cut by
    id among ties); it must keep exactly the sorted definition's tokens."""
    from jaxserve.sampler import _truncate, _Vocab

    Vt = 1000
    rows = _truncation_rows(np.random.default_rng(1), Vt)
    scaled = np.stack([r[0] for r in rows])
    s = SamplingInputs.neutral(len(rows), 1)
    s.temperature[:] = 1.0
    s.top_k[:] = [r[1] for r in rows]
    s.top_p[:] = [r[2] for r in rows]
    s.min_p[:] = [r[3] for r in rows]
    out = jax.jit(lambda x, s: _truncate(x, s, _Vocab(Vt)))(jnp.asarray(scaled), jax.tree.map(jnp.asarray, s))
    kept = np.isfinite(np.asarray(out))
    for i, (x, top_k, top_p, min_p) in enumerate(rows):
        # float32 sums may put a token whose preceding mass is within 1e-6 of top_p on either side of the cut
        lo, hi = (_sorted_truncation(x.astype(np.float64), top_k, top_p, min_p, d) for d in (-1e-6, 1e-6))
        assert (kept[i] >= lo).all() and (kept[i] <= hi).all(), (
            f"row {i} (top_k={top_k}, top_p={top_p}, min_p={min_p}): kept {kept[i].sum()} tokens, the sorted "
            f"definition {lo.sum()}-{hi.sum()}; differ at ids {np.flatnonzero((kept[i] < lo) | (kept[i] > hi))[:10]}")
    assert sum((_sorted_truncation(r[0].astype(np.float64), *r[1:]) != k).sum() for r, k in zip(rows, kept)) <= 2
    assert kept.sum(axis=1).max() > 128  # some prefixes ended past the candidates: the bisection ran


def test_draw_among_candidates_is_the_whole_rows_draw():
    """A step whose random rows each keep fewer than TRUNCATION_CANDIDATES tokens draws from those candidates alone
    (K noise values a row instead of V); its tokens must be the whole masked row's Gumbel-max draw, seed for seed.
    A step with one row that keeps more draws over the vocabulary; the same check holds there."""
    from jaxserve.sampler import TRUNCATION_CANDIDATES, _gumbel, _row_key, _truncate, _Vocab

    Vt = 1000
    rows = [r for r in _truncation_rows(np.random.default_rng(2), Vt) if r[1] != 0 or r[2] < 1 or r[3] > 0]
    scaled = np.stack([r[0] for r in rows])
    rng = np.random.default_rng(3)
    a = SamplingInputs.neutral(len(rows), 1)
    a.temperature[:] = rng.choice([1.0, 0.7, 0.0], len(rows))  # a greedy row's draw is not used
    a.top_k[:] = [r[1] for r in rows]
    a.top_p[:] = [r[2] for r in rows]
    a.min_p[:] = [r[3] for r in rows]

    def expected(x, s):
        masked = _truncate(x / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None], s, _Vocab(Vt))
        drawn = jnp.argmax(masked + _gumbel(_row_key(s.seeds, 0), jnp.arange(Vt)[None]), axis=-1)
        return jnp.where(s.temperature > 0, drawn, jnp.argmax(x, axis=-1)), jnp.isfinite(masked)

    expected, sample_ = jax.jit(expected), jax.jit(functools.partial(sample, max_logprobs=0))
    whole_row_steps = 0
    for trial in range(4):
        a.seeds[:] = rng.integers(0, 2**32, len(rows), dtype=np.uint32)
        s = jax.tree.map(jnp.asarray, a)
        want, kept = expected(jnp.asarray(scaled), s)
        kept_counts = np.where(a.temperature > 0, np.asarray(kept).sum(axis=1), 0)
        whole_row_steps += kept_counts.max() >= TRUNCATION_CANDIDATES
        np.testing.assert_array_equal(np.asarray(sample_(jnp.asarray(scaled), s).token_ids), np.asarray(want))
        # the same rows, those that keep K or more made greedy: the step draws among the candidates
        b = SamplingInputs(**{k: np.copy(v) for k, v in vars(a).items()})
        b.temperature[kept_counts >= TRUNCATION_CANDIDATES] = 0.0
        s = jax.tree.map(jnp.asarray, b)
        want, kept = expected(jnp.asarray(scaled), s)
        assert np.where(b.temperature > 0, np.asarray(kept).sum(axis=1), 0).max() < TRUNCATION_CANDIDATES
        assert (b.temperature > 0).sum() > 50
        np.testing.assert_array_equal(np.asarray(sample_(jnp.asarray(scaled), s).token_ids), np.asarray(want))
    assert whole_row_steps > 0  # some first batches had rows past the candidates: whole-row draws


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's lowering of top_k")
def test_the_step_takes_top_k_without_sorting_whole_rows():
    """XLA:CPU turns `lax.top_k` into its TopK kernel only when every reader takes the whole top K: a stray
    `top[:, 0]` once made the sampler sort each row of the vocabulary every step (~25x slower at 16 x 49,152)."""
    hlo = jax.jit(functools.partial(sample, max_logprobs=5)).lower(
        jnp.zeros((4, 1000), jnp.float32), _inputs(4)).compile().as_text()
    assert " sort(" not in hlo and "TopK" in hlo
