#!/usr/bin/env bash
# The main job on a fresh machine: install, then run jaxserve on the default model.
# Usage: scripts/run.sh [jaxserve arguments]   (default: generate from a sample prompt)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >&2
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
if [ $# -eq 0 ]; then
  set -- generate --prompt "The capital of France is" --max-tokens 32
fi
exec .venv/bin/jaxserve "$@"
