"""PipelineEngine: pipeline parallelism with `pp` scheduler batches in flight across steps (vLLM's virtual engines).

A pipeline of p stages is busy only while p micro-batches are in it. Splitting each step into p micro-batches
(`LLMEngine` alone, `pipeline.py`) fills it within the step but drains it at every step's end, because the next
step is scheduled only when this one's tokens are back: (p - 1) / (M + p - 1) of the stage time is idle. Here the
engine holds p virtual engines, each an `LLMEngine` with its own scheduler and requests, sharing the one
`PipelineRunner` (weights, KV cache) and the one `BlockManager` (pages and prefix cache). Each `step()` settles the
oldest virtual engine's step in flight and dispatches its next one right away, so while virtual engine 0 waits for
the last stage, stage 0 already runs virtual engine 1's batch. In steady state every stage works on some batch;
the bubble is only where fewer than p virtual engines have work (a single request, say).

Why this is safe with shared pages: a virtual engine schedules (allocates, preempts, frees) only between settling
its own step and dispatching its next, and a step writes only pages its own sequences hold; pages another virtual
engine frees (an abort, a finished or preempted sequence) can go to a later step, which the devices run after
every step dispatched before it (each stage's KV cache passes from step to step, donated). A virtual engine
preempts only its own sequences: one holding every page makes progress alone and frees them.

Requests are routed to the virtual engine with the fewest unfinished sequences (then tokens to compute), as
DataParallelEngine routes by load; the prefix cache is shared, so any virtual engine gets the hits. Each virtual
engine's batch gets the full `max_num_seqs` / `max_num_batched_tokens` budget, as each engine step does.
Used for meshes with pp > 1 and dp = 1 without a device-side proposer (n-gram speculation runs: a proposer per
virtual engine); a draft model, or data-parallel replicas, keep `LLMEngine`'s within-step micro-batches.
"""

from __future__ import annotations

import dataclasses

from jaxserve.block_manager import BlockManager
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import DataParallelEngine
from jaxserve.engine import LLMEngine
from jaxserve.factory import build_engine_parts
from jaxserve.outputs import RequestOutput
from jaxserve.spec_decode import make_proposer

__all__ = ["PipelineEngine", "uses_virtual_engines"]


def uses_virtual_engines(engine_config: EngineConfig | None) -> bool:
    """Whether `make_engine` builds a PipelineEngine for this config (see the module docstring)."""
    mesh = None if engine_config is None else engine_config.mesh
    spec = None if engine_config is None else engine_config.speculative_config
    return mesh is not None and mesh.pp > 1 and mesh.dp == 1 and (spec is None or spec.method == "ngram")


class PipelineEngine(DataParallelEngine):
    """`mesh.pp` virtual engines over one pipeline; the LLMEngine interface (see the module docstring)."""

    def __init__(self, model: str | None, engine_config: EngineConfig):
        if not uses_virtual_engines(engine_config):
            raise ValueError("PipelineEngine needs a mesh with pp > 1, dp = 1 and no draft-model / EAGLE-3 proposer "
                             f"(got mesh {engine_config.mesh}); use LLMEngine")
        parts = build_engine_parts(model, engine_config)
        cfg = parts.config
        block_manager = BlockManager(cfg.num_pages, cfg.page_size, cfg.enable_prefix_caching)
        self.replicas: list[LLMEngine] = []
        for i in range(cfg.mesh.pp):
            proposer = parts.proposer if i == 0 or parts.proposer is None else make_proposer(
                cfg.speculative_config, cfg, parts.model_config, parts.runner)
            engine = LLMEngine(parts=dataclasses.replace(parts, proposer=proposer), block_manager=block_manager)
            engine.num_microbatches = 1  # the pipeline fills across steps, not within one
            self.replicas.append(engine)
        self.num_replicas = len(self.replicas)
        first = self.replicas[0]
        self.model_config, self.tokenizer, self.config = first.model_config, first.tokenizer, cfg
        self.runner, self.block_manager = parts.runner, block_manager
        self._owner: dict[str, int] = {}  # request id -> virtual engine
        self.num_routed = [0] * self.num_replicas
        self._pending: list = [None] * self.num_replicas  # each virtual engine's step in flight
        self._next = 0  # the virtual engine whose turn it is

    def route(self, token_ids: list[int] | None) -> int:
        """By load alone: the prefix cache is shared, every virtual engine sees the same hits."""
        return min(range(self.num_replicas), key=lambda i: (self._load(self.replicas[i]), i))

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas) or any(p is not None for p in self._pending)

    def step(self) -> list[RequestOutput]:
        """The next virtual engine's turn: settle its step in flight (its outputs), then dispatch its next step.
        Outputs come back one virtual engine at a time, so a turn may return none while the others run."""
        i = self._next
        self._next = (i + 1) % self.num_replicas
        engine, pending = self.replicas[i], self._pending[i]
        self._pending[i] = None
        outputs = [] if pending is None else engine.finish_step(pending)
        if engine.has_unfinished_requests():
            self._pending[i] = engine.begin_step()
        for o in outputs:
            if o.finished:
                self._owner.pop(o.request_id, None)
        return outputs

    def get_stats(self) -> dict:
        """LLMEngine.get_stats() over the virtual engines (their one block manager gives each the same KV usage
        and prefix hit rate); no per-replica breakdown: the virtual engines are not replicas."""
        stats = super().get_stats()
        stats.pop("replicas")
        return stats

    def shutdown(self) -> None:
        pass
