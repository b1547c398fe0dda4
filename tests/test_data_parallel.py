"""Data parallelism on 8 simulated CPU devices: `mesh.dp` engine replicas behind one LLM / AsyncLLM / server
(`jaxserve/data_parallel.py`). dp2, dp2_tp2 and dp2_pp2 give the single-device engine's greedy tokens and logprobs
(1e-5) on a mixed batch with queueing and preemption; requests spread over both replicas; a prompt whose prefix one
replica has cached goes there; abort reaches the owning replica; each replica's weights live on its own devices;
/metrics labels every replica's gauges; `jaxserve serve` simulates the CPU devices a mesh needs.

jax fixes its device count when it starts, so everything runs in subprocesses with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (or none, for the CLI's own flag); the tests read their JSON.
"""

import json
import os
import subprocess
import sys

import pytest

from multidevice import ROOT, run_on_devices

_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import jax
import numpy as np
from tiny_models import make_tiny_model
from jaxserve import LLM, AsyncLLM, EngineConfig, SamplingParams
from jaxserve.data_parallel import DataParallelEngine

assert len(jax.devices()) == 8
tmp = sys.argv[2]
path = os.path.join(tmp, "llama_gqa")
make_tiny_model("llama_gqa", path)
# test_tensor_parallel.py's engine and batch, so the single-device run's executables come from the compile cache
KW = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=64, num_pages=20, precompile=False)
rng = np.random.default_rng(0)
prompts = [{"prompt_token_ids": rng.integers(3, 250, int(rng.integers(3, 40))).tolist()} for _ in range(6)]
prompts.append({"prompt_token_ids": [7, 8, 9, 10, 11] * 5})
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
report = {}


def devices(runner):
    runners = getattr(runner, "stages", [runner])
    return [sorted(d.id for d in jax.tree.leaves(r.weights)[0].sharding.device_set) for r in runners]


def summary(llm):
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    e = llm.llm_engine
    engines = getattr(e, "replicas", [e])
    return dict(tokens=[o.outputs[0].token_ids for o in outs],
                logprobs=[[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                          for o in outs],
                preemptions=e.get_stats()["num_preemptions"],
                routed=list(getattr(e, "num_routed", [])),
                steps=[r.num_steps for r in engines],
                devices=[devices(r.runner) for r in engines])


report["single"] = summary(LLM(path, **KW))
for mesh in ("dp2_tp2", "dp2_pp2", "dp2"):
    llm = LLM(path, mesh=mesh, **KW)
    report[mesh] = summary(llm)
    report[mesh]["type"] = type(llm.llm_engine).__name__

# prefix affinity: a long prompt lands on replica 1 (replica 0 is busier); later, when both are idle (load alone
# would pick replica 0), a prompt sharing its first 28 tokens goes to replica 1, which serves them from its cache
e = llm.llm_engine  # dp2's: its cache holds only pages of the batch above, which share nothing with these
long_prompt = rng.integers(3, 250, 36).tolist()
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
e.add_request("busy", {"prompt_token_ids": rng.integers(3, 250, 20).tolist()}, params)
e.add_request("long", {"prompt_token_ids": long_prompt}, params)
placed = [e.replica_of("busy"), e.replica_of("long")]
while e.has_unfinished_requests():
    e.step()
hits_before = e.replicas[1].block_manager.num_prefix_hits
e.add_request("shared", {"prompt_token_ids": long_prompt[:28] + [5, 6, 7]}, params)
report["affinity"] = dict(placed=placed, shared=e.replica_of("shared"))
while e.has_unfinished_requests():
    e.step()
report["affinity"]["hit_tokens"] = e.replicas[1].block_manager.num_prefix_hits - hits_before

# abort on replica 1; replica 0's request runs on
e.add_request("a0", {"prompt_token_ids": [3, 4, 5, 6, 7]}, SamplingParams(max_tokens=8, ignore_eos=True))
e.add_request("a1", {"prompt_token_ids": [8, 9, 10, 11]}, SamplingParams(max_tokens=8, ignore_eos=True))
owners = [e.replica_of("a0"), e.replica_of("a1")]
e.step()
final = e.abort_request("a1")
left = [r.has_unfinished_requests() for r in e.replicas]
finished = {}
while e.has_unfinished_requests():
    finished |= {o.request_id: len(o.outputs[0].token_ids) for o in e.step() if o.finished}
report["abort"] = dict(owners=owners, reason=final.outputs[0].finish_reason, finished=final.finished, left=left,
                       after=finished, again=e.abort_request("a1") is None)
try:
    e.add_request("a0", {"prompt_token_ids": [3]}, params)
    e.add_request("a0", {"prompt_token_ids": [3]}, params)
    report["duplicate"] = None
except Exception as ex:
    report["duplicate"] = f"{type(ex).__name__}: {ex}"

# a ServingEngine over a dp2 AsyncLLM: per-replica gauges on /metrics
from prometheus_client import generate_latest
from service.async_engine import ServingEngine
async_llm = AsyncLLM(path, EngineConfig.from_dict(dict(KW, mesh="dp2")))
serving = ServingEngine(async_llm, "tiny")
report["metrics"] = generate_latest(serving.registry).decode()
report["stats_keys"] = sorted(serving.stats())
async_llm.shutdown()
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_on_devices(_SCRIPT, str(tmp_path_factory.mktemp("dp")), timeout=600)


@pytest.mark.parametrize("mesh", ["dp2", "dp2_tp2", "dp2_pp2"])
def test_replicas_equal_one_device(report, mesh):
    single, dp = report["single"], report[mesh]
    assert dp["type"] == "DataParallelEngine"
    assert dp["tokens"] == single["tokens"]
    for a, b in zip(dp["logprobs"], single["logprobs"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert single["preemptions"] > 0 and dp["preemptions"] > 0  # 7 prompts; 4 seats and 20 pages per replica
    assert dp["routed"] == [4, 3] and all(n > 0 for n in dp["steps"])  # both replicas ran, load-balanced


@pytest.mark.parametrize("mesh, want", [
    ("dp2", [[[0]], [[1]]]),
    ("dp2_tp2", [[[0, 1]], [[2, 3]]]),
    ("dp2_pp2", [[[0], [1]], [[2], [3]]]),  # per replica, per stage
])
def test_each_replica_lives_on_its_own_devices(report, mesh, want):
    assert report[mesh]["devices"] == want


def test_prefix_affinity_routes_to_the_replica_holding_the_prefix(report):
    a = report["affinity"]
    assert a["placed"] == [0, 1]
    assert a["shared"] == 1
    assert a["hit_tokens"] == 28  # 7 full pages of 4 served from replica 1's cache


def test_abort_reaches_the_owning_replica(report):
    a = report["abort"]
    assert a["owners"] == [0, 1]
    assert a["finished"] and a["reason"] == "abort"
    assert a["left"] == [True, False]  # replica 1 freed, replica 0 still running
    assert a["after"] == {"a0": 8} and a["again"]
    assert report["duplicate"].startswith("InvalidRequestError") and "already in use" in report["duplicate"]


def test_metrics_label_every_replica(report):
    text = report["metrics"]
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate"):
        for i in ("0", "1"):
            assert f'jaxserve_{name}{{replica="{i}"}}' in text
    assert 'jaxserve_num_preemptions_total{replica="1"}' in text
    assert "jaxserve_ready " in text and "jaxserve_num_requests_in_flight " in text  # the server's own: unlabelled
    assert "replicas" in report["stats_keys"]


_CLI = r"""
import json, os
from service.cli import simulate_host_devices
from jaxserve.sharding import MeshConfig
set_now = simulate_host_devices(MeshConfig.preset("dp2_tp2"), os.environ)
import jax
n = len(jax.devices())
print(json.dumps(dict(set_now=set_now, devices=n, flags=os.environ["XLA_FLAGS"],
                      again=simulate_host_devices(MeshConfig.preset("dp4"), os.environ))))
"""


def test_serve_simulates_the_cpu_devices_a_mesh_needs():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", _CLI], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    r = json.loads(done.stdout.splitlines()[-1])
    assert r["set_now"] and r["devices"] == 4 and r["flags"] == "--xla_force_host_platform_device_count=4"
    assert r["again"] is False  # set already (and jax has started): left alone
