#!/usr/bin/env bash
# Rebuild, on the GPU machine, what scripts/gpu_bundle.sh packed (docs/gpu.md): check every part against
# MANIFEST.sha256, concatenate the parts of each whole file and check it, unpack *.tar.xz wholes into the site folder
# and check the files the manifest lists under site/ (the default model). Stops at the first missing part or
# checksum mismatch, saying which. Usage:
#   scripts/gpu_assemble.sh [--partial] [--out DIR] [--site DIR] BUNDLE_DIR...
# BUNDLE_DIRs hold the parts (any split between them) and the same MANIFEST.sha256. --partial: check the parts
# present and stop, content if some are still to come (the first call). --out: where the whole files go
# (default /tmp/gpu_bundle). --site: where archives are unpacked (default /tmp/site); then `export PYTHONPATH=SITE`.
set -euo pipefail
PY=${PYTHON:-python3}

die() { echo "gpu_assemble: ERROR: $*" >&2; exit 1; }

partial=0 out=/tmp/gpu_bundle site=/tmp/site
while [ $# -gt 0 ]; do
  case $1 in
    --partial) partial=1; shift ;;
    --out) out=$2; shift 2 ;;
    --site) site=$2; shift 2 ;;
    -*) die "unknown option $1" ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || die "usage: scripts/gpu_assemble.sh [--partial] [--out DIR] [--site DIR] BUNDLE_DIR..."
dirs=("$@")
manifest=$1/MANIFEST.sha256
for d in "${dirs[@]}"; do
  [ -f "$d/MANIFEST.sha256" ] || die "$d/MANIFEST.sha256 not found: not a folder made by scripts/gpu_bundle.sh"
  cmp -s "$manifest" "$d/MANIFEST.sha256" \
    || die "$d and $1 hold different builds of the bundle (MANIFEST.sha256 differs): send the parts of one build"
done

check() {  # check FILE SHA256
  local got
  got=$(sha256sum < "$1" | cut -d' ' -f1)
  [ "$got" = "$2" ] || die "checksum mismatch: $1 has sha256 $got, MANIFEST.sha256 says $2" \
    "(damaged in transfer, or from another build: send it again)"
}

find_part() {  # the first BUNDLE_DIR/NAME that exists, or nothing
  local d
  for d in "${dirs[@]}"; do
    if [ -f "$d/$1" ]; then echo "$d/$1"; return; fi
  done
}

missing=()
while read -r sum name; do
  [[ $name == *.part[0-9][0-9] ]] || continue
  path=$(find_part "$name")
  if [ -z "$path" ]; then missing+=("$name"); continue; fi
  check "$path" "$sum"
  echo "part ok: $path"
done < "$manifest"
if [ ${#missing[@]} -gt 0 ]; then
  if [ $partial = 1 ]; then echo "parts still to come: ${missing[*]}"; exit 0; fi
  die "missing parts: ${missing[*]} (looked in: ${dirs[*]}). The device keeps the first call's half only while" \
    "it is warm (30 s after a call): run the first call again, then the second at once"
fi
[ $partial = 0 ] || { echo "all parts present"; exit 0; }

mkdir -p "$out" "$site"
while read -r sum name; do
  [[ $name == *.part[0-9][0-9] || $name == site/* ]] && continue
  parts=()
  while read -r _ part; do
    [[ $part == "$name".part[0-9][0-9] ]] && parts+=("$(find_part "$part")")
  done < "$manifest"
  [ ${#parts[@]} -gt 0 ] || die "MANIFEST.sha256 lists $name but none of its parts"
  cat "${parts[@]}" > "$out/$name"
  check "$out/$name" "$sum"
  echo "whole ok: $out/$name (${#parts[@]} parts)"
  if [[ $name == *.tar.xz ]]; then
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
      "$out/$name" "$site"
    echo "unpacked into $site"
  fi
done < "$manifest"

while read -r sum name; do
  [[ $name == site/* ]] || continue
  [ -f "$site/${name#site/}" ] || die "$site/${name#site/} not found after unpacking"
  check "$site/${name#site/}" "$sum"
  echo "file ok: $site/${name#site/}"
done < "$manifest"
echo "bundle ready: export PYTHONPATH=$site"
