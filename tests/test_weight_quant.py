"""Weight quantization (`jaxserve.quant`): GGUF blocks repacked exactly (checked against the `gguf` package's own
dequantizer), the float quantizers' error bounds, HF parity of tiny models whose weights are quantized then
dequantized (through the scanned, unrolled and native-packed model), the scheme the engine picks for a checkpoint,
and clear errors for impossible choices."""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve import quant
from jaxserve.config import EngineConfig
from jaxserve.loader import resolve_quantization
from jaxserve.loader.gguf import default_model_path
from jaxserve.loader.weights import stack_layers
from paged_harness import PagedModel
from tiny_models import make_tiny_model

# byte offsets of each block type's f16 scale fields (random bytes there could be NaN or inf)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(ggml_type: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw bytes of a [rows, cols] tensor of `ggml_type`: every quant bit random, scales finite."""
    block, nbytes, _, _ = quant.GGUF_BLOCKS[ggml_type]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows * cols // block, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[ggml_type]:
        b[:, off:off + 2] = rng.normal(0, 0.05, (len(b), 1)).astype(np.float16).view(np.uint8)
    return b.reshape(rows, cols // block * nbytes)


@pytest.mark.parametrize("ggml_type", sorted(quant.GGUF_BLOCKS))
def test_gguf_blocks_decode_exactly(ggml_type):
    """Every block format's values, scales and zeros reproduce the gguf package's float dequantization bit for bit,
    and the [in, out] QuantizedLinear the model holds dequantizes to the transpose."""
    rows, cols = 6, 512
    data = random_blocks(ggml_type, rows, cols)
    ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[ggml_type]).reshape(rows, cols)
    bq = quant.decode_gguf_blocks(data, ggml_type, (rows, cols))
    assert bq.bits == quant.GGUF_BLOCKS[ggml_type][2] and bq.group == quant.GGUF_BLOCKS[ggml_type][3]
    np.testing.assert_array_equal(bq.dequantize(), ref)
    lin = bq.linear()
    assert lin.shape == (cols, rows)
    np.testing.assert_array_equal(lin.dequantize(), ref.T)
    on_device = jax.tree.map(jnp.asarray, lin)  # the traced (jnp) dequantization: the XLA reference path
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda w: w.dequantize())(on_device)), ref.T)


def test_layers_of_different_block_types_stack_exactly():
    """Layers a file stored in different formats (Q4_K here, Q6_K there: groups of 32 and 16) stack into one
    QuantizedLinear with the widest storage and the smallest group, and keep their values."""
    a = quant.decode_gguf_blocks(random_blocks("Q4_K", 4, 256, 1), "Q4_K", (4, 256))
    b = quant.decode_gguf_blocks(random_blocks("Q6_K", 4, 256, 2), "Q6_K", (4, 256))
    c = quant.decode_gguf_blocks(random_blocks("Q8_0", 4, 256, 3), "Q8_0", (4, 256))
    form = quant.BlockForm.common(t.form for t in (a, b, c))
    assert form == quant.BlockForm(bits=8, group=16, zeros=True)  # Q6_K's groups, Q4_K's zeros (0 for the others)
    stacked = stack_layers((t.linear(form) for t in (a, b, c)), 3)
    assert stacked.bits == 8 and stacked.group == 16 and stacked.shape == (3, 256, 4)
    for i, t in enumerate((a, b, c)):
        np.testing.assert_array_equal(stacked.dequantize()[i], t.dequantize().T)


@pytest.mark.parametrize("scheme", ["int8", "int4", "int4-g64"])
def test_float_quantizers_error_bound(scheme):
    """Round to nearest: every weight within half a step of its group's scale; 4-bit values pack two per byte and
    unpack to 0..15; all-equal groups (scale 0) are exact."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (3, 128, 40)).astype(np.float32)
    w[:, :64, 0] = 0.25  # a constant group
    q = quant.quantize_linear(w, scheme)
    assert q.shape == w.shape
    deq = q.dequantize()
    G = q.group
    assert G == {"int8": 128, "int4": 32, "int4-g64": 64}[scheme]
    step = np.repeat(q.scales, G, axis=-2)
    assert np.all(np.abs(deq - w) <= step / 2 + 1e-7)
    np.testing.assert_allclose(deq[:, :64, 0], 0.25, rtol=1e-6)
    if q.bits == 4:
        assert q.q.dtype == np.uint8 and q.q.shape == (3, 64, 40)
        assert q.values().max() <= 15
    assert np.abs(deq - w).max() > 0  # it did quantize


def test_bf16_scheme_rounds_once():
    w = np.random.default_rng(0).normal(0, 1, (8, 8)).astype(np.float32)
    b = quant.quantize_linear(w, "bf16")
    assert b.dtype == np.dtype("bfloat16")
    np.testing.assert_allclose(b.astype(np.float32), w, rtol=2**-8)


def _hf_with(hf, weights, tied: bool, bf16_inputs: bool = False):
    """The HF model with its linear weights replaced by `weights`' stored (quantized) values, dequantized; with
    `bf16_inputs`, every linear map's input rounded to bf16 first (what jaxserve's bf16 scheme multiplies)."""
    deq = lambda w: torch.tensor(np.asarray(  # noqa: E731
        w.dequantize() if isinstance(w, quant.QuantizedLinear) else np.asarray(w, np.float32)))
    names = dict(wq="self_attn.q_proj", wk="self_attn.k_proj", wv="self_attn.v_proj", wo="self_attn.o_proj",
                 w_gate="mlp.gate_proj", w_up="mlp.up_proj", w_down="mlp.down_proj")
    with torch.no_grad():
        for field, name in names.items():
            stacked = deq(getattr(weights.layers, field))  # [L, in, out]
            for i, layer in enumerate(hf.model.layers):
                layer.get_submodule(name).weight.copy_(stacked[i].T)
        if tied:  # the logits projection is its own (quantized) copy of embed.T; the lookup keeps the float table
            hf.lm_head.weight = torch.nn.Parameter(deq(weights.lm_head).T.contiguous())
        else:
            hf.lm_head.weight.copy_(deq(weights.lm_head).T)
    if bf16_inputs:
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _, args: (args[0].to(torch.bfloat16).to(torch.float32),))
    return hf


@pytest.mark.parametrize("variant", ["llama_gqa", "llama_tied", "qwen2_bias"])
@pytest.mark.parametrize("scheme", ["bf16", "int8", "int4"])
def test_quantized_model_matches_hf_on_dequantized_weights(tmp_path, variant, scheme):
    """A tiny model under each scheme computes what HF computes with the dequantized weights (logits within 1e-4
    at prefill and decode; for bf16, with each linear map's input rounded to bf16, as a bf16 GEMM does), with
    scanned and unrolled layers (the XLA reference) and, for bf16, native-packed ones (the native int8 / 4-bit
    kernels also round activations, as llama.cpp does: tests/test_weight_quant_engine.py compares them with the XLA
    reference of that); and differs from the float model (the scheme is in effect)."""
    hf = make_tiny_model(variant, str(tmp_path))
    with torch.no_grad():
        float_ref = hf(torch.tensor([[5, 17, 42, 99, 7]])).logits[0].numpy()
    ids = [5, 17, 42, 99, 7]
    for layers in ("scanned", "unrolled") + (("packed",) if scheme == "bf16" else ()):
        m = PagedModel(str(tmp_path), layers=layers, quantization=scheme)
        if layers == "scanned":
            hf = _hf_with(hf, m.host_weights, tied=variant == "llama_tied", bf16_inputs=scheme == "bf16")
            with torch.no_grad():
                ref = hf(torch.tensor([ids + [3]])).logits[0].numpy()
            assert np.abs(ref[:5] - float_ref).max() > 1e-3, "quantization changed nothing"
        out = m.step({0: ids})[0]
        np.testing.assert_allclose(out, ref[:5], atol=1e-4, err_msg=f"{scheme} {layers} prefill")
        out = m.step({0: [3]})[0]
        np.testing.assert_allclose(out[-1], ref[5], atol=1e-4, err_msg=f"{scheme} {layers} decode")


def test_default_scheme_per_checkpoint(tmp_path):
    """A quantized GGUF is served as shipped by default; float checkpoints stay float; explicit choices win."""
    gguf_path = default_model_path()
    scheme, note = resolve_quantization(gguf_path, None)
    assert scheme == "gguf" and "Q4_1" in note and "Q8_0" in note
    assert resolve_quantization(gguf_path, "int8")[0] == "int8"
    make_tiny_model("llama_gqa", str(tmp_path))
    assert resolve_quantization(str(tmp_path), None)[0] == "none"
    assert resolve_quantization(str(tmp_path), "int4")[0] == "int4"


def test_impossible_schemes_fail_clearly(tmp_path):
    make_tiny_model("llama_gqa", str(tmp_path))
    with pytest.raises(ValueError, match="quantization=gguf keeps a GGUF file's block formats"):
        resolve_quantization(str(tmp_path), "gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="multiple of it"):
        PagedModel(str(tmp_path), quantization="int4-g64")  # the MLP's 160 inputs are not groups of 64


def test_default_model_loads_its_blocks_unwidened():
    """The shipped Q4_1 file: 210 linear maps stay 4-bit (groups of 32, a scale and a zero each), the tied
    embedding's Q8_0 becomes the int8 logits projection, and the stored bytes are what the file holds (~98 MB with
    the f32 scales) instead of 538 MB of float32."""
    from jaxserve.loader import load_checkpoint
    from jaxserve.loader.weights import to_weights

    ck = load_checkpoint(None, None)
    w = to_weights(ck.config, ck.tensors, np.float32, ck.path, ck.quantization)
    assert isinstance(w.layers.wq, quant.QuantizedLinear) and w.layers.wq.bits == 4 and w.layers.wq.group == 32
    assert w.lm_head.bits == 8 and w.lm_head.shape == (576, 49152)
    assert quant.describe(w) == "int4 g32 x 210, int8 g32 x 1"
    assert 90e6 < quant.linear_bytes(w) < 140e6
    assert dataclasses.is_dataclass(w.layers.wq)
