"""The Optax training loop for an EAGLE-3 head over a feature directory (features.py), with held-out evaluation.

Parameters: every `Eagle3Weights` array except `d2t` (the vocabulary is fixed before training); fp32. The embedding
is the target's, frozen and passed separately. Init: lm_head columns = the target's output-embedding rows of the draft
ids, norms = 1, other matrices ~ N(0, 0.02). Optimizer: global-norm clip, AdamW (b1 0.9, b2 0.95, weight decay on
matrices only), linear warmup then cosine decay to 10% of the peak. Norm flags: all False (see Eagle3Config);
export.py writes whatever the config holds, so training and serving agree.

Data parallelism (`mesh`, a `jaxserve.sharding` mesh config with dp > 1 and pp = tp = 1): every array of a batch is
sharded on its leading (row) dimension over the logical axis "batch"; parameters, optimizer state, the frozen
embedding and the vocabulary arrays are replicated. The loss is one mean over the global batch (masked sums over
all rows, then divided), so XLA's SPMD partitioner turns the row sums into per-device partial sums plus an
all-reduce and the gradients come out averaged across dp: a sharded step is the unsharded step, up to the order of
float additions. `batch_tokens` is the global batch. A plan's rows are padded to a multiple of dp with empty rows
(length 0: every mask false), which add exact zeros to the sums and so leave the loss and gradients as they were;
pick `batch_tokens` so the planner's row counts divide dp to waste nothing. Host arrays are placed shard by shard
(`jax.make_array_from_callback`), so the mesh, built over `jax.devices()`, may span processes once they are
initialised; every process then assembles the same global batch and process 0 alone exports.

Resuming (checkpoint.py): with an output directory, the loop writes an Orbax checkpoint of everything the next step
depends on every `save_every` steps and when asked to stop (SIGTERM, SIGINT, `stop_after`); `train(resume=True)`
restores the latest one onto this trainer's arrays and continues, bit for bit the run that stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxserve import sharding
from jaxserve.config import ModelConfig
from jaxserve.loader import load_checkpoint
from jaxserve.loader.eagle3 import load_eagle3
from jaxserve.loader.gguf import model_id
from jaxserve.loader.weights import to_weights
from jaxserve.model.eagle3 import Eagle3Config, Eagle3Weights
from jaxserve.spec_decode.controller import SpecMetrics
from training.eagle3.batches import BatchPlan, BatchStream, assemble, plan_batches, shape_of
from training.eagle3.checkpoint import CHECKPOINTS, Checkpoints, StopRequests, check_same_run, run_identity
from training.eagle3.export import export_speculators
from training.eagle3.features import FeatureStore
from training.eagle3.progress import bar, duration, say
from training.eagle3.ttt import VocabArrays, acceptance, chain_hits, served_walk, ttt_logits, ttt_loss
from training.eagle3.vocab import build_vocab, coverage, token_counts

DEFAULT_DRAFT_VOCAB_SIZE = 8192


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    lr: float = 1e-3
    warmup_frac: float = 0.05
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs
    batch_tokens: int = 1024
    ttt_steps: int = 4
    loss_decay: float = 0.8
    loss: str = "kl"  # ttt.LOSSES: "kl" (the target's distribution), "ce" (its greedy choice), "kl_all" (kl unmasked)
    draft_vocab_size: int | None = None  # None: DEFAULT_DRAFT_VOCAB_SIZE for a fresh head, a starting head's own
    weight_decay: float = 0.01
    clip_norm: float = 0.5
    len_buckets: tuple[int, ...] = (256, 384, 640, 1280)
    win_buckets: tuple[int, ...] = (168, 264)  # regenerate.py: raw replies 160 tokens, chat <= 256
    eval_frac: float = 0.05
    log_every: int = 10
    save_every: int = 0  # steps between checkpoints (+ a head in OUT/step-N); 0: only on a stop request
    keep_checkpoints: int = 3  # the newest checkpoints kept
    num_speculative_tokens: int = 3  # written into the exported config
    seed: int = 0


def head_config(target: ModelConfig, aux_layer_ids, draft_vocab_size: int) -> Eagle3Config:
    layer = dataclasses.replace(target, architecture="llama", num_layers=1, tie_word_embeddings=False,
                                attention_bias=False, qk_norm=False, bos_token_id=None, eos_token_ids=())
    return Eagle3Config(layer=layer, draft_vocab_size=draft_vocab_size, aux_layer_ids=tuple(aux_layer_ids))


def init_head(cfg: Eagle3Config, out_embed: np.ndarray, draft_ids: np.ndarray, seed: int) -> Eagle3Weights:
    """out_embed f32[V, D] (the target's lm_head rows), draft_ids i64[Vd] -> trainable weights (d2t=None)."""
    c = cfg.layer
    D, F, NH, KH = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    rng = np.random.default_rng(seed)
    normal = lambda *s: jnp.asarray(0.02 * rng.standard_normal(s), jnp.float32)  # noqa: E731
    ones = lambda: jnp.ones((D,), jnp.float32)  # noqa: E731  (one buffer each: the train step donates them)
    return Eagle3Weights(
        fc=normal(3 * D, D), embed_norm=ones(), hidden_norm=ones(), wq=normal(2 * D, NH), wk=normal(2 * D, KH),
        wv=normal(2 * D, KH), wo=normal(NH, D), mlp_norm=ones(), w_gate=normal(D, F), w_up=normal(D, F),
        w_down=normal(F, D), final_norm=ones(), lm_head=jnp.asarray(out_embed[draft_ids].T, jnp.float32), d2t=None,
    )


def _decay_mask(params):
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(tc: TrainConfig, total_steps: int) -> optax.GradientTransformation:
    warmup = max(1, int(tc.warmup_frac * total_steps))
    sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, warmup, max(total_steps, warmup + 1), end_value=0.1 * tc.lr)
    return optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=_decay_mask))


def load_target_embeddings(model: str) -> tuple[ModelConfig, np.ndarray, np.ndarray]:
    """-> (target config, input embedding f32[V, D], output embedding f32[V, D])."""
    ck = load_checkpoint(model)
    w = to_weights(ck.config, ck.tensors, np.float32, ck.path)
    return ck.config, np.asarray(w.embed), np.asarray(w.embed if w.lm_head is None else w.lm_head.T)


def split(num_samples: int, eval_frac: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic held-out split -> (train ids, eval ids); at least one eval sample when eval_frac > 0."""
    perm = np.random.default_rng(seed).permutation(num_samples)
    n_eval = min(num_samples - 1, max(1, round(eval_frac * num_samples))) if eval_frac > 0 else 0
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


def data_parallel_mesh(value) -> tuple[sharding.MeshConfig | None, jax.sharding.Mesh | None]:
    """A trainer mesh config (a MeshConfig, preset name, .yaml path or mapping; None: one device) -> (config, mesh
    over the first dp of `jax.devices()`). Only data parallelism is built: raises, naming the field, for pp > 1,
    tp > 1, or dp > 1 with the "batch" rule mapping to no axis of size dp."""
    cfg = sharding.MeshConfig.from_value(value)
    if cfg is None:
        return None, None
    name = cfg.name or "mesh"
    for field, size in (("pp", cfg.pp), ("tp", cfg.tp)):
        if size > 1:
            raise ValueError(f"mesh.{field}={size} ({name}): the EAGLE-3 trainer is data-parallel only; use a mesh "
                             "with pp = tp = 1, e.g. dp2 or dp8")
    if cfg.dp > 1 and cfg.mesh_axis("batch") is None:
        raise ValueError(f"mesh.rules.batch ({name}): with dp={cfg.dp} the trainer shards the batch over dp, but "
                         f"the rule maps it to {dict(cfg.rules)['batch']!r}; drop the rule or map batch to dp")
    return cfg, sharding.make_mesh(cfg)  # raises, naming the mesh, if there are fewer than dp devices


def _place(x, where):
    """Host array -> a jax.Array laid out by the sharding `where` (None: the default device). Each process fills only
    the shards on its own devices, from the same host value, so `where` may span processes."""
    if where is None:
        return jnp.asarray(x)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, where, lambda idx: x[idx])


def _eval_step(loss_fn, logits_fn, params, embed, vocab, batch):
    """-> (the batch's summed TTT stats, its `chain_hits`), both from one computation of the draft logits."""
    logits = logits_fn(params, embed, batch)
    return loss_fn(params, embed, vocab, batch, logits=logits)[1], chain_hits(vocab, batch, logits)


def _train_step(loss_fn, params, opt_state, embed, vocab, batch, *, tx):
    """-> (params, opt_state, loss, stats); params and opt_state are donated by the caller's jit."""
    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, embed, vocab, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, stats


TRAINING_RECORD = "training.json"  # written beside an exported head


def training_record(head: str) -> dict:
    """The record of the run that trained `head`: `train`'s training.json beside it, or the training a shipped head's
    card records; {} when neither says (a head from elsewhere). Each record holds its own `started_from`, so a head
    trained in several runs (`--init-head`) carries its whole lineage."""
    for name, key in ((TRAINING_RECORD, None), ("card.json", "training")):
        path = os.path.join(head, name)
        if os.path.isfile(path):
            with open(path) as f:
                record = json.load(f)
            record = record if key is None else record.get(key)
            if record:
                return record
    return {}


class Trainer:
    def __init__(self, store: FeatureStore, tc: TrainConfig, model: str | None = None, head: str | None = None,
                 mesh=None):
        """`head`: start from an exported head (its vocabulary and weights) instead of a fresh one. `mesh`: a
        data-parallel mesh config (`data_parallel_mesh`), checked before anything is loaded; None: one device."""
        self.store, self.tc = store, tc
        self.mesh_config, self.mesh = data_parallel_mesh(mesh)
        self.dp = 1 if self.mesh_config is None else self.mesh_config.dp
        # replicated: parameters, optimizer state, embedding, vocabulary, the step's outputs
        self._replicated = None if self.mesh is None else jax.sharding.NamedSharding(self.mesh,
                                                                                      jax.sharding.PartitionSpec())
        self.model = model or store.meta["model"]
        tcfg, embed, out_embed = load_target_embeddings(self.model)
        if tcfg.hidden_size != store.meta["hidden_size"] or tcfg.vocab_size != store.meta["vocab_size"]:
            raise ValueError(f"features in {store.meta} were not made by target {self.model}")
        self.train_ids, self.eval_ids = split(store.num_samples, tc.eval_frac, tc.seed)
        rows = np.concatenate([np.arange(store.offsets[s], store.offsets[s] + store.lengths[s])
                               for s in self.train_ids])
        counts = token_counts(store.tokens[rows], store.is_output[rows], tcfg.vocab_size)
        self.started_from = None  # the starting head's training record, for a run's lineage
        if head is None:
            size = tc.draft_vocab_size or DEFAULT_DRAFT_VOCAB_SIZE
            self.draft_ids, self.d2t, self.t2d = build_vocab(counts, size)
            self.cfg = head_config(tcfg, store.meta["aux_layer_ids"], size)
        else:
            self.started_from = training_record(head)
            self.cfg, w = load_eagle3(head, tcfg, np.float32)
            if list(self.cfg.aux_layer_ids) != list(store.meta["aux_layer_ids"]):
                raise ValueError(f"head {head} reads layers {self.cfg.aux_layer_ids}, the features hold "
                                 f"{store.meta['aux_layer_ids']}")
            head_ids = np.arange(self.cfg.draft_vocab_size) + w.d2t.astype(np.int64)
            size = tc.draft_vocab_size or head_ids.size
            if size < head_ids.size:
                raise ValueError(f"draft_vocab_size {size} is smaller than head {head}'s {head_ids.size} ids; a "
                                 "head's vocabulary can be kept or grown, not shrunk")
            # grown: the head's ids keep their rows; each added id's row starts as a fresh head's does (the
            # target's output embedding)
            self.draft_ids, self.d2t, self.t2d = build_vocab(counts, size, keep=head_ids)
            lm_head = out_embed[self.draft_ids].T.copy()
            lm_head[:, np.searchsorted(self.draft_ids, head_ids)] = np.asarray(w.lm_head)
            w = dataclasses.replace(w, lm_head=lm_head)
            self.cfg = dataclasses.replace(self.cfg, draft_vocab_size=size)
        # the vocabulary's size is the run's: recorded as such in checkpoints and in training.json
        self.tc = tc = dataclasses.replace(tc, draft_vocab_size=size)
        print(f"[vocab] {len(self.draft_ids)} draft ids cover {coverage(counts, self.t2d):.4f} of "
              f"{int(counts.sum())} training output tokens", flush=True)
        self.embed = self._replicate(embed)
        self.vocab = self._replicate(VocabArrays(draft_ids=self.draft_ids.astype(np.int32), t2d=self.t2d,
                                                 target_head=out_embed[self.draft_ids].T))
        if head is None:
            self.params = self._replicate(init_head(self.cfg, out_embed, self.draft_ids, tc.seed))
        else:
            self.params = self._replicate(dataclasses.replace(w, d2t=None))
        loss_fn = functools.partial(ttt_loss, self.cfg, num_steps=tc.ttt_steps, decay=tc.loss_decay,
                                    kind=tc.loss)
        logits_fn = functools.partial(ttt_logits, self.cfg, num_steps=tc.ttt_steps)
        self._eval_step = jax.jit(functools.partial(_eval_step, loss_fn, logits_fn), **self._out_replicated())
        self._train_step_fn = functools.partial(_train_step, loss_fn)

    def _replicate(self, tree):
        """Host or device arrays -> one copy on every mesh device (without a mesh: the default device)."""
        return jax.tree.map(lambda x: _place(x, self._replicated), tree)

    def _out_replicated(self) -> dict:
        """jit keywords: every output replicated over the mesh (nothing without one)."""
        return {} if self.mesh is None else dict(out_shardings=self._replicated)

    def padded(self, plan: BatchPlan) -> BatchPlan:
        """`plan` with its rows rounded up to a multiple of dp (the extra rows are empty: every mask false)."""
        return dataclasses.replace(plan, rows=-(-plan.rows // self.dp) * self.dp)

    def _plans(self, ids, rng=None):
        tc = self.tc
        return plan_batches(self.store, ids, num_steps=tc.ttt_steps, len_buckets=tc.len_buckets,
                            win_buckets=tc.win_buckets, batch_tokens=tc.batch_tokens, rng=rng)

    def _batch(self, plan):
        """-> TTTBatch on the devices; with a mesh, rows padded to a multiple of dp and sharded over "batch"."""
        tc = self.tc
        host = assemble(self.store, self.padded(plan), tc.ttt_steps, tc.len_buckets, tc.win_buckets)
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, host)
        axes = jax.tree.map(lambda a: ("batch",) + (None,) * (a.ndim - 1), host)  # rows over dp, the rest whole
        return jax.tree.map(_place, host, sharding.shardings(self.mesh, self.mesh_config, host, axes))

    def evaluate(self, params=None, ids=None, max_tokens: int | None = None) -> dict:
        """Over `ids` (default: the held-out split): the `acceptance` summary of the summed TTT stats (every chain
        alike), and under "served_walk" what a server drafting K = num_speculative_tokens (at most ttt_steps) tokens
        at every step would measure on these replies (`ttt.served_walk`, as `SpecMetrics.as_dict`; `max_tokens`: the
        budget the replies were generated under, if they were cut by one)."""
        params = self.params if params is None else params
        ids = self.eval_ids if ids is None else ids
        total, plans = None, self._plans(ids)
        k = min(self.tc.num_speculative_tokens, self.tc.ttt_steps)
        walked = SpecMetrics(k)
        with bar(len(plans), desc="eval", unit="batch", quiet=jax.process_index() != 0) as progress:
            for plan in plans:
                s, hits = self._eval_step(params, self.embed, self.vocab, self._batch(plan))
                total = s if total is None else jax.tree.map(jnp.add, total, s)
                hits = jax.device_get(hits)  # replicated (the batch itself may be sharded over processes)
                for b, sample in enumerate(plan.samples):
                    n, P = int(self.store.lengths[sample]), int(self.store.prompt_lens[sample])
                    _, _, r0 = shape_of(n, P, self.tc.ttt_steps, self.tc.len_buckets, self.tc.win_buckets)
                    window = r0 + np.arange(plan.window)  # the chains of the row's window (batches.assemble)
                    by_chain = np.full((n, self.tc.ttt_steps), -1, np.int8)
                    by_chain[window[window < n]] = hits[b][window < n]
                    served_walk(by_chain[:, :k], P, n, max_tokens, walked)
                progress.update()
        if total is None:
            raise ValueError("no samples to evaluate")
        return acceptance(jax.device_get(total)) | {"served_walk": walked.as_dict()}

    def export(self, path: str) -> None:
        """Write the head (speculators format); on a mesh spanning processes, process 0 alone writes."""
        if jax.process_index() != 0:
            return
        export_speculators(path, self.cfg, jax.device_get(self.params), self.d2t, self.t2d,
                           verifier=model_id(self.model),
                           num_speculative_tokens=self.tc.num_speculative_tokens)

    def init_opt_state(self, tx: optax.GradientTransformation):
        return jax.jit(tx.init, **self._out_replicated())(self.params)

    def train_step(self, tx: optax.GradientTransformation):
        """The jitted step (params, opt_state, embed, vocab, batch) -> (params, opt_state, loss, stats); params and
        opt_state are donated; with a mesh every output is replicated and the batch comes sharded (`_batch`)."""
        return jax.jit(functools.partial(self._train_step_fn, tx=tx), donate_argnums=(0, 1),
                       **self._out_replicated())

    def identity(self) -> dict:
        """What a checkpoint of this run records to refuse a resume by a different one (`check_same_run`)."""
        return run_identity(dataclasses.asdict(self.tc), self.store.meta, self.draft_ids)

    def train(self, out_dir: str | None = None, *, resume: bool = False, stop_after: int | None = None) -> list[dict]:
        """Run the loop and export the head to `out_dir`; returns the logged records (step, loss, acc per TTT step,
        tau, seconds per step), a resumed run's earlier records included.

        With `out_dir`, checkpoints go to OUT/checkpoints/ every `save_every` steps and when a stop is requested:
        SIGTERM or SIGINT (at the end of the step the signal arrives in), or the step count reaching `stop_after`. A
        stopped run exports nothing and returns at once; `self.stop_signal` is the signal that stopped it, if one did.
        `resume`: continue from the latest checkpoint, which must exist and belong to this run (same TrainConfig
        less checkpoint.FREE_FIELDS, same features and draft vocabulary); without it, existing checkpoints are an
        error rather than something to overwrite. The mesh may change on resume: a dp mesh's step equals the
        one-device step up to the order of float additions (module docstring), so only bit-equality is lost."""
        tc = self.tc
        per_epoch = len(self._plans(self.train_ids))
        total = tc.max_steps if tc.max_steps is not None else max(1, int(round(tc.epochs * per_epoch)))
        self.stop_signal = None
        ckpts = Checkpoints(os.path.join(out_dir, CHECKPOINTS), tc.keep_checkpoints) if out_dir else None
        try:
            return self._train(ckpts, out_dir, total, per_epoch, resume, stop_after)
        finally:
            if ckpts is not None:
                ckpts.close()

    def _train(self, ckpts, out_dir, total, per_epoch, resume, stop_after) -> list[dict]:
        tc = self.tc
        latest = None if ckpts is None else ckpts.latest_step()
        if resume and latest is None:
            where = "no output directory" if ckpts is None else f"no checkpoint in {ckpts.directory}"
            raise ValueError(f"resume: {where}; train without --resume to start the run")
        if not resume and latest is not None:
            raise ValueError(f"{ckpts.directory} holds a run's checkpoints (up to step {latest}): pass --resume to "
                             "continue it, or train into a new --out")
        meta = None
        if resume:
            meta = ckpts.meta(latest)
            check_same_run(meta["identity"], self.identity(), f"{ckpts.directory} (step {latest})",
                           defaults=dataclasses.asdict(TrainConfig()))
        tx = make_optimizer(tc, total)
        step_fn, opt_state = self.train_step(tx), self.init_opt_state(tx)
        stream = BatchStream(functools.partial(self._plans, self.train_ids), tc.seed)
        log, acc_stats, step = [], None, 0
        if meta is not None:
            state = ckpts.restore_state(latest, dict(params=self.params, opt_state=opt_state))
            self.params, opt_state = state["params"], state["opt_state"]
            step, log = meta["step"], meta["log"]
            stream.seek(meta["data"])
            if meta["acc_stats"] is not None:
                acc_stats = self._replicate({k: np.asarray(v, np.float32) for k, v in meta["acc_stats"].items()})
            say(f"[train] resumed from {ckpts.directory} at step {step}/{total} (epoch {stream.epoch}, "
                f"{stream.taken} batches into it)")
        say(f"[train] {len(self.train_ids)} train / {len(self.eval_ids)} eval samples, {per_epoch} batches per "
            f"epoch, {total} steps")
        if self.mesh is not None:
            epoch = self._plans(self.train_ids)
            rows, padded = sum(p.rows for p in epoch), sum(self.padded(p).rows for p in epoch)
            say(f"[train] mesh {self.mesh_config.name or self.mesh_config.shape}: data parallel over {self.dp} "
                f"devices; {padded - rows} of {padded} rows per epoch are dp padding (raise --batch-tokens so "
                "batches divide dp)")
        t_last, step_last = time.perf_counter(), step
        with StopRequests() as stop, bar(total, desc="train", unit="step", initial=step,
                                         quiet=jax.process_index() != 0) as progress:
            while step < total:
                batch = self._batch(stream.next())
                self.params, opt_state, loss, stats = step_fn(self.params, opt_state, self.embed, self.vocab, batch)
                acc_stats = stats if acc_stats is None else jax.tree.map(jnp.add, acc_stats, stats)
                step += 1
                progress.update()
                if step % tc.log_every == 0 or step == total:
                    a = acceptance(jax.device_get(acc_stats))
                    dt = (time.perf_counter() - t_last) / (step - step_last)
                    log.append(dict(step=step, loss=float(loss), acc=a["acc"], tau=a["tau"], sec_per_step=dt))
                    progress.set_postfix(loss=f"{float(loss):.3f}", tau=f"{a['tau']:.2f}")
                    say(f"[train] step {step}/{total} loss {float(loss):.3f} acc "
                        f"{' '.join(f'{x:.3f}' for x in a['acc'])} tau {a['tau']:.2f} {dt:.2f} s/step, "
                        f"eta {duration(dt * (total - step))}")
                    acc_stats, t_last, step_last = None, time.perf_counter(), step
                stopping = stop.requested() or step == stop_after
                if ckpts is not None and (stopping or tc.save_every and step % tc.save_every == 0):
                    ckpts.save(step, dict(params=self.params, opt_state=opt_state), dict(
                        step=step, data=stream.position(), log=log, identity=self.identity(),
                        acc_stats=None if acc_stats is None else
                        {k: np.asarray(v).tolist() for k, v in jax.device_get(acc_stats).items()}))
                if out_dir and tc.save_every and step % tc.save_every == 0:
                    self.export(os.path.join(out_dir, f"step-{step}"))
                if stopping and step < total:
                    self.stop_signal = stop.signum
                    why = "stop_after" if stop.signum is None else signal.Signals(stop.signum).name
                    saved = f"checkpoint in {ckpts.directory}" if ckpts else "nothing saved (no output directory)"
                    say(f"[train] {why}: stopped at step {step}/{total}; {saved}")
                    return log
        if out_dir:
            self.export(out_dir)
            self.write_record(out_dir, log)
        return log

    def write_record(self, path: str, log: list[dict], **extra) -> None:
        """`path`/training.json: what the run was (target, settings, data) and what it took, plus `extra` (e.g. the
        held-out evaluation); `ship` copies it into the head's card. Process 0 alone writes."""
        if jax.process_index() != 0:
            return
        steps = [0] + [r["step"] for r in log]
        seconds = sum(r["sec_per_step"] * (b - a) for r, a, b in zip(log, steps, steps[1:]))
        out_rows = sum(int(self.store.is_output[self.store.rows(s)].sum()) for s in self.train_ids)
        record = dict(target=model_id(self.model), config=dataclasses.asdict(self.tc),
                      features=dict(num_samples=self.store.num_samples, num_tokens=self.store.meta["num_tokens"],
                                    aux_layer_ids=self.store.meta["aux_layer_ids"]),
                      train_samples=len(self.train_ids), train_output_tokens=out_rows,
                      eval_samples=len(self.eval_ids), steps=steps[-1], train_seconds=round(seconds, 1),
                      last_log=log[-1] if log else None, **extra)
        if self.started_from is not None:
            record["started_from"] = self.started_from
        with open(os.path.join(path, TRAINING_RECORD), "w") as f:
            json.dump(record, f, indent=1)
