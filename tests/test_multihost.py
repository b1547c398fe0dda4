"""Multi-host serving (`jaxserve/distributed.py`): two processes on 127.0.0.1, 4 simulated CPU devices each, joined
by `jax.distributed` (gloo collectives), build the same engines on a tiny model with 8 heads: tp8 (every layer's
all-reduces cross the processes) and pp2_tp4 (one stage per process); process 0 leads (`LLM.generate` on a mixed
batch, greedy, with a preemption) while process 1 follows its steps. The leader's tokens and logprobs equal one
process's engine on one device, the follower ran every step the leader ran, and both stop cleanly.
`jaxserve serve` itself across two processes (HTTP on the leader, tp4 over both); the flags / environment
resolution and the step message round trip.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from jaxserve import distributed
from jaxserve.batch import Bucket
from multidevice import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from jaxserve import distributed
ctx = distributed.initialize(sys.argv[3], 2, int(sys.argv[4]))
import jax
import numpy as np
import tiny_models
from jaxserve import LLM, SamplingParams

assert (len(jax.devices()), len(jax.local_devices())) == (8, 4), jax.devices()
tmp = sys.argv[2]
path = os.path.join(tmp, "llama_h8")
KW = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=64, num_pages=20, precompile=False)
rng = np.random.default_rng(0)
prompts = [{"prompt_token_ids": rng.integers(3, 250, int(n)).tolist()} for n in (3, 11, 26, 38, 7)]
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


def summary(llm):
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    return dict(tokens=[o.outputs[0].token_ids for o in outs],
                logprobs=[[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                          for o in outs],
                preemptions=llm.llm_engine.get_stats()["num_preemptions"])



report = dict(process_id=ctx.process_id, num_processes=ctx.num_processes)
for mesh in ("tp8", "pp2_tp4"):  # the same engines, config and model in every process, in the same order
    llm = LLM(path, mesh={"tp": 8} if mesh == "tp8" else {"pp": 2, "tp": 4}, **KW)
    runner = llm.llm_engine.runner
    distributed.check_supported(llm.llm_engine.config)
    kv = [runner.kv] if mesh == "tp8" else [s.kv for s in runner.stages]
    r = report[mesh] = dict(kv_processes=[sorted({d.process_index for d in c.k.sharding.device_set}) for c in kv])
    if ctx.is_leader:
        leader = distributed.lead(runner, ctx, channel=mesh)
        r.update(summary(llm), num_steps=llm.llm_engine.get_stats()["num_steps"])
        leader.stop()
    else:
        r.update(num_steps=distributed.follow(runner, channel=mesh))
    r["num_compiles"] = runner.num_compiles
if ctx.is_leader:
    report["single"] = summary(LLM(path, **KW, mesh={"device_ids": [0]}))  # one device of this process
print(json.dumps(report))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import tiny_models

    tmp = str(tmp_path_factory.mktemp("multihost"))
    tiny_models.VARIANTS["llama_h8"] = dict(arch="llama", num_attention_heads=8, num_key_value_heads=8, head_dim=8)
    tiny_models.make_tiny_model("llama_h8", os.path.join(tmp, "llama_h8"))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4))
    for k in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        env.pop(k, None)
    coordinator = f"127.0.0.1:{_free_port()}"
    logs = [open(os.path.join(tmp, f"process{i}.log"), "w+") for i in range(2)]  # files: a full pipe would block
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT, ROOT, tmp, coordinator, str(i)], env=env, cwd=ROOT,
                              stdout=log, stderr=subprocess.STDOUT, text=True) for i, log in enumerate(logs)]
    try:
        for p in procs:
            p.wait(timeout=200)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outputs = []
    for p, log in zip(procs, logs):
        log.seek(0)
        outputs.append(log.read())
        log.close()
        assert p.returncode == 0, outputs[-1][-4000:]
    return [json.loads([line for line in out.splitlines() if line.startswith("{")][-1]) for out in outputs]


@pytest.mark.parametrize("mesh, kv_processes", [("tp8", [[0, 1]]), ("pp2_tp4", [[0], [1]])])
def test_leader_follower_across_processes_equals_one_device(reports, mesh, kv_processes):
    """tp8: every layer's all-reduces cross the processes; pp2_tp4: stage 0 on process 0, stage 1 on process 1
    (the stage boundary and the outputs are cross-process copies)."""
    lead, follow = reports
    assert (lead["process_id"], follow["process_id"], lead["num_processes"]) == (0, 1, 2)
    got, single = lead[mesh], lead["single"]
    assert got["kv_processes"] == follow[mesh]["kv_processes"] == kv_processes
    assert got["tokens"] == single["tokens"]
    assert all(len(t) == 8 for t in got["tokens"])
    assert got["preemptions"] >= 1  # the batch outgrew the cache: preemption and recompute ran across processes
    np.testing.assert_allclose(np.concatenate(got["logprobs"]), np.concatenate(single["logprobs"]),
                               rtol=1e-5, atol=1e-5)
    assert follow[mesh]["num_steps"] >= got["num_steps"] > 1  # every engine step ran in the follower too
    assert follow[mesh]["num_compiles"] == got["num_compiles"]  # the same executables, compiled on first use


def test_step_message_round_trip():
    items = [(Bucket(32, 4, 16), False, np.arange(-5, 100, dtype=np.int32)),
             (Bucket(8, 2, 4, 6), True, np.array([2**31 - 1, -2**31], np.int32))]
    a, b = socket.socketpair()
    with a, b:
        a.sendall(distributed._encode(distributed._STEP, items))
        kind, got = distributed._receive(b)
        a.sendall(distributed._encode(distributed._STOP, []))
        assert distributed._receive(b) == (distributed._STOP, [])
    assert kind == distributed._STEP
    for (b0, p0, x0), (b1, p1, x1) in zip(items, got):
        assert (b0, p0) == (b1, p1) and x1.dtype == np.int32
        np.testing.assert_array_equal(x0, x1)


def test_flags_and_environment(monkeypatch):
    for k in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID,
              "JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri"):
        monkeypatch.delenv(k, raising=False)
    assert distributed.initialize() is None  # one process: nothing to initialise
    with pytest.raises(ValueError, match="missing --num-processes, --process-id"):
        distributed.initialize("127.0.0.1:1234")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "2")
    with pytest.raises(ValueError, match=r"--process-id must be in \[0, --num-processes\) \(got 2 of 2\)"):
        distributed.initialize("127.0.0.1:1234")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "0")
    with pytest.raises(ValueError, match="HOST:PORT"):
        distributed.initialize("localhost")
    import argparse

    ap = argparse.ArgumentParser()
    distributed.add_cli_args(ap)
    a = ap.parse_args(["--coordinator", "h:1", "--num-processes", "3", "--process-id", "1"])
    assert (a.coordinator, a.num_processes, a.process_id) == ("h:1", 3, 1)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    for k, v in dict(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_STEP_NODELIST="n1", SLURM_NTASKS="1").items():
        monkeypatch.setenv(k, v)
    assert not distributed.cluster_detected()  # one task: single process
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert distributed.cluster_detected()


def _read_until(proc, pattern, lines, timeout=240):
    """Lines of `proc`'s output until one matches `pattern` (the match), or the process ends (None)."""
    import re
    import time

    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        m = re.search(pattern, line)
        if m or time.monotonic() > deadline:
            return m
    return None


def test_jaxserve_serve_across_two_processes(tmp_path):
    """`jaxserve serve --mesh tp4 --coordinator ... --num-processes 2 --process-id I`: process 0 serves HTTP and
    leads, process 1 follows (2 simulated CPU devices each, found by serve itself); a greedy completion equals one
    device's `LLM.generate`; SIGTERM on the leader drains it, stops the follower, and both exit 0."""
    import signal
    import urllib.request

    from jaxserve import LLM, SamplingParams
    from service_fixtures import make_tiny_model_with_tokenizer

    path = make_tiny_model_with_tokenizer(str(tmp_path / "tiny"))
    prompt = [1, 70, 80, 90, 100, 110, 7, 8, 9]
    engine = ["--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--page-size", "4",
              "--num-pages", "40", "--no-precompile"]
    ref = LLM(path, **dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, page_size=4, num_pages=40,
                           precompile=False)).generate([{"prompt_token_ids": prompt}],
                                                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                      logprobs=1), use_tqdm=False)[0].outputs[0]
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS=xla_flags())
    for k in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        env.pop(k, None)
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "service", "serve", "--model", path, "--served-model-name", "tiny",
                               "--grpc-port", "-1", "--http-port", "0", "--mesh", "tp4", *engine,
                               "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    lines: list[str] = []
    try:
        m = _read_until(procs[0], r"http://[\d.]+:(\d+)", lines)
        assert m, "the leader did not start serving:\n" + "".join(lines)[-4000:]
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                           "logprobs": 1}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{m.group(1)}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            choice = json.loads(r.read())["choices"][0]
        procs[0].send_signal(signal.SIGTERM)
        out0 = "".join(lines) + procs[0].communicate(timeout=60)[0]
        out1 = procs[1].communicate(timeout=60)[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == 0, out0[-4000:]
    assert procs[1].returncode == 0, out1[-4000:]  # stopped by the leader, not lost
    assert "serving tiny on http" not in out1  # the follower serves nothing
    assert choice["text"] == ref.text and choice["finish_reason"] == "length"
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"],
                               [lp[t].logprob for lp, t in zip(ref.logprobs, ref.token_ids)], rtol=1e-5, atol=1e-5)
