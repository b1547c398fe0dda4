"""The native CPU kernels built for a chosen instruction set, beside the library in use (built with -march=native),
so one machine can test the AVX2 and the portable paths as well as its own."""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess

import jax

from cpu_kernels import build


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo, read once), empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))
    except OSError:
        return frozenset()


def build_for(source: str, march: str, out_dir: str) -> ctypes.CDLL:
    """`source` compiled with the kernels' flags but -march=`march` (x86-64: the portable loops; x86-64-v3: AVX2,
    FMA and F16C), loaded."""
    flags = [f for f in build.FLAGS if not f.startswith("-march")] + [f"-march={march}"]
    lib_path = os.path.join(out_dir, f"{os.path.basename(os.path.dirname(source))}-{march}.so")
    subprocess.run([build.compiler(), *flags, "-I", jax.ffi.include_dir(), source, "-o", lib_path], check=True,
                   capture_output=True)
    return ctypes.CDLL(lib_path)
