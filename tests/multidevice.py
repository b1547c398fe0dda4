"""Run a test script on simulated CPU devices. jax fixes its device count when it starts, so multi-device tests run
their body in a fresh interpreter with XLA_FLAGS=--xla_force_host_platform_device_count=N and read back the JSON
report it prints last. Those processes compile with `FAST_COMPILE`: the scripts compile many small executables and
compare results within the same process, so codegen speed matters and optimisation does not (the partitioned HLO is
unaffected)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# LLVM at -O0, and XLA:CPU's LLVM-IR fusion emitters instead of its MLIR ones (which build an MLIR context and pattern
# sets per compile): a tiny model's step compiles in ~0.65 s instead of ~2 s (1.3 s with -O0 alone), measured
# 2026-12-07. Not for the main process: on the 30-layer default model the older emitters compile slower at -O2.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test subprocess: `FAST_COMPILE`, on `devices` simulated CPU devices if given."""
    return FAST_COMPILE if devices is None else f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"


def run_on_devices(script: str, *args: str, devices: int = 8, timeout: float = 900) -> dict:
    """Run `script` with `sys.argv[1:]` = (the repository root, *args) on `devices` CPU devices; returns the JSON
    object its last line of output prints."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices))
    done = subprocess.run([sys.executable, "-c", script, ROOT, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])
