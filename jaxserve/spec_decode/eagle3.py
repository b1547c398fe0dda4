"""EAGLE-3 proposer: a one-layer head drafts from the target's own hidden states (`model/eagle3.py`).

Pairing (vLLM's convention). The head's input at position p is the pair (target feature f_p, token t_{p+1}):
f_p is the target's residual stream entering the three `aux_layer_ids` layers at position p (the state that
predicted t_{p+1}), and the pair predicts t_{p+2}. The head's KV for that pair lives at slot p of the sequence's
pages. Draft j >= 2 is fed draft j-1 at position n-3+j (n = tokens in the sequence) with the head's own output
hidden state from the previous draft step in place of a target feature.

When. Features exist only after a target step, so drafts for step s+1 are made at the end of step s
(`after_step`, called by the engine's postprocess with the step's features still on device):
  1. catch-up: for every sequence of the step, the pairs of the positions the target computed *and kept* this
     step (prefill chunks; the verified token plus accepted drafts), laid out in the step's own token bucket so the
     feature gather needs no reshuffling; afterwards the head's KV is valid exactly where the target's is;
  2. for every sequence that is now decoding, K - 1 single-token passes (a `lax.while_loop` in the same
     executable whose trip count is the largest K asked for, so one executable serves every K).
K per sequence is the request's cap, further cut to `k_hint`: the K the engine's controller would choose for the
next step (it is asked here, before that step exists), so the head does not pay for drafts that will not be
verified. The drafts wait in `seq.spec_token_ids`; the next step's `_propose` cuts them to the K it chooses and
the scheduler verifies as many as fit its budget. One executable per target bucket.

Drafts on the device. Where the target runs on one device, the drafts are not fetched: the head's output array
becomes the next target step's input (`ModelRunner.drafts`), `seq.spec_token_ids` holds placeholders (the scheduler
only counts them) and `seq.spec_draft_slot` their offset in the array, and the step takes them from there
(`StepBatch.draft_feed`; the sampler checks each verify row against the token its next position took). So the host
builds and dispatches the verify step while the head still runs, instead of waiting for the head's drafts first:
at batch 1 on the CPU, K = 3 every step, 1.13x the tokens per second of fetching them (4 alternating rounds, the
same drafts verified and accepted). A catch-up that drafts nothing is still waited for (the engine times the head
into the step that ran it, so the controller prices no speculation without it), and a run that drafts for a
request with penalties fetches (its verify rows' token history holds the drafts).

Off. When the controller would not speculate next step (`k_hint` = 0: a loaded server, where a verify step costs
more than its accepted drafts earn), the head does not run at all -- its catch-up alone measured ~6% of a 32-row
SmolLM2 step on the CPU, enough to make "speculation on but idle" slower than no speculation. The sequences it
skipped have a hole in their head KV from then on, so they are marked `spec_disabled` and never draft again
(preemption clears the mark: the recomputed prefill rebuilds the head KV); sequences that arrive later start with
the head on. Requests that opted out (`num_speculative_tokens=0`) are never caught up. A prefix-cache hit on pages
written while the head was off reuses stale head KV: drafts get worse there, output stays exact. With async
scheduling, a step that lands while the next one is already in flight (built without drafts) gets a catch-up only
(`draft_cap` 0), or the head is off as above when the controller would not speculate (k_hint = 0).

Pages. The head's cache uses the target's page ids (page p of both caches holds the same positions), so
allocation, sharing and preemption need nothing new. Draft passes write slots n-1 .. n+K-3, which may lie past the
pages the sequence holds (those cover the n - 1 computed tokens; the scheduler allocates the rest for the verify
step, after the head ran). The head's cache has one scratch page per step row beyond the target's page ids: the
draft passes see it as the page after a row's last held one, so a draft never lands in a page the sequence does not
own and K is not cut at a page's end (it was, to fit the held pages, and lost ~2% of the drafts on chat replies at
16-token pages, ~1 in 4 steps at 4); only K > page_size + 1 is capped. Draft KV is dead once its step is verified:
the next catch-up writes the accepted positions into the real pages, and rejected drafts' slots are overwritten.

Preemption drops the target KV and with it the head's (both recomputed, and the head catches up along the
prefill). Prefix caching: a cached page's head KV was written by the sequence that computed it, and its last slot
pairs the page's last position with the *next* page's first token, which a new sequence may not share. The head
remembers, per page hash, the token it paired that slot with (`_pairs`); a hit whose next token is the same reuses
every cached page (a shared system prompt that ends past a page boundary: the common case), otherwise the
scheduler reuses one page fewer (`reusable_prefix`: that page is recomputed, which also yields the features the
catch-up needs).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.batch import Bucket, ScheduledSeq, StepInputs, build_step_inputs, choose_bucket, slot_of
from jaxserve.config import EngineConfig, ModelConfig, SpeculativeConfig, kv_storage_dtype
from jaxserve.kv_cache import KVCache, init_kv_cache
from jaxserve.loader.eagle3 import load_eagle3
from jaxserve.model.eagle3 import (
    Eagle3Config,
    Eagle3Weights,
    draft_logits,
    eagle3_forward,
    greedy_target_ids,
    store_head,
)
from jaxserve.packing import Layout
from jaxserve.runner import ProposerRunner, linear_kernel
from jaxserve.spec_decode.proposer import Proposer
from jaxserve.spec_decode.rejection import NO_DRAFT

logger = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CatchUpInputs:
    """One head step's inputs (packed into one transfer like the target's `StepBatch`)."""

    step: StepInputs  # the catch-up pass: pairs (f_p, t_{p+1}) of the positions the target kept this step
    feature_rows: jax.Array  # i32[T]  the target step's token row whose feature each catch-up token pairs with
    draft_pos: jax.Array  # i32[S]  n - 1: where each sequence's first draft pass writes
    num_draft: jax.Array  # i32[S]  drafts wanted per sequence (0 = catch-up only)
    num_pages: jax.Array  # i32[S]  pages each sequence holds: its draft passes see the row's scratch page next


def draft_fn(
    cfg: Eagle3Config,
    k: int,
    max_seqs: int,
    page_size: int,
    scratch: int,  # the first scratch page (the target's page count): row s drafts past its pages into scratch + s
    backends,  # ops.Backends: the target's
    weights: Eagle3Weights,
    embed: jax.Array,  # f[V, D]  the target's embedding
    kv: KVCache,  # [1, P, page_size, K, H]
    aux: jax.Array,  # f[T, 3D]  the target step's features, in its token order
    packed: jax.Array,  # i32[*]  a CatchUpInputs
    *,
    layout: Layout,
) -> tuple[jax.Array, KVCache]:
    """Catch-up pass + max(num_draft) - 1 draft passes -> (drafts i32[max_seqs * k] in target ids, kv): sequence
    s's j-th draft at s * k + j (one shape for every bucket, so the target's step can take it as an input); drafts
    past a sequence's num_draft are unspecified."""
    a: CatchUpInputs = layout.unpack(packed)
    inputs = a.step
    S = a.num_draft.shape[0]
    # the head's KV for every caught-up pair; its output only for each sequence's last one (the first draft's)
    h, normed, kv = eagle3_forward(cfg, weights, embed, kv, inputs, aux[a.feature_rows], from_target=True,
                                   backends=backends, last_only=True)
    tok = greedy_target_ids(weights, draft_logits(weights, normed))
    P = inputs.block_tables.shape[1]
    seq_idx = jnp.arange(S, dtype=jnp.int32)
    # the draft passes' block table: each row's scratch page right after its held ones (rows holding P pages have
    # none; their K was capped to fit)
    bt = jnp.where(jnp.arange(P)[None, :] == a.num_pages[:, None], scratch + seq_idx[:, None], inputs.block_tables)

    def more(carry):
        return carry[0] < jnp.max(a.num_draft)  # the step's trip count is data: no pass nobody asked for

    def step(carry):
        j, tok, h, kv, drafts = carry
        active = j < a.num_draft  # this sequence still wants draft j + 1
        p = jnp.where(active, a.draft_pos + j - 1, 0)  # inactive rows: position 0, writing the sink slot
        page = bt[seq_idx, jnp.minimum(p // page_size, P - 1)]
        one = StepInputs(
            token_ids=tok,
            positions=p,
            slot_mapping=jnp.where(active, slot_of(page, p, page_size), 0),
            block_tables=bt,
            seq_lens=p + 1,
            cu_q_lens=jnp.arange(S + 1, dtype=jnp.int32),
            num_seqs=jnp.asarray(S, jnp.int32),
            logits_indices=seq_idx,
        )
        h, normed, kv = eagle3_forward(cfg, weights, embed, kv, one, h, from_target=False, backends=backends)
        tok = greedy_target_ids(weights, draft_logits(weights, normed))
        return j + 1, tok, h, kv, drafts.at[:, j].set(tok)

    drafts = jnp.zeros((S, k), jnp.int32).at[:, 0].set(tok)
    _, _, _, kv, drafts = jax.lax.while_loop(more, step, (jnp.asarray(1, jnp.int32), tok, h, kv, drafts))
    return jnp.zeros(max_seqs * k, jnp.int32).at[: S * k].set(drafts.reshape(-1)), kv


def head_scheme(spec: SpeculativeConfig, target_scheme: str | None) -> str:
    """The weight scheme of the head's linear maps: `speculative_config.quantization`, else the target's (a GGUF
    target's blocks: int8). The head's passes are ~1/4 of a K = 3 step at batch 1 on the CPU (~2 ms in 7): beside
    the default Q4_1 target, 12 chat prompts at K = 3, the head in bf16 / int8 / int4 ran 152-181 / 176-195 /
    192-208 tok/s (two rounds) and accepted 1.869 / 1.853 / 1.841 tokens per verify step."""
    if spec.quantization is not None:
        return spec.quantization
    if target_scheme == "gguf":
        return "int8"
    return target_scheme or "none"


class Eagle3Proposer(Proposer):
    """Drafts are made in `after_step` from the target's features and wait in seq.spec_token_ids."""

    def __init__(self, spec: SpeculativeConfig, engine_cfg: EngineConfig, target: ModelConfig, runner):
        self.engine_cfg = engine_cfg
        self.k = spec.num_speculative_tokens
        self.dtype = jnp.dtype(engine_cfg.dtype)
        self.cfg, host = load_eagle3(spec.model, target, self.dtype)
        if tuple(runner.hidden_layer_ids) != self.cfg.aux_layer_ids:
            raise ValueError(
                f"the target runner captures layers {runner.hidden_layer_ids}, the head needs {self.cfg.aux_layer_ids}"
            )
        kv_dtype = kv_storage_dtype(engine_cfg.kv_cache_dtype, engine_cfg.dtype)
        # the target's page ids, then one scratch page per step row for drafts past a sequence's pages
        kv = init_kv_cache(self.cfg.layer, engine_cfg.num_pages + engine_cfg.max_num_seqs, engine_cfg.page_size,
                           kv_dtype)
        # the head runs on the target's kernels: attention, and its linear maps stored for them (`store_head`)
        # On a tensor-parallel target the head runs replicated on the target's devices, beside the features and the
        # (vocabulary-sharded) embedding it reads there; its attention is not split by heads.
        backends = dataclasses.replace(runner.backends, mesh=None)
        self.scheme = head_scheme(spec, engine_cfg.quantization)
        host = store_head(host, self.scheme, linear_kernel(backends))  # the target's kernels for its linear maps
        fn = functools.partial(draft_fn, self.cfg, self.k, engine_cfg.max_num_seqs, engine_cfg.page_size,
                               engine_cfg.num_pages, backends)
        self.runner = ProposerRunner(fn, host, kv, shared=runner.head_embed, sharding=runner._replicated)
        # Drafts on the device: the target runner takes the next step's drafts from the head's output without the
        # host fetching them (`ModelRunner.drafts`), where it can (one device); `drafts_on_device` turns it off.
        self.target = runner
        self.drafts_on_device = getattr(runner, "drafts", None) is not None
        self._device_owners: list = []  # the sequences whose spec_token_ids are placeholders for the device drafts
        self._layouts: dict[Bucket, Layout] = {}
        # page hash -> the token the head paired the page's last slot with (module doc), the oldest dropped past
        # a bound (a page's hash outlives its page in the cache only until it is recomputed or evicted)
        self._pairs: dict[int, int] = {}
        self._max_pairs = 4 * engine_cfg.num_pages
        logger.info(
            "EAGLE-3 head %s: draft vocab %d, target layers %s (input convention), linear maps as %s",
            spec.model, self.cfg.draft_vocab_size, list(self.cfg.aux_layer_ids), self.scheme,
        )

    # ---- compilation ----------------------------------------------------------------------------------------

    @property
    def num_compiles(self) -> int:
        return self.runner.num_compiles

    def _inputs(self, b: Bucket, seqs: list[ScheduledSeq] = ()) -> CatchUpInputs:
        """The head step's host inputs for bucket `b` (all padding when `seqs` is empty)."""
        S = b.num_seqs
        return CatchUpInputs(
            build_step_inputs(list(seqs), b, self.engine_cfg.page_size),
            np.zeros(b.num_tokens, np.int32), np.zeros(S, np.int32), np.zeros(S, np.int32), np.zeros(S, np.int32),
        )

    def _layout(self, b: Bucket) -> Layout:
        if b not in self._layouts:
            self._layouts[b] = Layout.of(self._inputs(b))
        return self._layouts[b]

    def _bucket(self, num_tokens: int, num_pages: int) -> Bucket:
        cfg = self.engine_cfg
        return choose_bucket(num_tokens, num_pages, cfg.token_buckets, cfg.page_buckets, cfg.max_num_seqs)

    def warmup(self) -> None:
        cfg = self.engine_cfg
        for t in cfg.token_buckets:
            for p in cfg.page_buckets:
                b = self._bucket(t, p)
                aux = jax.ShapeDtypeStruct((t, 3 * self.cfg.layer.hidden_size), self.dtype)
                self.runner.executable(self._layout(b), aux)

    # ---- the proposer interface -----------------------------------------------------------------------------

    def draft(self, seq, k: int) -> list[int]:
        """Drafted at the end of the previous step (on the host, or placeholders for drafts on the device; those of
        a run since replaced are no drafts)."""
        if seq.spec_draft_slot < 0 and seq.spec_token_ids[:1] == [NO_DRAFT]:
            return []
        return seq.spec_token_ids[:k]

    def drafts_of(self, seq) -> list[int]:
        """`seq`'s drafts as token ids, fetched if they are on the device (for tests and debugging)."""
        if seq.spec_draft_slot < 0:
            return list(seq.spec_token_ids)
        at = seq.spec_draft_slot
        return [int(x) for x in np.asarray(self.target.drafts)[at : at + len(seq.spec_token_ids)]]

    def reusable_prefix(self, seq, hit: int) -> int:
        """All `hit` cached tokens if the head paired the last cached page's last slot with the token `seq` has
        next; else one page fewer (module doc). A sequence preempted with a token in flight (async scheduling) may
        hit on every token it knows: its next one is not known yet, so the pairing cannot be checked."""
        ps = self.engine_cfg.page_size  # `hit` is whole pages, their hashes in seq.page_hashes (reuse_prefix)
        if hit < len(seq.token_ids) and self._pairs.get(seq.page_hashes[hit // ps - 1]) == seq.token_ids[hit]:
            return hit
        return hit - ps

    # `verified`: nothing to roll back, the next catch-up overwrites the slots of rejected drafts.

    def after_step(self, work, starts: list[int], ends: list[int], aux: jax.Array, draft_cap, k_hint=None) -> None:
        """Catch the head up on what the target kept this step and draft for every decoding sequence.

        `work`: the step's ScheduledWork (in token order); work[i] computed and kept the tokens starts[i] ..
        ends[i] - 1 (with async scheduling the sequence may have moved on since); `aux`: the step's features
        f[T, 3D] on device (`ModelRunner.last_hidden`); `draft_cap(seq)`: the most drafts the engine lets `seq`
        verify (K, the request's cap, its end; 0 = catch up only); `k_hint`: draft at most this many per sequence
        (None: no further limit; 0 = the head is off, see the module doc)."""
        ps, max_pages = self.engine_cfg.page_size, self.engine_cfg.max_pages_per_seq
        seqs, feature_rows, draft_pos, num_draft, owners, pages_seen = [], [], [], [], [], []
        t = 0
        for w, start, end in zip(work, starts, ends):
            seq, row0 = w.seq, t
            t += w.num_tokens
            n_valid = end - start
            if n_valid <= 0 or not seq.page_ids or seq.spec_disabled:
                continue
            if k_hint == 0 or seq.params.num_speculative_tokens == 0:
                seq.spec_disabled = True  # no catch-up: its head KV has a hole from here on (see the module doc)
                continue
            n = seq.num_tokens
            # pair (f_p, t_{p+1}) for the positions p the target computed and kept this step
            seqs.append(ScheduledSeq(seq.token_ids[start + 1 : start + 1 + n_valid], start, seq.page_ids))
            for p in range(start + ps - 1 - start % ps, start + n_valid, ps):  # pages whose last slot this writes
                if p // ps < len(seq.page_hashes):
                    self._pairs.pop(seq.page_hashes[p // ps], None)  # re-inserted as the newest
                    self._pairs[seq.page_hashes[p // ps]] = seq.token_ids[p + 1]
            feature_rows.extend(range(row0, row0 + n_valid))
            k, held = 0, len(seq.page_ids)
            if not seq.is_finished and seq.num_uncomputed_tokens == 1:
                k = draft_cap(seq) if k_hint is None else min(draft_cap(seq), k_hint)
                # every draft KV write lands in a held page or the scratch page after them (when the row's block
                # table has a column left for it)
                k = min(k, (held + (held < max_pages)) * ps - n + 2)
            draft_pos.append(n - 1)
            num_draft.append(max(k, 0))
            pages_seen.append(held + (n + k - 2 > held * ps))  # block-table columns the row's passes read
            owners.append(seq)
            seq.draft_num_computed = end
        while len(self._pairs) > self._max_pairs:
            del self._pairs[next(iter(self._pairs))]
        for seq in self._device_owners:  # the last run's device drafts are about to be replaced
            seq.spec_draft_slot = -1  # placeholders left (a step being retried in parts) verify as no drafts
        self._device_owners = []
        if not seqs:
            return
        b = self._bucket(aux.shape[0], max(pages_seen))
        inputs = self._inputs(b, seqs)
        inputs.feature_rows[: len(feature_rows)] = feature_rows
        inputs.draft_pos[: len(seqs)] = draft_pos
        inputs.num_draft[: len(seqs)] = num_draft
        inputs.num_pages[: len(seqs)] = [len(s.page_ids) for s in seqs]
        # Drafts stay on the device when the host needs nothing from them: the next step takes them from there
        # (`StepBatch.draft_feed`) and is built while the head runs. A catch-up that drafts nothing still waits for
        # the head, so that its time is the step's (the controller prices no speculation without it), and a
        # request with penalties needs its drafts on the host (its verify rows' token history).
        drafting = [seq for seq, k in zip(owners, num_draft) if k]
        device = self.drafts_on_device and drafting and not any(s.params.has_penalties for s in drafting)
        drafts = self.runner.run(self._layout(b), inputs, aux, fetch=not device)  # i32[max_seqs * K]
        if device:
            self.target.drafts = drafts
            for i, (seq, k) in enumerate(zip(owners, num_draft)):
                if k:
                    seq.spec_token_ids, seq.spec_draft_slot = [NO_DRAFT] * k, i * self.k
                    self._device_owners.append(seq)
            return
        for i, (seq, k) in enumerate(zip(owners, num_draft)):
            if k:
                seq.spec_token_ids = [int(x) for x in drafts[i * self.k : i * self.k + k]]
