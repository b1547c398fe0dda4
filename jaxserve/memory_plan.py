"""GPU memory planning: how many KV pages fit beside the weights and the largest step's activations.

vLLM's rule (`gpu_memory_utilization`): the engine may fill that share of the device's memory with its weights,
the peak of a step's working memory, and the KV cache, which takes whatever is left. Here the working memory is
not profiled by running a step: the step for each of the largest buckets is compiled from abstract weights and an
abstract (minimal) KV cache (`runner.compile_step`), and XLA's memory analysis of the executable says what it needs
beyond its arguments (`StepMemory.activation_bytes`). The same compile runs for a device the process does not have
(a deviceless sm_90 target), so a GPU's memory plan is checked on a CPU machine (tests/test_step_compile_sm90.py,
docs/gpu.md).

The device's memory is what XLA's allocator may use (`memory_stats()["bytes_limit"]`; on a GPU,
$XLA_PYTHON_CLIENT_MEM_FRACTION of it, 0.75 by default). XLA:CPU reports no memory statistics, so on the CPU the
KV cache keeps its configured or default size (`factory.resolve_num_pages`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve import ops
from jaxserve.batch import Bucket, choose_bucket
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.kv_cache import KVCache, init_kv_cache
from jaxserve.model.llama import LayerWeights, Weights
from jaxserve.runner import compile_step


@dataclass(frozen=True)
class StepMemory:
    """XLA's memory analysis of one compiled step, in bytes per device."""

    bucket: Bucket
    argument_bytes: int  # weights, KV cache and the packed batch
    output_bytes: int  # the new KV cache (aliased to the donated one) and the sampled rows
    alias_bytes: int  # outputs that reuse an argument's buffer (the donated cache)
    temp_bytes: int  # the working memory XLA allocates for the step
    code_bytes: int  # generated code (0 on a GPU, where kernels live outside device memory)

    @classmethod
    def of(cls, bucket: Bucket, compiled: jax.stages.Compiled) -> StepMemory:
        m = compiled.memory_analysis()
        return cls(bucket, m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                   m.temp_size_in_bytes, m.generated_code_size_in_bytes)

    @property
    def activation_bytes(self) -> int:
        """What a call needs beyond its arguments: working memory, outputs that are not aliased, code."""
        return self.temp_bytes + self.output_bytes - self.alias_bytes + self.code_bytes


def abstract_weights(model_cfg: ModelConfig, dtype, sharding=None) -> Weights:
    """The model's weights as `ShapeDtypeStruct`s (stacked layers, linear maps unquantized in `dtype`), the form
    `loader.weights.to_weights` builds, placed by `sharding`: no memory is allocated."""
    D, F, V = model_cfg.hidden_size, model_cfg.intermediate_size, model_cfg.vocab_size
    L, N, K, H = model_cfg.num_layers, model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim

    def s(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)

    bias, qk = model_cfg.attention_bias, model_cfg.qk_norm
    layers = LayerWeights(
        attn_norm=s(L, D), wq=s(L, D, N * H), wk=s(L, D, K * H), wv=s(L, D, K * H), wo=s(L, N * H, D),
        mlp_norm=s(L, D), w_gate=s(L, D, F), w_up=s(L, D, F), w_down=s(L, F, D),
        bq=s(L, N * H) if bias else None, bk=s(L, K * H) if bias else None, bv=s(L, K * H) if bias else None,
        q_norm=s(L, H) if qk else None, k_norm=s(L, H) if qk else None,
    )
    return Weights(embed=s(V, D), layers=layers, final_norm=s(D),
                   lm_head=None if model_cfg.tie_word_embeddings else s(D, V))


def abstract_tree(tree, sharding=None):
    """A pytree of arrays (host or device) as `ShapeDtypeStruct`s placed by `sharding`."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def abstract_kv(model_cfg: ModelConfig, num_pages: int, page_size: int, kv_dtype, sharding=None) -> KVCache:
    """The KV cache (`kv_cache.init_kv_cache`, scales included for quantized dtypes) as `ShapeDtypeStruct`s."""
    kv = jax.eval_shape(lambda: init_kv_cache(model_cfg, num_pages, page_size, jnp.dtype(kv_dtype)))
    return abstract_tree(kv, sharding)


def tree_bytes(tree) -> int:
    """Bytes of a pytree's arrays (or `ShapeDtypeStruct`s): a `QuantizedLinear` counts its values and scales."""
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def planning_buckets(engine_cfg: EngineConfig) -> list[Bucket]:
    """The buckets whose activations bound every step's: the largest token count with the longest block tables,
    with (speculation) and without verify rows. A step's working memory grows with its tokens, its sampling rows
    and its block tables; the sequence count is capped at `max_num_seqs` in every large bucket."""
    cfg = engine_cfg
    T, P = cfg.token_buckets[-1], cfg.page_buckets[-1]
    rows = (0, T) if cfg.num_speculative_tokens else (0,)
    return list(dict.fromkeys(
        choose_bucket(T, P, cfg.token_buckets, cfg.page_buckets, cfg.max_num_seqs, 1 + cfg.num_speculative_tokens, r)
        for r in rows
    ))


def step_memory(
    model_cfg: ModelConfig, engine_cfg: EngineConfig, weights: Weights, kv_dtype, buckets: list[Bucket], *,
    backends: ops.Backends, sharding=None,
) -> list[StepMemory]:
    """Compile the step for each bucket (`runner.compile_step`) from `weights` (arrays or `ShapeDtypeStruct`s, in
    the form the runner places them) and a minimal KV cache of `kv_dtype` (one sequence's pages: the activations do
    not depend on the pool size, the cache being donated), placed by `sharding`; their memory analyses."""
    num_pages = 1 + engine_cfg.max_pages_per_seq
    kv = abstract_kv(model_cfg, num_pages, engine_cfg.page_size, kv_dtype, sharding)
    weights = abstract_tree(weights, sharding)
    return [StepMemory.of(b, compile_step(model_cfg, engine_cfg, weights, kv, b, backends=backends,
                                          placement=sharding))
            for b in buckets]


@dataclass(frozen=True)
class MemoryPlan:
    """The KV pages that fill `utilization` of a device's memory beside what is already in use, the weights and
    the largest step's activations."""

    device_bytes: int  # the memory XLA's allocator may use on the device
    utilization: float  # the share of it this engine may fill (`EngineConfig.gpu_memory_utilization`)
    in_use_bytes: int  # already allocated on the device (another engine, buffers of this process)
    weights_bytes: int
    activation_bytes: int  # the largest `StepMemory.activation_bytes` of the planning buckets
    page_bytes: int  # one KV page of every cache that shares page ids (the target's, a draft model's)

    @property
    def kv_bytes(self) -> int:
        """The KV cache's share: the budget less everything else (negative when nothing is left)."""
        budget = int(self.device_bytes * self.utilization)
        return budget - self.in_use_bytes - self.weights_bytes - self.activation_bytes

    @property
    def num_pages(self) -> int:
        """Pages of the KV cache (page 0, the padding sink, included); raises when not even two fit."""
        pages = self.kv_bytes // self.page_bytes
        if pages < 2:
            raise ValueError(f"no room for a KV cache: {self.describe()}; raise gpu_memory_utilization, or set "
                             "num_pages / kv_cache_memory_bytes")
        return pages

    def describe(self) -> str:
        gib = 2**30
        return (f"{self.utilization:g} x {self.device_bytes / gib:.2f} GiB of device memory = "
                f"{self.in_use_bytes / gib:.2f} GiB in use + {self.weights_bytes / gib:.2f} GiB of weights + "
                f"{self.activation_bytes / gib:.2f} GiB of step activations + {self.kv_bytes / gib:.2f} GiB of KV "
                f"pages ({self.page_bytes} bytes each)")


def device_memory(device) -> tuple[int, int] | None:
    """(bytes XLA's allocator may use, bytes in use) on `device`, or None where it reports no memory (the CPU)."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def memory_table(rows: list[tuple[str, StepMemory]]) -> str:
    """A markdown table of compiled steps' memory (MiB), one row per (label, StepMemory)."""
    mib = 2**20
    lines = ["| step | bucket (T, S, pages, rows) | argument MiB | output MiB | alias MiB | temp MiB "
             "| activation MiB |", "|---|---|---:|---:|---:|---:|---:|"]
    for label, m in rows:
        b = m.bucket
        lines.append(f"| {label} | {b.num_tokens}, {b.num_seqs}, {b.max_pages}, {b.rows} | "
                     f"{m.argument_bytes / mib:.1f} | {m.output_bytes / mib:.1f} | {m.alias_bytes / mib:.1f} | "
                     f"{m.temp_bytes / mib:.1f} | {m.activation_bytes / mib:.1f} |")
    return "\n".join(lines)
