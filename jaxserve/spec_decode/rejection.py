"""Lossless speculative verification (rejection sampling).

The maths and the XLA reference live in `pallas_kernels/spec_verify/reference.py` (read its module docstring);
this module re-exports the reference, through `jaxserve.ops`, under the names the engine uses. The sampler's verify
path calls `ops.verify_one_hot`, which runs the Pallas GPU kernel computing the same results where it applies.
"""

from __future__ import annotations

from jaxserve.ops import NO_DRAFT, accepted_length
from jaxserve.ops import reference_rejection_sample as rejection_sample
from jaxserve.ops import reference_verify_one_hot as verify_one_hot

__all__ = ["NO_DRAFT", "accepted_length", "rejection_sample", "verify_one_hot"]
