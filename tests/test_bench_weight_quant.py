"""`python -m bench quant` (bench/weight_quant.py) and `bench latency --schemes` (bench/decode_schemes.py): the
perplexity, agreement and noise arithmetic against hand computations, the weight-byte count, the goal column, and
the quick run end to end on a tiny checkpoint, checked against HF transformers' own logits."""

from __future__ import annotations

import argparse
import math
import types

import numpy as np
import pytest

from bench import decode_schemes
from bench import weight_quant as wq

LN = math.log


def test_reply_scores_is_log_softmax_at_the_target_and_argmax():
    logits = np.array([[0.0, LN(3), 0.0 - 50], [LN(2), 0.0, 0.0]], np.float32)
    nll, top1 = wq.reply_scores(logits, np.array([1, 2]))
    # row 0: p = [1, 3, ~0] / 4 -> -log(3/4); row 1: p = [2, 1, 1] / 4 -> -log(1/4)
    np.testing.assert_allclose(nll, [LN(4 / 3), LN(4)], rtol=1e-6)
    assert nll.dtype == np.float64 and top1.tolist() == [1, 0]
    # large logits: max-subtracted, no overflow
    big, _ = wq.reply_scores(np.array([[1000.0, 1000.0]]), np.array([0]))
    np.testing.assert_allclose(big, [LN(2)])


def test_perplexity_pools_tokens_over_samples():
    # 3 tokens at p = 1/2 and 1 at p = 1/8: mean NLL = (3 ln 2 + 3 ln 2) / 4 -> ppl 2 ** 1.5, not the mean of the
    # per-sample ppls (2 and 8 -> 5) nor their geometric mean (4)
    nll = [np.full(3, LN(2)), np.array([LN(8)])]
    assert wq.perplexity(nll) == pytest.approx(2**1.5)


def test_agreement_counts_positions_over_all_samples():
    a = [np.array([1, 2, 3]), np.array([4])]
    b = [np.array([1, 0, 3]), np.array([5])]
    assert wq.agreement(a, b) == pytest.approx(2 / 4)
    assert wq.agreement(a, a) == 1.0


def test_excess_rise_point_value_and_interval():
    rng = np.random.default_rng(0)
    lens = [5, 9, 3, 7]
    ref = [rng.uniform(1, 3, n) for n in lens]
    peer_ref = [rng.uniform(1, 3, n) for n in lens]
    nll = {"ours": [x + 0.10 for x in ref], "ref": ref, "peer": [x + 0.02 for x in peer_ref], "peer_ref": peer_ref}
    c = wq.excess_rise(nll, ("ours", "ref", "peer", "peer_ref"), num_boot=200)
    # every token rose by exactly 0.10 vs 0.02: the excess is 0.08 in every resample
    assert c["excess_nll"] == pytest.approx(0.08)
    assert c["ci95"] == pytest.approx([0.08, 0.08])
    # a rise that differs per sample but is 0 pooled over tokens: point value 0, an interval around it (not flagged)
    lens = rng.integers(3, 12, 40)
    ref = [rng.uniform(1, 3, n) for n in lens]
    shift = rng.normal(0, 0.3, len(lens))
    shift -= (shift * lens).sum() / lens.sum()
    nll = {"ours": [x + d for x, d in zip(ref, shift)], "ref": ref, "peer": ref, "peer_ref": ref}
    c = wq.excess_rise(nll, ("ours", "ref", "peer", "peer_ref"), num_boot=500)
    assert c["excess_nll"] == pytest.approx(0, abs=1e-12)
    assert c["ci95"][0] < -0.01 and c["ci95"][1] > 0.01


def test_streamed_weights_counts_linear_maps_and_the_logits_projection():
    def layer():
        return types.SimpleNamespace(**{f: np.zeros((4, 8), np.float32) for f in wq.LINEAR_FIELDS})

    q = types.SimpleNamespace(nbytes=100, shape=(64, 10), bits=4, group=32)  # a QuantizedLinear stand-in
    w = types.SimpleNamespace(layers=(layer(), layer()), lm_head=None, embed=np.zeros((10, 4), np.float16))
    nbytes, params, forms = wq.streamed_weights(w)
    assert (nbytes, params) == (2 * 7 * 32 * 4 + 40 * 2, 2 * 7 * 32 + 40)  # tied: the embedding is the lm_head
    assert forms == "float32 x 14, float16 x 1"
    w.lm_head = q
    nbytes, params, forms = wq.streamed_weights(w)
    assert (nbytes, params) == (2 * 7 * 32 * 4 + 100, 2 * 7 * 32 + 640) and forms.endswith("int4 g32 x 1")


def test_goal_column():
    row = dict(scheme="int8", batch=1, ratio=1.2, pct_roofline=85.0)
    assert decode_schemes.goal_check(row) == "yes"
    assert decode_schemes.goal_check({**row, "ratio": 0.9}) == "no (0.90x < 1.0x)"
    assert decode_schemes.goal_check({**row, "pct_roofline": 50.0}) == "no (50% < 80% roofline)"
    assert decode_schemes.goal_check({**row, "batch": 16, "ratio": 1.4, "pct_roofline": 10.0}) == "no (1.40x < 1.5x)"
    assert decode_schemes.goal_check({**row, "batch": 16, "ratio": 1.6}) == "yes"
    assert decode_schemes.goal_check({**row, "scheme": "none", "batch": 16}) == "–"  # float32 has no llama.cpp width
    assert decode_schemes.goal_check({**row, "ratio": None}) == "yes"  # no peer ran: only the roofline goal


def test_schemes_report_names_the_kv_cache():
    """`bench latency --schemes ... --kv-cache-dtype bfloat16`: the option reaches the run's arguments, and the
    table says which KV cache jaxserve read."""
    ap = argparse.ArgumentParser()
    from bench import decode

    decode.add_args(ap)
    args = ap.parse_args(["--schemes", "int8", "--kv-cache-dtype", "bfloat16", "--batches", "16"])
    assert args.kv_cache_dtype == "bfloat16"
    w = dict(bytes=100e6, bits_per_weight=8.5, stored_as="int8 g32 x 211", kv_dtype="bfloat16",
             kv_bytes_per_token=23040, f16_kv_bytes_per_token=23040)
    row = dict(scheme="int8", batch=16, peer="Q8_0", jaxserve_tok_s=dict(median=300.0, min=290.0, max=310.0),
               llamacpp_tok_s=dict(median=200.0, min=190.0, max=210.0), ratio=1.5, roofline_tok_s=1000.0,
               pct_roofline=30.0, llamacpp_pct_roofline=25.0, goal="yes")
    env = dict(backend="cpu", cpu="x", cpu_count=2, other_processes_cores=0.0, loadavg_before=[0, 0, 0],
               loadavg_after=[0, 0, 0], steal_pct=0.0, git="abc", python="3.11", versions={}, date="today")
    rec = dict(args=vars(args) | dict(reps=3), env=env, weights={"int8": w},
               gguf={"Q8_0": dict(file="q8.gguf", types={"Q8_0": 211}, bytes=140e6)}, results=[row], skipped={},
               copy_bandwidth_Bps={"median": 25e9, "min": 24e9, "max": 26e9}, command="python -m bench latency")
    md = decode_schemes.report_schemes(rec)
    assert "jaxserve's KV cache: bfloat16 (kv_cache_dtype=bfloat16)" in md
    assert "| int8 | int8 g32 x 211 | 8.50 | 16 |" in md


def test_roofline_counts_weights_once_and_each_sequences_kv():
    # 1 GB/s over 1 MB of weights + 16 sequences x 100 tokens x 1 kB of KV = 2.6 MB per step
    assert decode_schemes.roofline_steps(1e9, 1e6, 1e3, 16, 100) == pytest.approx(1e9 / 2.6e6)
    assert decode_schemes.roofline_steps(1e9, 1e6, 0, 16, 100) == pytest.approx(1e3)


def test_quick_run_on_a_tiny_model_matches_hf(tmp_path):
    torch = pytest.importorskip("torch")
    from tiny_models import make_tiny_model

    path = str(tmp_path / "tiny")
    hf = make_tiny_model("llama_gqa", path)
    ap = argparse.ArgumentParser()
    wq.add_args(ap)
    args = ap.parse_args(["--quick", "--num-samples", "4", "--model", path, "--peers", "--schemes", "none", "int8",
                          "--out-dir", str(tmp_path / "out")])
    rec = wq.run(args)
    rows = rec["rows"]
    assert set(rows) == {"none", "int8"} and rec["num_samples"] == 4
    assert "| int8 | 8." in (tmp_path / "out" / "weight_quant.md").read_text()  # the row, with its bits/weight

    # the same samples through HF: the "none" row's ppl is HF's float32 ppl over the reply tokens
    samples = wq.random_samples(300, 4, args.max_user_tokens, args.max_reply_tokens, args.seed)
    nll = []
    with torch.no_grad():
        for s in samples:
            logits = hf(torch.tensor([s.token_ids])).logits[0].numpy()
            nll.append(wq.reply_scores(logits[s.num_context - 1:-1], np.array(s.reply))[0])
    assert rows["none"]["ppl"] == pytest.approx(wq.perplexity(nll), rel=1e-4)
    assert rows["none"]["top1_vs_float32"] == 1.0 and rows["none"]["ppl_rise_pct"] == 0.0
    assert 0.5 < rows["int8"]["top1_vs_float32"] <= 1.0
    assert sum(rec["per_sample"]["int8"]["num_tokens"]) == rec["num_scored_tokens"] == 4 * args.max_reply_tokens


def test_num_layers_refuses_what_it_cannot_run():
    """`bench latency --schemes ... --num-layers N`: N below 1, or a gguf scheme (the deep model has no GGUF file),
    is a clear error before anything is built."""
    args = argparse.Namespace(schemes=["int8"], num_layers=0)
    with pytest.raises(ValueError, match="--num-layers must be at least 1, got 0"):
        decode_schemes.run_schemes(args)
    args = argparse.Namespace(schemes=["int8", "gguf:Q8_0"], num_layers=4)
    with pytest.raises(ValueError, match=r"--num-layers: \['gguf:Q8_0'\] need a GGUF file"):
        decode_schemes.run_schemes(args)
