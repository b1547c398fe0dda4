"""Target features for EAGLE-3 training: run the target over prompt + output once, store what the head learns from.

The target runs through the serving forward (`jaxserve.model.llama.forward` over a paged KV cache, inputs from
`jaxserve.batch.build_step_inputs`, with the kernels and weight layout a default engine uses), so the features are
the ones serving computes. Consecutive samples are packed into one ragged step of up to `max_len` tokens, as
serving prefills several prompts at once. Per token p of every sample we store:

  aux.npy            f16[N, 3D]  residual streams entering `aux_layer_ids` (input convention), concatenated
  hidden.npy         f16[N, D]   the target's final-normed hidden state (target logits = hidden @ output embedding)
  tokens.npy         i32[N]
  target_argmax.npy  i32[N]      the target's greedy next token after p, over the full vocabulary
  is_output.npy      u8[N]       1 where token p is an output token (the loss mask of the token it is)
  index.npz          offsets i64[S], lengths i32[S], prompt_lens i32[S]   (sample s = rows offsets[s]:+lengths[s])
  meta.json          model, aux_layer_ids, hidden_size, vocab_size, max_len, num_samples, num_tokens, fingerprint

Samples longer than `max_len` are cut at the end; samples left without output tokens are skipped.

Resumable: while it runs, progress.json names the samples whose rows are on disk (rewritten every few seconds, and on
the way out of an exception or Ctrl-C), so a run that stopped goes on from there when started again with the same
samples and target. meta.json is written last and marks a complete directory. `fingerprint` (a digest of the samples'
tokens and the target) decides what "the same" is; a directory holding other features is refused, not overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import ops
from jaxserve.batch import Bucket, ScheduledSeq, build_step_inputs, smallest_at_least
from jaxserve.config import EngineConfig
from jaxserve.kv_cache import init_kv_cache
from jaxserve.loader import load_checkpoint
from jaxserve.loader.eagle3 import default_aux_layer_ids
from jaxserve.loader.weights import to_weights
from jaxserve.model.layers import argmax
from jaxserve.model.llama import compute_logits, forward
from jaxserve.runner import prepare_weights
from training.eagle3.progress import bar, duration, say

PAGE_SIZE = 16
COMMIT_SECONDS = 10.0  # progress.json is rewritten at most this often: what a killed run recomputes


def read_jsonl(path: str, limit: int | None = None) -> list[dict]:
    """regenerate.py's output -> [{"prompt_token_ids", "output_token_ids", "chat"}]; a torn last line is dropped."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and len(out) >= limit:
                break
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # the file may still be being written
            if "prompt_token_ids" not in r or "output_token_ids" not in r:
                raise ValueError(f"{path}:{i + 1}: expected prompt_token_ids and output_token_ids (got {sorted(r)})")
            out.append(r)
    return out


def _target_step(cfg, aux_ids, backends, weights, kv, inputs):
    h, kv, hidden = forward(cfg, weights, kv, inputs, hidden_layer_ids=aux_ids, backends=backends)
    T = h.shape[0]
    aux = jnp.transpose(hidden, (1, 0, 2)).reshape(T, -1)  # [T, 3D]  (low, mid, high), as serving concatenates
    return aux, h, argmax(compute_logits(weights, h)), kv


class TargetFeatures:
    """The target model as a default engine runs it (the kernels `ops.resolve_backends` picks, the weights prepared
    as the runner prepares them), over a few sequences at a time: [tokens] -> [(aux f32[T, 3D], hidden f32[T, D],
    argmax i32[T])]. Sequences are packed into one ragged step of at most `max_len` tokens (padded to a length
    bucket), as prompts are prefilled together in serving: no padding per sequence, and steps big enough for the
    matmuls to run at speed."""

    def __init__(self, model: str | None, *, aux_layer_ids: tuple[int, ...] | None = None, max_len: int = 1280,
                 len_buckets: tuple[int, ...] = (128, 256, 512, 768, 1024, 1280), max_seqs: int = 16,
                 dtype=jnp.float32):
        ck = load_checkpoint(model)
        self.path, self.cfg = ck.path, ck.config
        self.aux_layer_ids = tuple(aux_layer_ids or default_aux_layer_ids(ck.config.num_layers))
        if len(self.aux_layer_ids) != 3 or not all(0 <= i <= ck.config.num_layers for i in self.aux_layer_ids):
            raise ValueError(f"aux_layer_ids must be 3 ids in [0, {ck.config.num_layers}] (got {self.aux_layer_ids})")
        self.max_len, self.max_seqs = max_len, max_seqs
        self.len_buckets = tuple(sorted({b for b in len_buckets if b < max_len} | {max_len}))
        host = to_weights(ck.config, ck.tensors, dtype, ck.path)
        self._out_embed = np.asarray(host.embed if host.lm_head is None else host.lm_head.T, np.float32)
        scan = jax.default_backend() != "cpu"  # as EngineConfig.scan_layers resolves
        self.backends = ops.resolve_backends(EngineConfig(), jnp.dtype(dtype).name, scan)
        self.weights = jax.device_put(prepare_weights(host, self.backends, scan))
        self.seq_pages = -(-max_len // PAGE_SIZE)
        # A step's sequences hold at most max_len tokens: their pages, each rounded up, fit this many.
        num_pages = self.seq_pages + max_seqs
        self.pages = list(range(1, num_pages + 1))  # page 0 is the padding sink
        self.kv = init_kv_cache(ck.config, num_pages + 1, PAGE_SIZE, dtype)
        self._step = jax.jit(_target_step, static_argnums=(0, 1, 2), donate_argnums=(4,))

    def output_embedding(self) -> np.ndarray:
        """f32[V, D]: the target's lm_head rows (the embedding when tied)."""
        return self._out_embed

    def __call__(self, seqs: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        lens = [len(t) for t in seqs]
        if not 1 <= len(seqs) <= self.max_seqs or min(lens) < 1 or sum(lens) > self.max_len:
            raise ValueError(f"a step takes 1..{self.max_seqs} non-empty sequences of at most {self.max_len} tokens "
                             f"together (got lengths {lens})")
        scheduled, p = [], 0
        for t in seqs:
            n = -(-len(t) // PAGE_SIZE)
            scheduled.append(ScheduledSeq(list(t), 0, self.pages[p : p + n]))
            p += n
        b = Bucket(num_tokens=smallest_at_least(self.len_buckets, sum(lens)), num_seqs=self.max_seqs,
                   max_pages=self.seq_pages)
        inputs = jax.tree.map(jnp.asarray, build_step_inputs(scheduled, b, PAGE_SIZE))
        aux, h, am, self.kv = self._step(self.cfg, self.aux_layer_ids, self.backends, self.weights, self.kv, inputs)
        aux, h, am = np.asarray(aux), np.asarray(h), np.asarray(am)
        ends = np.cumsum(lens)
        return [(aux[e - n : e], h[e - n : e], am[e - n : e]) for n, e in zip(lens, ends)]


def pack(lengths: list[int], start: int, max_tokens: int, max_seqs: int) -> int:
    """The end of the step that starts at sample `start`: the longest run of samples that together fit
    `max_tokens` and `max_seqs` (always at least one)."""
    end, total = start, 0
    while end < len(lengths) and end - start < max_seqs and total + lengths[end] <= max_tokens:
        total += lengths[end]
        end += 1
    return max(end, start + 1)


def _fp16(x: np.ndarray, what: str) -> np.ndarray:
    y = x.astype(np.float16)
    if not np.isfinite(y).all():
        raise ValueError(f"{what} overflows float16 (max |x| = {np.abs(x).max():.1f}); store float32 instead")
    return y


def _fingerprint(seqs: list[tuple[list[int], int]], target: TargetFeatures) -> str:
    """A digest of everything the stored features depend on: the target, its aux layers, max_len and every sample's
    (tokens, prompt length)."""
    h = hashlib.sha256(json.dumps([target.path, list(target.aux_layer_ids), target.max_len]).encode())
    h.update(np.array([P for _, P in seqs], np.int64).tobytes())
    h.update(np.array([len(ids) for ids, _ in seqs], np.int64).tobytes())
    h.update(np.concatenate([np.asarray(ids, np.int64) for ids, _ in seqs]).tobytes())
    return h.hexdigest()


def _write_json(path: str, obj: dict) -> None:
    """Replace `path` atomically: a reader (or a resumed run) sees the old file or the new one, never half of one."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def extract(samples: list[dict], target: TargetFeatures, out_dir: str, log_every: int = 20) -> dict:
    """Run the target over every sample and write the feature directory (layout and resuming in the module
    docstring); returns its meta.json. `log_every`: samples between log lines (0: none)."""
    seqs = []
    for r in samples:
        p, o = list(r["prompt_token_ids"]), list(r["output_token_ids"])
        ids = (p + o)[: target.max_len]
        if len(ids) > len(p):  # at least one output token left
            seqs.append((ids, len(p)))
    if not seqs:
        raise ValueError("no sample has an output token within max_len")
    fingerprint = _fingerprint(seqs, target)
    lengths = np.array([len(s) for s, _ in seqs], np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]])
    N, D = int(lengths.sum()), target.cfg.hidden_size
    os.makedirs(out_dir, exist_ok=True)
    meta_path, progress_path = os.path.join(out_dir, "meta.json"), os.path.join(out_dir, "progress.json")

    def refuse(record: str) -> ValueError:
        return ValueError(f"{out_dir} holds features of other samples or another target (its {record} has another "
                          "fingerprint); write to a new --out, or delete it to start over")

    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("fingerprint") != fingerprint:
            raise refuse("meta.json")
        say(f"[features] {out_dir} is complete ({meta['num_samples']} samples)")
        return meta
    done = 0
    if os.path.exists(progress_path):
        with open(progress_path) as f:
            saved = json.load(f)
        if saved["fingerprint"] != fingerprint:
            raise refuse("progress.json")
        done = saved["done"]
        say(f"[features] resuming {out_dir}: {done} of {len(seqs)} samples done")
    mode = "r+" if done else "w+"

    def mm(name: str, dtype, shape: tuple[int, ...]) -> np.memmap:
        return np.lib.format.open_memmap(os.path.join(out_dir, name), mode, dtype, shape)

    aux = mm("aux.npy", np.float16, (N, 3 * D))
    hid = mm("hidden.npy", np.float16, (N, D))
    toks = mm("tokens.npy", np.int32, (N,))
    am = mm("target_argmax.npy", np.int32, (N,))
    is_out = mm("is_output.npy", np.uint8, (N,))
    arrays = (aux, hid, toks, am, is_out)

    def commit(num_done: int) -> None:  # rows first, then the record that they are there
        for a in arrays:
            a.flush()
        _write_json(progress_path, dict(fingerprint=fingerprint, done=num_done))

    t0, t_commit, tokens = time.perf_counter(), time.perf_counter(), 0
    logged = done // log_every if log_every else 0
    try:
        with bar(len(seqs), desc="features", unit="sample", initial=done) as progress:
            while done < len(seqs):
                end = pack(lengths, done, target.max_len, target.max_seqs)
                for s, (a, h, g) in zip(range(done, end), target([ids for ids, _ in seqs[done:end]])):
                    ids, P = seqs[s]
                    sl = slice(int(offsets[s]), int(offsets[s]) + len(ids))
                    aux[sl], hid[sl] = _fp16(a, "an aux feature"), _fp16(h, "a final hidden state")
                    toks[sl], am[sl] = ids, g
                    is_out[sl] = np.arange(len(ids)) >= P
                    tokens += len(ids)
                progress.update(end - done)
                done = end
                if time.perf_counter() - t_commit > COMMIT_SECONDS:
                    commit(done)
                    t_commit = time.perf_counter()
                if log_every and done // log_every > logged:
                    logged, dt = done // log_every, time.perf_counter() - t0
                    written = int(offsets[done - 1]) + int(lengths[done - 1])
                    say(f"[features] {done}/{len(seqs)} samples, {written} tokens, {tokens / dt:.0f} tok/s, "
                        f"eta {duration((N - written) * dt / tokens)}")
    finally:  # an exception or Ctrl-C keeps what is done: the rows of samples < done are complete
        commit(done)
    np.savez(os.path.join(out_dir, "index.npz"), offsets=offsets, lengths=lengths,
             prompt_lens=np.array([P for _, P in seqs], np.int32))
    meta = dict(model=target.path, aux_layer_ids=list(target.aux_layer_ids), hidden_size=D,
                vocab_size=target.cfg.vocab_size, max_len=target.max_len, num_samples=len(seqs), num_tokens=N,
                fingerprint=fingerprint)
    _write_json(meta_path, meta)
    os.remove(progress_path)
    return meta


@dataclass
class FeatureStore:
    """A feature directory opened read-only (arrays memory-mapped)."""

    meta: dict
    offsets: np.ndarray  # i64[S]
    lengths: np.ndarray  # i32[S]
    prompt_lens: np.ndarray  # i32[S]
    aux: np.ndarray  # f16[N, 3D]
    hidden: np.ndarray  # f16[N, D]
    tokens: np.ndarray  # i32[N]
    target_argmax: np.ndarray  # i32[N]
    is_output: np.ndarray  # u8[N]
    path: str = ""  # the directory

    @classmethod
    def open(cls, path: str) -> "FeatureStore":
        if not os.path.isfile(os.path.join(path, "meta.json")):
            raise FileNotFoundError(f"{path}: no meta.json; run `python -m training.eagle3 features` first")
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        idx = np.load(os.path.join(path, "index.npz"))
        ld = lambda n: np.load(os.path.join(path, n + ".npy"), mmap_mode="r")  # noqa: E731
        return cls(meta, idx["offsets"], idx["lengths"], idx["prompt_lens"], ld("aux"), ld("hidden"), ld("tokens"),
                   ld("target_argmax"), ld("is_output"), path)

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    def rows(self, s: int) -> slice:
        return slice(int(self.offsets[s]), int(self.offsets[s]) + int(self.lengths[s]))
