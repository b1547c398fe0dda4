"""EAGLE-3 heads shipped with jaxserve, for the targets it serves out of the box.

`speculative_config={"method": "eagle3"}` without a `model` drafts with the head shipped for the target, found by the
target's stable id (`jaxserve.loader.gguf.model_id`: the hub id of the embedded default model). Each head is a
directory in the speculators format (config.json, bfloat16 model.safetensors) with its card: README.md for people,
card.json for programs (how it was trained, and its acceptance on held-out prompts, which a test re-measures).
`python -m training.eagle3 ship` writes one.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from jaxserve.config import SpeculativeConfig
from jaxserve.loader.gguf import model_id

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
# target id -> the head's directory (a name here, or an absolute path)
HEADS: dict[str, str] = {"HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m-instruct-eagle3"}


def shipped_head(target: str | None) -> str | None:
    """The directory of the head shipped for `target` (a path, None = the default model), or None."""
    name = HEADS.get(model_id(target))
    if name is None:
        return None
    path = os.path.join(HERE, name)
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def with_shipped_head(spec: SpeculativeConfig | None, target: str | None) -> SpeculativeConfig | None:
    """`spec` with `model` set to the shipped head when it asks for EAGLE-3 without one; raises when `target` has
    no shipped head. Other configs come back as they are."""
    if spec is None or spec.method != "eagle3" or spec.model:
        return spec
    head = shipped_head(target)
    if head is None:
        shipped = ", ".join(sorted(t for t in HEADS if shipped_head(t) is not None)) or "none"
        raise ValueError(
            f"speculative_config.model (an EAGLE-3 head's directory) is required for target {model_id(target)!r}: "
            f"jaxserve ships heads only for {shipped}"
        )
    logger.info("EAGLE-3: the head shipped for %s (%s)", model_id(target), head)
    return dataclasses.replace(spec, model=head)
