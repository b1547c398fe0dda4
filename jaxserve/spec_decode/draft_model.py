"""Draft-model proposer: a small model with the same tokenizer guesses K tokens, the target verifies them.

The draft keeps its own paged KV cache with the *target's* page ids: page p of the draft cache holds the draft's
keys and values for the same tokens as page p of the target cache, so the block manager, prefix sharing and
preemption need nothing new. Drafting happens after scheduling, into the pages the scheduler reserved for the
verify step (the last token plus K drafts), in two kinds of passes over a ragged batch:

  1. catch-up: every drafting sequence runs the tokens the draft has not seen yet (its whole prompt the first
     time, afterwards the tokens accepted last step), chunked to the token budget; the last pass also samples
     draft 1;
  2. K - 1 single-token passes, each feeding the previous draft and sampling the next.

Drafts are the draft model's greedy choices (a one-hot proposal), which the rejection sampler verifies exactly
for any target temperature; only the acceptance rate, not the output distribution, depends on this choice.
`seq.draft_num_computed` counts the tokens whose draft KV is valid; rejected drafts' KV is overwritten later.
"""

from __future__ import annotations

import logging

import numpy as np

from jaxserve import sharding
from jaxserve.batch import ScheduledSeq, StepBatch, build_step_inputs, choose_bucket
from jaxserve.config import EngineConfig, ModelConfig, SpeculativeConfig
from jaxserve.loader import load_checkpoint
from jaxserve.loader.weights import to_weights
from jaxserve.sampler import SamplingInputs
from jaxserve.spec_decode.proposer import Proposer

logger = logging.getLogger(__name__)


class DraftModelProposer(Proposer):
    """Drafts after scheduling, into the pages the scheduler reserved for the verify step."""

    def __init__(self, spec: SpeculativeConfig, engine_cfg: EngineConfig, target: ModelConfig):
        import jax.numpy as jnp

        from jaxserve.runner import ModelRunner

        # `speculative_config.quantization`, else the target's weight scheme; the target's "gguf" (which only a
        # quantized GGUF has) lets the draft model pick its own
        if spec.quantization is not None:
            scheme = spec.quantization
        else:
            scheme = None if engine_cfg.quantization == "gguf" else engine_cfg.quantization
        ckpt = load_checkpoint(spec.model, scheme)
        self.scheme = ckpt.quantization  # its weights' scheme, as loaded
        if ckpt.config.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_config.model {spec.model!r} has vocab_size {ckpt.config.vocab_size}, the target has "
                f"{target.vocab_size}: a draft model must share the target's tokenizer"
            )
        # on a sharded target the draft model runs whole on the target's first device: it shares no arrays with
        # the target (tokens travel through the host), and is small enough that splitting it would cost more
        mesh_cfg = None if engine_cfg.mesh is None else engine_cfg.mesh.first_device()
        # its own steps are built and run synchronously, inside the target step's proposal
        self.cfg = engine_cfg.replace(speculative_config=None, mesh=mesh_cfg, async_scheduling=False)
        weights = to_weights(ckpt.config, ckpt.tensors, jnp.dtype(engine_cfg.dtype), ckpt.path, ckpt.quantization)
        self.runner = ModelRunner(ckpt.config, self.cfg, weights, engine_cfg.dtype,
                                  mesh=None if mesh_cfg is None else sharding.make_mesh(mesh_cfg))
        logger.info("draft model %s: %d layers, quantization=%s", spec.model, ckpt.config.num_layers,
                    ckpt.quantization)

    @property
    def num_compiles(self) -> int:
        return self.runner.num_compiles

    def warmup(self) -> None:
        self.runner.warmup()

    def draft(self, seq, k: int) -> None:
        return None  # placeholders: drafted in `after_schedule`, once the verify step's pages are reserved

    def after_schedule(self, work) -> None:
        """Fill `seq.spec_token_ids[:w.num_draft]` for every scheduled sequence that verifies drafts."""
        items = [w for w in work if w.num_draft > 0]
        if not items:
            return
        drafts = {w.seq.seq_id: [] for w in items}
        # 1. catch-up (chunked to the budget); a sequence's last chunk samples its first draft
        pending = {w.seq.seq_id: w.seq.draft_num_computed for w in items}
        while pending:
            batch, budget = [], self.cfg.max_num_batched_tokens
            for w in items:
                start = pending.get(w.seq.seq_id)
                if start is None or budget == 0 or len(batch) == self.cfg.max_num_seqs:
                    continue
                n = min(w.seq.num_tokens - start, budget)
                batch.append((w, start, w.seq.token_ids[start : start + n]))
                budget -= n
            tokens = self._run(batch)
            for (w, start, toks), t in zip(batch, tokens):
                end = start + len(toks)
                if end == w.seq.num_tokens:
                    del pending[w.seq.seq_id]
                    drafts[w.seq.seq_id].append(t)
                else:
                    pending[w.seq.seq_id] = end
        # 2. one token at a time: feed draft i, sample draft i + 1
        for i in range(1, max(w.num_draft for w in items)):
            batch = [(w, w.seq.num_tokens + i - 1, drafts[w.seq.seq_id][-1:]) for w in items if w.num_draft > i]
            for (w, _, _), t in zip(batch, self._run(batch)):
                drafts[w.seq.seq_id].append(t)
        for w in items:
            w.seq.spec_token_ids = drafts[w.seq.seq_id]
            w.seq.draft_num_computed = w.seq.num_tokens + w.num_draft - 1

    def verified(self, seq, num_tokens_before: int, num_draft: int, num_accepted: int) -> None:
        """After verification, the draft KV is valid up to the last accepted draft it consumed."""
        seq.draft_num_computed = min(seq.draft_num_computed, num_tokens_before + min(num_accepted, num_draft - 1))

    def _run(self, batch: list) -> list[int]:
        """One draft pass over [(work, start position, tokens)] -> the greedy next token of each sequence."""
        seqs = [ScheduledSeq(list(toks), start, w.seq.page_ids) for w, start, toks in batch]
        cfg = self.cfg
        bucket = choose_bucket(
            sum(len(s.token_ids) for s in seqs),
            max(len(s.page_ids) for s in seqs),
            cfg.token_buckets,
            cfg.page_buckets,
            cfg.max_num_seqs,
        )
        inputs = build_step_inputs(seqs, bucket, cfg.page_size)
        sampling = SamplingInputs.neutral(bucket.rows, bucket.max_pages * cfg.page_size)  # all greedy
        out, _ = self.runner.run(bucket, StepBatch(inputs, sampling))
        return [int(t) for t in np.asarray(out.token_ids[: len(seqs)])]
