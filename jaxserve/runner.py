"""ModelRunner: owns the device weights and the KV cache; the only module that transfers, compiles and fetches.

One step = one host->device transfer of the padded inputs, one call of the executable compiled for that bucket
(KV cache donated, so it is updated in place), one fetch of the sampled tokens. Executables are compiled ahead of
time per bucket (`warmup`) or on first use, and counted, so tests can prove steady state never recompiles.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.batch import Bucket, StepInputs
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.kv_cache import KVCache, init_kv_cache, kv_cache_bytes
from jaxserve.model.llama import Weights, compute_logits, forward
from jaxserve.sampler import SamplerOutput, SamplingInputs, sample

logger = logging.getLogger(__name__)


def default_dtype() -> str:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def enable_compilation_cache(path: str | None = None) -> None:
    path = path or os.environ.get("JAXSERVE_COMPILE_CACHE", os.path.expanduser("~/.cache/jaxserve/xla"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@jax.tree_util.register_dataclass
@dataclass
class PromptLogprobs:
    """Log-probabilities of each token's *next* prompt token (rows whose target is -1 are meaningless)."""

    logprobs: jax.Array  # f32[T]
    ranks: jax.Array  # i32[T]
    top_ids: jax.Array  # i32[T, max_logprobs]
    top_logprobs: jax.Array  # f32[T, max_logprobs]


def prompt_logprobs(logits: jax.Array, targets: jax.Array, max_logprobs: int) -> PromptLogprobs:
    """logits: f32[T, V], targets: i32[T] (-1 = none) -> PromptLogprobs."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[:, None], axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logp, max_logprobs)
    return PromptLogprobs(chosen[:, 0], 1 + jnp.sum(logp > chosen, axis=-1).astype(jnp.int32), top_ids, top_logprobs)


def step_fn(
    model_cfg: ModelConfig,
    max_logprobs: int,
    weights: Weights,
    kv: KVCache,
    inputs: StepInputs,
    sampling: SamplingInputs,
    prompt_targets: jax.Array | None = None,  # i32[T]; given only to the prompt-logprobs variant
) -> tuple[tuple[SamplerOutput, PromptLogprobs | None], KVCache]:
    h, kv, _ = forward(model_cfg, weights, kv, inputs)
    if prompt_targets is None:
        logits = compute_logits(weights, h[inputs.logits_indices])
        return (sample(logits, sampling, max_logprobs=max_logprobs), None), kv
    all_logits = compute_logits(weights, h)  # [T, V]: only for requests that asked for prompt_logprobs
    sampled = sample(all_logits[inputs.logits_indices], sampling, max_logprobs=max_logprobs)
    return (sampled, prompt_logprobs(all_logits, prompt_targets, max(max_logprobs, 1))), kv


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, host_weights: Weights, dtype: str):
        self.model_cfg = model_cfg
        self.engine_cfg = engine_cfg
        self.dtype = jnp.dtype(dtype)
        enable_compilation_cache()
        self.weights = jax.device_put(host_weights)
        num_pages = engine_cfg.total_pages
        logger.info(
            "KV cache: %d pages x %d tokens, %.1f MiB",
            num_pages,
            engine_cfg.page_size,
            kv_cache_bytes(model_cfg, num_pages, engine_cfg.page_size, self.dtype) / 2**20,
        )
        self.kv = init_kv_cache(model_cfg, num_pages, engine_cfg.page_size, self.dtype)
        self._jitted = jax.jit(
            functools.partial(step_fn, model_cfg, engine_cfg.max_logprobs), donate_argnums=(1,)
        )
        self._executables: dict[tuple[Bucket, bool], jax.stages.Compiled] = {}
        self.num_compiles = 0

    def all_buckets(self) -> list[Bucket]:
        cfg = self.engine_cfg
        return [
            Bucket(num_tokens=t, num_seqs=min(t, cfg.max_num_seqs), max_pages=p)
            for t in cfg.token_buckets
            for p in cfg.page_buckets
        ]

    def _abstract_inputs(self, b: Bucket):
        def i32(*shape):
            return jax.ShapeDtypeStruct(shape, jnp.int32)

        inputs = StepInputs(
            token_ids=i32(b.num_tokens),
            positions=i32(b.num_tokens),
            slot_mapping=i32(b.num_tokens),
            block_tables=i32(b.num_seqs, b.max_pages),
            seq_lens=i32(b.num_seqs),
            cu_q_lens=i32(b.num_seqs + 1),
            num_seqs=i32(),
            logits_indices=i32(b.num_seqs),
        )
        sampling = SamplingInputs(
            **{
                k: jax.ShapeDtypeStruct(v.shape, v.dtype)
                for k, v in SamplingInputs.host_arrays(b.num_seqs, b.max_pages * self.engine_cfg.page_size).items()
            }
        )
        return inputs, sampling

    def executable(self, bucket: Bucket, prompt_logprobs: bool = False) -> jax.stages.Compiled:
        """The compiled step for `bucket` (the prompt-logprobs variant computes logits at every token)."""
        key = (bucket, prompt_logprobs)
        exe = self._executables.get(key)
        if exe is None:
            t0 = time.perf_counter()
            inputs, sampling = self._abstract_inputs(bucket)
            extra = (jax.ShapeDtypeStruct((bucket.num_tokens,), jnp.int32),) if prompt_logprobs else ()
            exe = self._jitted.lower(self.weights, self.kv, inputs, sampling, *extra).compile()
            self._executables[key] = exe
            self.num_compiles += 1
            logger.info("compiled %s%s in %.1f s", bucket, " (prompt logprobs)" if prompt_logprobs else "", time.perf_counter() - t0)
        return exe

    def warmup(self, buckets: list[Bucket] | None = None, progress: bool = True) -> None:
        """Compile every bucket ahead of time (persistent compilation cache makes restarts fast)."""
        buckets = self.all_buckets() if buckets is None else buckets
        it = buckets
        if progress:
            from tqdm import tqdm

            it = tqdm(buckets, desc="compiling buckets", unit="bucket")
        for b in it:
            self.executable(b)

    def run(
        self,
        bucket: Bucket,
        inputs: dict[str, np.ndarray],
        sampling: dict[str, np.ndarray],
        prompt_targets: np.ndarray | None = None,
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
        """One step. Returns the sampler's outputs and, if `prompt_targets` was given, prompt log-probabilities."""
        exe = self.executable(bucket, prompt_targets is not None)
        args = (StepInputs(**inputs), SamplingInputs(**sampling))
        if prompt_targets is not None:
            args += (prompt_targets,)
        (sampled, prompt_lp), self.kv = exe(self.weights, self.kv, *jax.device_put(args))
        sampled, prompt_lp = jax.device_get((sampled, prompt_lp))
        return vars(sampled), (vars(prompt_lp) if prompt_lp is not None else None)
