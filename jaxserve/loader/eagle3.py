"""EAGLE-3 head checkpoints -> `Eagle3Config` + host `Eagle3Weights`. Safetensors only.

Two formats are read (a directory with `config.json` and `*.safetensors`):

  speculators   `speculators_model_type: "eagle3"`; the layer's dims in `transformer_layer_config`;
                `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids`, `norm_before_fc`, `fc_norm`, `norm_output`,
                `norm_before_residual` at the top level; weights `fc.weight`, `input_norm.weight` (norm_before_fc),
                `fc_norm.weight` ([3, D] or [3D], fc_norm), `layers.0.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`.
  HF            `architectures: ["LlamaForCausalLMEagle3"]` (EAGLE's reference and SpecForge): a plain Llama config
                with `num_hidden_layers: 1` and `draft_vocab_size`; optional
                `eagle_config.eagle_aux_hidden_state_layer_ids`; layer weights named `midlayer.*` (EAGLE) or
                `layers.0.*`, optionally under `model.`.

Layer ids are stored in ONE convention (see `Eagle3Config`): the layer whose *input* residual stream is captured.
Speculators ids are already in it. HF-format ids come from SpecForge, which numbers the layer whose *output* is
captured, so they are shifted by +1 here (as SGLang does). Absent ids default to [2, N//2, N-3] for an N-layer
target (EAGLE's reference). `t2d` is only needed for training and is checked, not kept.
"""

from __future__ import annotations

import json
import os

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loader.hf import config_from_hf, read_safetensors
from jaxserve.model.eagle3 import Eagle3Config, Eagle3Weights


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


def _read_config(path: str) -> dict:
    fp = os.path.join(path, "config.json")
    if not os.path.isfile(fp):
        raise FileNotFoundError(
            f"{path}: no config.json; an EAGLE-3 head is a directory with config.json + *.safetensors"
        )
    with open(fp) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{fp}: not valid JSON ({e})") from e


def checkpoint_format(raw: dict, fp: str) -> str:
    if raw.get("speculators_model_type") is not None:
        if raw["speculators_model_type"] != "eagle3":
            raise ValueError(f"{fp}: speculators_model_type is {raw['speculators_model_type']!r}, expected 'eagle3'")
        return "speculators"
    if "LlamaForCausalLMEagle3" in (raw.get("architectures") or []):
        return "hf"
    raise ValueError(
        f"{fp}: not an EAGLE-3 head: expected speculators_model_type 'eagle3' or architectures "
        f"['LlamaForCausalLMEagle3'] (got architectures {raw.get('architectures')})"
    )


def read_eagle3_config(path: str, target: ModelConfig) -> Eagle3Config:
    """The head's config, validated against the target it will draft for (cheap: reads config.json only)."""
    path = os.path.expanduser(path)
    fp = os.path.join(path, "config.json")
    raw = _read_config(path)
    fmt = checkpoint_format(raw, fp)
    if fmt == "speculators":
        layer_raw = raw.get("transformer_layer_config")
        if not isinstance(layer_raw, dict):
            raise ValueError(f"{fp}: speculators format needs a transformer_layer_config object")
        ids = raw.get("eagle_aux_hidden_state_layer_ids")  # input convention already
        shift = 0
        target_hidden = raw.get("target_hidden_size") or layer_raw.get("hidden_size")
    else:
        layer_raw = raw
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        shift = 1  # SpecForge output indices -> input convention
        target_hidden = raw.get("target_hidden_size") or raw.get("hidden_size")
    flags = {k: bool(raw.get(k, False)) for k in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")}
    layer_raw = {k: v for k, v in layer_raw.items() if k != "architectures"} | {"model_type": "llama"}
    try:
        layer = config_from_hf(layer_raw, fp)
    except KeyError as e:
        raise ValueError(f"{fp}: the head's layer config lacks {e.args[0]!r}") from e
    if layer.num_layers != 1:
        raise ValueError(f"{fp}: num_hidden_layers is {layer.num_layers}; jaxserve serves single-layer EAGLE-3 heads")
    if layer.attention_bias or layer.qk_norm:
        raise ValueError(f"{fp}: attention biases / q-k norms in an EAGLE-3 head are not supported")
    if layer.hidden_size != target.hidden_size or target_hidden != target.hidden_size:
        raise ValueError(
            f"{fp}: head hidden_size {layer.hidden_size} (target_hidden_size {target_hidden}) must equal the target's "
            f"hidden_size {target.hidden_size}: the head shares the target's embedding"
        )
    if layer.vocab_size != target.vocab_size:
        raise ValueError(f"{fp}: vocab_size {layer.vocab_size} differs from the target's {target.vocab_size}")
    draft_vocab = int(raw.get("draft_vocab_size") or layer.vocab_size)
    if ids is None:
        aux = default_aux_layer_ids(target.num_layers)
    else:
        if not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) for i in ids):
            raise ValueError(f"{fp}: eagle_aux_hidden_state_layer_ids must be a list of 3 integers (got {ids!r})")
        aux = tuple(i + shift for i in ids)
    if not all(0 <= i <= target.num_layers for i in aux):
        raise ValueError(
            f"{fp}: aux layer ids {list(aux)} (input convention) fall outside the target's layers "
            f"0..{target.num_layers}"
        )
    return Eagle3Config(layer=layer, draft_vocab_size=draft_vocab, aux_layer_ids=aux, **flags)


def _normalise_name(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer.") :]
    return name


def read_eagle3_tensors(path: str) -> dict[str, np.ndarray]:
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights for the EAGLE-3 head (pickles are never loaded)")
    tensors = {}
    for n in files:
        tensors |= {_normalise_name(k): v for k, v in read_safetensors(os.path.join(path, n)).items()}
    return tensors


def load_eagle3(path: str, target: ModelConfig, dtype) -> tuple[Eagle3Config, Eagle3Weights]:
    """Read and validate a head for `target`; weights as host numpy in `dtype` (d2t as int32)."""
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"EAGLE-3 head {path!r} not found: pass a directory with config.json + *.safetensors")
    cfg = read_eagle3_config(path, target)
    t = read_eagle3_tensors(path)
    c = cfg.layer
    D, F, Vd, V = c.hidden_size, c.intermediate_size, cfg.draft_vocab_size, c.vocab_size
    NH, KH = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def take(name: str, shape: tuple[int, ...], transpose: bool = True) -> np.ndarray:
        if name not in t:
            raise ValueError(f"{path}: missing tensor {name} (have: {', '.join(sorted(t)[:12])}...)")
        a = t[name]
        if tuple(a.shape) != shape:
            raise ValueError(f"{path}: tensor {name} has shape {tuple(a.shape)}, expected {shape} from config.json")
        return (a.T if transpose else a).astype(dtype)

    lay = "layers.0."
    fc_in_norm = take("input_norm.weight", (3 * D,), False) if cfg.norm_before_fc else None
    fc_chunk_norm = None
    if cfg.fc_norm:
        if "fc_norm.weight" not in t:
            raise ValueError(f"{path}: fc_norm is set but tensor fc_norm.weight is missing")
        a = t["fc_norm.weight"]
        if a.size != 3 * D:
            raise ValueError(
                f"{path}: tensor fc_norm.weight has shape {tuple(a.shape)}, expected (3, {D}) or ({3 * D},)"
            )
        fc_chunk_norm = a.reshape(3, D).astype(dtype)
    if "d2t" in t:
        d2t = np.asarray(t["d2t"])
        if d2t.shape != (Vd,) or not np.issubdtype(d2t.dtype, np.integer):
            raise ValueError(
                f"{path}: d2t must be an integer vector of draft_vocab_size {Vd} (got {d2t.dtype}{list(d2t.shape)})"
            )
        mapped = np.arange(Vd) + d2t
        if mapped.min() < 0 or mapped.max() >= V:
            raise ValueError(f"{path}: d2t maps draft ids outside the target vocabulary [0, {V})")
    elif Vd == V:
        d2t = np.zeros(V, np.int64)
    else:
        raise ValueError(f"{path}: draft_vocab_size {Vd} < vocab_size {V} but the checkpoint has no d2t mapping")
    if "t2d" in t:
        t2d = np.asarray(t["t2d"]).astype(bool)
        if t2d.shape != (V,) or int(t2d.sum()) != Vd or not t2d[np.arange(Vd) + d2t].all():
            raise ValueError(f"{path}: t2d is not the membership mask of d2t's {Vd} target ids")
    w = Eagle3Weights(
        fc=take("fc.weight", (D, 3 * D)),
        embed_norm=take(lay + "input_layernorm.weight", (D,), False),
        hidden_norm=take(lay + "hidden_norm.weight", (D,), False),
        wq=take(lay + "self_attn.q_proj.weight", (NH, 2 * D)),
        wk=take(lay + "self_attn.k_proj.weight", (KH, 2 * D)),
        wv=take(lay + "self_attn.v_proj.weight", (KH, 2 * D)),
        wo=take(lay + "self_attn.o_proj.weight", (D, NH)),
        mlp_norm=take(lay + "post_attention_layernorm.weight", (D,), False),
        w_gate=take(lay + "mlp.gate_proj.weight", (F, D)),
        w_up=take(lay + "mlp.up_proj.weight", (F, D)),
        w_down=take(lay + "mlp.down_proj.weight", (D, F)),
        final_norm=take("norm.weight", (D,), False),
        lm_head=take("lm_head.weight", (Vd, D)),
        d2t=d2t.astype(np.int32),
        fc_in_norm=fc_in_norm,
        fc_chunk_norm=fc_chunk_norm,
    )
    return cfg, w
