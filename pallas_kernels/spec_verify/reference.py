"""Lossless speculative verification (rejection sampling): the maths, and the XLA reference the kernel must match.

A proposer guesses draft tokens d_1..d_K for a sequence; the target model scores the K+1 positions in one pass,
giving its sampling distribution p_j at position j (after penalties, temperature, top-k/p, min-p: exactly the
distribution plain decoding would sample from). Walking j = 1..K:

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j))          (q_j: the proposer's distribution)
    on the first rejection, emit one token from the residual
        r_j(x) = max(p_j(x) - q_j(x), 0) / sum_y max(p_j(y) - q_j(y), 0)
    and stop; if all K are accepted, emit a bonus token from p_{K+1}.

Why it is exact: P(emit x at j) = q(x) min(1, p(x)/q(x)) + P(reject) r(x) = min(q(x), p(x)) + max(p(x) - q(x), 0)
= p(x), because P(reject) = 1 - sum_y min(p(y), q(y)) = sum_y max(p(y) - q(y), 0), the normaliser of r.

Greedy proposers (n-gram lookup, a draft model's argmax) have one-hot q = [x == d]: accept with probability p(d),
and the residual is p with d removed, renormalised. Greedy targets (temperature 0) have one-hot p: accept iff d
is the argmax, and the residual is the argmax itself. Rows without a draft (the bonus position, or a sequence
without speculation) are a plain draw from p.

Draws use the Gumbel-max trick: argmax_x(log w(x) + g(x)) with g i.i.d. Gumbel(0, 1) samples w / sum(w), so the
residual never needs normalising, and the draw streams: a running (max, first index of the max) over vocabulary
blocks gives the same token as one argmax over the whole row. Ties go to the first index (`argmax`), everywhere.

Every row here is one verify position; rows carry no sequence structure. The host walks each sequence's rows in
order and stops at the first row whose draft was not accepted (`accepted_length`).

This module imports nothing from jaxserve; `jaxserve.spec_decode.rejection` re-exports it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NO_DRAFT = -1  # draft id of a row that only samples (the bonus position, or a row without speculation)


def argmax(x: jax.Array) -> jax.Array:
    """First index of the maximum along the last axis: f32[R, V] -> i32[R] (jnp.argmax's result, faster on
    XLA:CPU; the same formula as `jaxserve.model.layers.argmax`)."""
    V = x.shape[-1]
    is_max = x == jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(is_max, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def rejection_sample(
    target_probs: jax.Array,  # f32[R, V]  p_j
    draft_probs: jax.Array | None,  # f32[R, V]  q_j (rows without a draft are ignored); None: one-hot drafts
    draft_ids: jax.Array,  # i32[R]     d_j, or NO_DRAFT
    uniform: jax.Array,  # f32[R]      U(0, 1) for the accept test
    gumbel: jax.Array,  # f32[R, V]    Gumbel(0, 1) noise for the residual / plain draw
) -> tuple[jax.Array, jax.Array]:  # (i32[R] emitted-if-stopping-here token, bool[R] draft accepted)
    """General rejection sampling against a probabilistic draft (draft models, EAGLE heads), or against one-hot
    drafts (q = one_hot(d)) when `draft_probs` is None."""
    has_draft = draft_ids >= 0
    d = jnp.maximum(draft_ids, 0)[:, None]
    if draft_probs is None:
        draft_probs = (jnp.arange(target_probs.shape[-1], dtype=jnp.int32)[None, :] == d).astype(target_probs.dtype)
    p_d = jnp.take_along_axis(target_probs, d, axis=-1)[:, 0]
    q_d = jnp.take_along_axis(draft_probs, d, axis=-1)[:, 0]
    # u < p/q  <=>  u * q < p  (no division; q_d > 0 for any token the proposer actually drew)
    accepted = has_draft & (uniform * q_d < p_d)
    residual = jnp.maximum(target_probs - draft_probs, 0.0)
    # p == q exactly leaves no residual mass; rejection then has probability 0, any token will do.
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, target_probs)
    weights = jnp.where(has_draft[:, None], residual, target_probs)
    token = argmax(jnp.where(weights > 0, jnp.log(weights), -jnp.inf) + gumbel)
    return token, accepted


def verify_one_hot(
    scaled: jax.Array,  # f32[R, V]  tempered, truncated logits (-inf outside top-k/p, min-p)
    greedy: jax.Array,  # i32[R]     argmax of the penalised logits
    is_random: jax.Array,  # bool[R] temperature > 0
    draft_ids: jax.Array,  # i32[R]  d_j, or NO_DRAFT
    uniform: jax.Array,  # f32[R]
    gumbel: jax.Array,  # f32[R, V]
) -> tuple[jax.Array, jax.Array]:  # (i32[R] token emitted if the walk stops here, bool[R] accepted)
    """Rejection sampling against one-hot drafts, from the sampler's own intermediate values.

    Same maths as `rejection_sample` with q = one_hot(d) and p = softmax(scaled), without materialising q or p:
    accept with probability p(d); the residual draw is the ordinary Gumbel-max draw over the logits with d masked
    out (log p = scaled - logsumexp, a per-row constant that does not move the argmax). Greedy rows accept iff
    the draft is the argmax and emit the argmax.
    """
    has_draft = draft_ids >= 0
    d = jnp.maximum(draft_ids, 0)
    p = jax.nn.softmax(scaled, axis=-1)
    p_d = jnp.take_along_axis(p, d[:, None], axis=-1)[:, 0]
    masked = jnp.where(has_draft[:, None] & (jnp.arange(scaled.shape[-1])[None, :] == d[:, None]), -jnp.inf, scaled)
    # p(d) == 1 leaves nothing to draw from; then rejection has probability 0 and the row is never used.
    masked = jnp.where(jnp.any(masked > -jnp.inf, axis=-1, keepdims=True), masked, scaled)
    drawn = argmax(masked + gumbel)
    token = jnp.where(is_random, drawn, greedy)
    accepted = has_draft & jnp.where(is_random, uniform < p_d, greedy == d)
    return token, accepted


def accepted_length(accepted: list[bool]) -> int:
    """Drafts accepted for one sequence: the leading run of accepted rows (host side)."""
    n = 0
    for a in accepted:
        if not a:
            break
        n += 1
    return n
