"""Compiling the CPU kernels' C++ sources into shared libraries, once per machine and toolchain.

`build_library(source)` compiles one `.cc` file with the system C++ compiler (`$CXX`, default `g++`) against the XLA
FFI headers that ship with jaxlib, and returns the path of the shared library. Libraries are cached under
`$JAXSERVE_CACHE_DIR/cpu_kernels/` (default `~/.cache/jaxserve/cpu_kernels/`), one file per hash of everything that
can change the binary: the source, jaxlib's version (the FFI ABI), the compiler's version, the flags, and the CPU
model and feature flags (`-march=native`). Builds take a file lock and write under a temporary name that is then
renamed into place, so concurrent processes neither corrupt nor duplicate a build; a stale library is never reused
because its key would differ.

Failures raise `BuildError` with the compiler's output; callers decide how to fall back.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", "-fopenmp-simd", "-fno-math-errno")
BUILD_TIMEOUT_S = 300


class BuildError(RuntimeError):
    """The native library could not be built (no compiler, or the compiler failed)."""


def cache_dir() -> str:
    root = os.environ.get("JAXSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")
    return os.path.join(root, "cpu_kernels")


def compiler() -> str:
    """The C++ compiler's path; raises BuildError when there is none."""
    name = os.environ.get("CXX", "g++")
    path = shutil.which(name)
    if path is None:
        raise BuildError(f"no C++ compiler: {name!r} is not on PATH (install g++ or set $CXX)")
    return path


@functools.cache
def _compiler_version(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{path} --version failed: {e}") from e
    return out.splitlines()[0] if out else ""


@functools.cache
def _cpu_signature() -> str:
    """CPU model and feature flags: -march=native binaries are only valid where these match."""
    model = flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.strip()
                if model and flags:
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{model or platform.processor()}|{flags}"


def _include_dir() -> str:
    import jax.ffi

    return jax.ffi.include_dir()


def library_key(source: str) -> str:
    """Hash of everything that determines the compiled library for `source` on this machine."""
    import jaxlib

    with open(source, "rb") as f:
        text = f.read()
    h = hashlib.sha256(text)
    for part in (jaxlib.__version__, _compiler_version(compiler()), " ".join(FLAGS), _cpu_signature()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


def build_library(source: str) -> str:
    """Path of the shared library compiled from `source` (a .cc file), building it if the cache lacks it."""
    cxx = compiler()
    stem = os.path.splitext(os.path.basename(source))[0]
    directory = cache_dir()
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, f"{stem}-{library_key(source)}.so")
    if os.path.exists(target):
        return target
    with open(os.path.join(directory, f"{stem}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others find the finished file below
        try:
            if os.path.exists(target):
                return target
            fd, tmp = tempfile.mkstemp(prefix=f".{stem}-", suffix=".so", dir=directory)
            os.close(fd)
            cmd = [cxx, *FLAGS, "-I", _include_dir(), source, "-o", tmp]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as e:
                os.unlink(tmp)
                raise BuildError(f"compiling {source} failed: {e}") from e
            if proc.returncode != 0:
                os.unlink(tmp)
                raise BuildError(f"compiling {source} failed (exit {proc.returncode}):\n{' '.join(cmd)}\n"
                                 f"{proc.stderr[-4000:]}")
            os.replace(tmp, target)  # atomic: readers see either no file or a complete one
            return target
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load_cpu_target(build, source: str, symbol: str, target: str, unavailable: str) -> bool:
    """Build `source` with `build` (a kernel module's `build_library`), load it and register its FFI handler `symbol`
    as the CPU custom-call target `target`. On failure: log one warning "`unavailable`: why" and return False."""
    import jax

    try:
        lib = ctypes.CDLL(build(source))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (BuildError, OSError, AttributeError) as e:
        logger.warning("%s: %s", unavailable, e)
        return False
    return True
