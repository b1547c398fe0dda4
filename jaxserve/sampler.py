"""Token sampling on device. Every setting is a per-row array, so one executable serves any request mix.

Per row, in order (vLLM's semantics):
  1. banned tokens: EOS and stop tokens get -inf while the row has fewer than `min_tokens` outputs;
  2. penalties on the logits: repetition (tokens seen in prompt or output: positive logits / r, negative * r),
     frequency (- f * count in output) and presence (- p if in output);
  3. temperature (0 = greedy argmax of the penalised logits);
  4. truncation: top-k (0 = off), top-p (1 = off), min-p (0 = off), computed on the tempered distribution;
  5. a Gumbel-max draw with the row's own key, so a seeded request draws the same noise whatever shares the batch.
Rows whose raw logits hold a NaN or +inf are flagged (`nonfinite`), never silently sampled from.
Reported log-probabilities are the model's raw distribution (before penalties, temperature and truncation), as
vLLM's default `raw_logprobs` mode reports them. Work a batch doesn't need (penalties, sorting, noise) is skipped
at run time with `lax.cond`, not compiled away, so the executable stays the same for every mix.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import ops
from jaxserve.model.layers import argmax

MAX_BANNED = 16  # EOS + stop_token_ids suppressed under min_tokens, per row


@jax.tree_util.register_dataclass
@dataclass
class SamplingInputs:
    temperature: jax.Array  # f32[S]
    top_k: jax.Array  # i32[S]   0 = off
    top_p: jax.Array  # f32[S]   1 = off
    min_p: jax.Array  # f32[S]   0 = off
    seeds: jax.Array  # u32[S]   per-row key material (host-derived)
    repetition_penalty: jax.Array  # f32[S]  1 = off
    frequency_penalty: jax.Array  # f32[S]  0 = off
    presence_penalty: jax.Array  # f32[S]  0 = off
    history: jax.Array  # i32[S, C]  prompt + output token ids, -1 padded (only filled for rows with penalties)
    history_is_output: jax.Array  # bool[S, C]
    banned: jax.Array  # i32[S, MAX_BANNED]  token ids to suppress this step, -1 padded
    wants_logprobs: jax.Array  # bool[S]  top-k logprobs and ranks are only computed if some row wants them

    @staticmethod
    def neutral(num_rows: int, history_len: int) -> "SamplingInputs":
        """Host numpy rows with neutral (greedy, no penalties) padding values; the engine fills the real rows."""
        return SamplingInputs(
            temperature=np.zeros(num_rows, np.float32),
            top_k=np.zeros(num_rows, np.int32),
            top_p=np.ones(num_rows, np.float32),
            min_p=np.zeros(num_rows, np.float32),
            seeds=np.zeros(num_rows, np.uint32),
            repetition_penalty=np.ones(num_rows, np.float32),
            frequency_penalty=np.zeros(num_rows, np.float32),
            presence_penalty=np.zeros(num_rows, np.float32),
            history=np.full((num_rows, history_len), -1, np.int32),
            history_is_output=np.zeros((num_rows, history_len), np.bool_),
            banned=np.full((num_rows, MAX_BANNED), -1, np.int32),
            wants_logprobs=np.zeros(num_rows, np.bool_),
        )


@jax.tree_util.register_dataclass
@dataclass
class SamplerOutput:
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]   raw log-probability of the chosen token
    ranks: jax.Array  # i32[S]      its rank under the raw distribution (1 = most likely)
    top_ids: jax.Array  # i32[S, max_logprobs]
    top_logprobs: jax.Array  # f32[S, max_logprobs]
    accepted: jax.Array  # bool[S]   the row's draft token was accepted (speculative verify rows; else False)
    nonfinite: jax.Array  # bool[S]  the model's logits hold a NaN or +inf: the row's token is garbage (the engine
    # fails that request alone instead of emitting it)


def apply_penalties(logits: jax.Array, s: SamplingInputs) -> jax.Array:
    """logits: f32[S, V] -> f32[S, V] with repetition / frequency / presence penalties applied."""
    S, V = logits.shape
    rows = jnp.broadcast_to(jnp.arange(S)[:, None], s.history.shape)
    ok = s.history >= 0
    cols = jnp.where(ok, s.history, 0)
    out_counts = jnp.zeros((S, V), jnp.float32).at[rows, cols].add((ok & s.history_is_output).astype(jnp.float32))
    seen = jnp.zeros((S, V), jnp.float32).at[rows, cols].max(ok.astype(jnp.float32)) > 0
    r = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - s.frequency_penalty[:, None] * out_counts
    return logits - s.presence_penalty[:, None] * (out_counts > 0)


def _truncate(scaled: jax.Array, s: SamplingInputs) -> jax.Array:
    """Mask (to -inf) tokens outside top-k / top-p / min-p. scaled: f32[S, V] -> f32[S, V]."""
    V = scaled.shape[-1]
    order = jnp.argsort(-scaled, axis=-1)  # [S, V] descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(V)[None, :]
    keep = rank < jnp.where(s.top_k > 0, s.top_k, V)[:, None]
    # top-p: keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept).
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < s.top_p[:, None]
    keep &= probs >= s.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    sorted_masked = jnp.where(keep, sorted_logits, -jnp.inf)
    return jnp.take_along_axis(sorted_masked, jnp.argsort(order, axis=-1), axis=-1)


def _identity(x: jax.Array, _: SamplingInputs) -> jax.Array:
    return x


def sample(
    logits: jax.Array, s: SamplingInputs, *, max_logprobs: int, draft_ids: jax.Array | None = None, mesh=None
) -> SamplerOutput:
    """logits: f32[S, V] -> SamplerOutput.

    With `draft_ids` (i32[S], -1 = none), each row is a speculative verify position: its draft token is accepted
    or rejected by lossless rejection sampling (`spec_decode/rejection.py`), and the row's token is the draft if
    accepted, else the token to emit if the sequence's walk stops at this row.
    """
    S, V = logits.shape
    raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    banned = s.banned >= 0
    x = logits.astype(jnp.float32).at[jnp.arange(S)[:, None], jnp.where(banned, s.banned, 0)].add(
        jnp.where(banned, -jnp.inf, 0.0)
    )
    needs_penalty = jnp.any((s.repetition_penalty != 1) | (s.frequency_penalty != 0) | (s.presence_penalty != 0))
    x = jax.lax.cond(needs_penalty, apply_penalties, _identity, x, s)

    is_random = s.temperature > 0
    greedy = argmax(x)
    scaled = x / jnp.where(is_random, s.temperature, 1.0)[:, None]
    needs_truncation = jnp.any(is_random & ((s.top_k > 0) | (s.top_p < 1) | (s.min_p > 0)))
    scaled = jax.lax.cond(needs_truncation, _truncate, _identity, scaled, s)

    def gumbel_row(seed):
        return jax.random.gumbel(jax.random.key(seed), (V,), jnp.float32)

    if draft_ids is None:

        def draw(scaled, seeds):
            return argmax(scaled + jax.vmap(gumbel_row)(seeds))

        def no_draw(scaled, seeds):
            return jnp.zeros((S,), jnp.int32)

        drawn = jax.lax.cond(jnp.any(is_random), draw, no_draw, scaled, s.seeds)
        token_ids = jnp.where(is_random, drawn, greedy)
        accepted = jnp.zeros((S,), jnp.bool_)
    else:

        def verify(scaled, seeds):
            uniform = jax.vmap(lambda sd: jax.random.uniform(jax.random.fold_in(jax.random.key(sd), 1)))(seeds)
            gumbel = jax.vmap(gumbel_row)(seeds)
            return ops.verify_one_hot(scaled, greedy, is_random, draft_ids, uniform, gumbel)

        def verify_greedy(scaled, seeds):
            return greedy, (draft_ids >= 0) & (greedy == draft_ids)

        token, accepted = jax.lax.cond(jnp.any(is_random), verify, verify_greedy, scaled, s.seeds)
        token_ids = jnp.where(accepted, draft_ids, token)

    chosen = jnp.take_along_axis(raw, token_ids[:, None], axis=-1)

    def ranked(raw, chosen):
        ranks = 1 + jnp.sum(raw > chosen, axis=-1).astype(jnp.int32)
        top_logprobs, top_ids = jax.lax.top_k(raw, max_logprobs)
        return ranks, top_ids.astype(jnp.int32), top_logprobs

    def unranked(raw, chosen):
        return (jnp.zeros((S,), jnp.int32), jnp.zeros((S, max_logprobs), jnp.int32),
                jnp.zeros((S, max_logprobs), jnp.float32))

    ranks, top_ids, top_logprobs = jax.lax.cond(jnp.any(s.wants_logprobs), ranked, unranked, raw, chosen)
    return SamplerOutput(
        token_ids=token_ids,
        logprobs=chosen[:, 0],
        ranks=ranks,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
        accepted=accepted,
        nonfinite=jnp.any(jnp.isnan(logits) | (logits == jnp.inf), axis=-1),
    )


@jax.tree_util.register_dataclass
@dataclass
class PromptLogprobs:
    ranks: jax.Array  # i32[T]  rank of each position's next prompt token under the raw distribution
    top_ids: jax.Array  # i32[T, max_logprobs]
    logprobs: jax.Array  # f32[T]  log-probability of the next prompt token
    top_logprobs: jax.Array  # f32[T, max_logprobs]


def prompt_logprobs(logits: jax.Array, targets: jax.Array, *, max_logprobs: int, mesh=None) -> PromptLogprobs:
    """Log-probabilities of each position's *next* prompt token. logits: f32[T, V], targets: i32[T] (-1 = none)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[:, None], axis=-1)
    if max_logprobs:
        top_logprobs, top_ids = jax.lax.top_k(logp, max_logprobs)
    else:
        top_logprobs, top_ids = jnp.zeros((logits.shape[0], 0), jnp.float32), jnp.zeros((logits.shape[0], 0), jnp.int32)
    ranks = 1 + jnp.sum(logp > chosen, axis=-1).astype(jnp.int32)
    return PromptLogprobs(ranks, top_ids.astype(jnp.int32), chosen[:, 0], top_logprobs)
