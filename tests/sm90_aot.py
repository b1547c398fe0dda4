"""Shared harness for deviceless sm_90 (H100/H200) compile tests (`shared/notes/jax-on-cpu.md` §2).

The CUDA PJRT plugin (`jax-cuda12-plugin` + `jax-cuda12-pjrt`, same version as jaxlib, no CUDA libraries) lives
outside the main environment so that no other process sees it: `scripts/setup.sh --test` installs it into
`.venv/cuda-aot`. A compile test runs itself as a child script with that folder on its path; the child prints one
JSON line per configuration (`compile_config`) and the parent collects them (`run_compile_child`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN_DIR = os.environ.get("JAXSERVE_CUDA_AOT_DIR", os.path.join(ROOT, ".venv", "cuda-aot"))

# An H200 as XLA's GPU compiler sees it (sm_90, 132 SMs, 227 KB opt-in shared memory per block).
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150000000000 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H200"
"""


def h200_sharding():
    """(child process) A sharding on a deviceless one-GPU H200 mesh: what a ShapeDtypeStruct carries to be
    compiled for the H200."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    topology = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET_CONFIG, topology="1x1x1")
    return NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), PartitionSpec())


def h200_spec_factory():
    """(child process) A function (shape, dtype) -> ShapeDtypeStruct placed on a deviceless one-GPU H200 mesh."""
    import jax
    import jax.numpy as jnp

    sharding = h200_sharding()

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)

    return spec


@contextlib.contextmanager
def tracing_as_gpu():
    """(child process) Trace as a GPU process would: the kernel entry points' `impl="auto"` (ragged paged attention,
    spec verify) pick the Pallas kernel when `jax.default_backend()` says "gpu" at trace time, and this process's
    backend is the CPU. Inside, `jax.default_backend()` answers "gpu", so a deviceless compile of the engine's step
    traces what it traces on the H200."""
    import jax

    real = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        yield
    finally:
        jax.default_backend = real


def compile_config(config_id: str, fn, args, *, expect_in_hlo: str, note: str = "") -> dict:
    """(child process) jit(fn).lower(*args).compile() for the target; a JSON-able result (ok, error, seconds)."""
    import jax

    start = time.perf_counter()
    try:
        text = jax.jit(fn).lower(*args).compile().as_text() or ""
        ok = expect_in_hlo in text or "triton" in text
        error = "" if ok else f"compiled HLO holds no {expect_in_hlo!r} kernel call"
    except Exception as e:  # noqa: BLE001 - reported per config
        ok, error = False, f"{type(e).__name__}: {e}"[:3000]
    return dict(id=config_id, ok=ok, error=error, seconds=round(time.perf_counter() - start, 2), note=note)


def _plugin_in_main_env() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


def run_compile_child(script: str, *, timeout: float = 1500) -> dict[str, dict]:
    """Run `script` (a compile test run as __main__) with the plugin on its path; its results by config id.
    Fails the calling test with the setup command when the plugin is missing."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if not _plugin_in_main_env():
        if not os.path.isdir(os.path.join(PLUGIN_DIR, "jax_plugins")):
            pytest.fail(f"the CUDA PJRT plugin is not installed in {PLUGIN_DIR}: run scripts/setup.sh --test "
                        "(installs jax-cuda12-plugin and jax-cuda12-pjrt there, matching jaxlib)")
        env["PYTHONPATH"] = PLUGIN_DIR
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        pytest.fail(f"compile child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    results = {r["id"]: r for r in map(json.loads, lines)}
    total = sum(r["seconds"] for r in results.values())
    print(f"\nsm_90 deviceless compile: {sum(r['ok'] for r in results.values())}/{len(results)} ok, {total:.0f} s")
    return results
