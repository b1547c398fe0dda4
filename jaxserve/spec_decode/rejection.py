"""Lossless speculative verification (rejection sampling).

The maths and the XLA reference live in `pallas_kernels/spec_verify/reference.py` (read its module docstring);
this module re-exports them under the names the engine and sampler use. The Pallas GPU kernel computing the same
results is `pallas_kernels.spec_verify` (same functions with an `impl=` switch).
"""

from __future__ import annotations

from pallas_kernels.spec_verify.reference import NO_DRAFT, accepted_length, rejection_sample, verify_one_hot

__all__ = ["NO_DRAFT", "accepted_length", "rejection_sample", "verify_one_hot"]
