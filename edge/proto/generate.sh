#!/usr/bin/env bash
# Regenerate the committed gRPC stubs edge/sync_pb2.py(i) and edge/sync_pb2_grpc.py from sync.proto.
# Needs grpcio-tools (in the dev extra); tests/edge/test_sync.py checks the stubs are current.
set -euo pipefail
cd "$(dirname "$0")"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"${PYTHON:-python}" -m grpc_tools.protoc -I . --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" quorumfl/edge/sync.proto
cp "$out"/quorumfl/edge/sync_pb2.py "$out"/quorumfl/edge/sync_pb2.pyi "$out"/quorumfl/edge/sync_pb2_grpc.py ..
