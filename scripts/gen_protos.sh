#!/usr/bin/env bash
# Regenerate the gRPC stubs from service/proto/*.proto (never edit the outputs by hand):
#   service/proto/jaxserve_v1_pb2.py, jaxserve_v1_pb2.pyi, jaxserve_v1_pb2_grpc.py   (imported as usual)
#   service/proto/kserve_v2.binpb   (a descriptor set; service/kserve.py loads it into a private pool)
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: service/proto; tests pass a temp dir to detect stale stubs)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-service/proto}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Generate under the import path service/proto/..., so the stubs import each other as `service.proto.*`.
"$PY" -m grpc_tools.protoc -I . --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
  service/proto/jaxserve_v1.proto
cp "$tmp"/service/proto/jaxserve_v1_pb2.py "$tmp"/service/proto/jaxserve_v1_pb2.pyi \
  "$tmp"/service/proto/jaxserve_v1_pb2_grpc.py "$out"/
"$PY" -m grpc_tools.protoc -I service/proto --descriptor_set_out="$out"/kserve_v2.binpb kserve_v2.proto
