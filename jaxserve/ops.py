"""The one door to the kernels: the only module of jaxserve that imports `pallas_kernels` or `cpu_kernels`.

(Work in progress: speculative verification first; attention, linear maps and KV quantization follow.)
"""

from __future__ import annotations

from pallas_kernels import spec_verify as _spec_verify
from pallas_kernels.spec_verify import reference as _spec_verify_reference

NO_DRAFT = _spec_verify_reference.NO_DRAFT
accepted_length = _spec_verify_reference.accepted_length

# Speculative verification on the Pallas kernel where it covers the inputs (GPU), the XLA reference elsewhere.
verify_one_hot = _spec_verify.verify_one_hot
rejection_sample = _spec_verify.rejection_sample

# The XLA references themselves (the specification; `spec_decode.rejection` re-exports them).
reference_verify_one_hot = _spec_verify_reference.verify_one_hot
reference_rejection_sample = _spec_verify_reference.rejection_sample
