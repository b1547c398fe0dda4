#!/usr/bin/env bash
# The test suite on a fresh machine: install (with the HF reference), lint, then pytest. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
# Lint (config: [tool.ruff] in pyproject.toml; ruff comes from the `test` extra). A finding fails the run.
.venv/bin/ruff check .
export JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Two workers (the machines have 2 cores; much of the suite is single-threaded compilation), each taking whole test
# files so a file's module fixtures (a multi-device engine report, a server) are built once.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=30 "$@"
