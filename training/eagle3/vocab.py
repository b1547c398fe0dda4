"""The draft vocabulary: which target tokens the head can propose, as speculators / EAGLE / SpecForge store it.

  ids   the `draft_vocab_size` most frequent target ids among loss-masked (output) tokens, ties broken by the lower
        id; padded with the lowest ids never seen when fewer distinct tokens occur; sorted ascending
  d2t   i64[Vd]  offsets: target id = draft id + d2t[draft id]
  t2d   bool[V]  membership: t2d[t] is True iff target id t is in the draft vocabulary (sum == Vd)
"""

from __future__ import annotations

import numpy as np


def token_counts(tokens: np.ndarray, loss_mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """i32[N] tokens, bool/u8[N] mask -> i64[V] counts of the masked tokens."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}) (got {tokens.min()}..{tokens.max()})")
    return np.bincount(tokens[np.asarray(loss_mask, bool)], minlength=vocab_size).astype(np.int64)


def draft_vocab_ids(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """i64[V] counts -> i64[Vd] target ids of the draft vocabulary, sorted ascending."""
    V = counts.shape[0]
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in [1, {V}] (the target vocabulary), got {draft_vocab_size}")
    ids = np.arange(V)
    order = np.lexsort((ids, -counts))  # most frequent first, then lower id
    seen = order[counts[order] > 0][:draft_vocab_size]
    unused = ids[counts == 0][: draft_vocab_size - seen.size]  # lowest never-seen ids
    return np.sort(np.concatenate([seen, unused])).astype(np.int64)


def vocab_mapping(ids: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted target ids i64[Vd] -> (d2t i64[Vd] offsets, t2d bool[V])."""
    ids = np.asarray(ids, np.int64)
    if np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"draft vocabulary ids must be strictly increasing within [0, {vocab_size})")
    t2d = np.zeros(vocab_size, bool)
    t2d[ids] = True
    return ids - np.arange(ids.size, dtype=np.int64), t2d


def coverage(counts: np.ndarray, t2d: np.ndarray) -> float:
    """Fraction of the counted (loss) tokens that the draft vocabulary contains."""
    total = counts.sum()
    return float(counts[t2d].sum() / total) if total else 0.0


def build_vocab(counts: np.ndarray, draft_vocab_size: int,
                keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (ids i64[Vd], d2t i64[Vd], t2d bool[V]). `keep`: target ids the vocabulary must hold (a head's vocabulary
    being grown), the rest chosen as usual among the other ids."""
    if keep is not None:
        keep = np.asarray(keep, np.int64)
        if keep.size > draft_vocab_size:
            raise ValueError(f"draft_vocab_size {draft_vocab_size} cannot hold the {keep.size} ids to keep")
        counts = counts.copy()
        counts[keep] = counts.max() + 1  # ranked first: all of them are chosen
    ids = draft_vocab_ids(counts, draft_vocab_size)
    d2t, t2d = vocab_mapping(ids, counts.shape[0])
    return ids, d2t, t2d
