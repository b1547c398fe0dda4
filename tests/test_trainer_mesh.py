"""EAGLE-3 trainer data parallelism on 8 simulated CPU devices: training sharded over dp (dp2, dp3, dp8) equals the
unsharded trainer step for step -- the loss, the TTT counts and the updated parameters -- on batches whose rows
divide dp and batches whose rows do not (padded with empty rows); the batch really is split over the devices;
meshes the trainer cannot run fail at start naming the field; `python -m training.eagle3 train --mesh` runs; a dp2
run resumed from its Orbax checkpoint equals one dp2 run bit for bit, the checkpoint restoring onto the mesh, and a
one-device checkpoint restores onto dp2.

jax fixes its device count when it starts, so everything runs in one subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8; the tests read its JSON report.

Tolerances: float32 throughout. Sharding changes only the order of the float additions in the row sums (partial sums
per device, then an all-reduce), about 1e-7 relative per sum. Two steps run, since warmup gives the first a learning
rate of 0: step 1 fills Adam's moments and step 2 moves the parameters by lr * m / (sqrt(v) + eps). The loss is
compared at 1e-6 relative; the parameters at 1e-6 absolute, which is 2e-4 of the largest move (lr = 5e-3) and 5e-5 of
the initial weights' scale (0.02), so a dropped or doubled shard's gradient (a change of order lr) cannot pass.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from multidevice import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import dataclasses, json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import jax
import numpy as np
from tiny_models import make_tiny_model
from training.eagle3.__main__ import main
from training.eagle3.checkpoint import Checkpoints
from training.eagle3.features import FeatureStore, TargetFeatures, extract
from training.eagle3.train import TrainConfig, Trainer, make_optimizer

assert len(jax.devices()) == 8
tmp = sys.argv[2]
target = os.path.join(tmp, "target")
make_tiny_model("llama_gqa", target)
rng = np.random.default_rng(0)
# prompts of 4..15 tokens and replies of 4..12: every sample is one (T=32, W=16) shape, so one compile per trainer
samples = [dict(prompt_token_ids=rng.integers(3, 300, int(rng.integers(4, 16))).tolist(),
                output_token_ids=rng.integers(3, 300, int(rng.integers(4, 13))).tolist()) for _ in range(24)]
feats = os.path.join(tmp, "feats")
extract(samples, TargetFeatures(target, aux_layer_ids=(0, 1, 2), max_len=32, len_buckets=(32,)), feats, log_every=0)
store = FeatureStore.open(feats)


def config(**kw):  # 6 rows per batch (batch_tokens // W): dp2 and dp3 divide it, dp8 does not
    return TrainConfig(**(dict(lr=5e-3, batch_tokens=96, ttt_steps=3, draft_vocab_size=128, len_buckets=(32,),
                               win_buckets=(16,), eval_frac=0.0, log_every=1, max_steps=2) | kw))


def run(mesh):  # two steps of the trainer's own jitted step on its own placed batches (the first two plans)
    tr = Trainer(store, config(), mesh=mesh)
    tx = make_optimizer(tr.tc, 2)
    step, opt_state, params = tr.train_step(tx), tr.init_opt_state(tx), tr.params
    steps = []
    for plan in tr._plans(tr.train_ids)[:2]:
        batch = tr._batch(plan)
        params, opt_state, loss, stats = step(params, opt_state, tr.embed, tr.vocab, batch)
        steps.append(dict(loss=float(loss), stats={k: np.asarray(v).tolist() for k, v in stats.items()}))
    layout = dict(rows=plan.rows, padded_rows=int(batch.aux.shape[0]),
                  shard_rows=sorted({s.data.shape[0] for s in batch.aux.addressable_shards}),
                  devices=len(batch.aux.sharding.device_set),
                  spec=[str(a) for a in getattr(batch.aux.sharding, "spec", ())],
                  param_devices=len(params.fc.sharding.device_set))
    params = {f.name: np.asarray(getattr(params, f.name)) for f in dataclasses.fields(params)
              if getattr(params, f.name) is not None}
    return dict(steps=steps, layout=layout), params


base, base_params = run(None)
init = Trainer(store, config()).params
report = {"single": base,
          "param_move": max(float(np.abs(base_params[k] - np.asarray(getattr(init, k))).max()) for k in base_params)}
for mesh in ("dp2", "dp3", "dp8"):
    r, params = run(mesh)
    r["param_abs_diff"] = max(float(np.abs(params[k] - base_params[k]).max()) for k in params)
    report[mesh] = r

errors = {}
for name, mesh in (("tp2", "tp2"), ("pp2", "pp2"), ("dp2_tp2", "dp2_tp2"), ("dp16", "dp16"),
                   ("batch_rule", {"dp": 2, "rules": {"batch": None}})):
    try:
        Trainer(store, config(), mesh=mesh)
        errors[name] = None
    except Exception as e:
        errors[name] = f"{type(e).__name__}: {e}"
for name, extra in (("cli_tp2", ["--mesh", "tp2"]), ("cli_coordinator", ["--coordinator", "localhost:1234"])):
    try:
        main(["train", "--features", feats, "--out", os.path.join(tmp, "bad"), *extra])
        errors[name] = None
    except (Exception, SystemExit) as e:
        errors[name] = f"{type(e).__name__}: {e}"
report["errors"] = errors

out = os.path.join(tmp, "head")
main(["train", "--features", feats, "--out", out, "--mesh", "dp8", "--max-steps", "1", "--batch-tokens", "80",
      "--ttt-steps", "1", "--draft-vocab-size", "128", "--len-buckets", "32", "--win-buckets", "16",
      "--eval-frac", "0"])
report["cli_export"] = sorted(os.listdir(out))


def train(mesh, out=None, **kw):  # 4 steps of train(); kw: stop_after or resume
    tr = Trainer(store, config(max_steps=4), mesh=mesh)
    return tr, tr.train(out, **kw)


def leaves(params):
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def restore_on_dp2(out):  # the latest checkpoint in `out`, restored onto the arrays a dp2 trainer resumes with
    fresh = Trainer(store, config(max_steps=4), mesh="dp2")
    like = dict(params=fresh.params, opt_state=fresh.init_opt_state(make_optimizer(fresh.tc, 4)))
    restored = Checkpoints(os.path.join(out, "checkpoints"), 3).restore_state(2, like)
    return restored, all(a.sharding == b.sharding and len(a.sharding.device_set) == 2
                         for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(like), strict=True))


ref, ref_log = train("dp2")
out = os.path.join(tmp, "resume_dp2")
train("dp2", out, stop_after=2)
_, on_mesh = restore_on_dp2(out)
tr, log = train("dp2", out, resume=True)
report["resume_dp2"] = dict(
    restored_on_mesh=on_mesh, losses=[r["loss"] for r in log], ref_losses=[r["loss"] for r in ref_log],
    bit_equal=all(np.array_equal(a, b) for a, b in zip(leaves(tr.params), leaves(ref.params), strict=True)))
out = os.path.join(tmp, "resume_one_device")
one, _ = train(None, out, stop_after=2)
restored, on_mesh = restore_on_dp2(out)
report["one_device_on_dp2"] = dict(restored_on_mesh=on_mesh, bit_equal=all(
    np.array_equal(a, b) for a, b in zip(leaves(restored["params"]), leaves(one.params), strict=True)))
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    # fast compiles (multidevice.FAST_COMPILE): both sides of each comparison share them
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(8))
    tmp = str(tmp_path_factory.mktemp("trainer_mesh"))
    done = subprocess.run([sys.executable, "-c", _SCRIPT, ROOT, tmp], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


MESHES = {"dp2": 2, "dp3": 3, "dp8": 8}  # dp3 runs on 3 of the 8 devices, as make_mesh takes the first dp * pp * tp


@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_steps_equal_the_unsharded_steps(report, mesh):
    base, got = report["single"]["steps"], report[mesh]["steps"]
    assert len(got) == len(base) == 2
    for a, b in zip(got, base):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]), (got, base)
        for name, counts in b["stats"].items():  # per TTT step; all but loss_sum are counts of rows' positions
            if name == "loss_sum":
                np.testing.assert_allclose(a["stats"][name], counts, rtol=1e-6)
            else:
                assert a["stats"][name] == counts, name
        assert min(b["stats"]["loss_n"]) > 0  # every TTT step's loss covered real positions
    assert report[mesh]["param_abs_diff"] <= 1e-6
    assert report["param_move"] > 1e-3  # step 2 did move the parameters, by far more than the tolerance


@pytest.mark.parametrize("mesh", MESHES)
def test_batch_rows_are_split_over_dp_and_parameters_replicated(report, mesh):
    dp, lay = MESHES[mesh], report[mesh]["layout"]
    assert lay["rows"] == 6 and lay["padded_rows"] == -(-6 // dp) * dp  # dp8: 2 empty rows
    assert lay["devices"] == dp and lay["shard_rows"] == [lay["padded_rows"] // dp]
    assert lay["spec"][:1] == ["dp"] and set(lay["spec"][1:]) <= {"None"}
    assert lay["param_devices"] == dp  # one full copy per device
    assert report["single"]["layout"]["padded_rows"] == 6  # no padding without a mesh


def test_meshes_the_trainer_cannot_run_fail_naming_the_field(report):
    e = report["errors"]
    assert e["tp2"].startswith("ValueError: mesh.tp=2 (tp2): the EAGLE-3 trainer is data-parallel only")
    assert e["pp2"].startswith("ValueError: mesh.pp=2 (pp2)")
    assert e["dp2_tp2"].startswith("ValueError: mesh.tp=2 (dp2_tp2)")
    assert "needs 16 devices but 8 are available" in e["dp16"]
    assert e["batch_rule"].startswith("ValueError: mesh.rules.batch")
    assert e["cli_tp2"].startswith("ValueError: mesh.tp=2")
    assert e["cli_coordinator"].startswith("SystemExit: multi-host training: multi-host needs --coordinator, "
                                           "--num-processes and --process-id together (missing --num-processes, "
                                           "--process-id")


def test_cli_trains_and_exports_on_a_mesh(report):
    assert {"config.json", "model.safetensors"} <= set(report["cli_export"])


def test_a_dp_run_resumes_from_its_checkpoint_bit_for_bit(report):
    """dp2: 2 steps, a new trainer restoring the checkpoint onto its replicated arrays, 2 more == 4 dp2 steps."""
    r = report["resume_dp2"]
    assert r["restored_on_mesh"] and r["bit_equal"] and r["losses"] == r["ref_losses"] and len(r["losses"]) == 4


def test_a_one_device_checkpoint_restores_onto_a_mesh(report):
    """Saved on one device, restored replicated over dp2 with the same values (a resumed dp2 step then equals the
    one-device step as far as test_sharded_steps_equal_the_unsharded_steps says)."""
    r = report["one_device_on_dp2"]
    assert r["restored_on_mesh"] and r["bit_equal"]
