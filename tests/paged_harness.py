"""A minimal driver of the model's ragged step for tests: fixed page assignment, logits at every token."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.batch import Bucket, ScheduledSeq, build_step_inputs
from jaxserve.kv_cache import init_kv_cache
from jaxserve.loader import load_checkpoint
from jaxserve.loader.weights import to_weights
from jaxserve.model.llama import compute_logits, forward, pack_linear_weights, unstack_layers


def forward_logits(cfg, weights, kv, inputs):
    h, kv, _ = forward(cfg, weights, kv, inputs)
    return compute_logits(weights, h[inputs.logits_indices]), kv


class PagedModel:
    """Runs ragged steps on a checkpoint; sequence i owns pages [1 + i*pages_per_seq, ...)."""

    def __init__(self, path: str, *, num_seqs: int = 4, page_size: int = 4, pages_per_seq: int = 16, dtype="float32",
                 layers: str = "scanned", quantization: str = "none"):
        """`layers`: "scanned" (stacked weights, lax.scan), "unrolled" (per-layer weights) or "packed" (unrolled,
        linear weights packed for the native CPU matmul). `quantization`: how linear weights are stored
        (`jaxserve.quant`); `self.host_weights` keeps the stacked host form."""
        ckpt = load_checkpoint(path, quantization)
        self.cfg = ckpt.config
        weights = self.host_weights = to_weights(ckpt.config, ckpt.tensors, np.dtype(dtype), path, ckpt.quantization)
        if layers != "scanned":
            weights = unstack_layers(weights)
        if layers == "packed":
            weights = pack_linear_weights(weights)
        self.weights = jax.device_put(weights)
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        self.kv = init_kv_cache(self.cfg, 1 + num_seqs * pages_per_seq, page_size, jnp.dtype(dtype))
        self.lengths = [0] * num_seqs
        self._fwd = jax.jit(functools.partial(forward_logits, self.cfg), donate_argnums=(1,))

    def pages(self, i: int) -> list[int]:
        return list(range(1 + i * self.pages_per_seq, 1 + (i + 1) * self.pages_per_seq))

    def step(self, chunks: dict[int, list[int]], *, num_tokens: int | None = None) -> dict[int, np.ndarray]:
        """Feed each sequence i the tokens chunks[i]; return logits f32[len(chunk), V] per sequence."""
        seqs = [ScheduledSeq(toks, self.lengths[i], self.pages(i)) for i, toks in chunks.items()]
        T = sum(len(t) for t in chunks.values())
        bucket = Bucket(num_tokens=num_tokens or T, num_seqs=len(seqs), max_pages=self.pages_per_seq)
        host = build_step_inputs(seqs, bucket, self.page_size)
        host.logits_indices = np.arange(bucket.num_tokens, dtype=np.int32)
        logits, self.kv = self._fwd(self.weights, self.kv, host)
        logits = np.asarray(logits)
        out, t = {}, 0
        for i, toks in chunks.items():
            out[i] = logits[t : t + len(toks)]
            t += len(toks)
            self.lengths[i] += len(toks)
        return out
