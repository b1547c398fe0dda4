"""Token sampling on device. Every setting is a per-row array, so one executable serves any request mix.

Per row: temperature (0 = greedy), top-k (0 = off), top-p (1 = off), min-p (0 = off), then a Gumbel-max draw with
the row's own key, so a seeded request draws the same noise whatever else shares the batch. Log-probabilities are
those of the model's raw distribution (temperature 1, no truncation), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclass
class SamplingInputs:
    temperature: jax.Array  # f32[S]
    top_k: jax.Array  # i32[S]   0 = off
    top_p: jax.Array  # f32[S]   1 = off
    min_p: jax.Array  # f32[S]   0 = off
    seeds: jax.Array  # u32[S]   per-row key material (host-derived)

    @staticmethod
    def host_arrays(num_rows: int) -> dict[str, np.ndarray]:
        """Neutral (greedy) padding values; the engine fills the real rows."""
        return dict(
            temperature=np.zeros(num_rows, np.float32),
            top_k=np.zeros(num_rows, np.int32),
            top_p=np.ones(num_rows, np.float32),
            min_p=np.zeros(num_rows, np.float32),
            seeds=np.zeros(num_rows, np.uint32),
        )


@jax.tree_util.register_dataclass
@dataclass
class SamplerOutput:
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]   log-probability of the chosen token
    top_ids: jax.Array  # i32[S, max_logprobs]
    top_logprobs: jax.Array  # f32[S, max_logprobs]


def _truncate(scaled: jax.Array, s: SamplingInputs) -> jax.Array:
    """Mask (to -inf) tokens outside top-k / top-p / min-p. scaled: f32[S, V] -> f32[S, V]."""
    V = scaled.shape[-1]
    order = jnp.argsort(-scaled, axis=-1)  # [S, V] descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(V)[None, :]
    k = jnp.where(s.top_k > 0, s.top_k, V)[:, None]
    keep = rank < k
    # top-p: keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < s.top_p[:, None]
    keep &= probs >= s.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    sorted_masked = jnp.where(keep, sorted_logits, -jnp.inf)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(sorted_masked, inverse, axis=-1)


def sample(logits: jax.Array, s: SamplingInputs, *, max_logprobs: int) -> SamplerOutput:
    """logits: f32[S, V] -> SamplerOutput."""
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    is_random = s.temperature > 0
    scaled = logits / jnp.where(is_random, s.temperature, 1.0)[:, None]
    needs_truncation = jnp.any(is_random & ((s.top_k > 0) | (s.top_p < 1) | (s.min_p > 0)))
    scaled = jax.lax.cond(needs_truncation, _truncate, lambda x, _: x, scaled, s)

    def gumbel_row(seed):
        return jax.random.gumbel(jax.random.key(seed), (logits.shape[-1],), jnp.float32)

    noise = jax.lax.cond(
        jnp.any(is_random), lambda: jax.vmap(gumbel_row)(s.seeds), lambda: jnp.zeros_like(logits)
    )
    drawn = jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)
    token_ids = jnp.where(is_random, drawn, greedy)

    chosen = jnp.take_along_axis(logp, token_ids[:, None], axis=-1)[:, 0]
    if max_logprobs:
        top_logprobs, top_ids = jax.lax.top_k(logp, max_logprobs)
    else:
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return SamplerOutput(token_ids=token_ids, logprobs=chosen, top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs)
