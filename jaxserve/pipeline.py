"""Pipeline parallelism: the model's layers split into stages over the mesh's `pp` axis, several micro-batches in
flight so that the stages work at the same time.

Each stage is a `ModelRunner` on its own sub-mesh (`MeshConfig.stage`: the stage's `tp` devices, so a stage may
itself be tensor parallel) holding a contiguous slice of the layers (`model.llama.stage_layer_bounds`) and the KV
cache of those layers only; the first stage also holds the embedding, the last the final norm, the logits
projection and the sampler. A step's residual stream f[T, D] is the only thing that crosses from one stage's
devices to the next (`jax.device_put`, one transfer per micro-batch per stage boundary); the per-step inputs
(the packed `StepBatch`, a few KiB) go to every stage.

Why separate executables per stage (MPMD, as vLLM runs one worker per stage) rather than one SPMD program with a
`ppermute` ring: each stage is the tensor-parallel step that already runs, unchanged, with its own kernels; stages
on other hosts or without NVLink between them need nothing but a point-to-point transfer; and JAX's asynchronous
dispatch overlaps the stages by itself: `execute` enqueues micro-batch m on stage s right after m on stage s-1, so
while stage 1 runs micro-batch 0, stage 0 already runs micro-batch 1.

Micro-batches: the engine splits each scheduled step into `num_microbatches` (= pp) groups of whole sequences,
balanced by tokens (`split_microbatches`), each built into its own (bucket, StepBatch); every scheduling feature
(continuous batching, chunked prefill, preemption, speculative verify rows) is unchanged because one engine step
still returns every row's output. The bubble: with M micro-batches of equal cost t on p stages a step takes
(M + p - 1) t instead of M p t / p, so (p - 1) / (M + p - 1) of the stage-time is idle (1/3 for pp2 with M = 2,
3/7 for pp4 with M = 4): this engine keeps the pipeline full only within a step, not across steps (vLLM's
virtual engines keep p scheduler batches in flight across steps; here the next step is scheduled after this one's
tokens are back, which the synchronous sampler needs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import ops, sharding
from jaxserve.batch import Bucket, StepBatch
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.model.llama import Weights, stage_layer_bounds, stage_weights
from jaxserve.runner import ModelRunner
from jaxserve.sampler import PromptLogprobs, SamplerOutput


def split_microbatches(token_counts: list[int], num_groups: int) -> list[int]:
    """Cut points splitting consecutive items (sequences, with these token counts) into at most `num_groups`
    non-empty contiguous groups of about equal tokens: returns the group sizes (item counts)."""
    n = len(token_counts)
    groups = min(num_groups, n)
    if groups <= 1:
        return [n] if n else []
    total = sum(token_counts)
    sizes, start, acc = [], 0, 0
    for i, t in enumerate(token_counts):
        acc += t
        left_items, left_groups = n - i - 1, groups - len(sizes) - 1
        # close the group once it holds its share of the tokens, keeping one item for every group still to come
        if left_groups and (acc * groups >= total * (len(sizes) + 1) or left_items == left_groups):
            sizes.append(i + 1 - start)
            start = i + 1
    sizes.append(n - start)
    return sizes


class PipelineRunner:
    """`ModelRunner`'s interface over pp stages (see the module docstring)."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, host_weights: Weights, dtype: str,
                 scan_layers: bool, hidden_layer_ids: tuple[int, ...] = ()):
        """`hidden_layer_ids`: as for `ModelRunner` (EAGLE-3's features): each stage captures the ones among its
        layers, and `last_hidden` joins them on the last stage's devices, where the head runs."""
        mesh_cfg = engine_cfg.mesh
        self.model_cfg = model_cfg
        self.engine_cfg = engine_cfg
        self.bounds = stage_layer_bounds(model_cfg.num_layers, mesh_cfg.pp)
        if list(hidden_layer_ids) != sorted(hidden_layer_ids):
            raise ValueError(f"hidden_layer_ids must be ascending across pipeline stages (got {hidden_layer_ids})")
        self.stages: list[ModelRunner] = []
        for s, (start, end) in enumerate(self.bounds):
            first, last = s == 0, s == len(self.bounds) - 1
            stage_cfg = engine_cfg.replace(mesh=mesh_cfg.stage(s))
            mesh = sharding.make_mesh(stage_cfg.mesh)
            backends = ops.resolve_backends(stage_cfg, dtype, scan_layers, mesh)
            # the streams entering this stage's layers (local ids), and the final output on the last stage
            local_ids = tuple(i - start for i in hidden_layer_ids if start <= i < end or (last and i == end))
            self.stages.append(ModelRunner(
                dataclasses.replace(model_cfg, num_layers=end - start), stage_cfg,
                stage_weights(host_weights, start, end, first, last), dtype, hidden_layer_ids=local_ids,
                backends=backends, mesh=mesh, first_stage=first,
            ))
        last = self.stages[-1]
        self.backends = last.backends
        self._replicated = last._replicated  # where the outputs (and an EAGLE-3 head) live
        self.hidden_layer_ids = tuple(hidden_layer_ids)
        # the embedding an EAGLE-3 head shares, beside it on the last stage (the first stage's copy is elsewhere)
        self.head_embed = None
        if hidden_layer_ids:
            self.head_embed = (last.weights.embed if last.weights.embed is not None  # tied: the last stage has it
                               else jax.device_put(host_weights.embed, last._replicated))
        self.last_hidden = None
        self.publish = None
        self.num_microbatches = mesh_cfg.pp

    @property
    def num_compiles(self) -> int:
        return sum(s.num_compiles for s in self.stages)

    def all_buckets(self) -> list[Bucket]:
        return self.stages[0].all_buckets()

    def warmup(self, buckets: list[Bucket] | None = None, progress: bool = True) -> None:
        for s in self.stages:
            s.warmup(buckets, progress)

    def layout(self, b: Bucket, prompt_logprobs: bool = False):
        return self.stages[0].layout(b, prompt_logprobs)

    def run(self, bucket: Bucket, batch: StepBatch) -> tuple[SamplerOutput, PromptLogprobs | None]:
        return self.run_many([(bucket, batch)])[0]

    def run_many(self, steps: list[tuple[Bucket, StepBatch]]) -> list[tuple[SamplerOutput, PromptLogprobs | None]]:
        """Micro-batches through every stage, overlapped by asynchronous dispatch; outputs fetched at once."""
        return self.fetch(self.dispatch(steps))

    def dispatch(self, steps: list[tuple[Bucket, StepBatch]]) -> list[tuple]:
        """`ModelRunner.dispatch` through every stage: enqueued, not waited for."""
        items = [self.stages[-1].pack(b, batch) for b, batch in steps]
        if self.publish is not None:
            self.publish(items)
        return self.execute(items)

    def fetch(self, outs: list[tuple]) -> list[tuple[SamplerOutput, PromptLogprobs | None]]:
        return self.stages[-1].fetch(outs)

    def execute(self, items: list[tuple[Bucket, bool, np.ndarray]]) -> list[tuple]:
        """Dispatch micro-batch m on stage s right after it finished dispatching on stage s - 1, and micro-batch
        m + 1 on stage 0 right after: nothing here waits for a device."""
        outs = []
        for bucket, with_prompt, packed in items:
            x, hidden = None, []
            for stage in self.stages:
                if x is not None:
                    x = jax.device_put(x, stage._replicated)  # the stage boundary: f[T, D] to the next devices
                out = stage.call(bucket, with_prompt, jax.device_put(packed, stage._replicated), x)
                x = out[0]
                if stage.hidden_layer_ids:  # this stage's features f[T, n_s * D], to the last stage's devices
                    hidden.append(jax.device_put(out[-1], self._replicated))
            outs.append(out)
        # EAGLE-3's features of a single step (as ModelRunner.execute): every stage's, in layer order
        self.last_hidden = None
        if self.hidden_layer_ids and len(items) == 1:
            self.last_hidden = hidden[0] if len(hidden) == 1 else jnp.concatenate(hidden, axis=-1)
        return outs

    def kv_is_intact(self) -> bool:
        return all(s.kv_is_intact() for s in self.stages)
