"""Frozen configuration dataclasses: what the model is, and how the engine runs it.

`ModelConfig` is derived from a checkpoint (HF `config.json` or GGUF metadata) by `jaxserve.loader`.
`EngineConfig` holds the user's serving choices (vLLM names where vLLM has the concept) and validates them.
Both are hashable so they can be closed over by jitted functions as static data.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from jaxserve.sharding import MeshConfig

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling. Only `llama3` (Llama 3.1/3.2) and `linear` are understood."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"jaxserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def num_params(self) -> int:
        D, F, V, H = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        attn = D * H * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * D * F + 2 * D
        return self.num_layers * per_layer + V * D * (1 if self.tie_word_embeddings else 2) + D


QUANTIZATION_SCHEMES = ("none", "bf16", "int8", "int4", "int4-g64", "gguf")  # = jaxserve.quant.SCHEMES

# kv_cache_dtype names (vLLM's, plus int8) -> the array dtype the cache stores; "auto" follows the model dtype.
KV_CACHE_DTYPES = {
    "auto": None,
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "int8": "int8",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The dtype the KV pages hold for an engine's `kv_cache_dtype` setting."""
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


SPEC_METHODS = ("ngram", "draft_model", "eagle3")

# Kernel backend choices (`EngineConfig.attention_backend` / `matmul_backend`); `jaxserve.ops.resolve_backends`
# turns them into what runs. A field left None takes its environment variable, so the switches that predate the
# fields keep working; the variables are read when the config is made, never at trace time.
BACKEND_CHOICES = ("auto", "xla", "native")
BACKEND_ENV = {"attention_backend": "JAXSERVE_ATTENTION_BACKEND", "matmul_backend": "JAXSERVE_MATMUL_BACKEND"}


def _backend_choice(name: str, value: str | None) -> str:
    """A backend field's validated, lower-cased value; None -> its environment variable (unset or empty: 'auto')."""
    source = name
    if value is None:
        source = f"{BACKEND_ENV[name]} (the default of {name})"
        value = os.environ.get(BACKEND_ENV[name], "").strip() or "auto"
    choice = value.strip().lower() if isinstance(value, str) else value
    if choice not in BACKEND_CHOICES:
        raise ValueError(f"{source} must be one of {', '.join(BACKEND_CHOICES)} (got {value!r})")
    return choice


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's `speculative_config` keys."""

    method: str  # "ngram" (prompt lookup) | "draft_model" (a small model with the target's tokenizer) | "eagle3"
    num_speculative_tokens: int  # K: the most draft tokens verified per sequence per step
    # draft_model: the draft checkpoint (HF dir or GGUF); eagle3: the head's directory, None = the head jaxserve ships
    # for the target (`spec_decode.heads`)
    model: str | None = None
    prompt_lookup_max: int = 4  # ngram: longest suffix n-gram looked up in the sequence's own tokens
    prompt_lookup_min: int = 1  # ngram: shortest
    adaptive: bool = True  # choose K per step from measured step cost and acceptance (never slower than K = 0)
    # The drafter's weight scheme (vLLM's key; one of QUANTIZATION_SCHEMES). None: the target's (a draft model beside
    # a GGUF target picks its own; an EAGLE-3 head's linear maps are then int8: `spec_decode.eagle3.head_scheme`).
    quantization: str | None = None

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPEC_METHODS)} (got {self.method!r})"
            )
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be an integer in [1, 16] "
                f"(got {self.num_speculative_tokens!r})"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model (the draft model's path) is required for method 'draft_model'")
        if self.quantization is not None:
            if self.quantization not in QUANTIZATION_SCHEMES:
                raise ValueError(f"speculative_config.quantization must be one of {', '.join(QUANTIZATION_SCHEMES)} "
                                 f"(got {self.quantization!r})")
            if self.method == "ngram":
                raise ValueError("speculative_config.quantization: method 'ngram' has no weights to quantize")
            if self.method == "eagle3" and self.quantization == "gguf":
                raise ValueError("speculative_config.quantization 'gguf' keeps a GGUF file's blocks; an EAGLE-3 head "
                                 "is not a GGUF file: choose none, bf16, int8, int4 or int4-g64")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max "
                f"(got {self.prompt_lookup_min}, {self.prompt_lookup_max})"
            )

    @classmethod
    def from_dict(cls, values: dict) -> "SpeculativeConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        missing = [k for k in ("method", "num_speculative_tokens") if k not in values]
        if missing:
            raise ValueError(f"speculative_config needs {', '.join(missing)}")
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine runs a model. Names follow vLLM's engine arguments where the concept exists there."""

    max_model_len: int = 2048  # prompt + generated tokens per sequence
    max_num_seqs: int = 16  # sequences in one step
    max_num_batched_tokens: int = 512  # tokens (prefill chunks + decodes) in one step
    page_size: int = 16  # tokens per KV page ("block_size" in vLLM)
    num_pages: int | None = None  # KV pages incl. the padding page 0; None = from kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # KV budget when num_pages is None; None = enough pages for max_num_seqs
    # full-length sequences, capped at 1 GiB; on a GPU, what gpu_memory_utilization leaves
    # The share of the device's memory (what XLA's allocator may use) the weights, the largest step's activations and
    # the KV cache may fill, as vLLM's: sizes the cache when num_pages and kv_cache_memory_bytes are unset, on devices
    # that report their memory (GPUs; XLA:CPU does not, so the CPU ignores it). `jaxserve.memory_plan`.
    gpu_memory_utilization: float = 0.9
    dtype: str | None = None  # "float32" | "bfloat16" | "float16"; None = float32 on CPU, bfloat16 on GPU
    kv_cache_dtype: str = "auto"  # "auto" (= dtype) | "float32" | "bfloat16" | "float16" | "int8" | "fp8" (e4m3)
    # How linear weights are stored (`jaxserve.quant`): "none" (the dtype) | "bf16" | "int8" (per output channel) |
    # "int4" / "int4-g64" (groups of 32 / 64) | "gguf" (a GGUF's own blocks, repacked exactly); None = "gguf" for a
    # quantized GGUF (served as shipped), else "none".
    quantization: str | None = None
    max_logprobs: int = 20  # largest `logprobs` a request may ask for
    token_buckets: tuple[int, ...] = field(default=())  # padded token counts; () = powers of two up to the budget
    # Padded pages-per-sequence counts for block tables; () = powers of two from 8 pages (the XLA attention's cost
    # follows the padded table). The engine collapses them to the largest when the native CPU kernel runs (it walks
    # only each sequence's own pages, so more buckets would only mean more compiles).
    page_buckets: tuple[int, ...] = field(default=())
    # Run the layers as one `lax.scan` body (True) or unrolled (False); None = unrolled on the CPU, where XLA copies
    # each scanned layer's weight slices out of the stacked arrays every step, and scanned elsewhere.
    scan_layers: bool | None = None
    # Kernel backends, "auto" | "xla" | "native" (BACKEND_CHOICES); None = $JAXSERVE_ATTENTION_BACKEND /
    # $JAXSERVE_MATMUL_BACKEND, else "auto". attention: auto = Pallas on a GPU (the XLA reference for shapes it does
    # not cover), the native C++ kernel on the CPU when it builds, else the XLA reference. matmul: auto = the native
    # CPU matmul over packed weights for float32, unrolled layers on the CPU when it builds, else XLA dots.
    attention_backend: str | None = None
    matmul_backend: str | None = None
    enable_prefix_caching: bool = True
    precompile: bool = True  # compile every (tokens, pages) bucket at start; False = compile each on first use
    # Schedule and dispatch step N+1 while step N runs on the device, its sampled tokens fed to N+1 on the device
    # (vLLM's async scheduling; `engine.py`). None = on where it is supported (not with pipeline stages);
    # True where it is not is refused.
    async_scheduling: bool | None = None
    priority_aging_steps: int = 100  # a waiting request gains one priority level per this many steps
    seed: int = 0
    speculative_config: SpeculativeConfig | None = None  # or a dict with vLLM's keys: {"method": "ngram", ...}
    # Device mesh (`jaxserve.sharding.MeshConfig`): a preset name ("single", "tp2", "pp2_tp2", ...), a
    # configs/mesh/*.yaml path or a mapping; None = one device. One LLMEngine runs one dp replica (pp x tp);
    # `data_parallel.make_engine` builds dp of them.
    mesh: MeshConfig | None = None

    def __post_init__(self):
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        object.__setattr__(self, "mesh", MeshConfig.from_value(self.mesh))
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size", "priority_aging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        for name in BACKEND_ENV:
            object.__setattr__(self, name, _backend_choice(name, getattr(self, name)))
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of float32, bfloat16, float16 (got {self.dtype!r})")
        if self.quantization is not None and self.quantization not in QUANTIZATION_SCHEMES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_SCHEMES)} (got "
                             f"{self.quantization!r})")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (got {self.kv_cache_dtype!r})"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1 (got {self.kv_cache_memory_bytes})")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1] of the device's memory (got "
                             f"{self.gpu_memory_utilization!r})")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2: page 0 is reserved for padding (got {self.num_pages})")
        object.__setattr__(self, "token_buckets", tuple(sorted(self.token_buckets)))
        if not self.token_buckets:
            object.__setattr__(self, "token_buckets", _pow2_buckets(1, self.max_num_batched_tokens))
        elif max(self.token_buckets) < self.max_num_batched_tokens:
            raise ValueError(
                f"largest token bucket {max(self.token_buckets)} is below max_num_batched_tokens "
                f"{self.max_num_batched_tokens}"
            )
        m = self.max_pages_per_seq
        pages = tuple(sorted(set(self.page_buckets))) or _pow2_buckets(min(8, m), m)
        if pages[0] < 1 or pages[-1] < m:
            raise ValueError(
                f"page_buckets must be >= 1 and the largest must hold max_model_len={self.max_model_len} "
                f"({m} pages of {self.page_size}); got {self.page_buckets}"
            )
        # Buckets past the first one that holds max_model_len could never be chosen (e.g. after max_model_len shrank).
        object.__setattr__(self, "page_buckets", tuple(p for p in pages if p < m) + (next(p for p in pages if p >= m),))

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict, source: str = "engine config") -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"{source}: unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        values = dict(values)
        for key in ("token_buckets", "page_buckets"):
            if key in values:
                values[key] = tuple(values[key])
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str) -> "EngineConfig":
        import yaml

        with open(path) as f:
            values = yaml.safe_load(f) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of engine options, got {type(values).__name__}")
        return cls.from_dict(values, path)
