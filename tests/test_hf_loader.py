"""HF directory loading: sharded and bf16 safetensors, both rope config styles, and clear errors."""

import json
import os

import numpy as np
import pytest
import torch

from jaxserve.loader import load_checkpoint
from jaxserve.loader.hf import config_from_hf
from jaxserve.loader.weights import to_weights
from paged_harness import PagedModel
from tiny_models import make_tiny_model


def test_sharded_checkpoint_with_index(tmp_path):
    hf = make_tiny_model("llama_gqa", str(tmp_path))
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="100KB")
    assert os.path.isfile(sharded / "model.safetensors.index.json")
    assert len([n for n in os.listdir(sharded) if n.endswith(".safetensors")]) > 1
    a, b = load_checkpoint(str(tmp_path)), load_checkpoint(str(sharded))
    assert a.tensors.keys() == b.tensors.keys()
    for k in a.tensors:
        np.testing.assert_array_equal(a.tensors[k], b.tensors[k])


def test_bfloat16_checkpoint(tmp_path):
    hf = make_tiny_model("llama_gqa", str(tmp_path / "f32"))
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    ckpt = load_checkpoint(str(tmp_path / "bf16"))
    w = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert w.dtype.name == "bfloat16"
    ref = hf.model.layers[0].self_attn.q_proj.weight.float().detach().numpy()
    np.testing.assert_array_equal(w.astype(np.float32), ref)
    # and it runs: logits match HF loading the same bf16 file in float32
    import transformers

    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype=torch.float32)
    m = PagedModel(str(tmp_path / "bf16"))
    ids = [5, 9, 77, 120, 3]
    with torch.no_grad():
        ref_logits = ref_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(m.step({0: ids})[0], ref_logits, atol=1e-4)


def _base_cfg(**kw):
    cfg = dict(
        architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=512,
    )
    cfg.update(kw)
    return cfg


def test_rope_config_styles_agree():
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    v5 = config_from_hf(_base_cfg(rope_parameters=dict(rope_type="llama3", rope_theta=5e5, **scaling)))
    v4 = config_from_hf(_base_cfg(rope_theta=5e5, rope_scaling=dict(rope_type="llama3", **scaling)))
    old = config_from_hf(_base_cfg(rope_theta=5e5, rope_scaling=dict(type="llama3", **scaling)))
    assert v5 == v4 == old
    assert v5.rope_theta == 5e5 and v5.rope_scaling.rope_type == "llama3" and v5.rope_scaling.factor == 8.0
    plain = config_from_hf(_base_cfg(rope_theta=1e4))
    assert plain.rope_scaling is None and plain.head_dim == 16


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_checkpoint(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_checkpoint(str(tmp_path / "empty"))

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel"):
        load_checkpoint(str(gpt2))

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(_base_cfg()))
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="pickled weights are not loaded"):
        load_checkpoint(str(pickled))

    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        config_from_hf(_base_cfg(rope_scaling=dict(type="yarn", factor=2.0)))


def test_shape_mismatch_names_the_tensor(tmp_path):
    make_tiny_model("llama_gqa", str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_key_value_heads"] = 4  # k/v projections in the file are for 2 kv heads
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ckpt = load_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(32, 64\), expected \(64, 64\)"):
        to_weights(ckpt.config, ckpt.tensors, np.float32, ckpt.path)
