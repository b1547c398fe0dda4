"""Native CPU kernels called from XLA through the FFI (`jax.ffi`), the CPU counterpart of `pallas_kernels/`.

Each kernel is a C++ XLA FFI handler compiled on first use by `build.py` and registered for the CPU platform; its
Python entry has the same signature and semantics as the XLA reference it replaces, and falls back to that
reference (with one warning) when the library cannot be built or loaded.
"""
