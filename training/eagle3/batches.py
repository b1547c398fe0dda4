"""Feature samples -> fixed-shape TTT batches, so the train step compiles a few shapes only.

A sample of length n with a prompt of P tokens becomes one row padded to the smallest length bucket T >= n. Its
window (the chains that can reach an output token within `num_steps` steps, see ttt.py) starts at
r0 = max(0, P - 1 - num_steps) and is padded to the smallest window bucket W >= n - r0 (W <= T; r0 moves left when
r0 + W > T: the extra chains predict prompt tokens and are masked). Samples are grouped by (T, W); a group's
batches hold B = max(1, batch_tokens // max(W, T // 4)) rows (batch_tokens counts trained window positions, with
long prompts charged a quarter of their padded length for the step-0 pass); a last partial batch is filled with
empty rows (length 0: every mask false).

Training takes the batches from a `BatchStream`: every epoch re-plans (reshuffles) the training samples with one
generator, and the stream's position is small enough to checkpoint.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxserve.batch import smallest_at_least
from training.eagle3.features import FeatureStore
from training.eagle3.ttt import TTTBatch


@dataclass(frozen=True)
class BatchPlan:
    length: int  # T
    window: int  # W
    samples: tuple[int, ...]  # sample ids; fewer than `rows` -> empty rows
    rows: int  # B


def shape_of(n: int, prompt_len: int, num_steps: int, len_buckets, win_buckets) -> tuple[int, int, int]:
    """-> (T, W, r0) for one sample."""
    T = smallest_at_least(len_buckets, n)
    r0 = max(0, prompt_len - 1 - num_steps)
    W = smallest_at_least(tuple(sorted({w for w in win_buckets if w < T} | {T})), n - r0)
    return T, W, min(r0, T - W)


def plan_batches(store: FeatureStore, sample_ids, *, num_steps: int, len_buckets, win_buckets, batch_tokens: int,
                 rng: np.random.Generator | None = None) -> list[BatchPlan]:
    """Group `sample_ids` by shape into batches; shuffled (within groups and the batch order) when `rng` is given."""
    if max(store.lengths[list(sample_ids)], default=0) > max(len_buckets):
        raise ValueError(f"samples are longer than the largest length bucket {max(len_buckets)}; add a bucket")
    groups = defaultdict(list)
    for s in sample_ids:
        T, W, _ = shape_of(int(store.lengths[s]), int(store.prompt_lens[s]), num_steps, len_buckets, win_buckets)
        groups[(T, W)].append(int(s))
    plans = []
    for (T, W), ids in sorted(groups.items()):
        if rng is not None:
            rng.shuffle(ids)
        B = max(1, batch_tokens // max(W, T // 4))
        plans += [BatchPlan(T, W, tuple(ids[i : i + B]), B) for i in range(0, len(ids), B)]
    if rng is not None:
        rng.shuffle(plans)
    return plans


class BatchStream:
    """The training batches in order: epoch after epoch, each planned by `plan(rng)` with one generator seeded `seed`.

    `position()` -> {epoch, taken, rng_state}: the epochs started, the batches taken from the current one, and the
    generator's state before that epoch was planned. `seek(position)` plans the epoch again from that state and skips
    the batches taken, which leaves the generator where it was: the rest of the stream is the one the saved run would
    have drawn, batch for batch.
    """

    def __init__(self, plan: Callable[[np.random.Generator], list[BatchPlan]], seed: int):
        self._plan = plan
        self._rng = np.random.default_rng(seed)
        self._epoch_start = self._rng.bit_generator.state
        self._pending: list[BatchPlan] = []
        self.epoch, self.taken = 0, 0

    def next(self) -> BatchPlan:
        if not self._pending:
            self._epoch_start = self._rng.bit_generator.state
            self._pending = self._plan(self._rng)
            if not self._pending:
                raise ValueError("an epoch has no batches: no training samples")
            self.epoch, self.taken = self.epoch + 1, 0
        self.taken += 1
        return self._pending.pop()

    def position(self) -> dict:
        return dict(epoch=self.epoch, taken=self.taken, rng_state=self._epoch_start)

    def seek(self, position: dict) -> None:
        self._rng.bit_generator.state = position["rng_state"]
        self._epoch_start, self._pending = position["rng_state"], []
        self.epoch, self.taken = position["epoch"], 0
        if self.epoch:
            self._pending = self._plan(self._rng)
            if not 0 <= position["taken"] <= len(self._pending):
                raise ValueError(f"data position {position['taken']} is past the {len(self._pending)} batches of "
                                 "the epoch: the samples or the batch settings changed")
            del self._pending[len(self._pending) - position["taken"]:]  # next() pops from the end
            self.taken = position["taken"]


def assemble(store: FeatureStore, plan: BatchPlan, num_steps: int, len_buckets, win_buckets) -> TTTBatch:
    """Host numpy batch (float32 features) for one plan."""
    B, T, W = plan.rows, plan.length, plan.window
    D = store.meta["hidden_size"]
    aux = np.zeros((B, T, 3 * D), np.float32)
    hid = np.zeros((B, T, D), np.float32)
    tokens = np.zeros((B, T), np.int32)
    tam = np.zeros((B, T), np.int32)
    is_out = np.zeros((B, T), bool)
    lengths = np.zeros(B, np.int32)
    wpos = np.tile(np.arange(W, dtype=np.int32), (B, 1))
    for b, s in enumerate(plan.samples):
        rows, n = store.rows(s), int(store.lengths[s])
        aux[b, :n], hid[b, :n] = store.aux[rows], store.hidden[rows]
        tokens[b, :n], tam[b, :n], is_out[b, :n] = store.tokens[rows], store.target_argmax[rows], store.is_output[rows]
        lengths[b] = n
        _, _, r0 = shape_of(n, int(store.prompt_lens[s]), num_steps, len_buckets, win_buckets)
        wpos[b] += r0
    return TTTBatch(aux=aux, target_hidden=hid, tokens=tokens, target_argmax=tam, is_output=is_out, lengths=lengths,
                    window_pos=wpos)
