"""A trained head -> a speculators-format directory (config.json + model.safetensors), the format vLLM loads
natively and `jaxserve.loader.eagle3.load_eagle3` reads.

Weights go out in torch's [out, in] layout under speculators' names (`fc.weight`, `layers.0.*`, `norm.weight`,
`lm_head.weight`, `d2t` i64, `t2d` bool); the embedding is the target's and is not written. Layer ids are in the
input convention (speculators'), the norm flags are those the head was trained with.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxserve.config import ModelConfig
from jaxserve.model.eagle3 import Eagle3Config, Eagle3Weights

FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")


def layer_config_dict(c: ModelConfig) -> dict:
    """The head's single-layer ModelConfig as an HF Llama config (what `config_from_hf` reads back)."""
    out = dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=1, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings, hidden_act="silu",
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    )
    if c.rope_scaling is not None:
        out["rope_scaling"] = asdict(c.rope_scaling)
    return out


def export_speculators(path: str, cfg: Eagle3Config, w: Eagle3Weights, d2t: np.ndarray, t2d: np.ndarray, *,
                       verifier: str, num_speculative_tokens: int = 3, dtype: str = "float32") -> None:
    """Write `w` (host or device arrays, [in, out] linears) as a speculators EAGLE-3 checkpoint in `path`, its
    weights stored as `dtype` ("float32" or "bfloat16"; d2t and t2d keep their integer and bool types)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16 (got {dtype!r})")
    store = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    Vd = cfg.draft_vocab_size
    d2t, t2d = np.asarray(d2t, np.int64), np.asarray(t2d, bool)
    if d2t.shape != (Vd,) or t2d.shape != (cfg.layer.vocab_size,) or int(t2d.sum()) != Vd:
        raise ValueError(f"d2t must be i64[{Vd}] and t2d bool[{cfg.layer.vocab_size}] with {Vd} members "
                         f"(got {d2t.shape}, {t2d.shape} with {int(t2d.sum())})")
    cast = lambda a: np.ascontiguousarray(np.asarray(a, np.float32).astype(store))  # noqa: E731
    lay = "layers.0."
    tensors = {
        "fc.weight": cast(w.fc).T,
        lay + "input_layernorm.weight": cast(w.embed_norm),
        lay + "hidden_norm.weight": cast(w.hidden_norm),
        lay + "self_attn.q_proj.weight": cast(w.wq).T,
        lay + "self_attn.k_proj.weight": cast(w.wk).T,
        lay + "self_attn.v_proj.weight": cast(w.wv).T,
        lay + "self_attn.o_proj.weight": cast(w.wo).T,
        lay + "post_attention_layernorm.weight": cast(w.mlp_norm),
        lay + "mlp.gate_proj.weight": cast(w.w_gate).T,
        lay + "mlp.up_proj.weight": cast(w.w_up).T,
        lay + "mlp.down_proj.weight": cast(w.w_down).T,
        "norm.weight": cast(w.final_norm),
        "lm_head.weight": cast(w.lm_head).T,
        "d2t": d2t,
        "t2d": t2d,
    }
    if cfg.norm_before_fc:
        tensors["input_norm.weight"] = cast(w.fc_in_norm)
    if cfg.fc_norm:
        tensors["fc_norm.weight"] = cast(w.fc_chunk_norm)
    config = dict(
        speculators_model_type="eagle3",
        speculators_version="0.3.0",
        architectures=["Eagle3Speculator"],
        speculators_config=dict(
            algorithm="eagle3",
            proposal_methods=[dict(proposal_type="greedy", speculative_tokens=num_speculative_tokens)],
            default_proposal_method="greedy",
            verifier=dict(name_or_path=verifier, architectures=["LlamaForCausalLM"]),
        ),
        transformer_layer_config=layer_config_dict(cfg.layer),
        draft_vocab_size=Vd,
        target_hidden_size=cfg.layer.hidden_size,
        eagle_aux_hidden_state_layer_ids=list(cfg.aux_layer_ids),
        embed_requires_grad=False,
        torch_dtype=dtype,
        **{k: getattr(cfg, k) for k in FLAGS},
    )
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
