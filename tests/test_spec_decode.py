"""Speculative decoding: the rejection sampler reproduces the target distribution exactly (chi-square tests that
also catch deliberately broken samplers), the n-gram proposer, and the engine: greedy output with speculation
equals greedy output without it, under preemption, with mixed K per request, stop strings, n > 1 and aborts,
with every page returned."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from jaxserve import LLM, SamplingParams
from jaxserve.config import SpeculativeConfig
from jaxserve.sampler import SamplingInputs, sample
from jaxserve.spec_decode import NgramProposer, SpecController
from jaxserve.spec_decode.rejection import NO_DRAFT, accepted_length, rejection_sample
from tiny_models import make_tiny_model

ALPHA = 1e-3  # chi-square significance: a correct sampler fails one test in a thousand
N = 40_000  # samples per distribution test


def chi_square_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled a token of probability 0: {counts}"
    return stats.chisquare(counts[support], probs[support] / probs[support].sum() * len(samples)).pvalue


def _draws(fn, n=N, seed=0):
    keys = jax.random.split(jax.random.key(seed), n)
    return np.asarray(jax.jit(jax.vmap(fn))(keys))


# ---- the maths: rejection sampling against a probabilistic draft ------------------------------------------------

P = np.array([0.35, 0.25, 0.2, 0.1, 0.06, 0.04, 0.0, 0.0])
Q = np.array([0.05, 0.1, 0.2, 0.3, 0.05, 0.0, 0.3, 0.0])  # disagrees with P; proposes some tokens P never emits


def _speculate(key, p, q, verify):
    """One verify position: draw d ~ q, then emit the verified token."""
    kd, ku, kg = jax.random.split(key, 3)
    d = jax.random.categorical(kd, jnp.log(q))
    token, accepted = verify(p[None], q[None], d[None], jax.random.uniform(ku, (1,)),
                             jax.random.gumbel(kg, (1, len(p))))
    return jnp.where(accepted[0], d, token[0])


def test_rejection_sample_reproduces_target():
    p, q = jnp.asarray(P, jnp.float32), jnp.asarray(Q, jnp.float32)
    out = _draws(lambda k: _speculate(k, p, q, rejection_sample))
    assert chi_square_pvalue(out, P) > ALPHA


def _no_residual(p, q, d, u, g):  # broken: on rejection, resample from p itself
    token, accepted = rejection_sample(p, q, d, u, g)
    return jnp.argmax(jnp.log(p) + g, -1), accepted


def _unnormalised_accept(p, q, d, u, g):  # broken: accept with probability p(d) instead of min(1, p/q)
    token, _ = rejection_sample(p, q, d, u, g)
    return token, u < jnp.take_along_axis(p, d[:, None], -1)[:, 0]


@pytest.mark.parametrize("broken", [_no_residual, _unnormalised_accept])
def test_chi_square_catches_broken_samplers(broken):
    p, q = jnp.asarray(P, jnp.float32), jnp.asarray(Q, jnp.float32)
    out = _draws(lambda k: _speculate(k, p, q, broken))
    probs = P
    counts = np.bincount(out, minlength=len(P))
    if counts[P == 0].sum():  # emitting an impossible token is already proof
        return
    assert chi_square_pvalue(out, probs) < 1e-6


def test_identical_draft_always_accepted():
    p = jnp.asarray(P, jnp.float32)
    keys = jax.random.split(jax.random.key(1), 2000)

    def one(key):
        kd, ku, kg = jax.random.split(key, 3)
        d = jax.random.categorical(kd, jnp.log(p))
        return rejection_sample(p[None], p[None], d[None], jax.random.uniform(ku, (1,)),
                                jax.random.gumbel(kg, (1, 8)))[1][0]

    assert np.asarray(jax.vmap(one)(keys)).all()


# ---- the sampler's verify path: one-hot drafts with every sampling parameter ---------------------------------------

V = 12
LOGITS = np.linspace(2.0, -1.5, V).astype(np.float32) + np.random.default_rng(0).normal(0, 0.3, V).astype(np.float32)


def _target_probs(temperature, top_k=0, top_p=1.0, min_p=0.0):
    x = LOGITS.astype(np.float64) / temperature
    order = np.argsort(-x)
    p = np.exp(x[order] - x[order].max())
    p /= p.sum()
    keep = np.arange(V) < (top_k or V)
    keep &= (np.cumsum(p) - p) < top_p
    keep &= p >= min_p * p[0]
    keep[0] = True
    out = np.zeros(V)
    out[order[keep]] = p[keep]
    return out / out.sum()


def _verify_rows(n, draft, temperature, top_k=0, top_p=1.0, min_p=0.0):
    h = SamplingInputs.neutral(n, 4)
    h.temperature[:] = temperature
    h.top_k[:] = top_k
    h.top_p[:] = top_p
    h.min_p[:] = min_p
    h.seeds[:] = np.random.default_rng(7).integers(0, 2**32, n, dtype=np.uint32)
    s = jax.tree.map(jnp.asarray, h)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, V))
    out = jax.jit(lambda lg, s, d: sample(lg, s, max_logprobs=2, draft_ids=d))(logits, s,
                                                                               jnp.full((n,), draft, jnp.int32))
    return np.asarray(out.token_ids), np.asarray(out.accepted)


@pytest.mark.parametrize(
    "settings",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8),
     dict(temperature=1.0, min_p=0.15)],
)
@pytest.mark.parametrize("draft", [0, 3, V - 1])  # likely, middle, and (often) truncated-away draft tokens
def test_one_hot_verify_reproduces_sampling_distribution(settings, draft):
    tokens, accepted = _verify_rows(N, draft, **settings)
    p = _target_probs(**settings)
    assert chi_square_pvalue(tokens, p) > ALPHA
    assert np.all(accepted == (tokens == draft) if p[draft] > 0 else ~accepted)
    assert abs(accepted.mean() - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / N) + 1e-9


def test_greedy_verify_accepts_only_the_argmax():
    best = int(np.argmax(LOGITS))
    for draft in (best, (best + 1) % V):
        tokens, accepted = _verify_rows(64, draft, temperature=0.0)
        assert (tokens == best).all()
        assert accepted.all() == (draft == best) and accepted.any() == (draft == best)


def test_no_draft_rows_sample_like_plain_decoding():
    h = SamplingInputs.neutral(16, 4)
    h.temperature[:] = 0.9
    h.seeds[:] = np.arange(16, dtype=np.uint32) * 7919
    s = jax.tree.map(jnp.asarray, h)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (16, V))
    plain = sample(logits, s, max_logprobs=0)
    verify = sample(logits, s, max_logprobs=0, draft_ids=jnp.full((16,), NO_DRAFT, jnp.int32))
    np.testing.assert_array_equal(plain.token_ids, verify.token_ids)
    assert not np.asarray(verify.accepted).any()


def test_accepted_length():
    assert accepted_length([]) == 0
    assert accepted_length([True, True, False, True]) == 2
    assert accepted_length([True, True]) == 2


# ---- proposer and controller -------------------------------------------------------------------------------------


def test_ngram_proposer():
    prop = NgramProposer(min_n=1, max_n=3)
    assert prop.propose([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]  # "1 2 3" seen before, followed by 4 1 2
    assert prop.propose([5, 6, 7, 5, 6, 9, 5, 6], 2) == [9, 5]  # the most recent occurrence of "5 6" wins
    assert prop.propose([1, 2, 3], 4) == []  # no repeat, no guess
    assert prop.propose([1, 2, 1], 5) == [2, 1]  # runs out of history: fewer than k
    assert prop.propose([1, 1], 0) == []
    assert NgramProposer(min_n=2, max_n=2).propose([7, 8, 9, 8], 2) == []  # only 1-gram matches exist


@settings(max_examples=200, deadline=None)
@given(min_n=st.integers(1, 4), span=st.integers(0, 3), k=st.integers(0, 5), alphabet=st.integers(1, 6),
       prompt_len=st.integers(0, 30), seed=st.integers(0, 2**32 - 1))
def test_ngram_draft_index_equals_the_search(min_n, span, k, alphabet, prompt_len, seed):
    """The engine's lookup (`draft`: an index per sequence, extended as tokens arrive) proposes exactly what the
    search over the whole sequence (`propose`) does, at every length of a growing sequence, from a small alphabet
    (many repeats, overlapping matches); also after the sequence's output list is replaced (a fresh index)."""
    from jaxserve.sequence import Sequence

    rng = np.random.default_rng(seed)
    prop = NgramProposer(min_n=min_n, max_n=min_n + span)
    seq = Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=rng.integers(0, alphabet, prompt_len).tolist(),
                   params=SamplingParams(), max_tokens=64, arrival_time=0.0)
    for step in range(40):
        assert prop.draft(seq, k) == prop.propose(seq.token_ids, k), (seq.token_ids, k)
        seq.output_token_ids.extend(rng.integers(0, alphabet, int(rng.integers(1, 4))).tolist())  # 1-3 per step
        if step == 25:
            seq.output_token_ids = seq.output_token_ids[:-5] + [alphabet]  # a new list, not a continuation
    assert prop.draft(seq, k) == prop.propose(seq.token_ids, k)


def test_controller_backs_off_when_speculation_does_not_pay():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    c = SpecController(cfg, token_buckets=(1, 2, 4, 8, 16, 32, 64))
    seen = []
    for _ in range(200):
        k = c.choose_k(16, [3] * 16)
        seen.append(k)
        c.record_step(16 + 16 * k, 0.01 * (1 + k))  # cost grows linearly with tokens ...
        for _ in range(16 if k else 0):
            c.record(k, 0)  # ... and nothing is ever accepted (one record per verifying sequence)
    assert any(k > 0 for k in seen[:10])  # speculation is tried ...
    assert seen[-50:] == [0] * 50  # ... and dropped once measured not to pay
    assert sum(k > 0 for k in seen) <= 30  # after little exploration (20 drafts per position are enough)

    c2 = SpecController(cfg, token_buckets=(1, 2, 4, 8, 16, 32, 64))
    for _ in range(200):
        k = c2.choose_k(2, [3] * 2)
        c2.record_step(2 + 2 * k, 0.01)  # verify is free (memory-bound decode) ...
        c2.record(k, k) if k else None  # ... and everything is accepted
    assert c2.choose_k(2, [3] * 2) == 3

    c3 = SpecController(cfg, token_buckets=(1, 2, 4, 8, 16, 32, 64))
    c3.record_step(16, 0.1)
    c3.record_step(64, 0.4)  # cost linear in tokens: unmeasured buckets are interpolated, not tried
    assert c3._cost(32) == pytest.approx(0.2)
    for _ in range(40):
        c3.record(3, 0)  # nothing is accepted at any position
    assert c3.choose_k(16, [3] * 16) == 0


def test_controller_recovers_from_a_bad_start(monkeypatch):
    """Acceptance measured ~0 at first (K = 0 chosen, so nothing more is measured) and then the workload turns
    predictable: the controller's forgetting estimate plus its bounded exploration find K > 0 again; with
    exploration switched off it stays locked out. Its optimistic hint predicts the next decision, exploring included."""
    import jaxserve.spec_decode.controller as sd

    def run(explore_every):
        monkeypatch.setattr(sd, "EXPLORE_EVERY", explore_every)
        c = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=2), token_buckets=(1, 2, 4))
        seen = []
        for step in range(400):
            hint = c.choose_k(1, [2], optimistic=True)
            k = c.choose_k(1, [2])
            assert hint == k or len(c.cost) < 3  # (while a size is unmeasured the hint is optimistic by design)
            seen.append(k)
            c.record_step(1 + k, 0.010 + 0.001 * k)  # batch 1: verifying two drafts costs 20% more
            if k:
                c.record(k, 0 if step < 100 else k)  # nothing accepted for 100 steps, then everything
        return seen

    seen = run(16)
    assert seen[80:100] == [0] * 20 or sum(seen[80:100]) <= 2  # off while nothing is accepted (explored at most)
    assert seen[-100:].count(2) >= 98  # back on once the workload changed (K = 0 re-measured twice once stale)
    assert sum(k > 0 for k in seen[100:]) > 200  # (a few explorations, 16 steps apart, re-measure position 0)
    locked = run(10**9)
    assert all(k == 0 for k in locked[-300:])  # without exploration: never measured again, never back


def test_controller_explores_unmeasured_sizes_low_or_high():
    """With a step size unmeasured the controller tries the smallest such K (to measure it); asked optimistically
    (the hint for a proposer that turns itself off at K = 0) it names the largest, so exploring never turns it off."""
    c = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=3), token_buckets=(1, 2, 4, 8, 16))
    assert c.choose_k(2, [3, 2]) == 0
    assert c.choose_k(2, [3, 2], optimistic=True) == 3
    assert c.choose_k(2, [1, 1], optimistic=True) == 1
    for b in (1, 2, 4, 8, 16):
        c.record_step(b, 0.01 * b)  # every size measured: optimism no longer matters
    assert c.choose_k(2, [3, 2]) == c.choose_k(2, [3, 2], optimistic=True)


def test_controller_counts_only_the_drafts_that_exist():
    """An n-gram proposer finds drafts for only some sequences: the gain and the cost count the drafts that exist,
    and speculating must clear MIN_GAIN over no speculation."""
    from jaxserve.spec_decode.controller import MIN_GAIN

    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=1)
    c = SpecController(cfg, token_buckets=(16, 32))
    c.record_step(16, 0.10)
    c.record_step(32, 0.16)  # 16 decodes + 16 drafts cost 1.6x
    for _ in range(40):
        c.record(1, 1)  # every draft is accepted: 2 tokens per decode for 1.6x the cost
    assert c.choose_k(16, [1] * 16) == 1
    # only 4 of 16 sequences have a draft: 20 tokens for 20 tokens' worth, padded to the 32 bucket (1.25 / 1.6 < 1)
    assert c.choose_k(16, [1] * 4 + [0] * 12) == 0
    assert c.choose_k(16, [0] * 16) == 0  # nothing to verify
    c2 = SpecController(cfg, token_buckets=(16, 32))
    c2.record_step(16, 0.10)
    c2.record_step(32, 0.10 * 2 / MIN_GAIN * 1.01)  # a gain just under MIN_GAIN: not worth it
    for _ in range(40):
        c2.record(1, 1)
    assert c2.choose_k(16, [1] * 16) == 0
    c2.cost[32] = 0.10 * 2 / MIN_GAIN * 0.9  # a clear gain
    assert c2.choose_k(16, [1] * 16) == 1


def test_controller_prices_steps_with_drafts_as_built_after_the_one_before():
    """Async scheduling builds a step without drafts while the one before runs (the host's work hidden); a step that
    verifies drafts is always built after the one before landed. The controller keeps the two costs apart and prices
    K = 0 as the first, K > 0 as the second: pricing both from one table made speculation look cheaper than it is
    under load (n-gram ran at 0.95x of no speculation on 32 chat requests at once, 16 seats)."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=1)
    c = SpecController(cfg, token_buckets=(16, 32))
    c.record_step(16, 0.030, overlapped=True)  # 16 decodes built behind the step before
    c.record_step(16, 0.040)  # the same built after it landed
    c.record_step(32, 0.052)  # 16 decodes + 16 drafts (never built behind)
    for _ in range(40):
        c.record(1, 1)  # every draft accepted: 32 tokens
    assert c._cost(16, overlapped=True) == 0.030 and c._cost(16) == 0.040
    assert c.choose_k(16, [1] * 16) == 1  # 32 tokens in 52 ms vs 16 in 30 ms: 1.15x
    c.cost[32] = 0.060
    assert c.choose_k(16, [1] * 16) == 0  # 32 tokens in 60 ms: 1.0x (against 16 in 40 ms it would be 1.33x)
    one = SpecController(cfg, token_buckets=(16, 32))  # without overlapped steps (async off) K = 0 is priced sync
    one.record_step(16, 0.040)
    one.record_step(32, 0.060)
    for _ in range(40):
        one.record(1, 1)
    assert one.choose_k(16, [1] * 16) == 1
    fresh = SpecController(cfg, token_buckets=(16, 32, 64))  # a table that cannot tell falls back on the other
    fresh.record_step(16, 0.030, overlapped=True)
    fresh.record_step(64, 0.120, overlapped=True)
    assert fresh._cost(32) == pytest.approx(0.060)


def test_controller_does_not_extrapolate_past_a_bracketing_measurement():
    """A server's warm-up measured only 1- and 2-token steps built behind the step before (plus prefill's 512); the
    line through 1 and 2 priced 16 decodes built behind at 56 ms, where they take ~30, and a loaded n-gram server then
    verified drafts in most steps (at 0.5-0.9x of no speculation). An unmeasured size is interpolated between its
    measured neighbours, and an overlapped size is never priced above what it was measured to cost built after."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    c = SpecController(cfg, token_buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
    for b, ms in ((1, 5.3), (2, 8.7), (512, 380.0)):
        c.record_step(b, ms / 1e3, overlapped=True)
    for b, ms in ((16, 28.3), (32, 65.0), (64, 100.9), (512, 494.0)):
        c.record_step(b, ms / 1e3)
    for _ in range(100):  # acceptance as that server measured it: 0.4 / 0.28 / 0.33 / 0.26
        c.record(4, 1)
    for _ in range(40):
        c.record(4, 0)
    assert 0.0087 < c._cost(16, overlapped=True) < 0.0283  # between its neighbours, and below the sync cost
    assert c.choose_k(16, [4] * 16) == 0
    assert c._cost(4, overlapped=True) == pytest.approx(0.0087 + (0.380 - 0.0087) * 2 / 510)
    sync = SpecController(cfg, token_buckets=(16, 32, 64, 128))
    sync.record_step(32, 0.06)
    sync.record_step(64, 0.10)
    assert sync._cost(16) == 0.06  # below the smallest measured: its time
    assert sync._cost(128) == pytest.approx(0.18)  # past the largest: the line through the two largest


def test_controller_measures_no_speculation_again_when_its_cost_is_stale():
    """A slow spike while no speculation was last measured (the machine's, not the step's) priced K = 0 above
    speculating, so K = 0 was never measured again and a loaded server verified drafts at 0.8x of no speculation.
    Once K = 0's cost is STALE_AFTER decisions old, an exploring decision measures it again, and the new period
    replaces the stale average."""
    from jaxserve.spec_decode.controller import EXPLORE_EVERY, STALE_AFTER

    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=1)
    c = SpecController(cfg, token_buckets=(16, 32))
    for _ in range(40):
        c.record(1, 1)  # every draft accepted: 32 tokens per verify step
    c.record_step(32, 0.060)  # 16 decodes + 16 drafts: 533 tok/s
    c.record_step(16, 0.100, overlapped=True)  # 16 decodes measured during a spike: 160 tok/s (really 32 ms: 500)
    seen, prev = [], 1
    for _ in range(STALE_AFTER + 2 * EXPLORE_EVERY):
        # really K = 0 wins: built behind the step before 25 ms (640 tok/s), 32 ms after a verify step (500 tok/s)
        # (a step after a verify step cannot be built behind it)
        k = c.choose_k(16, [1] * 16, optimistic=True) if prev == 0 else None  # the engine's hint (skip_proposal)
        if k == 0:
            c.num_decisions += 1  # the step is built behind, without drafts: a decision
        else:
            k = c.choose_k(16, [1] * 16)  # the step before landed: propose's decision
        seen.append(k)
        c.record_step(16 + 16 * k, 0.060 if k else 0.025 if prev == 0 else 0.032, overlapped=k == 0 and prev == 0)
        prev = k
    first = seen.index(0)
    assert STALE_AFTER < first <= STALE_AFTER + EXPLORE_EVERY  # measured again once stale, on an exploring decision
    assert seen[first + 1] == 0  # ... and built behind that step: its table's stale average is replaced
    assert c.cost_overlapped[16] == pytest.approx(0.025)
    after = seen[first:]
    assert after.count(1) <= len(after) // EXPLORE_EVERY + 1  # K = 0 from then on (K = 1 only when exploring)


def test_controller_stops_waiting_for_hints_its_decisions_overrule():
    """A step in flight: waiting for it to land (to propose from its tokens) costs the overlap even when the decision
    then verifies nothing. Once most recent waits ended in K = 0, a marginal hint no longer makes the engine wait
    (except every EXPLORE_EVERY-th decision, so the share keeps being measured); when waits pay, it waits again."""
    from jaxserve.spec_decode.controller import EXPLORE_EVERY

    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=1)
    c = SpecController(cfg, token_buckets=(16, 32))
    c.record_step(16, 0.030, overlapped=True)  # 16 decodes built behind the step before ...
    c.record_step(16, 0.040)  # ... or after it landed
    c.record_step(32, 0.045)  # 16 decodes + 16 drafts
    for _ in range(40):
        c.record(1, 1)  # 32 tokens in 45 ms vs 16 in 30: the hint says wait (K = 1)
    assert c.wait_for(16, [1] * 16) == 1  # no waits measured yet: the hint
    for _ in range(30):
        c.record_wait(False)  # every decision after a wait chose K = 0 (the real drafts were fewer)
    waited = []
    for _ in range(2 * EXPLORE_EVERY):
        waited.append(c.wait_for(16, [1] * 16))
        c.num_decisions += 1  # the step built behind counts as a decision (`Speculator.skip_proposal`)
    assert waited.count(1) == 2 and waited.count(0) == 2 * EXPLORE_EVERY - 2  # only the exploring decisions wait
    for _ in range(30):
        c.record_wait(True)  # waits pay again
    assert all(c.wait_for(16, [1] * 16) == 1 for _ in range(EXPLORE_EVERY))


def test_a_head_that_drafts_ahead_keeps_up_when_the_controller_only_explores_no_speculation():
    """A proposer that drafts ahead (EAGLE-3) is told K = 0 for the next step either because speculation does not
    pay (it goes off, and its sequences stop speculating for good) or because the controller explores K = 0: then it
    must follow the step without drafting (k_hint > 0, no drafts), or exploring would switch it off."""
    from jaxserve.config import EngineConfig
    from jaxserve.sequence import Sequence
    from jaxserve.spec_decode.controller import EXPLORE_EVERY
    from jaxserve.spec_decode.proposer import Proposer
    from jaxserve.spec_decode.speculator import Speculator

    class AheadProposer(Proposer):
        def __init__(self):
            self.calls = []

        def draft(self, seq, k):
            return None

        def after_step(self, work, starts, ends, hidden, draft_cap, k_hint):
            self.calls.append((k_hint, [draft_cap(s) for s in running]))

    cfg = EngineConfig.from_dict(dict(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256,
                                      speculative_config={"method": "ngram", "num_speculative_tokens": 1}), "test")
    prop = AheadProposer()
    spec = Speculator(cfg, prop)
    c = spec.controller
    running = []
    for i in range(2):
        s = Sequence(i, str(i), 0, [5, 6, 7], SamplingParams(max_tokens=100), 100, 0.0)
        s.num_computed_tokens = 2
        running.append(s)
    for b in cfg.token_buckets:
        c.record_step(b, 0.010)  # 2 decodes + 2 drafts, half of them accepted: 3 tokens in 10 ms (300/s) ...
    for _ in range(40):
        c.record(1, 1)
        c.record(1, 0)
    c.record_step(2, 0.008, overlapped=True)  # ... beat 2 decodes built behind the step before in 8 ms (250/s),
    # the runner-up, within EXPLORE_MAX_LOSS: explored every EXPLORE_EVERY-th decision
    kinds = set()
    for decision in range(1, 2 * EXPLORE_EVERY + 1):
        c.num_decisions = decision - 1
        spec.after_step([], [], [], running, None)
        k_hint, caps = prop.calls[-1]
        assert k_hint > 0  # never off: speculation pays here, K = 0 is only ever explored
        kinds.add((k_hint, tuple(caps)))
        if caps == [0, 0]:
            assert decision % EXPLORE_EVERY == 0  # no drafts only on an exploring decision
    assert kinds == {(1, (1, 1)), (1, (0, 0))}  # drafts, and the explored K = 0: followed, without drafts
    c.record_step(2, 0.001, overlapped=True)  # now K = 0 is far cheaper: off, for real
    c.num_decisions = 1
    spec.after_step([], [], [], running, None)
    assert prop.calls[-1][0] == 0


def test_controller_keeps_drafts_within_the_room_left():
    """`room`: the most drafts the step can take in all. A K whose drafts do not fit is not a candidate, for the
    decision and for the optimistic hint alike; a fixed K is the user's and ignores it."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    c = SpecController(cfg, token_buckets=(4, 8, 16, 32))
    for b in (4, 8, 16, 32):
        c.record_step(b, 0.01)  # verifying is free ...
    for _ in range(40):
        c.record(3, 3)  # ... and every draft is accepted: the most drafts that fit win
    assert c.choose_k(4, [3] * 4) == 3
    assert c.choose_k(4, [3] * 4, room=12) == 3
    assert c.choose_k(4, [3] * 4, room=11) == 2  # 4 x 3 drafts do not fit, 4 x 2 do
    assert c.choose_k(4, [3, 1, 1, 1], room=5) == 2  # min(2, 3) + 3 x 1 = 5
    assert c.choose_k(4, [3] * 4, room=3) == 0  # not even one draft each
    assert c.choose_k(4, [3] * 4, room=0) == 0
    assert c.choose_k(4, [3] * 4, room=0, optimistic=True) == 0
    fresh = SpecController(cfg, token_buckets=(4, 8, 16, 32))  # unmeasured: the hint names the largest that fits
    assert fresh.choose_k(4, [3] * 4, room=8, optimistic=True) == 2
    fixed = SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False), (4, 8))
    assert fixed.choose_k(4, [3] * 4, room=0) == 3


def test_drafts_do_not_take_the_budget_of_prompts_that_can_be_scheduled():
    """Drafts are scheduled before waiting prompts, so drafts past the budget's free room would delay the prompts'
    first tokens, and a verify step does not overlap with the next one: the speculator leaves prompt tokens their
    budget. A waiting prompt counts only if a seat is free for it."""
    from jaxserve.config import EngineConfig
    from jaxserve.sequence import Sequence
    from jaxserve.spec_decode.speculator import Speculator

    def seq(i, prompt, computed):
        s = Sequence(i, str(i), 0, list(prompt), SamplingParams(max_tokens=100), 100, 0.0)
        s.num_computed_tokens = computed
        return s

    def engine_cfg(max_num_seqs):
        return EngineConfig.from_dict(dict(max_num_batched_tokens=32, max_num_seqs=max_num_seqs, max_model_len=256,
                                           speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                               "prompt_lookup_min": 1, "prompt_lookup_max": 3}), "test")

    def drafts(cfg, waiting):
        spec = Speculator(cfg, NgramProposer(1, 3))
        c = spec.controller
        for b in cfg.token_buckets:
            c.record_step(b, 0.01)  # verifying is free and everything is accepted: speculate whenever drafts fit
        for _ in range(40):
            c.record(3, 3)
        running = [seq(i, [7, 8, 9] * 5, 14) for i in range(2)]  # decoding, with n-gram drafts to propose
        spec.propose(running, waiting)
        return [len(s.spec_token_ids) for s in running], spec.skip_proposal(running, waiting)

    cfg = engine_cfg(max_num_seqs=4)
    assert drafts(cfg, []) == ([3, 3], False)
    assert drafts(cfg, [seq(9, range(3, 27), 0)]) == ([3, 3], False)  # 2 + 24 tokens leave room for 6 drafts
    assert drafts(cfg, [seq(9, range(3, 29), 0)]) == ([2, 2], False)  # 2 + 26: room for 4
    assert drafts(cfg, [seq(9, range(3, 43), 0)]) == ([0, 0], True)  # the prompt fills the budget: none
    # 2 seats free: 2 of 3 waiting 14-token prompts fit, 2 + 2 x 14 tokens leave room for 2 drafts (not 3 x 14)
    assert drafts(cfg, [seq(9 + i, range(3, 17), 0) for i in range(3)]) == ([1, 1], False)
    # ... no seat free: the waiting prompt cannot be scheduled, so it takes nothing from the drafts
    assert drafts(engine_cfg(max_num_seqs=2), [seq(9, range(3, 43), 0)]) == ([3, 3], False)


def test_a_step_in_flight_is_not_waited_for_when_no_sequence_can_have_ngram_drafts():
    """Async scheduling: with a step in flight, the next is built at once without drafts unless speculation might
    pay. n-gram counts the drafts a lookup finds in the tokens known now (`expected_drafts`), not every sequence's
    full cap: sequences whose text never repeats let the step overlap even where verifying would be free; one
    that repeats makes the engine wait and propose. A model proposer (the default hook) still counts its cap."""
    from jaxserve.config import EngineConfig
    from jaxserve.sequence import Sequence
    from jaxserve.spec_decode.proposer import Proposer
    from jaxserve.spec_decode.speculator import Speculator

    cfg = EngineConfig.from_dict(dict(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256,
                                      speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                          "prompt_lookup_min": 1, "prompt_lookup_max": 3}), "test")

    def decoding(i, prompt):
        s = Sequence(i, str(i), 0, list(prompt), SamplingParams(max_tokens=100), 100, 0.0)
        s.num_computed_tokens = len(prompt) - 1
        return s

    def speculator(proposer):
        spec = Speculator(cfg, proposer)
        for b in cfg.token_buckets:
            spec.controller.record_step(b, 0.01)  # verifying is free and everything is accepted
            spec.controller.record_step(b, 0.01, overlapped=True)
        for _ in range(40):
            spec.controller.record(3, 3)
        return spec

    fresh = [decoding(i, range(10 * i, 10 * i + 12)) for i in range(3)]  # no token repeats: no lookup matches
    assert speculator(NgramProposer(1, 3)).skip_proposal(fresh) is True
    repeating = fresh[:2] + [decoding(7, [5, 6, 7] * 4)]
    assert speculator(NgramProposer(1, 3)).skip_proposal(repeating) is False

    class ModelProposer(Proposer):  # drafts whatever the text: the default expectation, the full cap
        def draft(self, seq, k):
            return None

    assert speculator(ModelProposer()).skip_proposal(fresh) is False


# ---- the engine ----------------------------------------------------------------------------------------------------

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_spec")
    make_tiny_model("llama_gqa", str(path))
    return str(path)


def _engine_args(**kw):
    return dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=128, precompile=False) | kw


@pytest.fixture(scope="module")
def plain(tiny):
    return LLM(tiny, **_engine_args())


@pytest.fixture(scope="module")
def spec(tiny):
    return LLM(tiny, **_engine_args(speculative_config=SPEC))


def _repetitive_prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        motif = rng.integers(3, 300, int(rng.integers(2, 6))).tolist()
        out.append((motif * 8)[: int(rng.integers(6, 30))] + rng.integers(3, 300, 2).tolist())
    return out


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_greedy_with_ngram_equals_plain(plain, spec):
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(8)]
    outs = spec.generate(prompts, GREEDY, use_tqdm=False)
    assert _ids(outs) == _ids(plain.generate(prompts, GREEDY, use_tqdm=False))
    m = spec.llm_engine.spec.metrics
    assert sum(m.num_drafts) > 20 and sum(m.num_accepted) > 0, m.as_dict()  # speculation really happened
    assert sum(o.metrics.spec_num_draft_tokens for o in outs) == sum(m.num_drafts)
    assert sum(o.metrics.spec_num_accepted_tokens for o in outs) == sum(m.num_accepted)
    assert 1.0 < m.mean_acceptance_length <= 1 + SPEC["num_speculative_tokens"]
    used = {b for b, _ in spec.llm_engine.runner._executables}
    assert any(b.num_rows == 0 for b in used if b.num_tokens > b.num_seqs)  # steps without drafts: 1 row per seq
    assert any(b.rows > b.num_seqs for b in used)  # verify steps: a row per draft position
    spec.llm_engine.block_manager.check()
    assert spec.llm_engine.block_manager.num_used_pages == 0


def test_mixed_k_per_request_and_opt_out(plain, spec):
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(6, seed=3)]
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, num_speculative_tokens=k)
        for k in (0, 1, 2, 3, None, 0)
    ]
    before = spec.llm_engine.spec.metrics.num_steps
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert _ids(outs) == _ids(plain.generate(prompts, params, use_tqdm=False))
    assert spec.llm_engine.spec.metrics.num_steps > before
    assert spec.llm_engine.block_manager.num_used_pages == 0


def test_stop_strings_n_and_logprobs_with_speculation(plain, spec):
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(4, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=16, n=2, logprobs=2, stop_token_ids=[7], ignore_eos=True)
    a, b = spec.generate(prompts, params, use_tqdm=False), plain.generate(prompts, params, use_tqdm=False)
    assert _ids(a) == _ids(b)
    for x, y in zip(a, b):
        for cx, cy in zip(x.outputs, y.outputs):
            assert cx.finish_reason == cy.finish_reason
            assert len(cx.logprobs) == len(cx.token_ids)
            for lx, ly, t in zip(cx.logprobs, cy.logprobs, cx.token_ids):
                assert abs(lx[t].logprob - ly[t].logprob) < 1e-4


def test_greedy_with_speculation_under_preemption(tiny, plain):
    squeezed = LLM(tiny, **_engine_args(num_pages=24, max_model_len=64, speculative_config=SPEC))
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(6, seed=9)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert (_ids(squeezed.generate(prompts, params, use_tqdm=False))
            == _ids(plain.generate(prompts, params, use_tqdm=False)))
    eng = squeezed.llm_engine
    assert eng.scheduler.num_preemptions > 0
    assert sum(eng.spec.metrics.num_drafts) > 0
    eng.block_manager.check()
    assert eng.block_manager.num_used_pages == 0


def test_aborts_during_verification_leak_nothing(spec):
    eng = spec.llm_engine
    prompts = _repetitive_prompts(10, seed=11)
    for i, p in enumerate(prompts):
        eng.add_request(f"ab-{i}", {"prompt_token_ids": p},
                        SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True))
    live = {f"ab-{i}" for i in range(len(prompts))}
    steps = 0
    while eng.has_unfinished_requests():
        drafting = [s.request_id for s in eng.scheduler.running if s.spec_token_ids]
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
        steps += 1
        if steps % 3 == 0 and live:  # abort a request that just verified drafts, when there is one
            victim = next((r for r in drafting if r in live), sorted(live)[0])
            assert eng.abort_request(victim).finished
            live.discard(victim)
        eng.block_manager.check()
    assert eng.block_manager.num_used_pages == 0 and not eng.scheduler.running and not eng.scheduler.waiting


def test_precompiled_speculative_engine_never_recompiles(tiny):
    llm = LLM(tiny, **_engine_args(precompile=True, speculative_config=SPEC | {"adaptive": True}))
    compiled = llm.llm_engine.runner.num_compiles
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(7, seed=21)]
    params = [SamplingParams(temperature=t, seed=1, max_tokens=16, ignore_eos=True, logprobs=1)
              for t in (0, 0.8) * 3 + (0,)]
    llm.generate(prompts, params, use_tqdm=False)
    assert sum(llm.llm_engine.spec.metrics.num_drafts) > 0
    assert llm.llm_engine.runner.num_compiles == compiled


def test_bad_speculative_config():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "draft": 1})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)


# ---- draft-model proposer ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A different random model with the same vocabulary: a poor but valid draft."""
    path = tmp_path_factory.mktemp("tiny_draft")
    make_tiny_model("llama_mqa", str(path), seed=5)
    return str(path)


def test_identical_draft_model_is_accepted(tiny, plain):
    llm = LLM(tiny, **_engine_args(speculative_config={
        "method": "draft_model", "model": tiny, "num_speculative_tokens": 3, "adaptive": False}))
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(5, seed=13)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == _ids(plain.generate(prompts, params, use_tqdm=False))
    m = llm.llm_engine.spec.metrics
    assert sum(m.num_drafts) > 50
    assert m.acceptance_rate >= 0.98, m.as_dict()
    assert llm.llm_engine.block_manager.num_used_pages == 0


def test_different_draft_model_is_lossless_under_preemption(tiny, other_draft, plain):
    llm = LLM(tiny, **_engine_args(num_pages=24, max_model_len=64, speculative_config={
        "method": "draft_model", "model": other_draft, "num_speculative_tokens": 2, "adaptive": False}))
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(6, seed=17)]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, num_speculative_tokens=k)
              for k in (None, 1, 0, None, 2, None)]
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == _ids(plain.generate(prompts, params, use_tqdm=False))
    eng = llm.llm_engine
    assert eng.scheduler.num_preemptions > 0 and sum(eng.spec.metrics.num_drafts) > 0
    eng.block_manager.check()
    assert eng.block_manager.num_used_pages == 0


def test_draft_model_must_share_the_vocabulary(tiny, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(tiny, **_engine_args(speculative_config={"method": "draft_model", "model": str(tmp_path),
                                                     "num_speculative_tokens": 2}))
    with pytest.raises(ValueError, match="model"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2})


def test_kv_memory_budget_counts_the_draft_models_cache(tiny, other_draft):
    """The draft model's cache shares the target's page ids, so one page costs both models' bytes: the same
    kv_cache_memory_bytes holds fewer pages with a draft model than without, and the two caches together fit it."""
    from jaxserve.config import kv_storage_dtype
    from jaxserve.kv_cache import kv_cache_bytes
    from jaxserve.loader import read_model_config

    budget = 3_000_000
    alone = LLM(tiny, **_engine_args(kv_cache_memory_bytes=budget)).llm_engine
    with_draft = LLM(tiny, **_engine_args(kv_cache_memory_bytes=budget, speculative_config={
        "method": "draft_model", "model": other_draft, "num_speculative_tokens": 2})).llm_engine
    dtype = kv_storage_dtype(alone.config.kv_cache_dtype, alone.config.dtype)
    target_page = kv_cache_bytes(alone.model_config, 1, 4, dtype)
    draft_page = kv_cache_bytes(read_model_config(other_draft), 1, 4, dtype)
    assert alone.config.num_pages == budget // target_page
    assert with_draft.config.num_pages == budget // (target_page + draft_page)
    assert with_draft.config.num_pages < alone.config.num_pages


def test_controller_counts_the_draft_models_time(tiny, monkeypatch):
    """The controller's step cost includes the proposer's work: with a draft model made artificially slow (50 ms per
    proposal), adaptive speculation is tried, measured, and turned off, and the output is unchanged."""
    import time as _time

    llm = LLM(tiny, **_engine_args(speculative_config={
        "method": "draft_model", "model": tiny, "num_speculative_tokens": 3}))
    eng = llm.llm_engine
    propose = eng.proposer.after_schedule

    def slow_propose(work):
        if any(w.num_draft for w in work):
            _time.sleep(0.05)
        return propose(work)

    monkeypatch.setattr(eng.proposer, "after_schedule", slow_propose)
    choices = []
    choose = eng.spec.controller.choose_k

    def recorded(base, lens, optimistic=False, room=None):
        k = choose(base, lens, optimistic, room)
        # an optimistic call is async scheduling asking whether the next step may skip proposing: K = 0 is then
        # that step's decision (`Speculator.skip_proposal`); K > 0 hands the decision to `propose`
        if not optimistic or k == 0:
            choices.append(k)
        return k

    monkeypatch.setattr(eng.spec.controller, "choose_k", recorded)
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(4, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert any(k > 0 for k in choices)  # tried ...
    assert max(eng.spec.controller.cost.values()) >= 0.05  # ... its measured cost includes the draft model's time ...
    # ... and turned off (a step size never seen before may still be tried once)
    assert len(choices) >= 40 and sum(k > 0 for k in choices[len(choices) // 2 :]) <= 1, choices
    ref = LLM(tiny, **_engine_args()).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_acceptance_metrics_per_position_reach_prometheus(tiny):
    """Acceptance per draft position and the mean acceptance length are aggregated in the engine and exported on
    /metrics (the collector the servers register), consistent with the per-request counts."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from service.async_engine import _EngineCollector

    llm = LLM(tiny, **_engine_args(speculative_config=SPEC | {"adaptive": False}))
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(3, seed=5)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    eng = llm.llm_engine
    stats = eng.get_stats()
    drafts, accepted = stats["spec_decode_num_draft_tokens_per_pos"], stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(drafts) == SPEC["num_speculative_tokens"] and sum(accepted) > 0
    assert all(a <= d for a, d in zip(accepted, drafts)) and drafts == sorted(drafts, reverse=True)
    assert sum(drafts) == sum(o.metrics.spec_num_draft_tokens for o in outs)
    assert sum(accepted) == sum(o.metrics.spec_num_accepted_tokens for o in outs)

    registry = CollectorRegistry()
    registry.register(_EngineCollector(SimpleNamespace(stats=lambda: stats | {"num_requests_in_flight": 0},
                                                       ready=True)))
    samples = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    for i, (d, a) in enumerate(zip(drafts, accepted)):
        assert samples[f'jaxserve_spec_decode_num_draft_tokens_per_pos_total{{position="{i}"}}'] == d
        assert samples[f'jaxserve_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] == a
    assert samples["jaxserve_spec_decode_num_accepted_tokens_total"] == sum(accepted)
    assert samples["jaxserve_spec_decode_mean_acceptance_length"] == pytest.approx(
        stats["spec_decode_mean_acceptance_length"]
    )
    assert samples["jaxserve_spec_decode_mean_acceptance_length"] > 1


def test_a_new_proposer_plugs_in_through_the_protocol(tiny, plain):
    """The engine drives speculation only through the `Proposer` hooks: an oracle proposer that drafts the greedy
    reference continuation with its last draft wrong gets exactly the right ones accepted, every hook is called in
    step order, and the output is the reference."""
    from jaxserve.spec_decode import Proposer

    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(3, seed=11)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)}
    calls = []

    class Oracle(Proposer):
        def draft(self, seq, k):
            calls.append("draft")
            want = ref[tuple(seq.prompt_token_ids)][len(seq.output_token_ids) :][:k]
            return want[:-1] + [(want[-1] + 1) % 300] if len(want) > 1 else want  # the last draft is wrong

        def after_schedule(self, work):
            calls.append("after_schedule")

        def verified(self, seq, num_tokens_before, num_draft, num_accepted):
            calls.append(("verified", num_draft, num_accepted))

        def after_step(self, work, starts, ends, hidden, draft_cap, k_hint):
            calls.append("after_step")

    llm = LLM(tiny, **_engine_args(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                       "adaptive": False}))
    llm.llm_engine.spec.proposer = Oracle()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ref[tuple(o.prompt_token_ids)] for o in outs]
    verified = [c for c in calls if isinstance(c, tuple)]
    assert verified and all(acc == nd - 1 for _, nd, acc in verified if nd > 1)  # all but the wrong last draft
    assert any(nd == 3 for _, nd, _ in verified)
    assert {"draft", "after_schedule", "after_step"} <= set(calls)
    m = llm.llm_engine.spec.metrics
    assert sum(m.num_accepted) == sum(acc for _, _, acc in verified) > 0
