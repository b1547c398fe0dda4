"""DataParallelEngine: `mesh.dp` independent LLMEngine replicas behind the one LLMEngine interface.

Replica i is a whole engine (weights, KV cache, scheduler, prefix cache) on its own slice of the devices,
`MeshConfig.replica(i)` (dp = 1, the same pp x tp inside). Nothing is shared between replicas: a request lives on
one replica from add_request to its final output.

Routing (`add_request`): the replica whose prefix cache already holds the longest prefix of the prompt, in whole
pages (`BlockManager.num_cached_prefix_tokens`), unless that replica has more than a batch (`max_num_seqs`) of
unfinished sequences beyond the least loaded one; otherwise, and among equal hits, the least loaded replica by
unfinished sequences, then by tokens still to compute; ties go to the lowest index, so routing is deterministic.
Only pages already computed count: prompts added together before a step (an offline batch) are routed by load.

step(): every replica with unfinished requests steps once, concurrently on a small thread pool (JAX releases the
GIL while a step executes, so replicas really run in parallel); the outputs come back in replica order. A replica
whose step raises (EngineDeadError) raises out of step(): the front end treats the whole engine as dead, so
readiness means every replica is alive.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from jaxserve import sharding
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine, PromptType
from jaxserve.errors import InvalidRequestError
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

__all__ = ["DataParallelEngine", "make_engine"]


def make_engine(model: str | None, engine_config: EngineConfig | None):
    """An LLMEngine; a DataParallelEngine when the config's mesh has dp > 1; a PipelineEngine (pp batches in flight
    across steps) when it has pp > 1 (`pipeline_engine.uses_virtual_engines`)."""
    from jaxserve.pipeline_engine import PipelineEngine, uses_virtual_engines

    if engine_config is not None and engine_config.mesh is not None and engine_config.mesh.dp > 1:
        return DataParallelEngine(model, engine_config)
    if uses_virtual_engines(engine_config):
        return PipelineEngine(model, engine_config)
    return LLMEngine(model, engine_config)


class DataParallelEngine:
    def __init__(self, model: str | None, engine_config: EngineConfig):
        mesh = engine_config.mesh
        if mesh is None or mesh.dp < 2:
            raise ValueError(f"DataParallelEngine needs a mesh with dp >= 2 (got {mesh}); use LLMEngine")
        sharding.make_mesh(mesh)  # the whole mesh must fit: raises, naming it, if there are too few devices
        self.num_replicas = mesh.dp
        self._pool = ThreadPoolExecutor(max_workers=mesh.dp, thread_name_prefix="jaxserve-replica")
        futures = [self._pool.submit(LLMEngine, model, engine_config.replace(mesh=mesh.replica(i)))
                   for i in range(mesh.dp)]  # loading and warm-up (precompile) overlap across replicas
        self.replicas: list[LLMEngine] = [f.result() for f in futures]
        first = self.replicas[0]
        self.model_config, self.tokenizer = first.model_config, first.tokenizer
        self.config = first.config.replace(mesh=mesh)  # resolved as each replica's, on the whole mesh
        self._owner: dict[str, int] = {}  # request id -> replica index, until its final output or abort
        self.num_routed = [0] * mesh.dp  # requests added to each replica

    # ---- requests -------------------------------------------------------------------------------------------

    def route(self, token_ids: list[int] | None) -> int:
        """The replica a prompt with these token ids goes to (see the module docstring)."""
        loads = [self._load(r) for r in self.replicas]
        least = min(loads)
        if token_ids:
            hits = [r.block_manager.num_cached_prefix_tokens(token_ids) for r in self.replicas]
            batch = self.config.max_num_seqs
            best = max(range(self.num_replicas), key=lambda i: (hits[i], [-x for x in loads[i]], -i))
            if hits[best] > 0 and loads[best][0] <= least[0] + batch:
                return best
        return min(range(self.num_replicas), key=lambda i: (loads[i], i))

    @staticmethod
    def _load(engine: LLMEngine) -> tuple[int, int]:
        """(unfinished sequences, tokens they still have to compute) of one replica."""
        seqs = engine.scheduler.running + engine.scheduler.waiting
        return len(seqs), sum(s.num_tokens - s.num_computed_tokens for s in seqs)

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, priority: int = 0
    ) -> None:
        if request_id in self._owner:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", "request_id", "duplicate")
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if not isinstance(ids, list) and isinstance(prompt, str) and self.tokenizer is not None:
            ids = self.tokenizer.encode(prompt)  # for routing only; the replica tokenizes (and validates) again
        i = self.route(ids if isinstance(ids, list) and all(isinstance(t, int) for t in ids) else None)
        self.replicas[i].add_request(request_id, prompt, params, priority=priority)
        self._owner[request_id] = i
        self.num_routed[i] += 1

    def abort_request(self, request_id: str) -> RequestOutput | None:
        i = self._owner.pop(request_id, None)
        return None if i is None else self.replicas[i].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def replica_of(self, request_id: str) -> int | None:
        """The replica running `request_id` (None once it finished or was aborted)."""
        return self._owner.get(request_id)

    # ---- the step -------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work, concurrently; their RequestOutputs in replica order."""
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        if len(busy) == 1:
            results = [busy[0].step()]
        else:
            results = [f.result() for f in [self._pool.submit(r.step) for r in busy]]
        outputs = [o for outs in results for o in outs]
        for o in outputs:
            if o.finished:
                self._owner.pop(o.request_id, None)
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Every replica's (`LLMEngine.reset_prefix_cache`); False if any still holds pages."""
        return all([r.reset_prefix_cache() for r in self.replicas])

    # ---- monitoring -----------------------------------------------------------------------------------------

    def get_stats(self) -> dict:
        """LLMEngine.get_stats() over all replicas: counts summed, kv_cache_usage the fullest replica's, the prefix
        hit rate over all lookups, speculation counters summed; `replicas`: each replica's own stats, in order."""
        per = [r.get_stats() for r in self.replicas]
        bms = [r.block_manager for r in self.replicas]
        queries = sum(b.num_prefix_queries for b in bms)
        stats = {
            "num_requests_running": sum(s["num_requests_running"] for s in per),
            "num_requests_waiting": sum(s["num_requests_waiting"] for s in per),
            "kv_cache_usage": max(s["kv_cache_usage"] for s in per),
            "prefix_cache_hit_rate": sum(b.num_prefix_hits for b in bms) / queries if queries else 0.0,
            "num_preemptions": sum(s["num_preemptions"] for s in per),
            "num_steps": sum(s["num_steps"] for s in per),  # any replica's progress counts (readiness watchdog)
        }
        if "spec_decode_num_draft_tokens" in per[0]:
            for k in ("draft", "accepted"):
                stats[f"spec_decode_num_{k}_tokens"] = sum(s[f"spec_decode_num_{k}_tokens"] for s in per)
                stats[f"spec_decode_num_{k}_tokens_per_pos"] = [
                    sum(v) for v in zip(*(s[f"spec_decode_num_{k}_tokens_per_pos"] for s in per))]
            drafts, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
            stats["spec_decode_acceptance_rate"] = accepted / drafts if drafts else 0.0
            metrics = [r.spec.controller.metrics for r in self.replicas]
            steps = sum(m.num_steps for m in metrics)  # emitted tokens per verifying sequence-step, over all
            stats["spec_decode_mean_acceptance_length"] = sum(m.num_emitted for m in metrics) / steps if steps else 0.0
        stats["replicas"] = [s | {"num_requests_routed": n} for s, n in zip(per, self.num_routed)]
        return stats

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
