"""Speculative decoding inside continuous batching.

Per step, for every decoding sequence the engine asks the proposer for up to K draft tokens; the scheduler places
the sequence's last token plus its drafts in the same ragged batch as other requests' prefill chunks and plain
decodes; the sampler verifies every draft position by lossless rejection sampling (`rejection.py`); the engine
appends the accepted drafts plus one more token and rolls back the rest (KV slots past the accepted prefix are
simply overwritten later; pages past the sequence's end are freed).

Modules: `proposer.py` (the `Proposer` protocol every method implements), `ngram.py`, `draft_model.py`,
`eagle3.py` (the methods), `controller.py` (`SpecController`: K per step from measured costs and acceptance),
`speculator.py` (the engine's one handle: a proposer plus the controller, called through the same hooks for every
method), `rejection.py` (lossless verification, through the kernel door).
"""

from __future__ import annotations

from jaxserve.config import EngineConfig, ModelConfig, SpeculativeConfig
from jaxserve.spec_decode.controller import SpecController, SpecMetrics
from jaxserve.spec_decode.ngram import NgramProposer
from jaxserve.spec_decode.proposer import Proposer

__all__ = [
    "NgramProposer", "Proposer", "SpecController", "SpecMetrics", "make_proposer", "proposer_cache_configs",
    "target_hidden_layer_ids",
]


def target_hidden_layer_ids(cfg: SpeculativeConfig | None, target: ModelConfig) -> tuple[int, ...]:
    """Target layers whose input residual stream the proposer consumes (EAGLE-3), () for the others. The engine
    asks before building its runner, so the target step can output them."""
    if cfg is None or cfg.method != "eagle3":
        return ()
    from jaxserve.loader.eagle3 import read_eagle3_config

    return read_eagle3_config(cfg.model, target).aux_layer_ids


def proposer_cache_configs(cfg: SpeculativeConfig | None, target: ModelConfig) -> tuple[ModelConfig, ...]:
    """Models of the proposer's own KV caches (draft model, EAGLE-3 head layer), which share the target's page
    ids: the engine sizes its pages so that all caches together fit the KV memory budget. Reads configs only."""
    if cfg is None or cfg.method == "ngram":
        return ()
    if cfg.method == "eagle3":
        from jaxserve.loader.eagle3 import read_eagle3_config

        return (read_eagle3_config(cfg.model, target).layer,)
    from jaxserve.loader import read_model_config

    return (read_model_config(cfg.model),)


def make_proposer(cfg: SpeculativeConfig, engine_cfg: EngineConfig, target: ModelConfig, runner=None) -> Proposer:
    """The proposer for `cfg.method` (every one implements `proposer.Proposer`). `runner` is the target's
    ModelRunner (EAGLE-3 shares its embedding)."""
    if cfg.method == "ngram":
        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.method == "draft_model":
        from jaxserve.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(cfg, engine_cfg, target)
    if cfg.method == "eagle3":
        from jaxserve.spec_decode.eagle3 import Eagle3Proposer

        return Eagle3Proposer(cfg, engine_cfg, target, runner)
    raise ValueError(f"unknown speculative method {cfg.method!r}")
