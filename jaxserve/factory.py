"""From a model path and an EngineConfig to a ready engine's parts: checkpoint loaded, config resolved, weights on
device, KV cache allocated, proposer built (and, with `precompile`, every bucket compiled).

Resolution happens once, here, so everything downstream reads final values: the dtype (float32 on CPU, bfloat16
elsewhere), `max_model_len` capped by the model's context, `scan_layers`, the kernels (`ops.Backends` from the
`attention_backend` / `matmul_backend` fields), the page buckets the attention backend needs, and the number of KV
pages, sized so the target's cache and any proposer's (same page ids) fit the memory budget: `num_pages`, else
`kv_cache_memory_bytes`, else, on a device that reports its memory (a GPU), what `gpu_memory_utilization` of it
leaves beside the weights and the largest step's activations (`memory_plan`), else enough for `max_num_seqs` full
sequences capped at 1 GiB (the CPU).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve import memory_plan, ops, quant, sharding
from jaxserve.config import EngineConfig, ModelConfig, kv_storage_dtype
from jaxserve.kv_cache import kv_cache_bytes
from jaxserve.loader import load_checkpoint
from jaxserve.loader.weights import to_weights
from jaxserve.memory_plan import MemoryPlan
from jaxserve.model.llama import Weights, repeat_kv_heads, stage_layer_bounds
from jaxserve.pipeline import PipelineRunner
from jaxserve.runner import ModelRunner, default_dtype, prepare_weights
from jaxserve.spec_decode import Proposer, make_proposer, proposer_cache_configs, target_hidden_layer_ids
from jaxserve.spec_decode.heads import with_shipped_head
from jaxserve.tokenizer import Tokenizer

DEFAULT_KV_CACHE_BYTES = 1 << 30
logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    config: EngineConfig  # fully resolved
    runner: ModelRunner
    proposer: Proposer | None  # None without speculative_config
    eos_token_ids: tuple[int, ...]  # the model's and the tokenizer's, deduplicated


def page_bytes(
    engine_cfg: EngineConfig, model_cfg: ModelConfig, kv_dtype: str, extra_caches: tuple[ModelConfig, ...] = ()
) -> int:
    """Bytes one KV page costs: the target's cache and those of `extra_caches`, which use the same page ids."""
    return sum(kv_cache_bytes(c, 1, engine_cfg.page_size, kv_dtype) for c in (model_cfg, *extra_caches))


def resolve_num_pages(
    engine_cfg: EngineConfig, model_cfg: ModelConfig, kv_dtype: str, extra_caches: tuple[ModelConfig, ...] = (),
    plan: MemoryPlan | None = None,
) -> int:
    """Pages of the KV cache: as configured (`num_pages`), or as many as the memory budget holds at the cache's dtype
    (so an int8 cache holds 4x the pages of a float32 one in the same bytes): `kv_cache_memory_bytes`, else `plan`
    (the device's memory at `gpu_memory_utilization`; its `page_bytes` must be `page_bytes(...)`), else the CPU
    default. `extra_caches`: models whose caches use the same page ids (a draft model, an EAGLE-3 head), so a page
    costs their bytes too."""
    if engine_cfg.num_pages is not None:
        return engine_cfg.num_pages
    per_page = page_bytes(engine_cfg, model_cfg, kv_dtype, extra_caches)
    if engine_cfg.kv_cache_memory_bytes is not None:
        return max(2, engine_cfg.kv_cache_memory_bytes // per_page)
    if plan is not None:
        return plan.num_pages
    want = 1 + engine_cfg.max_num_seqs * engine_cfg.max_pages_per_seq
    return max(2, min(want, DEFAULT_KV_CACHE_BYTES // per_page))


def resolve_async_scheduling(cfg: EngineConfig) -> bool:
    """Async scheduling where the engine supports it: not with pipeline stages (micro-batches). With speculation
    it overlaps the steps that do not speculate (`engine.py`). Asked for explicitly where unsupported: refused."""
    unsupported = "pipeline parallelism" if cfg.mesh is not None and cfg.mesh.pp > 1 else None
    if cfg.async_scheduling and unsupported:
        raise ValueError(f"async_scheduling does not support {unsupported} yet; leave it unset or False")
    return unsupported is None if cfg.async_scheduling is None else cfg.async_scheduling


def check_mesh(cfg: EngineConfig, model_config: ModelConfig | None = None):
    """-> (the engine's `jax.sharding.Mesh` or None without a mesh config, how many copies of each KV head tensor
    parallelism needs), checked against this process's devices and, given the model, its heads
    (`sharding.kv_head_replicas`). One engine is one data-parallel replica: a mesh with dp > 1 is refused here
    (replicas are engines of their own, `data_parallel.py`)."""
    if cfg.mesh is None:
        return None, 1
    mesh = sharding.make_mesh(cfg.mesh)  # raises, naming the mesh, if there are too few devices
    if cfg.mesh.dp > 1:
        raise ValueError(f"mesh {cfg.mesh.name or cfg.mesh.shape}: one engine runs one data-parallel replica "
                         f"(mesh.dp={cfg.mesh.dp}); give each its own `MeshConfig.replica(i)`")
    if model_config is not None and cfg.mesh.pp > 1:
        stage_layer_bounds(model_config.num_layers, cfg.mesh.pp)  # raises, naming mesh.pp, if there are too few
    if cfg.mesh.tp == 1 or model_config is None:
        return mesh, 1
    return mesh, sharding.kv_head_replicas(cfg.mesh, model_config.num_heads, model_config.num_kv_heads)


def resolve_config(
    engine_config: EngineConfig, model_config: ModelConfig, mesh=None, weights: Weights | None = None
) -> tuple[EngineConfig, ops.Backends]:
    """`model_config`: the model as it will run (KV heads already replicated for tensor parallelism); `mesh`: from
    `check_mesh`. `weights`: the host weights the runner will place (stacked, in the resolved dtype): with them, and
    on a device that reports its memory (the first of `mesh`, or the default device), the KV cache fills
    `gpu_memory_utilization` of it (`plan_memory`)."""
    dtype = resolve_dtype(engine_config)
    max_model_len = min(engine_config.max_model_len, model_config.max_position_embeddings)
    scan = engine_config.scan_layers if engine_config.scan_layers is not None else jax.default_backend() != "cpu"
    cfg = engine_config.replace(dtype=dtype, max_model_len=max_model_len, scan_layers=scan)
    backends = ops.resolve_backends(cfg, dtype, scan, mesh)
    cfg = cfg.replace(async_scheduling=resolve_async_scheduling(cfg))
    if backends.attention == "native":
        # The native CPU kernel walks only each sequence's own pages: one block-table size serves every step.
        cfg = cfg.replace(page_buckets=cfg.page_buckets[-1:])
    kv_dtype = kv_storage_dtype(cfg.kv_cache_dtype, dtype)
    extra = proposer_cache_configs(cfg.speculative_config, model_config)
    plan = None
    if cfg.num_pages is None and cfg.kv_cache_memory_bytes is None and weights is not None:
        device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
        plan = plan_memory(cfg, model_config, weights, kv_dtype, extra, backends, mesh, device)
    cfg = cfg.replace(num_pages=resolve_num_pages(cfg, model_config, kv_dtype, extra, plan))
    if cfg.num_pages - 1 < cfg.max_pages_per_seq:
        raise ValueError(
            f"num_pages={cfg.num_pages} cannot hold one sequence of max_model_len={max_model_len} "
            f"({cfg.max_pages_per_seq} pages of {cfg.page_size}); lower max_model_len or raise num_pages"
        )
    return cfg, backends


def resolve_dtype(engine_config: EngineConfig) -> str:
    """The model's dtype: as configured, else float32 on the CPU and bfloat16 elsewhere."""
    return engine_config.dtype or default_dtype()


def plan_memory(
    cfg: EngineConfig, model_config: ModelConfig, weights: Weights, kv_dtype: str,
    extra_caches: tuple[ModelConfig, ...], backends: ops.Backends, mesh, device,
) -> MemoryPlan | None:
    """The KV cache's share of `device`'s memory at `cfg.gpu_memory_utilization` (`memory_plan`), or None where the
    device reports no memory (the CPU) or the engine spans several devices (then the default sizing applies). The
    activations are those of the planning buckets' steps, compiled for `device` with these weights' shapes."""
    memory = memory_plan.device_memory(device)
    if memory is None:
        return None
    if mesh is not None and mesh.size > 1:
        logger.warning("gpu_memory_utilization sizes the KV cache of one-device engines; this mesh has %d devices: "
                       "the default size is used (set kv_cache_memory_bytes or num_pages)", mesh.size)
        return None
    placed = prepare_weights(weights, backends, cfg.scan_layers)  # as the runner will place them
    steps = memory_plan.step_memory(model_config, cfg, placed, kv_dtype, memory_plan.planning_buckets(cfg),
                                    backends=backends, sharding=jax.sharding.SingleDeviceSharding(device))
    plan = MemoryPlan(device_bytes=memory[0], utilization=cfg.gpu_memory_utilization, in_use_bytes=memory[1],
                      weights_bytes=memory_plan.tree_bytes(placed),
                      activation_bytes=max(s.activation_bytes for s in steps),
                      page_bytes=page_bytes(cfg, model_config, kv_dtype, extra_caches))
    logger.info("KV cache from device memory: %s", plan.describe())
    return plan


def build_engine_parts(model: str | None, engine_config: EngineConfig | None = None) -> EngineParts:
    engine_config = engine_config or EngineConfig()
    ckpt = load_checkpoint(model, engine_config.quantization)
    engine_config = engine_config.replace(quantization=ckpt.quantization,
                                          speculative_config=with_shipped_head(engine_config.speculative_config,
                                                                               ckpt.path))
    mesh, r = check_mesh(engine_config, ckpt.config)  # before the weights are read: a bad mesh fails fast
    model_config = dataclasses.replace(ckpt.config, num_kv_heads=ckpt.config.num_kv_heads * r)  # as it will run
    tokenizer = ckpt.tokenizer
    weights = to_weights(ckpt.config, ckpt.tensors, jnp.dtype(resolve_dtype(engine_config)), ckpt.path,
                         ckpt.quantization)
    logger.info("weights: quantization=%s (%s): %s, %.1f MB of linear maps", ckpt.quantization, ckpt.note,
                quant.describe(weights), quant.linear_bytes(weights) / 1e6)
    _, weights = repeat_kv_heads(ckpt.config, weights, r)
    del ckpt
    cfg, backends = resolve_config(engine_config, model_config, mesh, weights)  # the KV cache may size by them
    hidden_ids = target_hidden_layer_ids(cfg.speculative_config, model_config)
    if cfg.mesh is not None and cfg.mesh.pp > 1:
        runner = PipelineRunner(model_config, cfg, weights, cfg.dtype, cfg.scan_layers, hidden_layer_ids=hidden_ids)
    else:
        runner = ModelRunner(model_config, cfg, weights, cfg.dtype, hidden_layer_ids=hidden_ids, backends=backends,
                             mesh=mesh)
    if cfg.precompile:
        runner.warmup()
    proposer = None
    if cfg.speculative_config is not None:
        proposer = make_proposer(cfg.speculative_config, cfg, model_config, runner)
        if cfg.precompile:
            proposer.warmup()
    eos = tuple(dict.fromkeys(model_config.eos_token_ids + (tokenizer.eos_token_ids if tokenizer else ())))
    return EngineParts(model_config, tokenizer, cfg, runner, proposer, eos)
