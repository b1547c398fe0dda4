"""Test setup: CPU devices, float32 everywhere, a persistent compilation cache under .jax_cache/."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault(
    "JAXSERVE_COMPILE_CACHE", os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache")
)

import warnings  # noqa: E402

# A donated buffer XLA cannot reuse means the KV cache was silently copied: fail loudly.
warnings.filterwarnings("error", message="Some donated buffers were not usable")
