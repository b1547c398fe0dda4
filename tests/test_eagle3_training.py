"""EAGLE-3 trainer: the TTT forward against the serving head (step 0, and steps 1..3 along a drafted chain), the
draft-vocabulary maths, stored features against the serving forward, training that learns, and export -> load_eagle3
-> lossless speculative serving; runs spread over several processes: a resumed training run (Orbax checkpoint, stop
requests) equals one run bit for bit, resumed feature extraction equals one extraction byte for byte, regenerate's
resume survives a torn line. Tiny random targets, nothing downloaded."""

import dataclasses
import itertools
import json
import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.batch import ScheduledSeq, build_step_inputs, choose_bucket
from jaxserve.kv_cache import init_kv_cache
from jaxserve.loader import load_checkpoint
from jaxserve.loader.eagle3 import load_eagle3
from jaxserve.loader.weights import to_weights
from jaxserve.model.eagle3 import Eagle3Weights, draft_logits, eagle3_forward
from jaxserve.model.layers import argmax
from jaxserve.model.llama import compute_logits, forward
from training.eagle3 import ttt
from training.eagle3.checkpoint import StopRequests
from training.eagle3.features import FeatureStore, TargetFeatures, extract, pack
from training.eagle3.regenerate import completed
from training.eagle3.ship import write_card
from training.eagle3.train import TRAINING_RECORD, TrainConfig, Trainer, head_config, training_record
from training.eagle3.ttt import TTTBatch, ttt_logits
from training.eagle3.vocab import build_vocab, coverage, draft_vocab_ids, token_counts, vocab_mapping

V, D, F, NH, NKV, L = 300, 64, 160, 4, 2, 5
AUX = (1, 3, 5)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    import torch
    import transformers

    path = str(tmp_path_factory.mktemp("train_target"))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=NH,
        num_key_value_heads=NKV, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(cfg).float().eval().save_pretrained(path)
    return path


def random_head(cfg, seed=0):
    c = cfg.layer
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(0.15 * rng.standard_normal(s), jnp.float32)  # noqa: E731
    n = lambda k: jnp.asarray(1 + 0.3 * rng.standard_normal(k), jnp.float32)  # noqa: E731
    NHd, KHd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return Eagle3Weights(fc=r(3 * D, D), embed_norm=n(D), hidden_norm=n(D), wq=r(2 * D, NHd), wk=r(2 * D, KHd),
                         wv=r(2 * D, KHd), wo=r(NHd, D), mlp_norm=n(D), w_gate=r(D, F), w_up=r(D, F), w_down=r(F, D),
                         final_norm=n(D), lm_head=r(D, cfg.draft_vocab_size), d2t=None)


# ---- TTT forward == the serving head --------------------------------------------------------------------------------


def _ttt_setup(target, seed=0, T=12, **flags):
    tcfg = load_checkpoint(target).config
    cfg = dataclasses.replace(head_config(tcfg, AUX, 40), **flags)
    w = random_head(cfg, seed)
    rng = np.random.default_rng(seed + 1)
    embed = jnp.asarray(rng.standard_normal((V, D)), jnp.float32)
    feats = rng.standard_normal((2, T, 3 * D)).astype(np.float32)
    tokens = rng.integers(0, V, (2, T)).astype(np.int32)
    batch = TTTBatch(aux=jnp.asarray(feats), target_hidden=jnp.zeros((2, T, D)), tokens=jnp.asarray(tokens),
                     target_argmax=jnp.zeros((2, T), jnp.int32), is_output=jnp.ones((2, T), bool),
                     lengths=jnp.asarray([T, T - 3], jnp.int32),
                     window_pos=jnp.asarray(np.stack([np.arange(T), np.arange(T) // 2]), jnp.int32))
    return cfg, w, embed, feats, tokens, batch


def _serving_chain_logits(cfg, w, embed, feats, tokens, p, k):
    """Serving: catch-up over pairs (f_q, t_{q+1}), q = 0..p, then k single-token drafts fed t_{p+2}, .. t_{p+1+k}.
    -> draft logits f32[k + 1, Vd] (step j predicts t_{p+2+j})."""
    ps, pages = 4, [3, 1, 4, 2]
    kv = init_kv_cache(cfg.layer, 6, ps, jnp.float32)
    fwd = jax.jit(eagle3_forward, static_argnums=0, static_argnames="from_target")
    b = choose_bucket(p + 1, len(pages), (16,), (4,), 4)
    inputs = jax.tree.map(jnp.asarray, build_step_inputs([ScheduledSeq(list(tokens[1 : p + 2]), 0, pages)], b, ps))
    h, normed, kv = fwd(cfg, w, embed, kv, inputs, jnp.asarray(np.pad(feats[: p + 1], ((0, 15 - p), (0, 0)))),
                        from_target=True)
    out, h = [draft_logits(w, normed[p : p + 1])[0]], h[p : p + 1]
    b1 = choose_bucket(1, len(pages), (1,), (4,), 4)
    for j in range(1, k + 1):
        one = jax.tree.map(jnp.asarray,
                           build_step_inputs([ScheduledSeq([int(tokens[p + 1 + j])], p + j, pages)], b1, ps))
        h, normed, kv = fwd(cfg, w, embed, kv, one, h, from_target=False)
        out.append(draft_logits(w, normed)[0])
    return np.stack([np.asarray(x) for x in out])


@pytest.mark.parametrize("flags", [{}, dict(norm_output=True, norm_before_residual=True)], ids=["plain", "norms"])
def test_ttt_matches_serving_along_chains(target, flags):
    """Step k at chain p (row 0: window = every position; row 1: a shifted window) == serving's k-th draft."""
    cfg, w, embed, feats, tokens, batch = _ttt_setup(target, **flags)
    logits = np.asarray(jax.jit(ttt_logits, static_argnums=0, static_argnames="num_steps")(cfg, w, embed, batch,
                                                                                           num_steps=4))
    T, checked = tokens.shape[1], 0
    for b in range(2):
        for wi, p in enumerate(np.asarray(batch.window_pos[b])):
            k = min(3, T - 2 - p)  # drafts fed tokens up to t_{p+1+k}
            if k < 0:
                continue
            ref = _serving_chain_logits(cfg, w, embed, feats[b], tokens[b], int(p), k)
            np.testing.assert_allclose(logits[: k + 1, b, wi], ref, rtol=1e-4, atol=1e-4, err_msg=f"row {b} chain {p}")
            checked += k + 1
    assert checked > 40


def test_wrong_chain_mask_is_caught(target, monkeypatch):
    """A step-k query that sees the step-0 keys up to its own position p + k (instead of p) disagrees with serving."""
    cfg, w, embed, feats, tokens, batch = _ttt_setup(target, seed=2)
    good = ttt.attend
    monkeypatch.setattr(ttt, "attend",
                        lambda q, q_pos, k0, v0, kd, vd, s: good(q, q_pos + kd.shape[2], k0, v0, kd, vd, s))
    logits = np.asarray(ttt_logits(cfg, w, embed, batch, num_steps=2))
    ref = _serving_chain_logits(cfg, w, embed, feats[0], tokens[0], 3, 1)
    np.testing.assert_allclose(logits[0, 0, 3], ref[0], rtol=1e-4, atol=1e-4)  # step 0 is unaffected
    assert np.abs(logits[1, 0, 3] - ref[1]).max() > 1e-3


@pytest.mark.parametrize("kind", ttt.LOSSES)
def test_ttt_loss_against_numpy(target, kind):
    """Each loss, step-decayed means over the valid positions whose target choice is in the draft vocabulary: "kl"
    = KL(target || head) over the draft vocabulary, "ce" = -log head(target's choice); "kl_all" over every valid
    position."""
    cfg, w, embed, feats, tokens, batch = _ttt_setup(target, seed=3)
    rng = np.random.default_rng(7)
    S, (B, T), Vd, decay = 3, tokens.shape, cfg.draft_vocab_size, 0.8
    draft_ids = np.sort(rng.choice(V, Vd, replace=False))
    t2d = np.zeros(V, bool)
    t2d[draft_ids] = True
    # target choices: two thirds inside the draft vocabulary, the rest anywhere
    argmax_ = np.where(rng.random((B, T)) < 0.67, rng.choice(draft_ids, (B, T)), rng.integers(0, V, (B, T)))
    hidden = rng.standard_normal((B, T, D)).astype(np.float32)
    head = rng.standard_normal((D, Vd)).astype(np.float32)
    # windows as batches.py lays them out: consecutive positions from a start
    batch = dataclasses.replace(batch, target_hidden=jnp.asarray(hidden), target_argmax=jnp.asarray(argmax_, jnp.int32),
                                is_output=jnp.asarray(rng.random((B, T)) < 0.8),
                                window_pos=jnp.asarray(np.stack([np.arange(T), 2 + np.arange(T)]), jnp.int32))
    vocab = ttt.VocabArrays(draft_ids=jnp.asarray(draft_ids, jnp.int32), t2d=jnp.asarray(t2d),
                            target_head=jnp.asarray(head))
    loss, stats = ttt.ttt_loss(cfg, w, embed, vocab, batch, num_steps=S, decay=decay, kind=kind)
    logits = np.asarray(ttt_logits(cfg, w, embed, batch, num_steps=S), np.float64)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    wp, lengths, is_output = (np.asarray(a) for a in (batch.window_pos, batch.lengths, batch.is_output))
    want, counted = 0.0, 0
    for k in range(S):
        terms = []
        for b in range(B):
            for wi, p in enumerate(wp[b]):
                tgt = argmax_[b, min(p + 1 + k, T - 1)]
                if not (p + 2 + k < lengths[b] and is_output[b, min(p + 2 + k, T - 1)]):
                    continue
                if kind != "kl_all" and not t2d[tgt]:
                    continue
                logq = log_softmax(logits[k, b, wi])
                if kind != "ce":
                    logp = log_softmax(hidden[b, min(p + 1 + k, T - 1)].astype(np.float64) @ head)
                    terms.append(np.sum(np.exp(logp) * (logp - logq)))
                else:
                    terms.append(-logq[np.searchsorted(draft_ids, tgt)])
        counted += len(terms)
        want += decay**k * np.mean(terms)
        assert float(stats["loss_n"][k]) == len(terms)
    assert counted >= 10
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)


# ---- draft vocabulary ------------------------------------------------------------------------------------------------


def test_vocab_mapping():
    counts = np.zeros(12, np.int64)
    counts[[7, 3, 9, 5]] = [5, 5, 2, 1]  # 7 and 3 tie; 3 wins the tie by id
    assert draft_vocab_ids(counts, 2).tolist() == [3, 7]
    ids, d2t, t2d = build_vocab(counts, 3)
    assert ids.tolist() == [3, 7, 9] and d2t.tolist() == [3, 6, 7] and d2t.dtype == np.int64
    assert t2d.dtype == bool and np.flatnonzero(t2d).tolist() == [3, 7, 9]
    assert ((np.arange(3) + d2t) == ids).all()
    ids, d2t, t2d = build_vocab(counts, 7)  # 4 seen tokens + the 3 lowest unused ids, sorted ascending
    assert ids.tolist() == [0, 1, 2, 3, 5, 7, 9] and t2d.sum() == 7
    assert coverage(counts, t2d) == 1.0 and coverage(counts, vocab_mapping(np.array([7]), 12)[1]) == 5 / 13
    assert token_counts(np.array([1, 1, 2, 3]), np.array([1, 1, 0, 1]), 5).tolist() == [0, 2, 0, 1, 0]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab(counts, 13)
    # growing a vocabulary: the ids to keep first (seen or not), then the most frequent others, then unused ids
    ids, d2t, t2d = build_vocab(counts, 4, keep=np.array([0, 9]))
    assert ids.tolist() == [0, 3, 7, 9] and ((np.arange(4) + d2t) == ids).all()
    assert build_vocab(counts, 6, keep=np.array([11]))[0].tolist() == [0, 3, 5, 7, 9, 11]
    with pytest.raises(ValueError, match="cannot hold the 2 ids"):
        build_vocab(counts, 1, keep=np.array([0, 9]))


# ---- features, training, export --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_llm(target):
    return LLM(target, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(8, 64), page_size=4,
               max_model_len=128, precompile=False)


@pytest.fixture(scope="module")
def dataset(target, plain_llm, tmp_path_factory):
    """The tiny target's own greedy replies to 24 motif prompts -> a feature directory."""
    rng = np.random.default_rng(0)
    prompts = []
    for _ in range(24):
        motif = rng.integers(3, V, int(rng.integers(2, 5))).tolist()
        prompts.append((motif * 8)[: int(rng.integers(4, 16))])
    outs = plain_llm.generate([{"prompt_token_ids": p} for p in prompts],
                              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    samples = [dict(prompt_token_ids=p, output_token_ids=list(o.outputs[0].token_ids), chat=False)
               for p, o in zip(prompts, outs)]
    path = str(tmp_path_factory.mktemp("feats"))
    tf = TargetFeatures(target, aux_layer_ids=AUX, max_len=64, len_buckets=(32, 64))
    extract(samples, tf, path, log_every=0)
    return samples, FeatureStore.open(path)


def test_features_equal_the_serving_forward(target, dataset):
    samples, store = dataset
    ck = load_checkpoint(target)
    weights = jax.device_put(to_weights(ck.config, ck.tensors, np.float32))
    for s in (0, 5):
        ids = samples[s]["prompt_token_ids"] + samples[s]["output_token_ids"]
        n, P = len(ids), len(samples[s]["prompt_token_ids"])
        kv = init_kv_cache(ck.config, 20, 4, jnp.float32)
        b = choose_bucket(n, 16, (64,), (16,), 1)
        inputs = jax.tree.map(jnp.asarray, build_step_inputs([ScheduledSeq(ids, 0, list(range(1, 17)))], b, 4))
        h, _, hidden = forward(ck.config, weights, kv, inputs, hidden_layer_ids=AUX)
        rows = store.rows(s)
        ref_aux = np.concatenate([np.asarray(hidden[j, :n]) for j in range(3)], axis=-1)
        np.testing.assert_allclose(store.aux[rows].astype(np.float32), ref_aux, rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(store.hidden[rows].astype(np.float32), np.asarray(h[:n]), rtol=2e-3, atol=2e-3)
        assert store.target_argmax[rows].tolist() == np.asarray(argmax(compute_logits(weights, h[:n]))).tolist()
        assert store.tokens[rows].tolist() == ids
        assert store.is_output[rows].tolist() == [0] * P + [1] * (n - P)
        # greedy data: the target's argmax at p is the output token p + 1
        assert (store.target_argmax[rows][P - 1 : n - 1] == store.tokens[rows][P:]).all()


def test_packed_steps_give_each_sample_its_own_features(target, dataset, tmp_path):
    """Samples packed into one ragged step (the default) get the features they get alone in a step."""
    samples, store = dataset
    lengths = store.lengths.tolist()
    starts = [0]
    while starts[-1] < len(lengths):
        starts.append(pack(lengths, starts[-1], 64, 16))
    assert max(np.diff(starts)) > 1 and starts[-1] == len(lengths)  # the dataset's steps do pack samples
    path = str(tmp_path / "alone")
    extract(samples, TargetFeatures(target, aux_layer_ids=AUX, max_len=64, len_buckets=(32, 64), max_seqs=1), path,
            log_every=0)
    alone = FeatureStore.open(path)
    assert alone.meta == store.meta
    np.testing.assert_allclose(alone.aux.astype(np.float32), store.aux.astype(np.float32), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(alone.hidden.astype(np.float32), store.hidden.astype(np.float32), rtol=1e-3,
                               atol=1e-3)
    assert np.array_equal(alone.target_argmax, store.target_argmax)
    assert np.array_equal(alone.tokens, store.tokens) and np.array_equal(alone.is_output, store.is_output)


def test_pack_fills_a_step_up_to_its_token_and_sequence_limits():
    assert pack([10, 20, 30, 5], 0, 64, 16) == 3  # 10 + 20 + 30 = 60; + 5 would be 65
    assert pack([10, 20, 30, 5], 2, 64, 16) == 4
    assert pack([10, 20, 30, 5], 0, 64, 2) == 2  # at most 2 sequences
    assert pack([70, 5], 0, 64, 16) == 1  # one sample alone always makes a step


def _trainer(store, **kw):
    tc = TrainConfig(**(dict(lr=3e-3, batch_tokens=64, ttt_steps=3, draft_vocab_size=64, len_buckets=(64,),
                             win_buckets=(32,), eval_frac=0.2, log_every=20, max_steps=60) | kw))
    return Trainer(store, tc)


def test_loss_mask_covers_exactly_the_output_predictions(dataset):
    samples, store = dataset
    tr = _trainer(store, eval_frac=0.0)
    total = None
    for plan in tr._plans(np.arange(store.num_samples)):
        st, _ = tr._eval_step(tr.params, tr.embed, tr.vocab, tr._batch(plan))
        total = st if total is None else jax.tree.map(jnp.add, total, st)
    for k in range(3):  # step k at chain p predicts token p + 2 + k: counted iff that token is an output token
        want = sum(len(r["output_token_ids"]) - max(0, 2 + k - len(r["prompt_token_ids"])) for r in samples)
        assert int(total["valid"][k]) == want


@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory):
    """(trainer, its exported head's directory, train-split evaluation before training, the training log)."""
    samples, store = dataset
    tr = _trainer(store)
    before = tr.evaluate(ids=tr.train_ids)
    head = str(tmp_path_factory.mktemp("trained") / "head")
    log = tr.train(out_dir=head)
    return tr, head, before, log


def test_training_learns_and_exports_losslessly(target, dataset, trained, plain_llm):
    samples, store = dataset
    tr, head, before, log = trained
    after = tr.evaluate(ids=tr.train_ids)
    assert log[-1]["loss"] < 0.7 * log[0]["loss"] or after["loss"][0] < 0.7 * before["loss"][0], (before, after)
    assert after["acc"][0] > before["acc"][0] + 0.2, (before, after)
    assert after["tau"] > before["tau"]

    cfg, w = load_eagle3(head, load_checkpoint(target).config, np.float32)
    assert dataclasses.replace(tr.cfg, layer=cfg.layer) == cfg and cfg.aux_layer_ids == AUX  # same flags and ids
    assert dataclasses.replace(tr.cfg.layer, max_position_embeddings=cfg.layer.max_position_embeddings) == cfg.layer
    assert cfg.layer.hidden_size == D and cfg.layer.num_layers == 1 and cfg.draft_vocab_size == 64
    params = jax.device_get(tr.params)
    for f in dataclasses.fields(Eagle3Weights):
        a, b = getattr(w, f.name), getattr(params, f.name)
        if f.name == "d2t":
            assert (a == tr.d2t).all()
        elif b is None:
            assert a is None
        else:
            np.testing.assert_array_equal(a, np.asarray(b), err_msg=f.name)

    spec = LLM(target, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(8, 64), page_size=4,
               max_model_len=128, precompile=False,
               speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    prompts = [{"prompt_token_ids": samples[i]["prompt_token_ids"]} for i in (0, 1, 2)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    ref = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, sp, use_tqdm=False)]
    assert got == ref
    assert sum(spec.llm_engine.spec.metrics.num_accepted) > 0  # the trained head's drafts do get accepted


def test_served_walk_counts_drafts_as_the_engine_does():
    """A hand-made reply (prompt 3 tokens, 12 in all, K = 3): the steps the walk takes and what it records, without a
    budget, under one the reply filled, and under one it ended before (at EOS: the engine drafts past it)."""
    from jaxserve.spec_decode.controller import SpecMetrics

    hits = np.full((12, 3), -1, np.int8)
    hits[2], hits[5], hits[6], hits[8] = [1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, -1]

    def walk(max_tokens):
        m = SpecMetrics(3)
        ttt.served_walk(hits, 3, 12, max_tokens, m)
        return m.num_drafts, m.num_accepted, m.num_steps, m.num_emitted

    # chains 2 (accepts 2) -> 5 (0) -> 6 (1) -> 8: two drafts left in the reply, both accepted -> 11, done
    assert walk(None) == ([4, 4, 3], [3, 2, 0], 4, 9)
    # budget 9 = the reply: at chain 8 one draft, so that the last token is the target's -> chain 10, done
    assert walk(9) == ([4, 3, 3], [3, 1, 0], 4, 8)
    # budget 12, the reply ended at 9: chain 8 drafts 3, the one past the end rejected
    assert walk(12) == ([4, 4, 4], [3, 2, 0], 4, 9)


def test_served_walk_replays_serving(target, dataset, trained):
    """The walk over the features of the target's own greedy replies measures what serving those prompts with the
    head (K = 3 every step, same budget) measures: the same drafts and acceptances, position by position."""
    from training.eagle3.ship import speculating_llm

    samples, store = dataset
    tr, head, _, _ = trained
    walked = tr.evaluate(ids=np.arange(store.num_samples), max_tokens=24)["served_walk"]
    llm = speculating_llm(target, head, 3, 4, **SERVE_KW)
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in samples],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r["output_token_ids"] for r in samples]
    served = llm.llm_engine.spec.metrics.as_dict()
    assert served["num_accepted_tokens"] > 0
    assert walked == served


def test_training_can_start_from_an_exported_head(dataset, trained, tmp_path):
    """`train --init-head HEAD`: the run starts from the head's weights and draft vocabulary (which replaces the
    configured size), so it continues from the head's held-out loss instead of a fresh head's."""
    samples, store = dataset
    tr, head, before, log = trained
    warm = Trainer(store, dataclasses.replace(tr.tc, draft_vocab_size=None, max_steps=4), head=head)
    assert warm.tc.draft_vocab_size == 64 and (warm.draft_ids == tr.draft_ids).all()
    for f in dataclasses.fields(Eagle3Weights):
        if f.name != "d2t":
            np.testing.assert_array_equal(np.asarray(getattr(warm.params, f.name)),
                                          np.asarray(getattr(tr.params, f.name)), err_msg=f.name)
    assert warm.evaluate() == tr.evaluate()
    fresh_loss = _trainer(store).evaluate(ids=tr.train_ids)["loss"][0]
    warm_log = warm.train(out_dir=str(tmp_path / "warm"))
    assert warm_log[0]["loss"] < 0.8 * fresh_loss  # its first step starts where the head left off
    # the run's record carries the head's (its lineage), and a head shipped from it says so in its card
    with open(os.path.join(head, TRAINING_RECORD)) as f:
        first = json.load(f)
    with open(tmp_path / "warm" / TRAINING_RECORD) as f:
        second = json.load(f)
    assert "started_from" not in first and second["started_from"] == first and second["steps"] == 4
    assert training_record(str(tmp_path)) == {}
    card = dict(target="t", dtype="bfloat16", draft_vocab_size=64, aux_layer_ids=list(AUX), training=second,
                served=dict(num_prompts=1, max_tokens=8, num_speculative_tokens=3, quantization="none",
                            acceptance_rate_per_position=[0.5, 0.2, 0.1], mean_acceptance_length=1.8,
                            num_draft_tokens=30, num_accepted_tokens=8))
    write_card(str(tmp_path), card)
    readme = (tmp_path / "README.md").read_text()
    assert f"- on top of a head trained {first['steps']} steps" in readme and "in all" in readme


def test_eval_judges_a_head_on_its_own_runs_split(dataset, trained, tmp_path, capsys):
    """`eval` without --eval-frac / --seed holds out the samples the head's run held out (its training.json): a run
    with another seed draws another split, and judging it on the default one would count samples it trained on."""
    from training.eagle3.__main__ import main

    samples, store = dataset
    tr, head, before, log = trained
    other = tmp_path / "head"
    shutil.copytree(head, other)
    record = json.loads((other / TRAINING_RECORD).read_text())
    assert record["config"]["eval_frac"] == 0.2 and record["config"]["seed"] == 0
    record["config"]["seed"] = 7
    (other / TRAINING_RECORD).write_text(json.dumps(record))
    assert set(_trainer(store, seed=7).eval_ids) != set(tr.eval_ids)

    def printed(argv):
        main(["eval", "--head", str(other), "--features", store.path, "--ttt-steps", "3", *argv])
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("[eval] held-out "))
        return json.loads(line.removeprefix("[eval] held-out "))

    def split(seed):
        judge = Trainer(store, TrainConfig(ttt_steps=3, eval_frac=0.2, seed=seed), head=str(other))
        return json.loads(json.dumps(judge.evaluate()))

    assert printed([]) == split(7)
    assert printed(["--seed", "0"]) == split(0) != split(7)


def test_training_can_grow_an_exported_heads_vocabulary(target, dataset, trained):
    """`train --init-head HEAD --draft-vocab-size N` with N above the head's size: the head's ids keep their trained
    rows, the added ids are the most frequent training outputs the head lacked, each starting from the target's
    output embedding row as a fresh head's does; the rest of the head is unchanged. A smaller N is refused."""
    samples, store = dataset
    tr, head, _, _ = trained
    grown = Trainer(store, dataclasses.replace(tr.tc, draft_vocab_size=96, max_steps=2), head=head)
    assert grown.tc.draft_vocab_size == grown.cfg.draft_vocab_size == 96
    assert np.isin(tr.draft_ids, grown.draft_ids).all()
    rows = np.concatenate([np.arange(store.offsets[s], store.offsets[s] + store.lengths[s]) for s in grown.train_ids])
    counts = token_counts(store.tokens[rows], store.is_output[rows], V)
    added = np.setdiff1d(grown.draft_ids, tr.draft_ids)
    others = np.setdiff1d(np.arange(V), tr.draft_ids)
    assert counts[added].min() >= counts[np.setdiff1d(others, added)].max()  # the most frequent ones were added
    assert coverage(counts, grown.t2d) > coverage(counts, tr.t2d)
    lm_head, old = np.asarray(grown.params.lm_head), np.asarray(tr.params.lm_head)
    at = np.searchsorted(grown.draft_ids, tr.draft_ids)
    np.testing.assert_array_equal(lm_head[:, at], old)
    out_embed = np.asarray(load_checkpoint(target).tensors["lm_head.weight"], np.float32)
    np.testing.assert_allclose(lm_head[:, np.searchsorted(grown.draft_ids, added)], out_embed[added].T, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(grown.params.fc), np.asarray(tr.params.fc))
    assert np.isfinite(grown.train()[-1]["loss"])
    with pytest.raises(ValueError, match="smaller than head"):
        Trainer(store, dataclasses.replace(tr.tc, draft_vocab_size=32), head=head)


SERVE_KW = dict(max_num_batched_tokens=64, token_buckets=(8, 64), page_size=4, max_model_len=128, precompile=False)


def test_shipped_head_is_what_eagle3_without_a_model_drafts_with(target, dataset, trained, plain_llm, tmp_path,
                                                                 monkeypatch):
    """`ship` writes the head in bfloat16 with a card that records the run and its served acceptance; with the head
    registered for its target, `{"method": "eagle3"}` without a `model` drafts with it, losslessly, at the card's
    acceptance; a target without a shipped head is refused, naming the field."""
    from jaxserve.spec_decode import heads
    from training.eagle3.ship import served_acceptance, ship, speculating_llm

    samples, store = dataset
    tr, head, _, log = trained
    prompts = [samples[i]["prompt_token_ids"] for i in range(6)]
    out = str(tmp_path / "shipped")
    card = ship(head, out, features=store.path, served=dict(max_tokens=20, max_num_seqs=4), prompts=prompts,
                **SERVE_KW)
    assert card["held_out"]["tau"] == pytest.approx(tr.evaluate()["tau"], abs=0.05)  # bfloat16 barely moves it
    assert card["target"] == target and card["dtype"] == "bfloat16"
    assert card["training"]["steps"] == log[-1]["step"] == 60 and card["training"]["train_seconds"] > 0
    assert card["training"]["train_samples"] == len(tr.train_ids)
    served = card["served"]
    assert served["num_prompts"] == 6 and served["num_draft_tokens"] > 0 and served["num_accepted_tokens"] > 0
    assert "acceptance per draft position" in open(os.path.join(out, "README.md")).read()

    cfg, w = load_eagle3(out, load_checkpoint(target).config, np.float32)
    params = jax.device_get(tr.params)
    for f in ("fc", "wq", "w_down", "lm_head", "final_norm"):  # the trained weights, rounded to bfloat16
        want = np.asarray(getattr(params, f)).astype(jnp.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(getattr(w, f), want, err_msg=f)
    assert (w.d2t == tr.d2t).all()

    monkeypatch.setattr(heads, "HEADS", {target: out})
    llm = LLM(target, max_num_seqs=4, **SERVE_KW,
              speculative_config={"method": "eagle3", "num_speculative_tokens": 3, "adaptive": False})
    assert llm.llm_engine.config.speculative_config.model == out
    again, got = served_acceptance(llm, prompts, 20)
    assert again == {k: served[k] for k in again}  # the card's acceptance, measured again
    sp = SamplingParams(temperature=0, max_tokens=20)
    assert got == [o.outputs[0].token_ids for o in plain_llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                                      use_tqdm=False)]
    # the same measurement through the helper the shipped-head test uses
    assert served_acceptance(speculating_llm(target, out, 3, 4, **SERVE_KW), prompts, 20)[0] == again

    monkeypatch.setattr(heads, "HEADS", {})
    with pytest.raises(ValueError, match="speculative_config.model .* is required for target"):
        LLM(target, max_num_seqs=4, **SERVE_KW, speculative_config={"method": "eagle3", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="speculative_config.model .* is required for method 'draft_model'"):
        LLM(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 3})


def test_heldout_features_replay_the_served_measurement(target, dataset, trained, tmp_path):
    """`heldout` answers the served prompts greedily and writes their features; `eval`'s walk over them (with the
    served budget) gives the acceptance serving those prompts with the head measures, and `ship --heldout` records
    that walk in the card."""
    from training.eagle3.ship import SERVED, served_acceptance, served_features, ship, speculating_llm

    samples, _ = dataset
    tr, head, _, _ = trained
    prompts = [samples[i]["prompt_token_ids"] for i in range(6)]
    path = str(tmp_path / "heldout")
    kw = SERVE_KW | dict(max_model_len=160)  # room for the served budget (128) after each prompt
    served_features(path, 6, target, prompts=prompts, features_kw=dict(aux_layer_ids=AUX, max_len=160,
                                                                        len_buckets=(64, 160)), **kw)
    replies = [json.loads(line) for line in open(os.path.join(path, "replies.jsonl"))]
    assert [r["prompt_token_ids"] for r in replies] == prompts
    store = FeatureStore.open(path)
    walker = Trainer(store, dataclasses.replace(tr.tc, eval_frac=0.0, len_buckets=(64, 160), win_buckets=(64,)),
                     head=head)
    walked = walker.evaluate(ids=np.arange(store.num_samples), max_tokens=SERVED["max_tokens"])["served_walk"]
    llm = speculating_llm(target, head, 3, SERVED["max_num_seqs"], quantization=SERVED["quantization"], **kw)
    served, got = served_acceptance(llm, prompts, SERVED["max_tokens"])
    assert got == [r["output_token_ids"] for r in replies]
    assert served["num_accepted_tokens"] > 0
    assert {k: served[k] for k in ("num_draft_tokens", "num_accepted_tokens")} == \
        {k: walked[k] for k in ("num_draft_tokens", "num_accepted_tokens")}
    assert served["acceptance_rate_per_position"] == pytest.approx(walked["acceptance_rate_per_position"], abs=1e-4)

    # `ship --heldout` records the walk in the card, beside serving the prompts. The shipped head is bfloat16, which
    # serving multiplies on the bf16 kernel and the walk in float32: a near-tie draft may flip, no more.
    out = str(tmp_path / "shipped")
    card = ship(head, out, heldout=path, prompts=prompts, **kw)
    w, s = card["walked"], card["served"]
    assert w["num_prompts"] == 6 and w["max_tokens"] == SERVED["max_tokens"] and w["num_speculative_tokens"] == 3
    for k in ("num_draft_tokens", "num_accepted_tokens"):
        assert w[k] == pytest.approx(s[k], rel=0.01) and w[k] == pytest.approx(walked[k], rel=0.01)
    assert w["acceptance_rate_per_position"] == pytest.approx(s["acceptance_rate_per_position"], abs=0.01)
    assert "walked over more held-out replies" in open(os.path.join(out, "README.md")).read()


def test_exported_head_names_its_verifier(tmp_path):
    """An exported head names its target as the hub id for the embedded default model (not a site-packages path),
    else as the path it was trained against."""
    from jaxserve.loader.gguf import DEFAULT_MODEL_ID, default_model_path, model_id

    assert model_id(default_model_path()) == model_id(None) == DEFAULT_MODEL_ID
    assert model_id(str(tmp_path)) == str(tmp_path)
    assert model_id("no/such/model") == "no/such/model"


# ---- runs spread over several processes ------------------------------------------------------------------------------

# 100 steps of ~10 batches per epoch: a run stopped at 50 resumes on an epoch boundary, one stopped at 23 inside an
# epoch. Records at 7, 14, .., 98, 100: the stats of record 56 straddle a restart at 50 (and of 28, one at 23).
RESUME = dict(max_steps=100, log_every=7)


def _leaves(params) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def _records(log) -> list[dict]:
    """The logged records less their timing, which differs between runs; everything else is computed."""
    return [{k: v for k, v in r.items() if k != "sec_per_step"} for r in log]


@pytest.fixture(scope="module")
def one_run(dataset):
    """100 steps in one go: what every run split over several processes must reproduce exactly."""
    tr = _trainer(dataset[1], **RESUME)
    log = tr.train()
    assert tr.stop_signal is None and len(log) == 15
    return _records(log), _leaves(tr.params)


@pytest.fixture(scope="module")
def stopped_at_50(dataset, tmp_path_factory):
    """A run told to stop after 50 of its 100 steps, checkpointing every 20 steps and keeping 2 checkpoints."""
    out = str(tmp_path_factory.mktemp("resume") / "run")
    tr = _trainer(dataset[1], **RESUME, save_every=20, keep_checkpoints=2)
    log = tr.train(out, stop_after=50)
    return out, _records(log)


def _assert_equals_one_run(tr, log, one_run):
    ref_log, ref_params = one_run
    assert _records(log) == ref_log
    for got, want in zip(_leaves(tr.params), ref_params, strict=True):
        assert np.array_equal(got, want)


def test_two_runs_equal_one_run(dataset, one_run, stopped_at_50, tmp_path):
    """50 steps, then a new trainer that restores the checkpoint from disk and runs the other 50 == 100 steps in one
    go: every parameter bit and every logged record, the earlier run's included."""
    src, first_log = stopped_at_50
    assert first_log == one_run[0][:7]  # records 7 .. 49
    assert sorted(os.listdir(os.path.join(src, "checkpoints")), key=int) == ["40", "50"]  # 20: pruned (keep 2)
    assert {"step-20", "step-40"} <= set(os.listdir(src))  # a head per periodic checkpoint
    assert not os.path.exists(os.path.join(src, "config.json"))  # a stopped run exports no final head
    out = str(tmp_path / "run")
    shutil.copytree(src, out)
    tr = _trainer(dataset[1], **RESUME)
    log = tr.train(out, resume=True)
    _assert_equals_one_run(tr, log, one_run)
    assert tr.stop_signal is None and os.path.exists(os.path.join(out, "config.json"))


def test_sigterm_checkpoints_the_step_and_resume_finishes_the_run(dataset, one_run, tmp_path, monkeypatch):
    """SIGTERM arriving during step 23 (while its batch is assembled): the step completes, step 23 is checkpointed,
    train returns without exporting and puts the old handler back; a new trainer resumes and finishes the run exactly
    as one go does."""
    out = str(tmp_path / "run")
    tr = _trainer(dataset[1], **RESUME)
    batches, assemble_batch = itertools.count(1), tr._batch

    def batch_then_sigterm(plan):
        if next(batches) == 23:
            os.kill(os.getpid(), signal.SIGTERM)
        return assemble_batch(plan)

    monkeypatch.setattr(tr, "_batch", batch_then_sigterm)
    handler = signal.getsignal(signal.SIGTERM)
    log = tr.train(out)
    assert tr.stop_signal == signal.SIGTERM and signal.getsignal(signal.SIGTERM) is handler
    assert _records(log) == one_run[0][:3]  # records 7, 14, 21
    assert os.listdir(os.path.join(out, "checkpoints")) == ["23"]
    assert not os.path.exists(os.path.join(out, "config.json"))
    tr = _trainer(dataset[1], **RESUME)
    log = tr.train(out, resume=True)
    _assert_equals_one_run(tr, log, one_run)


def test_a_second_signal_acts_as_before():
    """The first SIGINT only asks for a stop; the handler is then put back, so a second one interrupts at once.
    Python's own SIGINT handler is installed first: a pytest-xdist worker ignores SIGINT, which would leave nothing
    for the second signal to do."""
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopRequests() as stop:
            assert not stop.requested()
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.requested() and stop.signum == signal.SIGINT
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


def test_resume_refuses_another_run(dataset, stopped_at_50, tmp_path):
    """A resume whose settings change what a step computes is refused naming the setting, before anything is
    written; so are --resume with nothing to resume and a fresh run over a run's checkpoints."""
    src, _ = stopped_at_50
    store = dataset[1]
    with pytest.raises(ValueError, match=r"cannot resume from .*\(step 50\): it belongs to a different run "
                                         r"\(lr: 0.003 there, 0.002 here; max_steps: 100 there, 120 here\)"):
        _trainer(store, **RESUME | dict(lr=2e-3, max_steps=120)).train(src, resume=True)
    with pytest.raises(ValueError, match=r"holds a run's checkpoints \(up to step 50\): pass --resume"):
        _trainer(store, **RESUME).train(src)
    with pytest.raises(ValueError, match="resume: no checkpoint in"):
        _trainer(store, **RESUME).train(str(tmp_path / "empty"), resume=True)
    assert sorted(os.listdir(os.path.join(src, "checkpoints")), key=int) == ["40", "50"]


def test_resume_of_a_checkpoint_older_than_a_setting():
    """A checkpoint written before a TrainConfig field existed ran with that field's default: a resume with the
    default goes on, one with another value is refused naming the field."""
    from training.eagle3.checkpoint import check_same_run, run_identity

    ids = np.arange(8)
    current = lambda **kw: run_identity(dataclasses.asdict(TrainConfig(**kw)), {"n": 1}, ids)  # noqa: E731
    saved = current()
    del saved["config"]["loss"]
    defaults = dataclasses.asdict(TrainConfig())
    check_same_run(saved, current(), "old", defaults=defaults)
    with pytest.raises(ValueError, match=r"loss: 'kl' there, 'ce' here"):
        check_same_run(saved, current(loss="ce"), "old", defaults=defaults)
    with pytest.raises(ValueError, match=r"loss: None there, 'kl' here"):
        check_same_run(saved, current(), "old")


def test_features_resume_where_a_run_stopped(target, dataset, tmp_path, monkeypatch):
    """Extraction that dies after its first 10 or so samples resumes with the next one and ends byte-equal to one
    uninterrupted extraction; a complete directory is returned as it is; another sample set is refused, not
    overwritten."""
    samples, store = dataset
    tf = TargetFeatures(target, aux_layer_ids=AUX, max_len=64, len_buckets=(32, 64))
    run_target, calls = TargetFeatures.__call__, []

    def dies_after_10(self, seqs):  # calls: one entry per sample a step computed
        if len(calls) >= 10:
            raise RuntimeError("killed")
        calls.extend(len(t) for t in seqs)
        return run_target(self, seqs)

    path = str(tmp_path / "feats")
    monkeypatch.setattr(TargetFeatures, "__call__", dies_after_10)
    with pytest.raises(RuntimeError, match="killed"):
        extract(samples, tf, path, log_every=0)
    assert not os.path.exists(os.path.join(path, "meta.json"))
    with pytest.raises(FileNotFoundError, match="run `python -m training.eagle3 features` first"):
        FeatureStore.open(path)  # a partial directory is not mistaken for features

    def counts(self, seqs):
        calls.extend(len(t) for t in seqs)
        return run_target(self, seqs)

    monkeypatch.setattr(TargetFeatures, "__call__", counts)
    first, calls[:] = len(calls), []
    meta = extract(samples, tf, path, log_every=0)
    assert len(calls) == len(samples) - first  # only the samples the first run did not finish
    got = FeatureStore.open(path)
    assert meta == got.meta == store.meta and not os.path.exists(os.path.join(path, "progress.json"))
    for f in dataclasses.fields(FeatureStore):
        if f.name not in ("meta", "path"):
            assert np.array_equal(getattr(got, f.name), getattr(store, f.name)), f.name
    calls.clear()
    assert extract(samples, tf, path, log_every=0) == meta and calls == []
    with pytest.raises(ValueError, match="holds features of other samples or another target"):
        extract(samples[:5], tf, path, log_every=0)


def test_regenerate_resume_cuts_a_torn_last_line(tmp_path):
    """A run killed in the middle of writing a reply leaves half a line; the next run must cut it off before it
    appends, or its first reply would join that half and neither would parse."""
    path = tmp_path / "replies.jsonl"
    path.write_text('{"index": 3, "output_token_ids": [1]}\n{"index": 0, "output_token_ids": [2]}\n{"index": 5, "ou')
    assert completed(str(path)) == {0, 3}
    assert path.read_text().endswith("[2]}\n")
    assert completed(str(tmp_path / "absent.jsonl")) == set()
