"""`python -m training.eagle3 {regenerate,features,train,eval,heldout,ship}`: the EAGLE-3 head pipeline.

    regenerate  ShareGPT prompts answered greedily by the target -> JSONL   (training/eagle3/regenerate.py)
    features    JSONL -> feature directory (target aux features, final hidden, argmax, loss mask)
    train       feature directory -> trained head, exported in speculators format (+ held-out evaluation)
    eval        an exported head + a feature directory -> per-position accuracy and implied acceptance length,
                and the acceptance a server would measure on those replies (`ttt.served_walk`)
    heldout     ship's held-out chat prompts answered greedily -> their features, for `eval` to replay the served
                measurement without serving
    ship        an exported head -> the directory jaxserve ships (bfloat16, with its card)  (training/eagle3/ship.py)

Every step can be spread over several runs: run `regenerate` or `features` again with the same arguments and it
goes on from what the last run wrote; `train --resume` continues from the latest checkpoint in OUT/checkpoints/
(written every --save-every steps and on SIGTERM / Ctrl-C); `eval` only reads. Progress bars with an ETA are drawn
on a terminal; the log lines are the record in a file.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def features(argv) -> None:
    from training.eagle3.features import TargetFeatures, extract, read_jsonl

    ap = argparse.ArgumentParser(prog="python -m training.eagle3 features")
    ap.add_argument("--data", required=True, help="regenerate.py's JSONL")
    ap.add_argument("--out", required=True, help="feature directory to write")
    ap.add_argument("--model", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--aux-layer-ids", type=_ints, default=None, help="3 ids, input convention (default 2,L//2,L-3)")
    ap.add_argument("--max-len", type=int, default=1280)
    ap.add_argument("--limit", type=int, default=None, help="first N samples only")
    a = ap.parse_args(argv)
    target = TargetFeatures(a.model, aux_layer_ids=a.aux_layer_ids, max_len=a.max_len)
    meta = extract(read_jsonl(a.data, a.limit), target, a.out)
    print(json.dumps(meta))


def _add_parallel_args(ap) -> None:
    from jaxserve import distributed

    ap.add_argument("--mesh", default=None,
                    help="data-parallel mesh: a preset (dp2, dp8) or configs/mesh/*.yaml; dp > 1, pp = tp = 1. The "
                         "batch is sharded over dp, parameters replicated; --batch-tokens is the global batch. With "
                         "several processes the mesh spans every process's devices")
    distributed.add_cli_args(ap)


def _init_processes(a) -> None:
    """Multi-host: join the job (`jaxserve.distributed.initialize`, before any jax computation) so `jax.devices()`,
    and the trainer's mesh with it, span every process. Every process runs the same command; each fills only its
    own devices' rows of a batch, and process 0 alone writes the head."""
    from jaxserve import distributed

    try:
        ctx = distributed.initialize_from_args(a)
    except ValueError as e:
        raise SystemExit(f"multi-host training: {e}") from None
    if ctx is not None:
        import jax

        print(f"[train] process {ctx.process_id} of {ctx.num_processes}: {len(jax.local_devices())} of "
              f"{len(jax.devices())} devices here", flush=True)


def _train_config(a):
    from training.eagle3.train import TrainConfig

    return TrainConfig(lr=a.lr, epochs=a.epochs, max_steps=a.max_steps, batch_tokens=a.batch_tokens,
                       ttt_steps=a.ttt_steps, loss=a.loss, draft_vocab_size=a.draft_vocab_size,
                       len_buckets=a.len_buckets, win_buckets=a.win_buckets,
                       eval_frac=a.eval_frac, log_every=a.log_every, save_every=a.save_every,
                       keep_checkpoints=a.keep_checkpoints, seed=a.seed)


def _print_acceptance(result: dict, num_samples: int) -> None:
    """The held-out result as the JSON line scripts parse ("[eval] held-out {...}"), then the summary a person reads."""
    print("[eval] held-out", json.dumps(result))
    acc = " / ".join(f"{x:.3f}" for x in result["acc"])
    walk = result["served_walk"]
    served = " / ".join(f"{x:.3f}" for x in walk["acceptance_rate_per_position"])
    print(f"[eval] {num_samples} held-out samples: over every chain, accuracy per draft step {acc}, tau "
          f"{result['tau']:.2f}; walked as served (K = {len(walk['acceptance_rate_per_position'])} every step), "
          f"acceptance per position {served}, mean acceptance length {walk['mean_acceptance_length']:.2f}",
          flush=True)


def train(argv) -> None:
    from training.eagle3.features import FeatureStore
    from training.eagle3.train import DEFAULT_DRAFT_VOCAB_SIZE, TrainConfig, Trainer
    from training.eagle3.ttt import LOSSES

    d = TrainConfig()
    ap = argparse.ArgumentParser(prog="python -m training.eagle3 train")
    ap.add_argument("--features", required=True)
    ap.add_argument("--out", required=True, help="directory for the exported head; Orbax checkpoints go to "
                    "OUT/checkpoints/STEP, a head per checkpoint to OUT/step-STEP")
    ap.add_argument("--model", default=None, help="target (default: the one recorded in the features)")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--epochs", type=float, default=d.epochs)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--batch-tokens", type=int, default=d.batch_tokens)
    ap.add_argument("--ttt-steps", type=int, default=d.ttt_steps)
    ap.add_argument("--loss", choices=LOSSES, default=d.loss,
                    help="kl: forward KL to the target's distribution over the draft vocabulary; ce: cross-entropy "
                         "of the target's greedy choice (both skip positions whose greedy choice is outside the draft "
                         "vocabulary); kl_all: kl at those positions too")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help=f"target ids the head can draft (default {DEFAULT_DRAFT_VOCAB_SIZE}; with --init-head, the "
                         "head's own: a larger size grows it by the most frequent other ids)")
    ap.add_argument("--len-buckets", type=_ints, default=d.len_buckets)
    ap.add_argument("--win-buckets", type=_ints, default=d.win_buckets)
    ap.add_argument("--eval-frac", type=float, default=d.eval_frac)
    ap.add_argument("--log-every", type=int, default=d.log_every)
    ap.add_argument("--save-every", type=int, default=d.save_every,
                    help="steps between checkpoints (0: only when stopped by SIGTERM or Ctrl-C)")
    ap.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, help="the newest N are kept")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in --out from its latest checkpoint (same settings and features)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--init-head", default=None,
                    help="start from this exported head (e.g. the shipped one): its draft vocabulary (or grown to "
                         "--draft-vocab-size) and weights; the optimizer starts fresh. A --resume passes it again")
    _add_parallel_args(ap)
    a = ap.parse_args(argv)
    _init_processes(a)
    tr = Trainer(FeatureStore.open(a.features), _train_config(a), a.model, head=a.init_head, mesh=a.mesh)
    log = tr.train(a.out, resume=a.resume)
    if tr.stop_signal is not None:
        print("[train] to continue: the same command with --resume", flush=True)
        raise SystemExit(128 + tr.stop_signal)  # the status a shell gives a process the signal ended: not done
    if len(tr.eval_ids):
        result = tr.evaluate()
        tr.write_record(a.out, log, held_out=result)
        _print_acceptance(result, len(tr.eval_ids))


def evaluate(argv) -> None:
    from training.eagle3.features import FeatureStore
    from training.eagle3.train import TrainConfig, Trainer, training_record

    ap = argparse.ArgumentParser(prog="python -m training.eagle3 eval")
    ap.add_argument("--head", required=True, help="exported speculators directory")
    ap.add_argument("--features", required=True)
    ap.add_argument("--ttt-steps", type=int, default=TrainConfig().ttt_steps)
    ap.add_argument("--eval-frac", type=float, default=None,
                    help="the split train used (default: the head's training.json says, else 0.05)")
    ap.add_argument("--seed", type=int, default=None,
                    help="the seed train used: with --eval-frac, it draws the split (default: as --eval-frac)")
    ap.add_argument("--all", action="store_true", help="every sample, not just the held-out split")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="the budget the replies were generated under, for the served walk (`heldout`: 128)")
    _add_parallel_args(ap)
    a = ap.parse_args(argv)
    _init_processes(a)
    store = FeatureStore.open(a.features)
    # the held-out split is drawn from the run's seed: a head trained with --seed 2 is judged on its own split
    run = training_record(a.head).get("config", {})
    d = TrainConfig()
    eval_frac = a.eval_frac if a.eval_frac is not None else run.get("eval_frac", d.eval_frac)
    seed = a.seed if a.seed is not None else run.get("seed", d.seed)
    tr = Trainer(store, TrainConfig(ttt_steps=a.ttt_steps, eval_frac=eval_frac, seed=seed), head=a.head, mesh=a.mesh)
    ids = np.arange(store.num_samples) if a.all else tr.eval_ids
    _print_acceptance(tr.evaluate(ids=ids, max_tokens=a.max_tokens), len(ids))


def heldout(argv) -> None:
    from training.eagle3.ship import SERVED, served_features

    ap = argparse.ArgumentParser(prog="python -m training.eagle3 heldout")
    ap.add_argument("--out", required=True, help="feature directory to write (with the replies, replies.jsonl)")
    ap.add_argument("--num-prompts", type=int, default=64, help="the first N of `ship`'s held-out chat prompts")
    ap.add_argument("--model", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    a = ap.parse_args(argv)
    print(json.dumps(served_features(a.out, a.num_prompts, a.model)))
    print(f"[heldout] now: python -m training.eagle3 eval --head HEAD --features {a.out} --all "
          f"--max-tokens {SERVED['max_tokens']}", flush=True)


def ship(argv) -> None:
    from training.eagle3.ship import SERVED
    from training.eagle3.ship import ship as write_shipped

    ap = argparse.ArgumentParser(prog="python -m training.eagle3 ship")
    ap.add_argument("--head", required=True, help="a head `train` exported (its training.json goes into the card)")
    ap.add_argument("--out", required=True,
                    help="the shipped directory, e.g. jaxserve/spec_decode/heads/smollm2-135m-instruct-eagle3")
    ap.add_argument("--features", default=None, help="the head's features: adds the held-out split's evaluation")
    ap.add_argument("--model", default=None, help="target (default: the one training.json names)")
    ap.add_argument("--heldout", default=None,
                    help="features `heldout` wrote: adds the served walk over their replies (`eval --all`)")
    ap.add_argument("--num-prompts", type=int, default=SERVED["num_prompts"], help="held-out chat prompts served")
    a = ap.parse_args(argv)
    card = write_shipped(a.head, a.out, features=a.features, target=a.model, heldout=a.heldout,
                         served=dict(num_prompts=a.num_prompts))
    print(json.dumps({k: card.get(k) for k in ("served", "walked", "held_out")}), flush=True)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cmds = {"features": features, "train": train, "eval": evaluate, "heldout": heldout, "ship": ship}
    if not argv or argv[0] not in cmds | {"regenerate": None}:
        print(__doc__)
        raise SystemExit(f"expected a subcommand: regenerate, features, train, eval, heldout or ship (got {argv[:1]})")
    if argv[0] == "regenerate":
        from training.eagle3.regenerate import main as regenerate

        return regenerate(argv[1:])
    cmds[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
