"""The EAGLE-3 training forward: train-time test (TTT), dense, pure JAX, the same maths as serving.

Pairing (as `jaxserve/spec_decode/eagle3.py`): step 0 at position p is fed (target feature f_p, token t_{p+1}) and
predicts t_{p+2}. Step k >= 1 continues the chain that started at p: it runs at position p + k, is fed the head's own
output hidden state of step k-1 at the same chain and the teacher-forced token t_{p+1+k}, and predicts t_{p+2+k}.

Attention at step k (what the drafter sees at inference along one chain): the query of chain p sees the step-0 keys
at positions 0..p (the catch-up over the real sequence) plus its own chain's keys of steps 1..k (positions
p+1..p+k), never another chain's. RoPE positions are p + k for step k, queries and keys alike.

Window. Steps k >= 1 and all logits run only on a per-row window of positions `window_pos` (i32[B, W]): chains that
start earlier predict prompt tokens only, which the loss mask drops anyway. Step 0 runs over all T positions (its
keys are every chain's context).

Loss at step k, chain p: forward KL(p || q) = sum_v p(v) (log p(v) - log q(v)) over the draft vocabulary (EAGLE's soft
cross-entropy minus the target's entropy: the same gradient, and 0 for a perfect head), p = softmax
of the target's logits at position p + 1 + k (the position that predicts t_{p+2+k}) restricted to the draft ids,
q = the draft's distribution; masked by: t_{p+2+k} is an output token inside the sequence, and the target's argmax
lies in the draft vocabulary (not for "kl_all"). Steps are weighted `decay ** k`. Accuracy counts the same positions
without the vocabulary condition (a target token outside the draft vocabulary is a miss, as it is at inference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.eagle3 import Eagle3Config, Eagle3Weights, fuse_features, head_output, head_qkv
from jaxserve.model.layers import argmax

NEG_INF = -1e30


@jax.tree_util.register_dataclass
@dataclass
class TTTBatch:
    """B rows (sequences, right-padded to T; empty rows have length 0), features as computed by features.py."""

    aux: jax.Array  # f[B, T, 3D]  target features f_p
    target_hidden: jax.Array  # f[B, T, D]  the target's final-normed hidden state at p (predicts t_{p+1})
    tokens: jax.Array  # i32[B, T]
    target_argmax: jax.Array  # i32[B, T]  the target's greedy prediction for t_{p+1}, full vocabulary
    is_output: jax.Array  # bool[B, T]  token p is an output (trained) token
    lengths: jax.Array  # i32[B]
    window_pos: jax.Array  # i32[B, W]  chains p that steps >= 1 and the loss run on; consecutive (r0 + arange(W))


@jax.tree_util.register_dataclass
@dataclass
class VocabArrays:
    draft_ids: jax.Array  # i32[Vd]  target id of each draft id (sorted)
    t2d: jax.Array  # bool[V]
    target_head: jax.Array  # f[D, Vd]  the target's output embedding columns for the draft ids (frozen)


def attend(q, q_pos, k0, v0, kd, vd, sm_scale):
    """Chain attention. q f[B, Q, N, H] at base positions q_pos i32[B, Q]; step-0 keys k0/v0 f[B, T, K, H], seen
    causally (key index <= q_pos); chain keys kd/vd f[B, Q, J, K, H] (J >= 0), query q sees only its own row q.
    -> f[B, Q, N, H]."""
    B, Q, N, H = q.shape
    T, K = k0.shape[1], k0.shape[2]
    qg = q.reshape(B, Q, K, N // K, H).astype(jnp.float32)
    s0 = jnp.einsum("bqkgh,btkh->bkgqt", qg, k0.astype(jnp.float32)) * sm_scale  # [B, K, G, Q, T]
    causal = jnp.arange(T)[None, None, :] <= q_pos[:, :, None]  # [B, Q, T]
    s0 = jnp.where(causal[:, None, None], s0, NEG_INF)
    sd = jnp.einsum("bqkgh,bqjkh->bkgqj", qg, kd.astype(jnp.float32)) * sm_scale  # [B, K, G, Q, J]
    p = jax.nn.softmax(jnp.concatenate([s0, sd], axis=-1), axis=-1)
    o = jnp.einsum("bkgqt,btkh->bqkgh", p[..., :T], v0.astype(jnp.float32))
    o = o + jnp.einsum("bkgqj,bqjkh->bqkgh", p[..., T:], vd.astype(jnp.float32))
    return o.reshape(B, Q, N, H).astype(q.dtype)


def _take(x, idx):
    """x [B, T, ...], idx i32[B, W] (clipped into [0, T)) -> [B, W, ...]."""
    idx = jnp.clip(idx, 0, x.shape[1] - 1)
    return jax.vmap(lambda a, i: a[i])(x, idx)


def ttt_logits(cfg: Eagle3Config, w: Eagle3Weights, embed: jax.Array, batch: TTTBatch, *, num_steps: int):
    """-> draft logits f32[num_steps, B, W, Vd]: step k, chain p = window_pos[b, w] (predicting t_{p+2+k})."""
    c = cfg.layer
    B, T = batch.tokens.shape
    W = batch.window_pos.shape[1]
    D, N, H = c.hidden_size, c.num_heads, c.head_dim
    scale = 1.0 / math.sqrt(H)
    dtype = w.fc.dtype
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    nxt = jnp.concatenate([batch.tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)  # t_{p+1}
    h = fuse_features(cfg, w, batch.aux.reshape(B * T, 3 * D).astype(dtype))  # [B*T, D]
    q, k0, v0, res = head_qkv(cfg, w, embed, h, nxt.reshape(-1), pos.reshape(-1))
    k0, v0 = k0.reshape(B, T, *k0.shape[1:]), v0.reshape(B, T, *v0.shape[1:])
    none = jnp.zeros((B, T, 0, *k0.shape[2:]), dtype)
    o = attend(q.reshape(B, T, N, H), pos, k0, v0, none, none, scale)
    h, normed = head_output(cfg, w, res, o.reshape(B * T, N * H))
    wp = batch.window_pos
    h = _take(h.reshape(B, T, D), wp)  # [B, W, D]  each chain's hidden after step 0
    logits = [jnp.einsum("bwd,dv->bwv", _take(normed.reshape(B, T, D), wp), w.lm_head,
                         preferred_element_type=jnp.float32)]
    kd, vd = [], []
    for k in range(1, num_steps):
        tok = _take(batch.tokens, wp + 1 + k)  # teacher-forced t_{p+1+k}
        q, kk, vv, res = head_qkv(cfg, w, embed, h.reshape(B * W, D), tok.reshape(-1), (wp + k).reshape(-1))
        kd.append(kk.reshape(B, W, *kk.shape[1:]))
        vd.append(vv.reshape(B, W, *vv.shape[1:]))
        o = attend(q.reshape(B, W, N, H), wp, k0, v0, jnp.stack(kd, 2), jnp.stack(vd, 2), scale)
        h, normed = head_output(cfg, w, res, o.reshape(B * W, N * H))
        h = h.reshape(B, W, D)
        logits.append(jnp.einsum("bwd,dv->bwv", normed.reshape(B, W, D), w.lm_head, preferred_element_type=jnp.float32))
    return jnp.stack(logits)


def _check_step(vocab: VocabArrays, batch: TTTBatch, logits_k: jax.Array, k: int):
    """Step k's draft logits f[B, W, Vd] -> (the target's choice for each chain's t_{p+2+k} i32[B, W], valid: that
    token is an output token inside the sequence bool[B, W], correct: the draft's top-1 is that choice bool[B, W])."""
    wp = batch.window_pos
    tgt = _take(batch.target_argmax, wp + 1 + k)
    valid = (wp + 2 + k < batch.lengths[:, None]) & _take(batch.is_output, wp + 2 + k)
    return tgt, valid, vocab.draft_ids[argmax(logits_k)] == tgt


def chain_hits(vocab: VocabArrays, batch: TTTBatch, logits: jax.Array) -> jax.Array:
    """`ttt_logits` f32[S, B, W, Vd] -> i8[B, W, S]: whether chain p = window_pos[b, w]'s greedy draft at step k is
    the target's choice (1) or not (0), -1 where t_{p+2+k} is not an output token of the sequence. What
    `served_walk` walks."""
    hits = []
    for k in range(logits.shape[0]):
        _, valid, correct = _check_step(vocab, batch, logits[k], k)
        hits.append(jnp.where(valid, correct.astype(jnp.int8), jnp.int8(-1)))
    return jnp.stack(hits, axis=-1)


LOSSES = ("kl", "ce", "kl_all")


def ttt_loss(cfg: Eagle3Config, w: Eagle3Weights, embed: jax.Array, vocab: VocabArrays, batch: TTTBatch, *,
             num_steps: int, decay: float = 0.8, kind: str = "kl", logits: jax.Array | None = None):
    """-> (loss f32[], stats): stats are per-step count vectors f32[num_steps] to sum over batches:
    `loss_sum`/`loss_n` (the masked loss), `valid`/`correct` (top-1 == target argmax), `chain_prev`/`chain_ok`
    (valid positions whose chain was right through step k-1 / through step k).

    `kind`: "kl", forward KL from the target's distribution over the draft vocabulary to the head's (every
    probability counts); "ce", cross-entropy of the target's greedy choice (only the top-1 counts, what greedy
    verification accepts). Both skip positions whose target choice lies outside the draft vocabulary (the head
    cannot draft it); "kl_all" is "kl" without that mask: there it learns the target's distribution over the draft
    ids all the same (its runners-up)."""
    if kind not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES} (got {kind!r})")
    if logits is None:  # (`logits`: this batch's `ttt_logits`, already computed)
        logits = ttt_logits(cfg, w, embed, batch, num_steps=num_steps)  # [S, B, W, Vd]
    wp = batch.window_pos
    W = wp.shape[1]
    if kind != "ce":  # the target's log-probs over the draft vocabulary at positions wp + 1 .. wp + W + num_steps - 1,
        # computed once: chain p at step k reads position p + 1 + k, i.e. column w + k
        ext = wp[:, :1] + 1 + jnp.arange(W + num_steps - 1, dtype=jnp.int32)[None]  # [B, W + S - 1]
        th = _take(batch.target_hidden, ext).astype(jnp.float32)
        target_logp = jax.nn.log_softmax(jnp.einsum("bwd,dv->bwv", th, vocab.target_head.astype(jnp.float32)),
                                         axis=-1)
    loss, prev = jnp.zeros((), jnp.float32), jnp.ones(wp.shape, bool)
    stats = {n: [] for n in ("loss_sum", "loss_n", "valid", "correct", "chain_prev", "chain_ok")}
    for k in range(num_steps):
        tgt, valid, correct = _check_step(vocab, batch, logits[k], k)
        mask = valid if kind == "kl_all" else valid & vocab.t2d[tgt]
        logq = jax.nn.log_softmax(logits[k], axis=-1)  # [B, W, Vd]
        if kind != "ce":
            logp = target_logp[:, k : k + W]
            ce = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)  # [B, W]  KL(p||q)
        else:  # the draft index of the target's choice (any index where it is outside: those are masked)
            d = jnp.minimum(jnp.searchsorted(vocab.draft_ids, tgt), vocab.draft_ids.shape[0] - 1)
            ce = -jnp.take_along_axis(logq, d[..., None], axis=-1)[..., 0]
        n = jnp.sum(mask)
        loss_sum = jnp.sum(jnp.where(mask, ce, 0.0))
        loss = loss + decay**k * loss_sum / jnp.maximum(n, 1)
        ok = prev & valid & correct  # a chain counts from its first valid step on
        for name, v in (("loss_sum", loss_sum), ("loss_n", n), ("valid", valid), ("correct", valid & correct),
                        ("chain_prev", valid & prev), ("chain_ok", valid & ok)):
            stats[name].append(jnp.sum(v).astype(jnp.float32))
        prev = ok
    return loss, {n: jnp.stack(v) for n, v in stats.items()}


def acceptance(stats: dict) -> dict:
    """Summed stats -> per-step accuracy, chain-conditional accuracy and tau = 1 + sum_k prod_{j<=k} cond_acc_j
    (the implied mean number of tokens per target step with a chain of num_steps greedy drafts)."""
    s = {k: np.asarray(v, np.float64) for k, v in stats.items()}
    acc = s["correct"] / np.maximum(s["valid"], 1)
    cond = s["chain_ok"] / np.maximum(s["chain_prev"], 1)
    tau = 1.0 + float(np.sum(np.cumprod(cond)))
    loss = s["loss_sum"] / np.maximum(s["loss_n"], 1)
    return dict(loss=loss.tolist(), acc=acc.tolist(), cond_acc=cond.tolist(), tau=tau)


def served_walk(hits: np.ndarray, prompt_len: int, length: int, max_tokens: int | None, metrics) -> None:
    """Replay one greedy reply as a server drafting K = hits.shape[1] tokens at every verify step sees it, recording
    each step's (drafts, accepted) into `metrics` (a `SpecMetrics`, as the engine records them).

    `hits`: i8[length, K], row p = chain p's `chain_hits` (1: the draft is the target's choice). The reply's first
    token comes from prefill; the first verify step drafts from chain P - 1 (P = `prompt_len`), and a step at chain
    p that accepts a drafts moves to chain p + a + 1 (the a accepted tokens and the target's own next one). Drafts
    per step are capped as the engine caps them: with `max_tokens` (the budget the reply was generated under), so
    that the last token of the budget is the target's own, and drafts past a reply that ended sooner (at EOS: the
    engine cannot know) count as drafted and rejected; without it, at the reply's last token.

    Per-position acceptance averaged over every chain (`acceptance`) reads higher than this: a step starts where the
    previous one's drafts failed, and those positions are harder than the average one."""
    P, n, K = prompt_len, length, hits.shape[1]
    end = n if max_tokens is None else min(n, P + max_tokens)
    p = P - 1
    while p + 2 < end:  # p + 2 tokens known
        m = min(K, n - p - 2) if max_tokens is None else min(K, P + max_tokens - p - 3)
        a = 0
        while a < m and p + 2 + a < n and hits[p, a] == 1:
            a += 1
        if m > 0:
            metrics.record(m, a)
        p += a + 1
