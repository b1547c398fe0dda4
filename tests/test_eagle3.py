"""EAGLE-3: the head's forward against an independent torch re-implementation, both checkpoint formats (speculators
and HF `LlamaForCausalLMEagle3`) with a non-trivial d2t, the layer-id convention, and greedy output with EAGLE-3
speculation equal to greedy output without it (mixed K per request, preemption, aborts leaking no pages).

Heads are random (written here with safetensors, nothing downloaded), so they accept little; one head is rigged
(zero lm_head: it always drafts the same token) so that accepted drafts, and the catch-up over them, happen too.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from jaxserve import LLM, SamplingParams, ops
from jaxserve.batch import ScheduledSeq, build_step_inputs, choose_bucket
from jaxserve.config import SpeculativeConfig
from jaxserve.kv_cache import init_kv_cache
from jaxserve.loader import load_checkpoint
from jaxserve.loader.eagle3 import load_eagle3, read_eagle3_config
from jaxserve.loader.weights import to_weights
from jaxserve.model.eagle3 import draft_logits, eagle3_forward, greedy_target_ids, store_head
from jaxserve.model.llama import forward
from jaxserve.quant import QuantizedLinear, quantize_int8

V, D, F, NH, NKV, L = 300, 64, 160, 4, 2, 5
HD = D // NH
AUX_IDS = [1, 3, 5]  # input convention (5 == L: the final pre-norm output)
LAYER_CFG = dict(
    model_type="llama", vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=1,
    num_attention_heads=NH, num_key_value_heads=NKV, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=512, hidden_act="silu", tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random 5-layer Llama (so three distinct layers can be captured)."""
    import transformers

    path = str(tmp_path_factory.mktemp("eagle_target"))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**(LAYER_CFG | dict(num_hidden_layers=L, initializer_range=0.1, bos_token_id=1,
                                                       eos_token_id=2)))
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(path)
    return path, model


def _vocab(rng, vd, first=None):
    """Sorted random draft vocabulary -> (d2t offsets, t2d mask); `first`: draft id 0 maps to it (then unsorted)."""
    if first is None:
        ids = np.sort(rng.choice(V, vd, replace=False)).astype(np.int64)
    else:
        ids = np.concatenate([[first], rng.choice(np.setdiff1d(np.arange(V), [first]), vd - 1, replace=False)])
    t2d = np.zeros(V, bool)
    t2d[ids] = True
    return ids - np.arange(vd), t2d


def make_eagle_pair(tmp: str, summarize_plain):
    """A 5-layer random Llama target (the head's aux layers 1, 3 and 5 span it) and a head that always drafts the
    target's commonest greedy token, so drafts get accepted: (target dir, head dir, summarize_plain(target dir)),
    where `summarize_plain` runs the target without speculation and returns a dict with "tokens"."""
    import transformers

    torch.manual_seed(0)
    target = os.path.join(tmp, "eagle_target")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**(LAYER_CFG | dict(
        num_hidden_layers=5, initializer_range=0.1, bos_token_id=1, eos_token_id=2)))).float().eval().save_pretrained(
        target)
    plain = summarize_plain(target)
    counts = np.bincount([t for r in plain["tokens"] for t in r], minlength=V)
    head = os.path.join(tmp, "head")
    make_head(head, "hf", seed=7, zero_lm_head=True, first=int(np.argmax(counts)))
    return target, head, plain


def make_head(path, fmt="speculators", seed=0, vd=40, zero_lm_head=False, first=None, **flags):
    """Write a random EAGLE-3 head (draft vocab `vd` < V, sorted random ids -> non-trivial d2t) in `fmt`."""
    rng = np.random.default_rng(seed)
    r = lambda *s: (0.15 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    norm = lambda n: (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    d2t, t2d = _vocab(rng, vd, first)
    lay = "layers.0." if fmt == "speculators" else "midlayer."
    w = {
        "fc.weight": r(D, 3 * D),
        lay + "input_layernorm.weight": norm(D),
        lay + "hidden_norm.weight": norm(D),
        lay + "self_attn.q_proj.weight": r(NH * HD, 2 * D),
        lay + "self_attn.k_proj.weight": r(NKV * HD, 2 * D),
        lay + "self_attn.v_proj.weight": r(NKV * HD, 2 * D),
        lay + "self_attn.o_proj.weight": r(D, NH * HD),
        lay + "post_attention_layernorm.weight": norm(D),
        lay + "mlp.gate_proj.weight": r(F, D),
        lay + "mlp.up_proj.weight": r(F, D),
        lay + "mlp.down_proj.weight": r(D, F),
        "norm.weight": norm(D),
        "lm_head.weight": np.zeros((vd, D), np.float32) if zero_lm_head else r(vd, D),
        "d2t": d2t,
        "t2d": t2d,
    }
    if flags.get("norm_before_fc"):
        w["input_norm.weight"] = norm(3 * D)
    if flags.get("fc_norm"):
        w["fc_norm.weight"] = norm(3 * D).reshape(3, D)
    if fmt == "speculators":
        cfg = dict(
            speculators_model_type="eagle3", architectures=["Eagle3Speculator"], transformer_layer_config=LAYER_CFG,
            draft_vocab_size=vd, eagle_aux_hidden_state_layer_ids=AUX_IDS,
            speculators_config={"algorithm": "eagle3",
                                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]},
        ) | flags
    else:  # EAGLE / SpecForge: output-index layer ids
        cfg = LAYER_CFG | dict(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=vd,
                               eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in AUX_IDS]}) | flags
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(w, os.path.join(path, "model.safetensors"))
    return w


# ---- independent reference: the EAGLE-3 layer in torch ops -------------------------------------------------------


def _t(a):
    return torch.from_numpy(np.asarray(a, np.float32))


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos):  # x [T, heads, HD], HF rotate-half
    inv = 1.0 / (10000.0 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    ang = (pos[:, None].double() * inv[None]).float()
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : HD // 2], x[..., HD // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def torch_eagle3(w, feats, tokens, embed, lay, flags, extra_hidden=None, return_k=False):
    """One causal pass over a single sequence at positions 0..T-1 -> (next hidden, draft-vocab logits). The first
    rows are fed fused target features, `extra_hidden` rows (draft steps) the head's own earlier output."""
    x = _t(feats)
    if flags.get("norm_before_fc"):
        x = _rms(x, _t(w["input_norm.weight"]))
    if flags.get("fc_norm"):
        x = _rms(x.reshape(-1, 3, D), _t(w["fc_norm.weight"])).reshape(-1, 3 * D)
    h = x @ _t(w["fc.weight"]).T
    if extra_hidden is not None:
        h = torch.cat([h, extra_hidden])
    T = h.shape[0]
    hn = _rms(h, _t(w[lay + "hidden_norm.weight"]))
    e = _rms(_t(embed)[torch.as_tensor(tokens)], _t(w[lay + "input_layernorm.weight"]))
    x = torch.cat([e, hn], -1)
    res = hn if flags.get("norm_before_residual") else h
    pos = torch.arange(T)
    q = _rope((x @ _t(w[lay + "self_attn.q_proj.weight"]).T).reshape(T, NH, HD), pos)
    k = _rope((x @ _t(w[lay + "self_attn.k_proj.weight"]).T).reshape(T, NKV, HD), pos)
    v = (x @ _t(w[lay + "self_attn.v_proj.weight"]).T).reshape(T, NKV, HD)
    keys = k
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                         is_causal=True)
    h1 = res + o.transpose(0, 1).reshape(T, D) @ _t(w[lay + "self_attn.o_proj.weight"]).T
    m = _rms(h1, _t(w[lay + "post_attention_layernorm.weight"]))
    act = (torch.nn.functional.silu(m @ _t(w[lay + "mlp.gate_proj.weight"]).T)
           * (m @ _t(w[lay + "mlp.up_proj.weight"]).T))
    out = h1 + act @ _t(w[lay + "mlp.down_proj.weight"]).T
    normed = _rms(out, _t(w["norm.weight"]))
    if return_k:
        return keys  # [T, NKV, HD] after RoPE: what the head's KV cache must hold
    return (normed if flags.get("norm_output") else out), normed @ _t(w["lm_head.weight"]).T


FLAG_SETS = [
    {},
    dict(norm_before_residual=True, norm_before_fc=True),
    dict(fc_norm=True, norm_output=True),
]


@pytest.mark.parametrize("flags", FLAG_SETS, ids=["plain", "norm_before_fc+residual", "fc_norm+norm_output"])
@pytest.mark.parametrize("fmt", ["speculators", "hf"])
@pytest.mark.parametrize("packed", [None, "f32", "bf16", "int8", "int8-xla"])
def test_head_forward_matches_torch_reference(target, tmp_path, fmt, flags, packed):
    """The head's forward (draft and catch-up passes) against torch ops; `packed`: its linear maps stored as the
    engine serves them (`store_head`): packed for the native CPU matmul from float32 values or from bfloat16 ones
    (a head exported in bfloat16), which it stores in bfloat16, or quantized to int8 (a scale per output channel)
    for the native kernel or for XLA's dot ("int8-xla")."""
    if packed in ("f32", "bf16", "int8") and not ops.native_matmul_available():
        pytest.skip("the native CPU matmul library is not available")
    tpath, _ = target
    tcfg = load_checkpoint(tpath).config
    w = make_head(str(tmp_path), fmt, seed=3, **flags)
    if packed == "bf16":  # values a bfloat16 export holds, stored as float32 (as the shipped one loads)
        w = {k: v.astype(jnp.bfloat16).astype(np.float32) if v.dtype == np.float32 else v for k, v in w.items()}
        save_file(w, os.path.join(tmp_path, "model.safetensors"))
    cfg, hw = load_eagle3(str(tmp_path), tcfg, np.float32)
    assert cfg.aux_layer_ids == tuple(AUX_IDS) and cfg.draft_vocab_size == 40
    loaded = hw
    if packed == "int8-xla":
        hw = store_head(hw, "int8", "xla")
        maps = [hw.fc, hw.wq, hw.wk, hw.wv, hw.wo, hw.w_gate, hw.w_up, hw.w_down, hw.lm_head]
        assert all(isinstance(m, QuantizedLinear) and m.bits == 8 and m.kernel == "xla" for m in maps)
    elif packed:
        hw = store_head(hw, "int8" if packed == "int8" else "none")
        maps = [hw.fc, hw.wq.w, hw.wo, hw.w_gate.w, hw.w_down, hw.lm_head]  # q/k/v and gate/up fused
        assert {m.format for m in maps} == {packed}
    # the bfloat16 kernel rounds the activations to bfloat16 as well (one rounding per product input)
    tol = dict(rtol=3e-2, atol=1e-1) if packed == "bf16" else dict(rtol=1e-4, atol=1e-4)
    rng = np.random.default_rng(1)
    embed = rng.standard_normal((V, D)).astype(np.float32)
    T, ps = 11, 4
    feats = rng.standard_normal((T, 3 * D)).astype(np.float32)
    tokens = rng.integers(0, V, T + 1).tolist()
    lay = "layers.0." if fmt == "speculators" else "midlayer."
    pages = [3, 1, 4, 2]  # deliberately out of order
    fwd = jax.jit(eagle3_forward, static_argnums=0, static_argnames="from_target")

    def run(hw):
        """Pass 1: T target features in one prefill; pass 2: one draft step at position T fed the head's own
        hidden state from position T - 1. -> (hidden, logits) of pass 1's T rows and of pass 2's row."""
        kv = init_kv_cache(cfg.layer, 6, ps, jnp.float32)
        b = choose_bucket(T, len(pages), (16,), (4,), 4)
        jin = jax.tree.map(jnp.asarray, build_step_inputs([ScheduledSeq(tokens[:T], 0, pages)], b, ps))
        h, normed, kv = fwd(cfg, hw, jnp.asarray(embed), kv, jin,
                            jnp.asarray(np.pad(feats, ((0, 16 - T), (0, 0)))), from_target=True)
        b1 = choose_bucket(1, len(pages), (1,), (4,), 4)
        jin = jax.tree.map(jnp.asarray, build_step_inputs([ScheduledSeq([tokens[T]], T, pages)], b1, ps))
        h2, normed2, kv = fwd(cfg, hw, jnp.asarray(embed), kv, jin, h[T - 1 : T], from_target=False)
        return [np.asarray(x) for x in (h[:T], draft_logits(hw, normed[:T]), h2[0], draft_logits(hw, normed2)[0])]

    got = run(hw)
    if packed == "int8":
        # the native int8 kernel rounds the activations to int8 per 32 inputs: its reference is XLA's dot of the same
        # maps after the same rounding ("xla-q8", the target's own reference path)
        want = run(store_head(loaded, "int8", "xla-q8"))
    else:
        ref_w = w
        if packed == "int8-xla":  # the reference multiplies what int8 stores: each map's dequantized values
            ref_w = {k: quantize_int8(v.T).dequantize().T if k.endswith(("proj.weight", "fc.weight", "lm_head.weight"))
                     else v for k, v in w.items()}
        ref_h, ref_logits = torch_eagle3(ref_w, feats, tokens[:T], embed, lay, flags)
        ref_h2, ref_logits2 = torch_eagle3(ref_w, feats, tokens[:T] + [tokens[T]], embed, lay, flags,
                                           extra_hidden=ref_h[-1:])
        want = [x.numpy() for x in (ref_h, ref_logits, ref_h2[-1], ref_logits2[-1])]
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, **tol)
    d = int(np.argmax(got[3] if packed == "bf16" else want[3]))
    logits2 = jnp.asarray(got[3])[None]
    assert int(greedy_target_ids(hw, logits2)[0]) == d + int(w["d2t"][d])  # d2t offsets into the target vocab


@pytest.mark.parametrize("packed", [None, "int8"])
def test_catch_up_computes_only_each_sequences_last_token(target, tmp_path, packed):
    """`eagle3_forward(..., last_only=True)`, the catch-up pass: every pair's KV is written as in the full pass,
    and the output rows (next hidden, normed) are the full pass's rows at each sequence's last token."""
    if packed and not ops.native_matmul_available():
        pytest.skip("the native CPU matmul library is not available")
    tcfg = load_checkpoint(target[0]).config
    make_head(str(tmp_path), seed=5)
    cfg, hw = load_eagle3(str(tmp_path), tcfg, np.float32)
    if packed:
        hw = store_head(hw, packed)
    rng = np.random.default_rng(2)
    embed = jnp.asarray(rng.standard_normal((V, D)).astype(np.float32))
    ps = 4
    seqs = [ScheduledSeq(rng.integers(0, V, 11).tolist(), 0, [3, 1, 4]),  # a prompt's catch-up
            ScheduledSeq(rng.integers(0, V, 2).tolist(), 5, [2, 5])]  # two accepted tokens after 5 earlier ones
    b = choose_bucket(13, 3, (16,), (4,), 4)  # 4 sequence slots: 2 of them padding
    jin = jax.tree.map(jnp.asarray, build_step_inputs(seqs, b, ps))
    feats = jnp.asarray(rng.standard_normal((16, 3 * D)).astype(np.float32))
    kv0 = init_kv_cache(cfg.layer, 7, ps, jnp.float32)
    kv0 = dataclasses.replace(kv0, k=kv0.k + 0.5, v=kv0.v - 0.25)  # earlier keys of the second sequence
    fwd = jax.jit(eagle3_forward, static_argnums=0, static_argnames=("from_target", "last_only"))
    h, normed, kv = fwd(cfg, hw, embed, kv0, jin, feats, from_target=True)
    h1, normed1, kv1 = fwd(cfg, hw, embed, kv0, jin, feats, from_target=True, last_only=True)
    assert h1.shape == (4, D) and normed1.shape == (4, D)
    np.testing.assert_array_equal(np.asarray(kv1.k), np.asarray(kv.k))
    np.testing.assert_array_equal(np.asarray(kv1.v), np.asarray(kv.v))
    last = [10, 12]  # each real sequence's last token in the step
    np.testing.assert_allclose(np.asarray(h1)[:2], np.asarray(h)[last], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(normed1)[:2], np.asarray(normed)[last], rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.asarray(greedy_target_ids(hw, draft_logits(hw, normed1[:2]))),
                          np.asarray(greedy_target_ids(hw, draft_logits(hw, normed[jnp.asarray(last)]))))


def test_layer_id_conventions_capture_the_same_tensors(target, tmp_path):
    """Speculators ids (input convention) and SpecForge output ids (HF format) name the same captured tensors, and
    those are HF's hidden_states[id] (the residual stream entering layer id)."""
    tpath, model = target
    ck = load_checkpoint(tpath)
    make_head(str(tmp_path / "spec"), "speculators")
    make_head(str(tmp_path / "hf"), "hf")
    a = read_eagle3_config(str(tmp_path / "spec"), ck.config).aux_layer_ids
    b = read_eagle3_config(str(tmp_path / "hf"), ck.config).aux_layer_ids
    assert a == b == tuple(AUX_IDS)
    tokens = [1, 17, 42, 99, 5, 250, 7]
    T = len(tokens)
    weights = jax.device_put(to_weights(ck.config, ck.tensors, np.float32))
    kv = init_kv_cache(ck.config, 4, 4, jnp.float32)
    bk = choose_bucket(T, 2, (8,), (2,), 2)
    inputs = jax.tree.map(jnp.asarray, build_step_inputs([ScheduledSeq(tokens, 0, [1, 2])], bk, 4))
    _, _, hidden = forward(ck.config, weights, kv, inputs, hidden_layer_ids=a)
    with torch.no_grad():
        hf = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    for j, i in enumerate(a):
        if i < L:  # HF normalises its last entry; id L is the pre-norm output, checked via the layer below
            np.testing.assert_allclose(np.asarray(hidden[j, :T]), hf[i][0].numpy(), rtol=1e-4, atol=1e-4)
    # SpecForge id i - 1 = output of layer i - 1 = input of layer i
    hf_cfg = json.load(open(tmp_path / "hf" / "config.json"))
    assert [i - 1 for i in b] == hf_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]


def test_malformed_heads_fail_clearly(target, tmp_path):
    tcfg = load_checkpoint(target[0]).config
    p = tmp_path / "h"
    w = make_head(str(p))
    del w["layers.0.hidden_norm.weight"]
    save_file(w, str(p / "model.safetensors"))
    with pytest.raises(ValueError,
                       match=r"model.*missing tensor layers.0.hidden_norm.weight|missing tensor layers.0.hidden_norm"):
        load_eagle3(str(p), tcfg, np.float32)
    make_head(str(p))
    cfg = json.load(open(p / "config.json"))
    json.dump(cfg | {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}, open(p / "config.json", "w"))
    with pytest.raises(ValueError, match="config.json.*outside the target"):
        load_eagle3(str(p), tcfg, np.float32)
    json.dump(cfg | {"speculators_model_type": "medusa"}, open(p / "config.json", "w"))
    with pytest.raises(ValueError, match="expected 'eagle3'"):
        load_eagle3(str(p), tcfg, np.float32)
    w = make_head(str(p))
    w["d2t"] = w["d2t"][:-1]
    save_file(w, str(p / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t"):
        load_eagle3(str(p), tcfg, np.float32)
    # no model: the head jaxserve ships for the target, looked up when the engine is built (test_eagle3_training.py)
    assert SpeculativeConfig.from_dict({"method": "eagle3", "num_speculative_tokens": 2}).model is None


# ---- engine: greedy output with EAGLE-3 equals greedy output without it --------------------------------------------


def _engine_args(**kw):
    # few buckets: every engine here compiles (and the persistent cache keeps) the same handful of executables
    return dict(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32), page_size=4, max_model_len=64,
                precompile=False) | kw


def _eagle(head, k=3):
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, "adaptive": False}


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        motif = rng.integers(3, V, int(rng.integers(2, 5))).tolist()
        out.append({"prompt_token_ids": (motif * 6)[: int(rng.integers(5, 22))]})
    return out


def _ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target[0], **_engine_args())


@pytest.fixture(scope="module")
def prompts_and_plain(plain):
    prompts = _prompts(6, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, num_speculative_tokens=k)
              for k in (None, 1, 0, 2, None, 3)]
    return prompts, params, _ids(plain.generate(prompts, params, use_tqdm=False))


@pytest.fixture(scope="module")
def rigged_head(prompts_and_plain, tmp_path_factory):
    """A head that always drafts the target's most frequent greedy token: drafts do get accepted."""
    _, _, ref = prompts_and_plain
    counts = np.bincount([t for r in ref for t in r[0]], minlength=V)
    path = str(tmp_path_factory.mktemp("rigged"))
    return path, make_head(path, "hf", seed=7, zero_lm_head=True, first=int(np.argmax(counts)))


@pytest.mark.parametrize("fmt", ["speculators", "hf"])
def test_greedy_with_eagle3_equals_plain_mixed_k(target, prompts_and_plain, tmp_path, fmt):
    make_head(str(tmp_path), fmt, seed=11)
    llm = LLM(target[0], **_engine_args(speculative_config=_eagle(str(tmp_path))))
    prompts, params, ref = prompts_and_plain
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == ref
    eng = llm.llm_engine
    assert sum(eng.spec.metrics.num_drafts) > 50
    eng.block_manager.check()
    assert eng.block_manager.num_used_pages == 0
    # every step compiled one target executable per bucket and one head executable per bucket, nothing else
    assert eng.proposer.num_compiles <= eng.runner.num_compiles


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_drafts_stay_on_the_device(target, prompts_and_plain, rigged_head, plain, tmp_path, monkeypatch,
                                   async_scheduling):
    """The head's drafts stay on the device: the next step takes them from the head's output (`draft_feed`) without
    the host fetching them. The same requests, drafts on the device and fetched, alternating on one engine: the
    same drafts verified and accepted at every position (a misplaced or stale draft would be rejected: the counts
    would differ), outputs equal to the plain engine's; the head's drafting runs are not fetched, its catch-ups
    alone are. A request with penalties needs its drafts on the host (its verify rows' token history): a run
    that drafts for it fetches, and its output equals the plain engine's too."""
    prompts, params, ref = prompts_and_plain
    random_head = str(tmp_path / "random")
    make_head(random_head, "speculators", seed=11)
    for head in (rigged_head[0], random_head):
        llm = LLM(target[0], **_engine_args(num_pages=20, speculative_config=_eagle(head),
                                            async_scheduling=async_scheduling))
        eng = llm.llm_engine
        assert eng.proposer.drafts_on_device and eng.builder.draft_feed  # on by default on one device
        runs, run = [], eng.proposer.runner.run
        monkeypatch.setattr(eng.proposer.runner, "run", lambda lay, x, aux, fetch=True: runs.append(
            (fetch, int(x.num_draft.max()))) or run(lay, x, aux, fetch=fetch))
        counts = {}
        for on_device in (True, False, True):
            eng.proposer.drafts_on_device = on_device
            llm.reset_prefix_cache()
            runs.clear()
            m = eng.spec.metrics
            before = list(m.num_drafts), list(m.num_accepted)
            assert _ids(llm.generate(prompts, params, use_tqdm=False)) == ref
            drafts = [a - b for a, b in zip(m.num_drafts, before[0])]
            accepted = [a - b for a, b in zip(m.num_accepted, before[1])]
            counts.setdefault(on_device, []).append((drafts, accepted))
            assert sum(drafts) > 20
            # drafting runs stay on the device exactly when asked; catch-ups that draft nothing are fetched
            assert all(fetch == (not on_device or d == 0) for fetch, d in runs), runs
            assert any(d for _, d in runs)
        assert counts[True][0] == counts[True][1] == counts[False][0], counts
        if head == rigged_head[0]:
            assert sum(counts[True][0][1]) > 5  # drafts taken from the device were accepted
        eng.block_manager.check()
        assert eng.block_manager.num_used_pages == 0
    # penalties: drafts fetched for the runs that draft for that request
    pen = [dataclasses.replace(p, repetition_penalty=1.3) if i == 0 else p for i, p in enumerate(params)]
    ref_pen = _ids(plain.generate(prompts, pen, use_tqdm=False))
    eng.proposer.drafts_on_device = True
    runs.clear()
    assert _ids(llm.generate(prompts, pen, use_tqdm=False)) == ref_pen
    assert any(d and fetch for fetch, d in runs) and any(d and not fetch for fetch, d in runs), runs


def test_verify_step_with_device_drafts_retried_in_parts(target, prompts_and_plain, rigged_head):
    """A verify step whose drafts are on the device raises once: the engine runs its sequences one at a time, and the
    head's run after the first of them replaces the device drafts the others' placeholders point at; those verify no
    drafts (token 0 in, nothing accepted) instead of reading another run's drafts. Outputs equal the plain engine's."""
    from jaxserve.batch import FED_DRAFT

    prompts, params, ref = prompts_and_plain
    llm = LLM(target[0], **_engine_args(speculative_config=_eagle(rigged_head[0]), async_scheduling=False))
    eng = llm.llm_engine
    dispatch, failed = eng.runner.dispatch, []

    def flaky(steps):
        batch = steps[0][1]
        if not failed and int(batch.inputs.num_seqs) >= 3 and (np.asarray(batch.draft_ids) == FED_DRAFT).any():
            failed.append(int(batch.inputs.num_seqs))
            raise RuntimeError("injected device fault")
        return dispatch(steps)

    eng.runner.dispatch = flaky
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == ref
    assert failed and eng.num_failed_requests == 0
    eng.block_manager.check()
    assert eng.block_manager.num_used_pages == 0


def test_accepted_drafts_and_preemption(target, prompts_and_plain, rigged_head):
    """Greedy output equals the plain engine's through accepted drafts and preemptions, with async scheduling off
    and on; with K fixed, both verify and accept the same drafts (async scheduling overlaps only the steps without
    drafts, and the head follows those steps too)."""
    prompts, params, ref = prompts_and_plain
    metrics = []
    for mode in (False, True):
        llm = LLM(target[0], **_engine_args(num_pages=20, speculative_config=_eagle(rigged_head[0]),
                                            async_scheduling=mode))
        assert _ids(llm.generate(prompts, params, use_tqdm=False)) == ref
        eng = llm.llm_engine
        m = eng.spec.metrics
        assert eng.scheduler.num_preemptions > 0
        assert sum(m.num_accepted) > 5 and m.num_accepted[1] > 0, m.as_dict()  # multi-token accepts happened
        assert (eng.num_overlapped_steps > 0) is mode
        metrics.append(m.as_dict())
        eng.block_manager.check()
        assert eng.block_manager.num_used_pages == 0
    assert metrics[0] == metrics[1]


@pytest.mark.parametrize("target_scheme, head_quant, expected", [
    (None, "int4", "int4"),  # speculative_config.quantization, beside a float32 target
    ("int8", None, "int8"),  # none asked: the target's scheme
])
def test_quantized_head_serves_losslessly(target, prompts_and_plain, rigged_head, target_scheme, head_quant,
                                          expected):
    """The head's linear maps stored as `speculative_config.quantization`, else as the target's weights are: the
    output stays the target's own greedy output (that of the same target without speculation), drafts are
    accepted, and the maps hold what was asked for (packed for the native kernel, or integer maps for XLA)."""
    prompts, params, ref = prompts_and_plain
    if target_scheme is not None:
        ref = _ids(LLM(target[0], **_engine_args(quantization=target_scheme)).generate(prompts, params,
                                                                                      use_tqdm=False))
    spec = _eagle(rigged_head[0]) | ({} if head_quant is None else {"quantization": head_quant})
    llm = LLM(target[0], **_engine_args(speculative_config=spec, quantization=target_scheme))
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == ref
    proposer = llm.llm_engine.proposer
    assert proposer.scheme == expected
    lm_head = proposer.runner.weights.lm_head
    bits = 8 if expected == "int8" else 4
    if isinstance(lm_head, ops.PackedLinear):
        assert lm_head.format == expected
    else:
        assert isinstance(lm_head, QuantizedLinear) and lm_head.bits == bits
    assert sum(llm.llm_engine.spec.metrics.num_accepted) > 5


def test_speculative_quantization_is_checked():
    """A scheme that does not exist, or that the method cannot take, is refused with the reason; without one the
    head takes the target's scheme, int8 beside a GGUF target's blocks."""
    from jaxserve.spec_decode.eagle3 import head_scheme

    spec = SpeculativeConfig(method="eagle3", num_speculative_tokens=3)
    assert [head_scheme(spec, t) for t in ("gguf", "int4", "bf16", "none", None)] == ["int8", "int4", "bf16",
                                                                                        "none", "none"]
    assert head_scheme(SpeculativeConfig(method="eagle3", num_speculative_tokens=3, quantization="bf16"), "gguf") \
        == "bf16"
    with pytest.raises(ValueError, match="must be one of"):
        SpeculativeConfig(method="eagle3", num_speculative_tokens=3, quantization="fp4")
    with pytest.raises(ValueError, match="'ngram' has no weights"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, quantization="int8")
    with pytest.raises(ValueError, match="not a GGUF file"):
        SpeculativeConfig(method="eagle3", num_speculative_tokens=3, quantization="gguf")


def test_prefix_cache_hits_and_aborts_during_verification(target, rigged_head, prompts_and_plain, plain):
    llm = LLM(target[0], **_engine_args(speculative_config=_eagle(rigged_head[0])))
    eng = llm.llm_engine
    prompts, params, ref = prompts_and_plain
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == ref
    hits = eng.block_manager.num_prefix_hits
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == ref  # second time from the prefix cache
    assert eng.block_manager.num_prefix_hits > hits
    rng = np.random.default_rng(0)
    for i, p in enumerate(_prompts(8, seed=21)):
        eng.add_request(f"ab-{i}", p, SamplingParams(temperature=0.7, seed=i, max_tokens=30, ignore_eos=True))
    live, steps = {f"ab-{i}" for i in range(8)}, 0
    while eng.has_unfinished_requests():
        drafting = [s.request_id for s in eng.scheduler.running if s.spec_token_ids]
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
        steps += 1
        if steps % 3 == 0 and live:  # abort a request that just verified drafts, when there is one
            victim = next((r for r in drafting if r in live), sorted(live)[int(rng.integers(len(live)))])
            assert eng.abort_request(victim).finished
            live.discard(victim)
        eng.block_manager.check()
    assert eng.block_manager.num_used_pages == 0 and not eng.scheduler.running and not eng.scheduler.waiting


def _reference_drafts(model, w, toks, num, flags):
    """Drafts of the torch reference for a sequence `toks`: HF features f_p (p = 0 .. n-2) paired with t_{p+1}, then
    each further draft fed the previous one and the head's own last hidden state."""
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, a, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        hs = model(torch.tensor([toks[:-1]]), output_hidden_states=True).hidden_states
    hook.remove()
    feats = torch.cat([captured["last"][0] if i == L else hs[i][0] for i in AUX_IDS], -1).numpy()
    embed = model.model.embed_tokens.weight.detach().numpy()
    lay = "layers.0." if "layers.0.hidden_norm.weight" in w else "midlayer."
    inputs, extra, drafts = list(toks[1:]), None, []
    if num == 0:
        return torch_eagle3(w, feats, inputs, embed, lay, flags, return_k=True).numpy()
    for _ in range(num):
        h, logits = torch_eagle3(w, feats, inputs, embed, lay, flags, extra)
        d = int(torch.argmax(logits[-1]))
        drafts.append(d + int(w["d2t"][d]))
        inputs.append(drafts[-1])
        extra = h[-1:] if extra is None else torch.cat([extra, h[-1:]])
    return drafts


def _landed(eng, seq) -> int:
    """`seq`'s computed tokens as of the steps that landed: async scheduling moves a step's sequences on when it is
    dispatched (the head catches up when it lands)."""
    launched = None if eng._in_flight is None else eng._in_flight.launched
    if launched is None or not launched.advanced:
        return seq.num_computed_tokens
    return next((s for w, s in zip(launched.work, launched.starts) if w.seq is seq), seq.num_computed_tokens)


def _check_drafts(eng, model, w, flags, steps, drafts=True, head_off=False):
    """Step the engine; after each step every running sequence's drafts, and the head's cached keys at all its
    computed positions (of the steps that landed), equal the reference. `head_off`: the controller may have turned
    the head off for some sequences (otherwise only requests that opted out skip it)."""
    checked, ps = 0, eng.config.page_size
    for _ in range(steps):
        eng.step()
        for seq in eng.scheduler.running:
            if drafts and seq.spec_token_ids:
                got = eng.proposer.drafts_of(seq)  # drafts left on the device included
                assert got == _reference_drafts(model, w, seq.token_ids, len(got), flags)
                checked += 1
            if seq.spec_disabled:  # opted out: the head never catches up on it (checked in the test below)
                assert head_off or seq.params.num_speculative_tokens == 0
                continue
            n = _landed(eng, seq)
            if n == 0:
                continue  # its first prefill chunk is in flight
            ref_k = _reference_drafts(model, w, seq.token_ids[: n + 1], 0, flags)  # pairs at positions 0 .. n-1
            pos = np.arange(n)
            cached = np.asarray(eng.proposer.runner.state.k)[0, np.asarray(seq.page_ids)[pos // ps], pos % ps]
            np.testing.assert_allclose(cached, ref_k, rtol=1e-3, atol=1e-3)
    return checked


def test_drafts_follow_the_pairing_convention(target, tmp_path):
    """The proposer's drafts equal the torch reference fed HF's features: (f_p, t_{p+1}) at position p for every
    token so far, then drafts 2..K from the head's own hidden state. Two requests share each ragged step."""
    tpath, model = target
    flags = {"norm_output": True}
    w = make_head(str(tmp_path), "speculators", seed=5, **flags)
    eng = LLM(tpath, **_engine_args(speculative_config=_eagle(str(tmp_path)))).llm_engine
    for i, p in enumerate(_prompts(2, seed=8)):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert _check_drafts(eng, model, w, flags, steps=6) >= 6


def test_drafts_past_a_sequences_pages_use_its_own_scratch_page(target, tmp_path):
    """Two different 9-token prompts decode in lockstep (a random head: drafts rejected, one token a step), K = 5: in
    some runs both rows' draft passes write and read positions past the pages they hold, at the same slots. Each row
    drafts there in a scratch page of its own: all 5 drafts (a cap to the held pages cut them to 2 or 3), each equal
    to the reference (a page shared by the rows, or the padding page, mixes their draft KV)."""
    tpath, model = target
    w = make_head(str(tmp_path), "speculators", seed=3)
    eng = LLM(tpath, **_engine_args(speculative_config=_eagle(str(tmp_path), k=5))).llm_engine
    ps, runs = eng.config.page_size, []
    run = eng.proposer.runner.run

    def spy(layout, inputs, *a, **kw):  # rows whose passes read draft KV written past their pages
        runs.append(int(np.sum(inputs.draft_pos + inputs.num_draft - 3 >= inputs.num_pages * ps)))
        return run(layout, inputs, *a, **kw)

    eng.proposer.runner.run = spy
    for i, p in enumerate(_prompts(2, seed=4)):
        ids = (p["prompt_token_ids"] * 9)[:9]
        eng.add_request(f"r{i}", {"prompt_token_ids": [t + i for t in ids]},
                        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    for _ in range(12):
        eng.step()
        for seq in eng.scheduler.running:
            if seq.spec_token_ids:
                got = eng.proposer.drafts_of(seq)
                assert got == _reference_drafts(model, w, seq.token_ids, len(got), {})
                assert len(got) == 5 or seq.num_output_tokens + len(got) + 1 >= 14
    assert runs.count(2) >= 2, runs  # both rows, in several runs


@pytest.mark.parametrize("shared, reused", [(8, 4), (9, 8)], ids=["next-token-differs", "next-token-shared"])
def test_prefix_cache_hit_leaves_the_head_kv_valid(target, tmp_path, shared, reused):
    """B shares A's first `shared` prompt tokens, so two cached pages (8 tokens) match. A's head KV at the last
    matched slot pairs it with A's next token: when B's differs (8 shared), B recomputes that page; when B shares it
    too (9: a shared system prompt that ends past a page boundary), B reuses both pages. Either way B's drafts equal
    the reference."""
    tpath, model = target
    w = make_head(str(tmp_path), "speculators", seed=6)
    eng = LLM(tpath, **_engine_args(speculative_config=_eagle(str(tmp_path)))).llm_engine
    rng = np.random.default_rng(2)
    a = rng.integers(3, V, 14).tolist()
    b = a[:shared] + [t % (V - 3) + 3 for t in np.add(a[shared:], 7)]
    eng.add_request("a", {"prompt_token_ids": a}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    hits = eng.block_manager.num_prefix_hits
    eng.add_request("b", {"prompt_token_ids": b}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert _check_drafts(eng, model, w, {}, steps=5) >= 4
    assert eng.block_manager.num_prefix_hits - hits == reused


def test_prefix_hit_on_every_known_token(target, tmp_path):
    """A sequence preempted with a token in flight (async scheduling) may find every token it knows in the prefix
    cache: its next token is not known, so the pairing of the last cached page cannot be checked and that page is
    recomputed (before, looking the next token up raised IndexError and took the engine down)."""
    import types

    make_head(str(tmp_path), "speculators", seed=6)
    eng = LLM(target[0], **_engine_args(speculative_config=_eagle(str(tmp_path)))).llm_engine
    ps = eng.config.page_size
    seq = types.SimpleNamespace(token_ids=list(range(3, 3 + 2 * ps)), page_hashes=[11, 12])
    eng.proposer._pairs[12] = 99
    assert eng.proposer.reusable_prefix(seq, 2 * ps) == ps
    seq.token_ids.append(99)  # the next token known, and the one the head paired the page with: all reused
    assert eng.proposer.reusable_prefix(seq, 2 * ps) == 2 * ps


def test_precompiled_engine_never_recompiles(target, rigged_head, prompts_and_plain):
    llm = LLM(target[0], **_engine_args(precompile=True, speculative_config=_eagle(rigged_head[0])))
    eng = llm.llm_engine
    before = (eng.runner.num_compiles, eng.proposer.num_compiles)
    assert before[1] == len(eng.config.token_buckets) * len(eng.config.page_buckets)
    prompts, params, ref = prompts_and_plain
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == ref
    assert (eng.runner.num_compiles, eng.proposer.num_compiles) == before


def test_head_kv_stays_valid_through_accepts_and_preemption(target, rigged_head, prompts_and_plain):
    """With accepted drafts (the catch-up then covers them) and preemptions (the head recomputes along the prefill),
    the head's cached keys equal the reference at every computed position after every step."""
    path, w = rigged_head
    eng = LLM(target[0], **_engine_args(num_pages=20, speculative_config=_eagle(path))).llm_engine
    prompts, params, _ = prompts_and_plain
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"q{i}", p, sp)
    while eng.has_unfinished_requests():
        _check_drafts(eng, target[1], w, {}, steps=1, drafts=False)  # (its drafts are constant)
    assert eng.scheduler.num_preemptions > 0 and sum(eng.spec.metrics.num_accepted) > 5


def test_head_drafts_only_what_the_controller_would_verify(target, rigged_head, prompts_and_plain, monkeypatch):
    """The head drafts at the end of a step for the next one; it makes as many drafts as the controller would
    choose for that step (the engine's hint), so a K = 1 or K = 0 controller pays for no draft passes beyond it,
    and the output is unchanged. One head executable serves every K (the draft loop's trip count is data)."""
    prompts, params, ref = prompts_and_plain
    llm = LLM(target[0], **_engine_args(speculative_config=_eagle(rigged_head[0]) | {"adaptive": True}))
    eng = llm.llm_engine
    made, verified = [], []
    after_step, process = eng.proposer.after_step, eng._process

    def spy_after_step(work, starts, ends, aux, draft_cap, k_hint=None):
        after_step(work, starts, ends, aux, draft_cap, k_hint)
        made.extend((k_hint, len(w.seq.spec_token_ids)) for w in work)

    def spy_process(work, *args):
        verified.extend(w.num_draft for w in work)
        return process(work, *args)

    head_runs, run = [], eng.proposer.runner.run
    monkeypatch.setattr(eng.proposer.runner, "run", lambda *a, **kw: head_runs.append(1) or run(*a, **kw))
    monkeypatch.setattr(eng.proposer, "after_step", spy_after_step)
    monkeypatch.setattr(eng, "_process", spy_process)
    for k_fixed in (1, 0, 2):  # K = 2 after K = 0: requests that arrive after the head was off speculate again
        monkeypatch.setattr(eng.spec.controller, "choose_k",
                            lambda base, lens, optimistic=False, room=None, k=k_fixed: min(k, max(lens, default=k)))
        made.clear(), verified.clear(), head_runs.clear()
        assert _ids(llm.generate(prompts, params, use_tqdm=False)) == ref
        assert all(n <= h <= k_fixed for h, n in made) and (k_fixed, k_fixed) in made, (k_fixed, made)
        assert max(verified, default=0) == k_fixed  # the drafts that were made are the ones verified
        # K = 0: the head does not run at all (not even its catch-up); otherwise once per step with a kept token
        assert (len(head_runs) == 0) == (k_fixed == 0), (k_fixed, len(head_runs))
    assert eng.proposer.num_compiles <= len(eng.config.token_buckets) * len(eng.config.page_buckets)
    eng.block_manager.check()
    assert eng.block_manager.num_used_pages == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_speculation_is_priced_without_the_heads_run(target, rigged_head, prompts_and_plain, monkeypatch,
                                                        async_scheduling):
    """K = 0 is the alternative in which the head does not run (the K = 0 the controller prefers turns it off), so a
    step that verifies no drafts is priced without the head's run, wherever the engine's timing put it (the step's
    own period, or with async scheduling the next step's). A head made slow (20 ms a run, against a target step
    of a few ms) is priced out and turned off: it runs for a few steps, not for every one. Before, the K = 0 steps
    measured with the head on cost as much as speculating, and the engine kept paying for the head."""
    import time

    prompts, params, ref = prompts_and_plain
    llm = LLM(target[0], **_engine_args(speculative_config=_eagle(rigged_head[0]) | {"adaptive": True},
                                        async_scheduling=async_scheduling))
    eng = llm.llm_engine
    head_runs, run = [], eng.proposer.runner.run

    def slow_run(*a, **kw):
        head_runs.append(1)
        time.sleep(0.02)
        return run(*a, **kw)

    monkeypatch.setattr(eng.proposer.runner, "run", slow_run)
    priced, step = [], {}  # per step the controller timed: (drafts, the head's share, the seconds it was given)
    spec_record, controller_record = eng.spec.record_step, eng.spec.controller.record_step

    def spy_spec_record(bucket, num_tokens, seconds, overlapped=False, num_drafts=0, proposer_seconds=0.0):
        step.update(drafts=num_drafts, head=proposer_seconds)
        spec_record(bucket, num_tokens, seconds, overlapped, num_drafts, proposer_seconds)

    monkeypatch.setattr(eng.spec, "record_step", spy_spec_record)
    monkeypatch.setattr(eng.spec.controller, "record_step", lambda n, seconds, overlapped=False: priced.append(
        (step["drafts"], step["head"], seconds)) or controller_record(n, seconds, overlapped))
    eng.step_trace = []
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == ref  # the controller learns the costs
    assert any(d == 0 and head >= 0.02 for d, head, _ in priced)  # the head ran in steps without drafts ...
    assert all(seconds < 0.02 for d, _, seconds in priced if d == 0), priced  # ... which are priced without it
    assert max(r["proposer_ms"] for r in eng.step_trace) >= 20  # the trace shows the head's share of the period
    head_runs.clear()
    eng.step_trace = []
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == ref
    # each request's prefill catch-up, and the controller's rare explorations
    assert len(head_runs) <= len(eng.step_trace) // 3, (len(head_runs), len(eng.step_trace))


def test_head_kv_cache_is_never_copied(target, rigged_head):
    """The head's donated KV cache is updated in place through the catch-up and the draft loop: no compiled head
    executable copies it (a copy per step would stream the whole cache through memory)."""
    import re

    llm = LLM(target[0], **_engine_args(speculative_config=_eagle(rigged_head[0])))
    prop = llm.llm_engine.proposer
    prop.warmup()
    L, P, ps, K, H = prop.runner.state.k.shape
    shapes = {f"f32[{L},{P},{ps},{K},{H}]", f"f32[{L * P},{ps},{K},{H}]"}
    assert prop.runner._executables
    for exe in prop.runner._executables.values():
        hlo = exe.as_text()
        copies = [m for m in re.findall(r"= (f32\[[\d,]+\])\S* copy\(", hlo) if m in shapes]
        assert not copies, f"the head's KV cache is copied {len(copies)} times"


def test_async_scheduling_overlaps_the_steps_that_do_not_speculate(target, rigged_head, prompts_and_plain,
                                                                     monkeypatch, alternating_controller):
    """Async scheduling with an EAGLE-3 head: a step that verifies drafts lands before the next is built (the head
    drafts for it when it lands); a step without drafts is built while the one before is in flight, and when that
    one lands the head only catches up on it (or is off for its sequences, as in the synchronous engine, when the
    controller would not speculate). The controller alternates K = max / 0 whatever the timings, so every kind of
    step occurs: greedy outputs equal the plain engine's, and after every step the head's KV of every sequence it
    still drafts for equals the reference."""
    prompts, params, ref = prompts_and_plain
    path, w = rigged_head
    for mode in (False, True):
        # without prefix caching: a preempted sequence recomputes its prefix, so its head KV is rebuilt even where
        # the head was off (a cache hit there would reuse stale head KV: worse drafts, exact output; module doc)
        llm = LLM(target[0], **_engine_args(num_pages=20, speculative_config=_eagle(path), async_scheduling=mode,
                                            enable_prefix_caching=False))
        eng = llm.llm_engine
        assert eng.async_scheduling is mode
        if mode:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                eng.add_request(f"q{i}", p, sp)
            in_flight, head_runs = [0], []
            dispatch, fetch, run = eng.runner.dispatch, eng.runner.fetch, eng.proposer.runner.run
            monkeypatch.setattr(eng.runner, "dispatch", lambda s: in_flight.append(in_flight.pop() + 1) or dispatch(s))
            monkeypatch.setattr(eng.runner, "fetch", lambda o: in_flight.append(in_flight.pop() - 1) or fetch(o))
            monkeypatch.setattr(eng.proposer.runner, "run", lambda lay, x, aux, **kw: head_runs.append(
                (in_flight[0], x.num_draft.max())) or run(lay, x, aux, **kw))
            while eng.has_unfinished_requests():
                _check_drafts(eng, target[1], w, {}, steps=1, drafts=False, head_off=True)
            # the head drafted only with no target step in flight; with one, it only caught up
            assert any(d for _, d in head_runs) and any(f for f, _ in head_runs)
            assert not any(f and d for f, d in head_runs), head_runs
        assert _ids(llm.generate(prompts, params, use_tqdm=False)) == ref
        m = eng.spec.metrics
        assert sum(m.num_accepted) > 0, m.as_dict()  # drafts were verified and accepted
        assert (eng.num_overlapped_steps > 0) is mode
        eng.block_manager.check()
        assert eng.block_manager.num_used_pages == 0
