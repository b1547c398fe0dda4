#!/usr/bin/env bash
# The main job on a fresh machine: install, then serve the default model (SmolLM2-135M-Instruct).
# Usage: scripts/run.sh [jaxserve arguments]
#   (no arguments)          jaxserve serve: gRPC on 127.0.0.1:50051, OpenAI-compatible HTTP on 127.0.0.1:8000
#   serve --http-port 9000  any `jaxserve serve` options
#   generate --prompt TEXT  one-shot generation, as before
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >&2
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
if [ $# -eq 0 ]; then
  set -- serve
fi
exec .venv/bin/jaxserve "$@"
