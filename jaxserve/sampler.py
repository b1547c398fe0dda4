"""Token sampling on device. Every setting is a per-row array, so one executable serves any request mix.

Per row, in order (vLLM's semantics):
  1. banned tokens: EOS and stop tokens get -inf while the row has fewer than `min_tokens` outputs;
  2. penalties on the logits: repetition (tokens seen in prompt or output: positive logits / r, negative * r),
     frequency (- f * count in output) and presence (- p if in output);
  3. temperature (0 = greedy argmax of the penalised logits);
  4. truncation: top-k (0 = off), top-p (1 = off), min-p (0 = off), each computed on the tempered distribution
     (top-p on its whole mass, not on the top-k survivors), and the most likely token is always kept;
  5. a Gumbel-max draw with the row's own noise, so a seeded request draws the same noise whatever shares the batch.
Rows whose raw logits hold a NaN or +inf are flagged (`nonfinite`), never silently sampled from.
Reported log-probabilities are the model's raw distribution (before penalties, temperature and truncation), as
vLLM's default `raw_logprobs` mode reports them. Work a batch doesn't need (penalties, truncation, noise, ranks) is
skipped at run time with `lax.cond`, not compiled away, so the executable stays the same for every mix.

Vocabulary-parallel. Under tensor parallelism the LM head is split over the vocabulary, so the logits f32[S, V]
arrive split on V over the mesh axis `sharding` maps "vocab" to. `sample` and `prompt_logprobs` then run once per
shard under `shard_map`, each on its own contiguous slice of V/tp ids, and only per-row values cross devices:
maxima and sums (an all-reduce of [S]), (value, first id) pairs for an argmax, and the local top `max_logprobs`
candidates (an all-gather of [S, tp * max_logprobs]). Without a mesh, or when tp does not divide V (the LM head,
hence the logits, are then replicated), the same code runs with plain reductions over the whole row. `_Vocab`
holds the difference; everything else is written once, for a slice.

Truncation without sorting. Sorting the tempered row (descending, ties by id, as a stable sort) keeps a prefix: a
token is kept iff fewer than top_k tokens and less than top_p of the mass come before it, and its probability is
at least min_p times the largest. The first two conditions only depend on what lies strictly above the token, so
the prefix's last key is the smallest `t` for which "fewer than top_k tokens and less than top_p of the mass lie
above t" holds, over float32 keys mapped to u32 in the same order. A bisection over the 2^32 keys finds it in 32
rounds of a masked count and sum per row (each an all-reduce of [S] when split); tokens tied at that key are cut
by id with a second, shorter bisection, only in steps where a tie straddles the cut. The kept set is the sorted
definition's except for the order of summation at the top-p boundary. On one CPU device it is also faster than
the two argsorts of [S, V] it replaces (issue 20; `bench/sampler.py`, docs/benchmarks/sampler.md), so both paths
use it. Most steps need no bisection: the prefix usually ends among the row's TRUNCATION_CANDIDATES most likely
tokens (one `top_k`). When every random row's kept set lies among its candidates, the step draws from them alone,
K noise values a row instead of V: the same token as the whole row's draw, since the noise at an id is the same
either way and everything outside the kept set is -inf there.

Noise is counter-based: the Gumbel noise of row seed `s` at vocabulary id `v` is a threefry hash of (s, v), so a
shard computes exactly the values the whole row has at its ids, and a seeded request draws the same token whether
or not the vocabulary is split.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxserve import ops, sharding
from jaxserve.model.layers import argmax

MAX_BANNED = 16  # EOS + stop_token_ids suppressed under min_tokens, per row
VOCAB_AXIS = dict(sharding.DEFAULT_RULES)["vocab"]  # the mesh axis the LM head splits the vocabulary over
_KEY_BITS = 32  # bisection rounds over the u32 order keys of float32 values
TRUNCATION_CANDIDATES = 128  # top-k / top-p look for their cut among this many most likely tokens first


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


@jax.tree_util.register_dataclass
@dataclass
class PromptLogprobs:
    ranks: jax.Array  # i32[T]  rank of each position's next prompt token under the raw distribution
    top_ids: jax.Array  # i32[T, max_logprobs]
    logprobs: jax.Array  # f32[T]  log-probability of the next prompt token
    top_logprobs: jax.Array  # f32[T, max_logprobs]


# --- the vocabulary slice ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Vocab:
    """The ids the arrays in hand hold, and reductions of a row over the whole vocabulary.

    `axis` None: the whole vocabulary is here and the reductions are plain ones. Else the vocabulary is split into
    equal contiguous slices over mesh axis `axis`, in axis-index order (what `shard_map` with P(None, axis) gives),
    and each reduction is a local one followed by an all-reduce of one value per row."""

    size: int  # V, the whole vocabulary
    axis: str | None = None

    def ids(self, local_size: int) -> jax.Array:  # i32[1, Vl]: the vocabulary ids held here
        first = 0 if self.axis is None else lax.axis_index(self.axis) * local_size
        return (first + jnp.arange(local_size, dtype=jnp.int32))[None, :]

    def local(self, ids: jax.Array, local_size: int) -> jax.Array:
        """Global ids (-1 = none) -> their index in this slice, or `local_size` (out of bounds: a scatter with
        mode="drop" skips it) for ids held elsewhere or none."""
        first = 0 if self.axis is None else lax.axis_index(self.axis) * local_size
        at = ids - first
        return jnp.where((ids >= 0) & (at >= 0) & (at < local_size), at, local_size)

    def max(self, x: jax.Array) -> jax.Array:  # [R, Vl] -> [R]
        m = jnp.max(x, axis=-1)
        return m if self.axis is None else lax.pmax(m, self.axis)

    def sum(self, x: jax.Array) -> jax.Array:  # [R, Vl] -> [R]
        total = jnp.sum(x, axis=-1)
        return total if self.axis is None else lax.psum(total, self.axis)

    def any(self, x: jax.Array) -> jax.Array:  # bool[R, Vl] -> bool[R]
        return self.sum(x.astype(jnp.int32)) > 0

    def argmax(self, x: jax.Array) -> jax.Array:
        """f32[R, Vl] -> i32[R]: the first id of the row's maximum (`argmax` of the whole row)."""
        if self.axis is None:
            return argmax(x)
        m = self.max(x)
        first = jnp.min(jnp.where(x == m[:, None], self.ids(x.shape[-1]), self.size), axis=-1)
        return lax.pmin(first, self.axis)

    def take(self, x: jax.Array, ids: jax.Array) -> jax.Array:
        """x[r, ids[r]] for each row: f32[R, Vl], i32[R] in [0, V) -> f32[R] (from the shard that holds it)."""
        if self.axis is None:
            return jnp.take_along_axis(x, ids[:, None], axis=-1)[:, 0]
        at = self.local(ids, x.shape[-1])
        here = jnp.take_along_axis(x, jnp.minimum(at, x.shape[-1] - 1)[:, None], axis=-1)[:, 0]
        return lax.psum(jnp.where(at < x.shape[-1], here, 0.0), self.axis)

    def top_k(self, x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """The k largest of each row, ties by lower id (`lax.top_k` of the whole row): f32[R, Vl] ->
        (f32[R, k], i32[R, k]). Split: each shard's top min(k, Vl), gathered as [R, tp * min(k, Vl)] in shard
        order (so equal values keep id order), then the top k of those."""
        R, Vl = x.shape
        if k == 0:
            return jnp.zeros((R, 0), jnp.float32), jnp.zeros((R, 0), jnp.int32)
        values, at = lax.top_k(x, min(k, Vl))
        ids = jnp.take_along_axis(jnp.broadcast_to(self.ids(Vl), x.shape), at, axis=-1)
        if self.axis is None:
            return values, ids
        values = lax.all_gather(values, self.axis, axis=1, tiled=True)
        ids = lax.all_gather(ids, self.axis, axis=1, tiled=True)
        values, at = lax.top_k(values, k)
        return values, jnp.take_along_axis(ids, at, axis=-1)


def _split_vocab(mesh, V: int) -> _Vocab | None:
    """The split vocabulary of logits f32[., V] on `mesh`, or None to run on whole rows (no mesh, tp = 1, or tp
    not dividing V: the LM head and the logits are then replicated)."""
    tp = sharding.tensor_parallel_size(mesh)
    return _Vocab(V, VOCAB_AXIS) if tp > 1 and V % tp == 0 else None


def _normaliser(logits: jax.Array, vocab: _Vocab) -> tuple[jax.Array, jax.Array]:
    """f32[R, Vl] -> (max f32[R], log-sum-exp below it f32[R]): log_softmax(x) = (x - max) - log_z."""
    m = vocab.max(logits)
    return m, jnp.log(vocab.sum(jnp.exp(logits - m[:, None])))


# --- penalties, truncation, noise -------------------------------------------------------------------------------


def apply_penalties(logits: jax.Array, s: SamplingInputs) -> jax.Array:
    """logits: f32[S, V] -> f32[S, V] with repetition / frequency / presence penalties applied."""
    return _penalise(logits, s, _Vocab(logits.shape[-1]))


def _penalise(x: jax.Array, s: SamplingInputs, vocab: _Vocab) -> jax.Array:
    """`apply_penalties` on a vocabulary slice x: f32[S, Vl]; history ids held elsewhere are dropped."""
    S, Vl = x.shape
    rows = jnp.broadcast_to(jnp.arange(S)[:, None], s.history.shape)
    cols = vocab.local(s.history, Vl)
    out_counts = jnp.zeros((S, Vl), jnp.float32).at[rows, cols].add(
        s.history_is_output.astype(jnp.float32), mode="drop")
    seen = jnp.zeros((S, Vl), jnp.bool_).at[rows, cols].set(True, mode="drop")
    r = s.repetition_penalty[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
    x = x - s.frequency_penalty[:, None] * out_counts
    return x - s.presence_penalty[:, None] * (out_counts > 0)


def _key_to_float(key: jax.Array) -> jax.Array:
    """u32 order keys -> the float32 values they stand for. Keys order floats as their values do: non-negative
    floats are their bits with the sign bit set, negative ones their bits flipped; [KEY_MIN, KEY_MAX] is
    [-inf, +inf], with no NaN inside (-0.0 and +0.0 are adjacent keys and compare equal as floats)."""
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(bits, jnp.float32)


KEY_MIN, KEY_MAX = 0x007FFFFF, 0xFF800000  # the order keys of -inf and +inf


@jax.tree_util.register_dataclass
@dataclass
class _Candidates:
    """A row's TRUNCATION_CANDIDATES most likely tokens and what `_truncate` makes of them (see there)."""

    e: jax.Array  # f32[S, Vl]  exp(scaled - max): p / p_max
    top: jax.Array  # f32[S, K]  the candidates' values, descending, ties by id
    top_ids: jax.Array  # i32[S, K]
    kept: jax.Array  # bool[S, K]  candidates in the top-k / top-p prefix and above min-p: when fewer than K, the
    # row's whole kept set
    t: jax.Array  # f32[S]  the prefix's last value, where it ends among the candidates (`resolved`)
    cut: jax.Array  # i32[S]  and the last id kept at that value
    resolved: jax.Array  # bool[S]  the prefix is known (no prefix to find, or it ends before the last candidate)
    top_k: jax.Array  # i32[S]  (V = off)
    top_mass: jax.Array  # f32[S]  top_p of the row's mass in units of e (inf = off)


def _candidates(scaled: jax.Array, s: SamplingInputs, vocab: _Vocab) -> _Candidates:
    """The sorted definition of `_truncate` on each row's first K positions (one `top_k`)."""
    V = vocab.size
    m = vocab.max(scaled)
    m = jnp.where(jnp.isfinite(m), m, 0.0)[:, None]
    e = jnp.exp(scaled - m)  # f32[S, Vl]; also p / p_max, for min-p
    z = vocab.sum(e)
    top_k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, V), V)  # i32[S]
    top_mass = jnp.where(s.top_p < 1, s.top_p * z, jnp.inf)  # f32[S]
    searched = (s.temperature > 0) & ((s.top_k > 0) | (s.top_p < 1))  # rows with a prefix to find
    K = min(TRUNCATION_CANDIDATES, V)
    top, top_ids = vocab.top_k(scaled, K)  # [S, K], descending, ties by id
    e_top = jnp.exp(top - m)
    before = jnp.cumsum(e_top, axis=-1) - e_top  # mass of the positions before each
    rank = jnp.arange(K)[None, :]
    prefix = ((rank < top_k[:, None]) & (before < top_mass[:, None])) | (rank == 0)
    num_kept = jnp.sum(prefix, axis=-1)
    last = jnp.take_along_axis(top, (num_kept - 1)[:, None], axis=-1)[:, 0]
    last_id = jnp.take_along_axis(top_ids, (num_kept - 1)[:, None], axis=-1)[:, 0]
    return _Candidates(
        e=e, top=top, top_ids=top_ids, kept=prefix & (e_top >= s.min_p[:, None]),
        t=jnp.where(searched, last, -jnp.inf), cut=jnp.where(searched, last_id, V),
        resolved=~searched | (num_kept < K), top_k=top_k, top_mass=top_mass,
    )


def _truncate(scaled: jax.Array, s: SamplingInputs, vocab: _Vocab, c: _Candidates | None = None) -> jax.Array:
    """Mask (to -inf) tokens outside top-k / top-p / min-p. scaled: f32[S, Vl] -> f32[S, Vl].

    The sorted definition (descending, ties by id): the token at position j is kept iff j < top_k, the mass of
    positions before j is < top_p, p_j >= min_p * p_0; position 0 always. With e = exp(scaled - max) standing for
    p (= e / z), the mass test is "sum of e < top_p * z" and min-p is e >= min_p, token by token. The top-k / top-p
    prefix ends at a value t and an id: kept = scaled > t, or scaled == t with id <= cut. Found from the row's
    TRUNCATION_CANDIDATES most likely tokens (`c`, `_candidates`) when the prefix ends among them (the usual
    case), else by bisection over the whole row (module docstring)."""
    c = _candidates(scaled, s, vocab) if c is None else c
    ids = vocab.ids(scaled.shape[-1])

    def bisect(_):
        t_all, cut_all = _search_prefix(scaled, c.e, ids, c.top_k, c.top_mass, vocab)
        return jnp.where(c.resolved, c.t, t_all), jnp.where(c.resolved, c.cut, cut_all)

    t, cut = lax.cond(jnp.all(c.resolved), lambda _: (c.t, c.cut), bisect, None)
    keep = (scaled > t[:, None]) | ((scaled == t[:, None]) & (ids <= cut[:, None]))
    keep &= c.e >= s.min_p[:, None]  # min_p <= 1 keeps the most likely token (e = 1)
    return jnp.where(keep, scaled, -jnp.inf)


def _draw_candidates(c: _Candidates, noise_key: tuple[jax.Array, jax.Array], V: int) -> jax.Array:
    """The Gumbel-max draw of rows whose kept set lies among their candidates: the token the whole row's draw picks
    (`argmax(_truncate(scaled) + _gumbel(noise_key, ids))`, first id of ties: everything else is -inf there), from K
    noise values instead of V. -> i32[S]."""
    val = jnp.where(c.kept, c.top + _gumbel(noise_key, c.top_ids), -jnp.inf)
    best = jnp.max(val, axis=-1, keepdims=True)
    return jnp.min(jnp.where(val == best, c.top_ids, V), axis=-1)


def _search_prefix(scaled, e, ids, top_k, top_mass, vocab: _Vocab) -> tuple[jax.Array, jax.Array]:
    """The end (t f32[S], cut i32[S]) of each row's top-k / top-p prefix over the whole row, by bisection: the
    prefix's last value t has the smallest order key for which "fewer than top_k tokens and less than top_mass of
    e lie strictly above it (or none does)" holds, a condition monotone in the key; then the tokens tied at t are
    cut by id. Counts are summed in float32 (exact below 2^24 tokens)."""
    S = scaled.shape[0]
    V = vocab.size

    def above(t):  # f32[S] -> how many tokens, and how much of e, lie strictly above t
        gt = scaled > t[:, None]
        return vocab.sum(jnp.where(gt, 1.0, 0.0)), vocab.sum(jnp.where(gt, e, 0.0))

    def halve(_, state):  # the smallest key whose value keeps "a token there, first of its ties" lies in [lo, hi]
        lo, hi, n_hi, w_hi = state  # (n_hi, w_hi): above(hi)
        mid = lo + (hi - lo) // 2
        n, w = above(_key_to_float(mid))
        ok = (n == 0) | ((n < top_k) & (w < top_mass))
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi), jnp.where(ok, n, n_hi), jnp.where(ok, w, w_hi)

    zero = jnp.zeros((S,), jnp.float32)  # nothing lies above +inf
    state = (jnp.full((S,), KEY_MIN, jnp.uint32), jnp.full((S,), KEY_MAX, jnp.uint32), zero, zero)
    _, hi, n, w = lax.fori_loop(0, _KEY_BITS, halve, state)
    t = _key_to_float(hi)

    # Tokens tied at t, in id order: the j-th is kept iff n + j < top_k and w + j * e_t < top_mass (or n + j is 0).
    tie = scaled == t[:, None]
    num_ties = vocab.sum(jnp.where(tie, 1.0, 0.0))
    e_t = vocab.max(jnp.where(tie, e, 0.0))
    by_mass = jnp.where(e_t > 0, jnp.ceil((top_mass - w) / e_t), jnp.inf)
    room = jnp.maximum(jnp.minimum(by_mass, top_k - n), (n == 0).astype(jnp.float32))
    num_kept = jnp.minimum(num_ties, room)

    def cut_ties(_):  # the smallest id c with num_kept ties below it: the ties keep their lowest ids
        def halve_ids(_, bounds):
            lo, hi = bounds
            mid = (lo + hi) // 2
            ok = vocab.sum(jnp.where(tie & (ids < mid[:, None]), 1.0, 0.0)) >= num_kept
            return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

        return lax.fori_loop(0, V.bit_length(), halve_ids, (jnp.zeros((S,), jnp.int32), jnp.full((S,), V)))[1]

    c = lax.cond(jnp.any(num_kept < num_ties), cut_ties, lambda _: jnp.full((S,), V), None)
    return t, c - 1


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(key: tuple[jax.Array, jax.Array], count: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32, 20 rounds (Salmon et al., SC'11): the hash behind `jax.random`, the same bits, on u32 arrays
    that broadcast (a key pair, a counter pair -> a pair). Written out because jax.random lowers it for the CPU as
    a five-iteration while loop, a loop over [S, V] of ~14 kernels, where the unrolled rounds are one elementwise
    fusion (`bench.sampler`: faster to compile and to run)."""
    k0, k1 = key
    ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(0x1BD11BDA))
    x0, x1 = count[0] + ks[0], count[1] + ks[1]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = x0 ^ ((x1 << r) | (x1 >> (32 - r)))
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x0, x1


def _row_key(seeds: jax.Array, purpose: int) -> tuple[jax.Array, jax.Array]:
    """u32[S] -> each row's key for `purpose` (0: the Gumbel noise, 1: the verify path's accept test), the key
    data of `jax.random.fold_in(jax.random.key(seed), purpose)`."""
    zero = jnp.zeros_like(seeds)
    return _threefry2x32((zero, seeds), (zero, zero + jnp.uint32(purpose)))


def _gumbel(key: tuple[jax.Array, jax.Array], ids: jax.Array) -> jax.Array:
    """Gumbel(0, 1) noise at vocabulary ids of each row's noise key (`_row_key(seeds, 0)`): u32[S] pair,
    i32[1 or S, N] -> f32[S, N]. Counter-based (a threefry hash of (key, id): the second word of `fold_in` of the id
    into the key), so any slice of the vocabulary gets the values the whole row has there."""
    k0, k1 = key
    v = ids.astype(jnp.uint32)
    _, bits = _threefry2x32((k0[:, None], k1[:, None]), (jnp.zeros_like(v), v))  # u32[S, Vl]
    # 23 random bits, centred: (k + 0.5) / 2^23 is exact in float32, so u is never 0 or 1 (no infinite noise)
    u = ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))
    return -jnp.log(-jnp.log(u))


def _uniform(seeds: jax.Array) -> jax.Array:
    """u32[S] -> f32[S] in [0, 1), each row's draw for the verify path's accept test: the value
    `jax.random.uniform` gives for the row's key (purpose 1) with jax's default partitionable threefry."""
    k0, k1 = _row_key(seeds, 1)
    zero = jnp.zeros_like(seeds)
    b0, b1 = _threefry2x32((k0, k1), (zero, zero))
    return lax.bitcast_convert_type(((b0 ^ b1) >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0


def _verify_split(scaled, greedy, is_random, draft_ids, uniform, gumbel, vocab: _Vocab):
    """`ops.verify_one_hot` on a vocabulary slice (the kernel needs whole rows). The same maths: accept the draft
    d with probability p(d) = e_d / z; the residual of a one-hot draft is p without d, so the draw is the Gumbel-max
    argmax with d masked out, on whichever shard holds it. scaled, gumbel: f32[S, Vl]; the rest [S]."""
    has_draft = draft_ids >= 0
    d = jnp.maximum(draft_ids, 0)
    e = jnp.exp(scaled - vocab.max(scaled)[:, None])
    p_d = vocab.take(e, d) / vocab.sum(e)
    masked = jnp.where(has_draft[:, None] & (vocab.ids(scaled.shape[-1]) == d[:, None]), -jnp.inf, scaled)
    # p(d) == 1 leaves nothing to draw from; then rejection has probability 0 and the row is never used.
    masked = jnp.where((vocab.max(masked) > -jnp.inf)[:, None], masked, scaled)
    token = jnp.where(is_random, vocab.argmax(masked + gumbel), greedy)
    accepted = has_draft & jnp.where(is_random, uniform < p_d, greedy == d)
    return token, accepted


# --- sampling ---------------------------------------------------------------------------------------------------


def sample(
    logits: jax.Array, s: SamplingInputs, *, max_logprobs: int, draft_ids: jax.Array | None = None, mesh=None,
    native_stats: bool = False,
) -> SamplerOutput:
    """logits: f32[S, V] -> SamplerOutput.

    With `draft_ids` (i32[S], -1 = none), each row is a speculative verify position: its draft token is accepted
    or rejected by lossless rejection sampling (`spec_decode/rejection.py`), and the row's token is the draft if
    accepted, else the token to emit if the sequence's walk stops at this row.
    `mesh`: the step's tensor-parallel mesh (None: one device); with tp > 1 dividing V, vocabulary-parallel (module
    docstring). Same results either way, up to the order of summation in the normalisers.
    `native_stats` (CPU, one device): each row's maximum, greedy argmax, normaliser and non-finite check come from
    one native pass (`cpu_kernels.row_stats`) instead of XLA:CPU's several; the same tokens, logprobs equal to float
    rounding.
    """
    vocab = _split_vocab(mesh, logits.shape[-1])
    if vocab is None:
        return _sample(logits, s, draft_ids, max_logprobs=max_logprobs, vocab=_Vocab(logits.shape[-1]),
                       native_stats=native_stats)
    body = functools.partial(_sample, max_logprobs=max_logprobs, vocab=vocab)
    return jax.shard_map(body, mesh=mesh, in_specs=(P(None, vocab.axis), P(), P()), out_specs=P(),
                         check_vma=False)(logits, s, draft_ids)


def _sample(logits, s: SamplingInputs, draft_ids, *, max_logprobs: int, vocab: _Vocab,
            native_stats: bool = False) -> SamplerOutput:
    """`sample` on a vocabulary slice: logits f32[S, Vl] (Vl = V unless split); every output is whole."""
    native_stats = native_stats and vocab.axis is None
    if native_stats:
        logits = logits.astype(jnp.float32)
        m, _, log_z, nonfinite = ops.row_stats(logits)
    else:
        nonfinite = vocab.any(jnp.isnan(logits) | (logits == jnp.inf))
        logits = logits.astype(jnp.float32)
    S, Vl = logits.shape

    def ban(x):  # a scatter copies the whole of x: only in steps where some row bans tokens
        return x.at[jnp.arange(S)[:, None], vocab.local(s.banned, Vl)].set(-jnp.inf, mode="drop")

    x = lax.cond(jnp.any(s.banned >= 0), ban, lambda x: x, logits)
    needs_penalty = jnp.any((s.repetition_penalty != 1) | (s.frequency_penalty != 0) | (s.presence_penalty != 0))
    x = lax.cond(needs_penalty, functools.partial(_penalise, vocab=vocab), lambda x, _: x, x, s)

    is_random = s.temperature > 0
    greedy = ops.row_stats(x)[1] if native_stats else vocab.argmax(x)

    needs_truncation = jnp.any(is_random & ((s.top_k > 0) | (s.top_p < 1) | (s.min_p > 0)))

    def scale(x):  # only in steps with a random row: greedy steps skip a pass over the vocabulary
        return x / jnp.where(is_random, s.temperature, 1.0)[:, None]

    if draft_ids is None:
        noise_key = _row_key(s.seeds, 0)

        def draw_dense(scaled):
            return vocab.argmax(scaled + _gumbel(noise_key, vocab.ids(Vl)))

        def draw_truncated(scaled):
            c = _candidates(scaled, s, vocab)
            # Rows whose kept set is among their candidates (greedy rows' draws are not used) draw from those
            # alone; one row that keeps more makes the whole step draw over the vocabulary. (The row's best
            # candidate as a max over all K: reading `top[:, 0]` made XLA sort whole rows instead of taking their
            # top K, ~25x slower.)
            fits = ~is_random | ((jnp.sum(c.kept, axis=-1) < c.kept.shape[-1]) & (jnp.max(c.top, axis=-1) > -jnp.inf))
            return lax.cond(jnp.all(fits), lambda: _draw_candidates(c, noise_key, vocab.size),
                            lambda: draw_dense(_truncate(scaled, s, vocab, c)))

        def draw(x):
            return lax.cond(needs_truncation, draw_truncated, draw_dense, scale(x))

        drawn = lax.cond(jnp.any(is_random), draw, lambda _: jnp.zeros((S,), jnp.int32), x)
        token_ids = jnp.where(is_random, drawn, greedy)
        accepted = jnp.zeros((S,), jnp.bool_)
    else:

        def verify(x, s):
            scaled = lax.cond(needs_truncation, functools.partial(_truncate, s=s, vocab=vocab), lambda x: x, scale(x))
            uniform = _uniform(s.seeds)
            gumbel = _gumbel(_row_key(s.seeds, 0), vocab.ids(Vl))
            if vocab.axis is None:
                return ops.verify_one_hot(scaled, greedy, is_random, draft_ids, uniform, gumbel)
            return _verify_split(scaled, greedy, is_random, draft_ids, uniform, gumbel, vocab)

        def verify_greedy(x, s):
            return greedy, (draft_ids >= 0) & (greedy == draft_ids)

        token, accepted = lax.cond(jnp.any(is_random), verify, verify_greedy, x, s)
        token_ids = jnp.where(accepted, draft_ids, token)

    if not native_stats:
        m, log_z = _normaliser(logits, vocab)
    chosen = vocab.take(logits, jnp.minimum(token_ids, vocab.size - 1))  # (V: a NaN row's argmax; flagged)

    def ranked(_):  # ranks by the logits themselves: the raw distribution's order, without its rounding
        ranks = 1 + vocab.sum(logits > chosen[:, None]).astype(jnp.int32)
        top, top_ids = vocab.top_k(logits, max_logprobs)
        return ranks, top_ids, (top - m[:, None]) - log_z[:, None]

    def unranked(_):
        return (jnp.zeros((S,), jnp.int32), jnp.zeros((S, max_logprobs), jnp.int32),
                jnp.zeros((S, max_logprobs), jnp.float32))

    ranks, top_ids, top_logprobs = lax.cond(jnp.any(s.wants_logprobs), ranked, unranked, None)
    return SamplerOutput(
        token_ids=token_ids,
        logprobs=(chosen - m) - log_z,
        ranks=ranks,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
        accepted=accepted,
        nonfinite=nonfinite,
    )


def prompt_logprobs(logits: jax.Array, targets: jax.Array, *, max_logprobs: int, mesh=None) -> PromptLogprobs:
    """Log-probabilities of each position's *next* prompt token. logits: f32[T, V], targets: i32[T] (-1 = none).
    `mesh` as for `sample`."""
    vocab = _split_vocab(mesh, logits.shape[-1])
    if vocab is None:
        return _prompt_logprobs(logits, targets, max_logprobs=max_logprobs, vocab=_Vocab(logits.shape[-1]))
    body = functools.partial(_prompt_logprobs, max_logprobs=max_logprobs, vocab=vocab)
    return jax.shard_map(body, mesh=mesh, in_specs=(P(None, vocab.axis), P()), out_specs=P(),
                         check_vma=False)(logits, targets)


def _prompt_logprobs(logits, targets, *, max_logprobs: int, vocab: _Vocab) -> PromptLogprobs:
    logits = logits.astype(jnp.float32)
    m, log_z = _normaliser(logits, vocab)
    chosen = vocab.take(logits, jnp.maximum(targets, 0))
    ranks = 1 + vocab.sum(logits > chosen[:, None]).astype(jnp.int32)
    top, top_ids = vocab.top_k(logits, max_logprobs)
    return PromptLogprobs(ranks, top_ids, (chosen - m) - log_z, (top - m[:, None]) - log_z[:, None])
