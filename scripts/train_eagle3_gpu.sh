#!/usr/bin/env bash
# Train an EAGLE-3 head for the default model on a lent GPU in one command (docs/gpu.md, "Training an EAGLE-3 head"),
# inside a time budget, and leave only the shipped head and the logs in OUT_DIR, in files a device call brings back
# (each under 15 MiB). Usage, from anywhere:
#   scripts/train_eagle3_gpu.sh OUT_DIR
# Steps, each under its own time limit: the regenerated replies kept in git (training/eagle3/regenerated/, no
# regenerate needed) -> features -> a short calibration run of `train` (its seconds per step) -> `train` for as
# many steps as fit the budget (at most EPOCHS epochs) -> `ship` (bfloat16 head, card with the held-out evaluation
# and the served acceptance on 16 held-out chat prompts). OUT_DIR then holds eagle3_head.tgz.partNN (cat them:
# a tgz of shipped/, or of head/ as train exported it if ship did not finish), eagle3_head.sha256 and
# eagle3_logs.tgz (each step's log, the main run's training.json, JAX's devices): at most 5 files.
# Settings (environment): EPOCHS (8), DRAFT_VOCAB (16384, the shipped head's), TTT_STEPS (3), LR (1e-3),
# BATCH_TOKENS (1024), INIT_HEAD (none: a fresh head; a path: start from that exported head, e.g. the shipped one),
# LIMIT (6000: the file's first samples, the run as planned; it holds more since 2026-12-07), NUM_PROMPTS (16,
# served), TRAIN_SECONDS (200: the main run's budget), DEADLINE (540: seconds from the start by which everything has
# ended, so one device call of 600 s holds it), WORK (a scratch folder, /tmp/eagle3_gpu).
# Limits: features 120 s, calibration 90, train its budget (cut to what leaves ship SHIP_SECONDS, 200) x 1.25 + 60
# for the compiles, ship what is left before DEADLINE (its engine compiles its buckets first). A step that fails or
# overruns ends the run with what exists.
# Python: $PYTHON, else .venv/bin/python, else python3 (on the GPU machine: the image's, with /tmp/site from
# scripts/gpu_assemble.sh on PYTHONPATH). Runs on a CPU too (slowly; with small LIMIT / TRAIN_SECONDS as a smoke test).
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { echo "usage: scripts/train_eagle3_gpu.sh OUT_DIR" >&2; exit 2; }
OUT=$1
EPOCHS=${EPOCHS:-8} DRAFT_VOCAB=${DRAFT_VOCAB:-16384} TTT_STEPS=${TTT_STEPS:-3} LR=${LR:-1e-3}
BATCH_TOKENS=${BATCH_TOKENS:-1024} INIT_HEAD=${INIT_HEAD:-} LIMIT=${LIMIT:-6000} NUM_PROMPTS=${NUM_PROMPTS:-16}
TRAIN_SECONDS=${TRAIN_SECONDS:-200} DEADLINE=${DEADLINE:-540} SHIP_SECONDS=${SHIP_SECONDS:-200}
W=${WORK:-/tmp/eagle3_gpu}
PY=${PYTHON:-}
[ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python; } || PY=python3
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the calibration run's executables serve the main run (the same shapes) from JAX's persistent cache
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$W/jax-cache} JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
rm -rf "$W/logs" && mkdir -p "$OUT" "$W/logs"
start=$SECONDS

die() { echo "== FAILED: $*"; pack; exit 1; }

run() {  # run NAME SECONDS COMMAND...: COMMAND under its limit (SIGTERM, then SIGKILL 20 s later), log in W/logs
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s, ${SECONDS}s elapsed)"
  timeout --kill-after=20 "$limit" "$@" > >(tee "$W/logs/$name.log") 2>&1
}

pack() {  # the head and the logs into OUT (see the top of this file)
  local dir=
  [ -f "$W/head/training.json" ] && cp "$W/head/training.json" "$W/logs/"
  tar -C "$W" -czf "$OUT/eagle3_logs.tgz" logs
  if [ -f "$W/shipped/card.json" ]; then dir=shipped; elif [ -f "$W/head/model.safetensors" ]; then dir=head; fi
  if [ -n "$dir" ]; then
    tar -C "$W" -czf "$W/eagle3_head.tgz" "$dir"
    split -b 15M -d -a 2 "$W/eagle3_head.tgz" "$OUT/eagle3_head.tgz.part"
    (cd "$W" && sha256sum eagle3_head.tgz) > "$OUT/eagle3_head.sha256"
    echo "== head: $OUT/eagle3_head.tgz.part* (cat them, check eagle3_head.sha256, tar xzf: $dir/)"
  fi
  echo "== done in $((SECONDS - start)) s"
  ls -l "$OUT"
}

"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$W/logs/devices.txt"
zcat training/eagle3/regenerated/smollm2-135m-instruct.jsonl.gz > "$W/data.jsonl" || die "the regenerated replies"

run features 120 "$PY" -m training.eagle3 features --data "$W/data.jsonl" --out "$W/feats" ${LIMIT:+--limit "$LIMIT"} \
  || die "features"

TRAIN=(--features "$W/feats" --ttt-steps "$TTT_STEPS" --draft-vocab-size "$DRAFT_VOCAB" --lr "$LR"
       --batch-tokens "$BATCH_TOKENS" ${INIT_HEAD:+--init-head "$INIT_HEAD"})
rm -rf "$W/calib" "$W/head" "$W/shipped"
run calibrate 90 "$PY" -m training.eagle3 train "${TRAIN[@]}" --out "$W/calib" --max-steps 40 --log-every 5 \
  --eval-frac 0  # may be stopped by its limit: only its log lines count
# steps = the budget over the median seconds per step of the calibration's log intervals after its first (which
# holds the compiles), at most about EPOCHS epochs (the calibration holds out no samples: its epoch is ~5% longer)
budget=$((DEADLINE - SECONDS - 60 - SHIP_SECONDS))
[ "$budget" -lt "$TRAIN_SECONDS" ] || budget=$TRAIN_SECONDS
[ "$budget" -gt 0 ] || die "no time left to train before DEADLINE=${DEADLINE}s"
steps=$("$PY" - "$W/logs/calibrate.log" "$EPOCHS" "$budget" <<'EOF'
import re, statistics, sys
log, epochs, budget = open(sys.argv[1]).read(), float(sys.argv[2]), float(sys.argv[3])
per_step = [float(x) for x in re.findall(r"([0-9.]+) s/step", log)][1:]
if not per_step:
    sys.exit("the calibration logged fewer than two intervals: no seconds per step to go by")
per_epoch = int(re.search(r"(\d+) batches per epoch", log).group(1))
print(max(1, min(round(epochs * per_epoch), int(budget / statistics.median(per_step)))))
EOF
) || die "reading the calibration"
echo "== train: $steps steps in a ${budget}s budget"
run train $((budget * 5 / 4 + 60)) "$PY" -m training.eagle3 train "${TRAIN[@]}" --out "$W/head" --max-steps "$steps" \
  --save-every 0 || die "train"

[ $((DEADLINE - SECONDS)) -gt 30 ] || die "no time left to ship before DEADLINE=${DEADLINE}s"
run ship $((DEADLINE - SECONDS)) "$PY" -m training.eagle3 ship --head "$W/head" --out "$W/shipped" --features "$W/feats" \
  --num-prompts "$NUM_PROMPTS" || die "ship"
pack
