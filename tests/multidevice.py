"""Run a test script on simulated CPU devices. jax fixes its device count when it starts, so multi-device tests run
their body in a fresh interpreter with XLA_FLAGS=--xla_force_host_platform_device_count=N and read back the JSON
report it prints last. LLVM runs at -O0 there: the scripts compile many small executables and compare results
within the same process, so codegen speed matters and optimisation does not (the partitioned HLO is unaffected)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_on_devices(script: str, *args: str, devices: int = 8, timeout: float = 900) -> dict:
    """Run `script` with `sys.argv[1:]` = (the repository root, *args) on `devices` CPU devices; returns the JSON
    object its last line of output prints."""
    flags = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    done = subprocess.run([sys.executable, "-c", script, ROOT, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])
