"""Resumable training state for the EAGLE-3 trainer: Orbax checkpoints in OUT/checkpoints/<step>/, and the stop
requests (SIGTERM, SIGINT) that make the trainer write one and leave.

A checkpoint holds everything the next step depends on, so a resumed run continues the one that stopped bit for bit:

  state/  (Orbax StandardSave)  params and optimizer state: device arrays, restored onto the shardings of the
                                resuming trainer's own arrays (one device, or replicated over its dp mesh)
  meta/   (Orbax JsonSave)      step; the data position (`batches.BatchStream.position`: epoch, batches taken, the
                                shuffle generator's state); the logged records and the TTT stats summed since the last
                                one; the run's identity: the TrainConfig, the feature directory's meta.json and a digest
                                of the draft vocabulary, which a resume must match (`check_same_run`)

Saves are synchronous: the train step donates the parameter and optimizer buffers, and one blocking write every
`save_every` steps costs less than keeping a background writer from racing the next step. orbax is imported on first
use, so `eval` and the other steps do not pay for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading

import jax
import numpy as np

CHECKPOINTS = "checkpoints"  # under the train --out directory

# TrainConfig fields that do not change what a step computes; a resumed run may set them differently.
FREE_FIELDS = frozenset({"log_every", "save_every", "keep_checkpoints", "num_speculative_tokens"})


def run_identity(config: dict, features_meta: dict, draft_ids: np.ndarray) -> dict:
    """What a resumed run must share with the run it continues: its TrainConfig (less FREE_FIELDS), the feature
    directory it reads, and its draft vocabulary (built from the data, or taken from a starting head)."""
    return dict(config={k: v for k, v in config.items() if k not in FREE_FIELDS}, features=features_meta,
                draft_vocab=hashlib.sha256(np.asarray(draft_ids, np.int64).tobytes()).hexdigest())


def check_same_run(saved: dict, current: dict, where: str, defaults: dict | None = None) -> None:
    """Raise ValueError naming every difference between a checkpoint's identity and this run's. `defaults`: the
    values of config fields a checkpoint may predate (it ran with the default then)."""
    saved, current = json.loads(json.dumps(saved)), json.loads(json.dumps(current))  # tuples -> lists, as saved
    saved["config"] = {k: v for k, v in json.loads(json.dumps(defaults or {})).items()
                       if k in current["config"]} | saved["config"]
    diffs = [f"{k}: {saved['config'].get(k)!r} there, {current['config'].get(k)!r} here"
             for k in sorted(set(saved["config"]) | set(current["config"]))
             if saved["config"].get(k) != current["config"].get(k)]
    if saved["features"] != current["features"]:
        diffs.append(f"features: {saved['features']} there, {current['features']} here")
    if saved["draft_vocab"] != current["draft_vocab"] and not diffs:
        diffs.append("the draft vocabulary differs (was the run started from another --head?)")
    if diffs:
        raise ValueError(f"cannot resume from {where}: it belongs to a different run ({'; '.join(diffs)}). Resume "
                         "with the settings and features it was trained with, or train into a new --out")


class Checkpoints:
    """The Orbax checkpoints of one run, in `directory`; keeps the newest `keep`. The manager is opened lazily, so a run
    that never saves (and a multi-host run that never saves) never touches Orbax."""

    def __init__(self, directory: str, keep: int):
        if keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1 (got {keep})")
        self.directory, self.keep = os.path.abspath(directory), keep
        self._manager = None

    def _open(self):
        if self._manager is None:
            import orbax.checkpoint as ocp

            options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True,
                                                   enable_async_checkpointing=False)
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        return self._manager

    def latest_step(self) -> int | None:
        if self._manager is None and not os.path.isdir(self.directory):
            return None
        return self._open().latest_step()

    def save(self, step: int, state: dict, meta: dict) -> None:
        """state: a pytree of jax.Arrays; meta: JSON-serialisable."""
        import orbax.checkpoint as ocp

        self._open().save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)))

    def meta(self, step: int) -> dict:
        import orbax.checkpoint as ocp

        return self._open().restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def restore_state(self, step: int, like):
        """-> the saved state, shaped, typed and laid out (sharding included) as the arrays of `like`."""
        import orbax.checkpoint as ocp

        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
        return self._open().restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))).state

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()
            self._manager = None


class StopRequests:
    """SIGTERM and SIGINT -> a request that the training loop honours at the end of the current step (saving a
    checkpoint first) instead of dying mid-step. The first signal is caught and the previous handlers are put back,
    so a second one acts as it did before (SIGINT: KeyboardInterrupt, SIGTERM: the process ends) for whoever cannot
    wait for the step and the save. Handlers can only be installed from the main thread; in another thread, signals
    keep their usual meaning.

    Use as a context manager around the loop; `requested()` between steps."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _handle(self, signum, frame) -> None:  # runs between two bytecodes of the loop: set the flag, nothing else
        self.signum = signum
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: installed outside Python
        self._previous = {}

    def requested(self) -> bool:
        """Whether to stop after this step. With several processes, whether any of them was signalled (one tiny
        all-gather per call): all of them must stop at the same step to write the checkpoint together, and each then
        reports the signal in `signum`, so none goes on alone to the export and the evaluation."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            signums = multihost_utils.process_allgather(np.int32(self.signum or 0))
            self.signum = self.signum or int(np.max(signums)) or None
        return self.signum is not None
