"""Multi-host EAGLE-3 training: `python -m training.eagle3 train --mesh dp4 --coordinator ... --num-processes 2
--process-id I` in two processes on 127.0.0.1 (2 simulated CPU devices each, gloo collectives) trains the same head
as one process on one device: the batch rows are split over the 4 devices of both processes, process 0 alone
writes the head, and the held-out evaluation runs across the processes too.

Tolerances as in tests/test_trainer_mesh.py (float32; sharding only reorders the row sums): parameters 1e-6
absolute after two steps, the second of which moves them by more than 1e-3.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from jaxserve import distributed
from multidevice import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAIN_ARGS = ["--max-steps", "2", "--lr", "5e-3", "--batch-tokens", "96", "--ttt-steps", "2", "--draft-vocab-size",
              "128", "--len-buckets", "32", "--win-buckets", "16", "--eval-frac", "0.2", "--log-every", "1"]

_FEATURES = r"""
import os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import numpy as np
from tiny_models import make_tiny_model
from training.eagle3.features import TargetFeatures, extract

tmp = sys.argv[2]
target = os.path.join(tmp, "target")
make_tiny_model("llama_gqa", target)
rng = np.random.default_rng(0)
samples = [dict(prompt_token_ids=rng.integers(3, 300, int(rng.integers(4, 16))).tolist(),
                output_token_ids=rng.integers(3, 300, int(rng.integers(4, 13))).tolist()) for _ in range(30)]
extract(samples, TargetFeatures(target, aux_layer_ids=(0, 1, 2), max_len=32, len_buckets=(32,)),
        os.path.join(tmp, "feats"), log_every=0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(tmp, out, extra, devices, process_id=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices))
    for k in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        env.pop(k, None)
    log = open(os.path.join(tmp, f"{os.path.basename(out)}{'' if process_id is None else process_id}.log"), "w+")
    cmd = [sys.executable, "-m", "training.eagle3", "train", "--features", os.path.join(tmp, "feats"), "--out", out,
           *TRAIN_ARGS, *extra]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True), log


def _finish(procs):
    outputs = []
    try:
        for p, _ in procs:
            p.wait(timeout=300)
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
    for p, log in procs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
        assert p.returncode == 0, outputs[-1][-4000:]
    return outputs


def _head(path):
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _eval_line(output):
    return json.loads(next(line for line in output.splitlines() if line.startswith("[eval] held-out"))[16:])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("trainer_multihost"))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", _FEATURES, ROOT, tmp], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    coordinator = f"127.0.0.1:{_free_port()}"
    multi = [_train(tmp, os.path.join(tmp, "multi"), ["--mesh", "dp4", "--coordinator", coordinator,
                                                      "--num-processes", "2", "--process-id", str(i)], 2, i)
             for i in range(2)]
    single = _train(tmp, os.path.join(tmp, "single"), [], 1)
    outputs = _finish(multi + [single])
    return dict(tmp=tmp, multi=outputs[:2], single=outputs[2])


def test_two_processes_train_the_one_device_head(runs):
    tmp = runs["tmp"]
    assert "[train] process 0 of 2: 2 of 4 devices here" in runs["multi"][0]
    assert "[train] process 1 of 2: 2 of 4 devices here" in runs["multi"][1]
    assert "data parallel over 4 devices" in runs["multi"][0]
    assert not os.path.exists(os.path.join(tmp, "multi", "step-2"))  # no checkpoints asked for
    single, multi = _head(os.path.join(tmp, "single")), _head(os.path.join(tmp, "multi"))
    assert sorted(single) == sorted(multi)
    for name in single:  # (a shard's gradient dropped or doubled moves step 2's update by the order of lr = 5e-3)
        np.testing.assert_allclose(multi[name], single[name], atol=1e-6, rtol=0, err_msg=name)
    losses = [[float(line.split(" loss ")[1].split()[0]) for line in out.splitlines() if " loss " in line]
              for out in (runs["single"], *runs["multi"])]
    assert len(losses[0]) == 2 and losses[1] == losses[2] == pytest.approx(losses[0], rel=1e-5)


def test_held_out_evaluation_runs_across_processes(runs):
    single = _eval_line(runs["single"])
    for out in runs["multi"]:  # every process prints the same global result
        got = _eval_line(out)
        np.testing.assert_allclose(got["acc"], single["acc"], rtol=1e-6)
        assert got["tau"] == pytest.approx(single["tau"], rel=1e-6)
        assert got["served_walk"] == single["served_walk"]
