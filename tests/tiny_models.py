"""Tiny random HF checkpoints, made with transformers inside the tests (nothing is downloaded).

Weights are initialised large (std 0.1, norms perturbed) so that a wrong RoPE convention, eps or scaling shows up
as a logits error far above the 1e-4 tolerance.
"""

from __future__ import annotations

import torch

VARIANTS = {
    "llama_gqa": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2),
    # head dim 64, as real models have (the native CPU attention's decode path takes head dims 64 and 128)
    "llama_hd64": dict(arch="llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2),
    "llama_mqa": dict(arch="llama", num_attention_heads=4, num_key_value_heads=1),
    "llama_tied": dict(arch="llama", num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3_rope": dict(
        arch="llama",
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
    "llama_head_dim": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "mistral": dict(arch="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
    "qwen2_bias": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=2),
    "qwen3_qknorm": dict(arch="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}


def make_tiny_model(variant: str, path: str, seed: int = 0):
    """Write a random tiny checkpoint of `variant` to `path`; return the HF model (float32, eval mode)."""
    import transformers

    spec = dict(VARIANTS[variant])
    arch = spec.pop("arch")
    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    base = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(spec)
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**base)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model
