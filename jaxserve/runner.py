"""ModelRunner: owns the device weights and the KV cache; the only module that transfers, compiles and fetches.

One step = one host->device transfer of the padded `StepBatch` (packed into one buffer, `packing.py`), one call of
the executable compiled for that bucket (KV cache donated, so it is updated in place), one fetch of the sampled
tokens. Executables are compiled ahead of
time per bucket (`warmup`) or on first use, and counted, so tests can prove steady state never recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve import hugepages, ops, quant, sharding
from jaxserve.batch import FED_DRAFT, Bucket, StepBatch, build_step_inputs, choose_bucket
from jaxserve.config import EngineConfig, ModelConfig, kv_storage_dtype
from jaxserve.kv_cache import KV_AXES, KV_SCALE_AXES, KVCache, init_kv_cache, kv_cache_bytes
from jaxserve.model.llama import Weights, compute_logits, forward, pack_linear_weights, unstack_layers, weight_axes
from jaxserve.packing import Layout, RowLayout
from jaxserve.sampler import PromptLogprobs, SamplerOutput, SamplingInputs, prompt_logprobs, sample

logger = logging.getLogger(__name__)


def default_dtype() -> str:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def enable_compilation_cache(path: str | None = None) -> None:
    path = path or os.environ.get("JAXSERVE_COMPILE_CACHE", os.path.expanduser("~/.cache/jaxserve/xla"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def step_fn(
    model_cfg: ModelConfig,
    max_logprobs: int,
    weights: Weights,
    kv: KVCache,
    packed: jax.Array,  # i32[*]  a StepBatch, see `layout`
    x_in: jax.Array | None = None,  # f[T, D]  the residual stream from the previous pipeline stage
    prev_tokens: jax.Array | None = None,  # i32[max rows]  the previous step's sampled tokens (async scheduling)
    drafts: jax.Array | None = None,  # i32[max_num_seqs * K]  an EAGLE-3 head's drafts left on the device
    *,
    layout: Layout,
    rows: RowLayout,
    prompt_rows: RowLayout,
    backends: ops.Backends,
    hidden_layer_ids: tuple[int, ...] = (),
    out_shardings=None,  # (the KV cache's shardings, replicated) on a mesh
):
    """-> ((sampled i32[R, C], prompt logprobs i32[T, C'] | None), kv), or with `hidden_layer_ids`
    ((sampled, prompt logprobs | None, aux f[T, len(ids) * D]), kv): the residual streams entering those layers,
    concatenated per token (EAGLE-3). Outputs travel packed (`rows`, `prompt_rows`): one fetch.
    A pipeline stage before the last (weights without `final_norm`) returns ((x f[T, D],), kv) instead: its
    residual stream, for the next stage's `x_in`.
    Async scheduling (the batch has a `token_feed`): positions with feed row r >= 0 take `prev_tokens[r]` as their
    token, and the outputs end with this step's sampled tokens, i32[max rows], the next step's `prev_tokens`.
    Drafts on the device (the batch has a `draft_feed`): positions with feed index i >= 0 take `drafts[i]` as their
    token, and each verify row marked `FED_DRAFT` checks the token its next position took."""
    batch: StepBatch = layout.unpack(packed)
    inputs = batch.inputs
    draft_ids = batch.draft_ids
    if batch.token_feed is not None:
        fed = prev_tokens[jnp.maximum(batch.token_feed, 0)]
        inputs = dataclasses.replace(inputs, token_ids=jnp.where(batch.token_feed >= 0, fed, inputs.token_ids))
    if batch.draft_feed is not None:
        fed = drafts[jnp.maximum(batch.draft_feed, 0)]
        tokens = jnp.where(batch.draft_feed >= 0, fed, inputs.token_ids)
        inputs = dataclasses.replace(inputs, token_ids=tokens)
        # verify row r samples at token logits_indices[r]; the draft it checks is the token after it
        nxt = tokens[jnp.minimum(inputs.logits_indices + 1, tokens.shape[0] - 1)]
        draft_ids = jnp.where(draft_ids == FED_DRAFT, nxt, draft_ids)
    h, kv, hidden = forward(model_cfg, weights, kv, inputs, x_in, hidden_layer_ids=hidden_layer_ids,
                            backends=backends)
    if weights.final_norm is None:
        out = (h,)
    elif batch.prompt_targets is None:
        logits = compute_logits(weights, h[inputs.logits_indices])
        sampled = sample(logits, batch.sampling, max_logprobs=max_logprobs, draft_ids=draft_ids,
                         mesh=backends.mesh, native_stats=backends.native_cpu)
        out = (rows.pack(sampled), None)
    else:
        all_logits = compute_logits(weights, h)  # [T, V]: only for requests that asked for prompt_logprobs
        sampled = sample(all_logits[inputs.logits_indices], batch.sampling, max_logprobs=max_logprobs,
                         draft_ids=draft_ids, mesh=backends.mesh, native_stats=backends.native_cpu)
        lp = prompt_logprobs(all_logits, batch.prompt_targets, max_logprobs=max_logprobs, mesh=backends.mesh)
        out = (rows.pack(sampled), prompt_rows.pack(lp))
    if hidden_layer_ids:
        T = hidden.shape[1]
        out += (jnp.transpose(hidden, (1, 0, 2)).reshape(T, -1),)
    if batch.token_feed is not None:
        out += (jnp.zeros_like(prev_tokens).at[: sampled.token_ids.shape[0]].set(sampled.token_ids),)
    if out_shardings is not None:  # the cache keeps its sharding across steps; outputs come back whole
        kv_shardings, replicated = out_shardings
        kv = jax.lax.with_sharding_constraint(kv, kv_shardings)
        out = jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, replicated), out)
    return out, kv


def _structs(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def prepare_weights(host_weights: Weights, backends: ops.Backends, scan_layers: bool) -> Weights:
    """Host weights (stacked layers) in the form the step reads them: unstacked when `forward` unrolls the layers,
    linear maps packed for the native CPU kernel or tagged with the kernel that multiplies them."""
    if not scan_layers:
        host_weights = unstack_layers(host_weights)
    kernel = linear_kernel(backends)
    if kernel == "native":
        return pack_linear_weights(host_weights)
    return host_weights if kernel == "xla" else quant.with_kernel(host_weights, kernel)


def linear_kernel(backends: ops.Backends) -> str:
    """What multiplies the linear maps on `backends`: "native" (packed for the native CPU matmul), else the
    `QuantizedLinear.kernel` of quantized maps: "pallas", "xla-q8" (XLA dots with the native kernel's semantics, on
    the CPU: tp, or no g++) or "xla"."""
    if backends.matmul in ("native", "pallas"):
        return backends.matmul
    return "xla-q8" if jax.default_backend() == "cpu" else "xla"


def compile_step(
    model_cfg: ModelConfig,
    engine_cfg: EngineConfig,
    weights: Weights,
    kv: KVCache,
    bucket: Bucket,
    *,
    backends: ops.Backends,
    placement=None,
) -> jax.stages.Compiled:
    """The engine's step for `bucket`, compiled from abstract weights and KV cache (trees of `ShapeDtypeStruct`s in
    the form `ModelRunner` places them, each with its sharding) without touching device memory: so a step can be
    measured before its KV cache exists (`jaxserve.memory_plan`), or compiled for a device this process does not
    have (a deviceless GPU target: tests/test_step_compile_sm90.py). `placement`: the sharding of the packed batch
    (the weights' device; None = the default device). The jit is `ModelRunner`'s: `step_fn` with the same bound
    arguments, the bucket's layout static, the cache donated; a plain step (no prompt logprobs, no EAGLE-3
    features, no async token feed)."""
    k, V = engine_cfg.max_logprobs, model_cfg.vocab_size
    speculative = engine_cfg.speculative_config is not None
    logits, ids = jax.ShapeDtypeStruct((1, V), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.int32)
    sampled = jax.eval_shape(functools.partial(sample, max_logprobs=k), logits,
                             _structs(SamplingInputs.neutral(1, 1)), draft_ids=ids if speculative else None)
    lp = jax.eval_shape(functools.partial(prompt_logprobs, max_logprobs=k), logits, ids)
    batch = StepBatch(build_step_inputs([], bucket, engine_cfg.page_size),
                      SamplingInputs.neutral(bucket.rows, bucket.max_pages * engine_cfg.page_size),
                      np.full(bucket.rows, -1, np.int32) if speculative else None)
    layout = Layout.of(batch)
    jitted = jax.jit(
        functools.partial(step_fn, model_cfg, k, rows=RowLayout.of(sampled), prompt_rows=RowLayout.of(lp),
                          backends=backends),
        static_argnames=("layout",),
        donate_argnames=("kv",),
    )
    packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=placement)
    return jitted.lower(weights, kv, packed, layout=layout).compile()


class ModelRunner:
    def __init__(
        self,
        model_cfg: ModelConfig,
        engine_cfg: EngineConfig,
        host_weights: Weights,
        dtype: str,
        hidden_layer_ids: tuple[int, ...] = (),
        backends: ops.Backends | None = None,
        mesh=None,
        first_stage: bool = True,
    ):
        """`hidden_layer_ids`: also output the residual streams entering these layers (EAGLE-3 features); after
        each `run` they stay on device as `self.last_hidden`, f[T, len(ids) * D] in the step's token order.
        `backends`: the kernels the step runs (`ops.resolve_backends`; resolved from `engine_cfg` if None).
        `mesh`: the devices the weights and the cache live on, placed by their logical axes under
        `engine_cfg.mesh` (default `backends.mesh`; None: the default device). `host_weights` may be one pipeline
        stage's part (`model.llama.stage_weights`, with `model_cfg.num_layers` its layer count): the runner is
        then that stage (`pipeline.PipelineRunner` chains them); `first_stage=False` for every stage but the first,
        whose steps take the previous stage's residual stream."""
        self.model_cfg = model_cfg
        self.hidden_layer_ids = tuple(hidden_layer_ids)
        self.last_hidden: jax.Array | None = None
        self.engine_cfg = engine_cfg
        self.dtype = jnp.dtype(dtype)
        self.kv_dtype = jnp.dtype(kv_storage_dtype(engine_cfg.kv_cache_dtype, dtype))
        enable_compilation_cache()
        self.scan_layers = (engine_cfg.scan_layers if engine_cfg.scan_layers is not None
                            else jax.default_backend() != "cpu")
        self.backends = backends or ops.resolve_backends(engine_cfg, dtype, self.scan_layers)
        self.native_matmul = self.backends.matmul == "native"
        host_weights = prepare_weights(host_weights, self.backends, self.scan_layers)
        self.mesh = mesh if mesh is not None else self.backends.mesh  # weights and KV placed by logical axes
        self.first_stage = first_stage
        self.last_stage = host_weights.final_norm is not None
        self.publish = None  # multi-host: called with each run's (bucket, prompt logprobs?, packed) before running
        self.num_microbatches = 1  # steps per engine step (pipeline parallelism splits one into several)
        self.weights = jax.device_put(host_weights, self._shardings(host_weights, weight_axes(host_weights)))
        num_pages = engine_cfg.num_pages
        if num_pages is None:
            raise ValueError("ModelRunner needs a resolved num_pages (LLMEngine resolves it from the memory budget)")
        logger.info(
            "KV cache: %d pages x %d tokens, %s, %.1f MiB",
            num_pages,
            engine_cfg.page_size,
            self.kv_dtype.name,
            kv_cache_bytes(model_cfg, num_pages, engine_cfg.page_size, self.kv_dtype) / 2**20,
        )
        kv = init_kv_cache(model_cfg, num_pages, engine_cfg.page_size, self.kv_dtype)
        kv_axes = KVCache(KV_AXES, KV_AXES, *((KV_SCALE_AXES, KV_SCALE_AXES) if kv.quantized else ()))
        kv_shardings = self._shardings(kv, kv_axes)
        self.kv = jax.device_put(kv, kv_shardings)
        if jax.default_backend() == "cpu":  # fewer TLB misses per step (`hugepages`)
            t0 = time.perf_counter()
            leaves = jax.block_until_ready(jax.tree_util.tree_leaves((self.weights, self.kv)))
            collapsed = hugepages.back_with_huge_pages(leaves)
            if collapsed:
                logger.info("huge pages: %.0f MiB of weights and KV cache in %.1f s", collapsed / 2**20,
                            time.perf_counter() - t0)
        self._replicated = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        self.rows, self.prompt_rows = self._output_layouts()
        self._jitted = jax.jit(
            functools.partial(
                step_fn, model_cfg, engine_cfg.max_logprobs, rows=self.rows, prompt_rows=self.prompt_rows,
                backends=self.backends, hidden_layer_ids=self.hidden_layer_ids,
                out_shardings=None if self.mesh is None else (kv_shardings, self._replicated),
            ),
            static_argnames=("layout",),
            donate_argnames=("kv",),
        )
        # async scheduling: the last step's sampled tokens stay on the device for the next step's `token_feed`
        self.async_scheduling = bool(engine_cfg.async_scheduling)
        self.last_tokens = None
        if self.async_scheduling:
            max_rows = engine_cfg.max_num_seqs * (1 + engine_cfg.num_speculative_tokens)
            self.last_tokens = jax.device_put(np.zeros(max_rows, np.int32), self._replicated)
        # An EAGLE-3 head's drafts may stay on the device (`Eagle3Proposer`): the next step takes them from this
        # array (`StepBatch.draft_feed`), which the head replaces after each target step it drafts from. Without a
        # mesh and in one piece (on a mesh the head's output would have to be placed as the step expects it;
        # pipeline stages take tokens on the first stage only).
        self.drafts = None
        if self.hidden_layer_ids and self.first_stage and self.last_stage and self.mesh is None:
            size = engine_cfg.max_num_seqs * engine_cfg.num_speculative_tokens
            self.drafts = jax.device_put(np.zeros(size, np.int32), self._replicated)
        self._layouts: dict[tuple[Bucket, bool], Layout] = {}
        self._executables: dict[tuple[Bucket, bool], jax.stages.Compiled] = {}
        self.num_compiles = 0

    def _shardings(self, tree, axes):
        """Where `tree`'s arrays go: by their logical axes on the mesh, or the default device without one."""
        if self.mesh is None:
            return None
        if self.mesh.size == 1:  # one device (a pipeline stage or replica without tp): everything on it, as it is
            return NamedSharding(self.mesh, PartitionSpec())
        return sharding.shardings(self.mesh, self.engine_cfg.mesh, tree, axes, sharding.model_units(self.model_cfg))

    def all_buckets(self) -> list[Bucket]:
        cfg = self.engine_cfg
        k = cfg.num_speculative_tokens
        rows = (0, cfg.max_num_batched_tokens) if k else (0,)  # with speculation: without and with verify rows
        return list(dict.fromkeys(
            choose_bucket(t, p, cfg.token_buckets, cfg.page_buckets, cfg.max_num_seqs, 1 + k, r)
            for t in cfg.token_buckets
            for p in cfg.page_buckets
            for r in rows
        ))

    def _output_layouts(self) -> tuple[RowLayout, RowLayout]:
        """The packed column layouts of the sampler's and the prompt logprobs' outputs, derived once from their
        dataclasses (shapes traced for one row; the columns do not depend on the row count)."""
        k, V = self.engine_cfg.max_logprobs, self.model_cfg.vocab_size
        logits = jax.ShapeDtypeStruct((1, V), jnp.float32)
        ids = jax.ShapeDtypeStruct((1,), jnp.int32)
        draft_ids = ids if self.engine_cfg.speculative_config is not None else None
        sampled = jax.eval_shape(
            functools.partial(sample, max_logprobs=k), logits, _structs(SamplingInputs.neutral(1, 1)),
            draft_ids=draft_ids
        )
        lp = jax.eval_shape(functools.partial(prompt_logprobs, max_logprobs=k), logits, ids)
        return RowLayout.of(sampled), RowLayout.of(lp)

    def neutral_batch(self, b: Bucket, prompt_logprobs: bool = False) -> StepBatch:
        """A step of bucket `b` that runs nothing (padding only): the template every real step's layout matches."""
        R, T = b.rows, b.num_tokens
        return StepBatch(
            build_step_inputs([], b, self.engine_cfg.page_size),
            SamplingInputs.neutral(R, b.max_pages * self.engine_cfg.page_size),
            np.full(R, -1, np.int32) if self.engine_cfg.speculative_config is not None else None,
            np.full(T, -1, np.int32) if prompt_logprobs else None,
            np.full(T, -1, np.int32) if self.async_scheduling else None,
            np.full(T, -1, np.int32) if self.drafts is not None else None,
        )

    def layout(self, b: Bucket, prompt_logprobs: bool = False) -> Layout:
        """Where every step input lives in the packed buffer, for bucket `b` (derived from `StepBatch`)."""
        key = (b, prompt_logprobs)
        if key not in self._layouts:
            self._layouts[key] = Layout.of(self.neutral_batch(b, prompt_logprobs))
        return self._layouts[key]

    def executable(self, bucket: Bucket, prompt_logprobs: bool = False) -> jax.stages.Compiled:
        """The compiled step for `bucket` (the prompt-logprobs variant computes logits at every token)."""
        key = (bucket, prompt_logprobs)
        exe = self._executables.get(key)
        if exe is None:
            t0 = time.perf_counter()
            lay = self.layout(bucket, prompt_logprobs)
            packed = jax.ShapeDtypeStruct((lay.size,), jnp.int32, sharding=self._replicated)
            x_in = None if self.first_stage else jax.ShapeDtypeStruct(
                (bucket.num_tokens, self.model_cfg.hidden_size), self.dtype, sharding=self._replicated)
            prev, drafts = (None if a is None else jax.ShapeDtypeStruct(a.shape, jnp.int32, sharding=self._replicated)
                            for a in (self.last_tokens, self.drafts))
            exe = self._jitted.lower(self.weights, self.kv, packed, x_in, prev, drafts, layout=lay).compile()
            self._executables[key] = exe
            self.num_compiles += 1
            logger.info("compiled %s%s in %.1f s", bucket, " (prompt logprobs)" if prompt_logprobs else "",
                        time.perf_counter() - t0)
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

    def run(self, bucket: Bucket, batch: StepBatch) -> tuple[SamplerOutput, PromptLogprobs | None]:
        """One step: one transfer in, one executable call, one fetch out. Returns the sampler's outputs (numpy) and,
        if the batch has `prompt_targets`, the prompt log-probabilities."""
        return self.run_many([(bucket, batch)])[0]

    def run_many(self, steps: list[tuple[Bucket, StepBatch]]) -> list[tuple[SamplerOutput, PromptLogprobs | None]]:
        """Several steps (an engine step's micro-batches) dispatched back to back, their outputs fetched at once."""
        return self.fetch(self.dispatch(steps))

    def dispatch(self, steps: list[tuple[Bucket, StepBatch]]) -> list[tuple]:
        """The first half of `run_many`: pack, publish (multi-host) and enqueue the steps on the devices without
        waiting for them; returns their device outputs for `fetch`."""
        items = [self.pack(b, batch) for b, batch in steps]
        if self.publish is not None:
            self.publish(items)
        return self.execute(items)

    def fetch(self, outs: list[tuple]) -> list[tuple[SamplerOutput, PromptLogprobs | None]]:
        """The second half of `run_many`: wait for `dispatch`'s outputs and unpack them on the host."""
        outs = jax.device_get([out[:2] for out in outs])
        return [(self.rows.unpack(sampled), None if prompt_lp is None else self.prompt_rows.unpack(prompt_lp))
                for sampled, prompt_lp in outs]

    @property
    def head_embed(self) -> jax.Array:
        """The embedding an EAGLE-3 head shares with this target (on the devices the head runs on)."""
        return self.weights.embed

    def pack(self, bucket: Bucket, batch: StepBatch) -> tuple[Bucket, bool, np.ndarray]:
        """A step as what `execute` takes (and multi-host followers receive): (bucket, prompt logprobs?, packed)."""
        with_prompt = batch.prompt_targets is not None
        return bucket, with_prompt, self.layout(bucket, with_prompt).pack(batch)

    def execute(self, items: list[tuple[Bucket, bool, np.ndarray]]) -> list[tuple]:
        """Run packed steps in order, without waiting for them: their device outputs (`step_fn`)."""
        outs = []
        for bucket, with_prompt, packed in items:
            outs.append(self.call(bucket, with_prompt, jax.device_put(packed, self._replicated)))
        self.last_hidden = outs[-1][2] if self.hidden_layer_ids and len(outs) == 1 else None
        return outs

    def call(self, bucket: Bucket, with_prompt: bool, packed: jax.Array, x_in: jax.Array | None = None) -> tuple:
        """One executable call on device-resident inputs (the KV cache is donated and replaced)."""
        exe = self.executable(bucket, with_prompt)
        out, self.kv = exe(self.weights, self.kv, packed, x_in, self.last_tokens, self.drafts)
        if self.async_scheduling:
            self.last_tokens = out[-1]
        return out

    def kv_is_intact(self) -> bool:
        """False once a failed executable call consumed the donated KV cache: the engine cannot go on."""
        return not any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.kv))


class ProposerRunner:
    """The device side of a proposer with its own jitted step beside the target's (the EAGLE-3 head): owns the
    proposer's weights and state (its KV cache), compiles one executable per input layout, and per call does one
    transfer in, one executable call (state donated) and one fetch out.

    `fn(weights, shared, state, device_input, packed, *, layout) -> (out, state)`: `shared` is device data owned
    elsewhere (the target's embedding), `device_input` an array already on device (the target step's features).
    """

    def __init__(self, fn, host_weights, state, shared, sharding=None):
        """`sharding`: where the weights, the state and the inputs live (replicated on the target's mesh, or the
        default device when None)."""
        self.weights = jax.device_put(host_weights, sharding)
        self.state = jax.device_put(state, sharding)
        self.shared = shared
        self.sharding = sharding
        self._jitted = jax.jit(fn, static_argnames=("layout",), donate_argnums=(2,))
        self._executables: dict[tuple, jax.stages.Compiled] = {}
        self.num_compiles = 0

    def executable(self, layout: Layout, device_input: jax.ShapeDtypeStruct) -> jax.stages.Compiled:
        key = (layout, device_input.shape, jnp.dtype(device_input.dtype).name)
        exe = self._executables.get(key)
        if exe is None:
            t0 = time.perf_counter()
            packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=self.sharding)
            device_input = jax.ShapeDtypeStruct(device_input.shape, device_input.dtype, sharding=self.sharding)
            lowered = self._jitted.lower(self.weights, self.shared, self.state, device_input, packed, layout=layout)
            exe = lowered.compile()
            self._executables[key] = exe
            self.num_compiles += 1
            logger.info("compiled proposer step for %s in %.1f s", device_input.shape, time.perf_counter() - t0)
        return exe

    def run(self, layout: Layout, inputs, device_input: jax.Array, fetch: bool = True) -> np.ndarray | jax.Array:
        """`inputs`: the host pytree `layout` was derived from (e.g. the head's catch-up dataclass). `fetch=False`:
        the output stays on the device (not waited for)."""
        exe = self.executable(layout, jax.ShapeDtypeStruct(device_input.shape, device_input.dtype))
        packed = jax.device_put(layout.pack(inputs), self.sharding)
        out, self.state = exe(self.weights, self.shared, self.state, device_input, packed)
        return np.asarray(jax.device_get(out)) if fetch else out
