#!/usr/bin/env bash
# Regenerates the Python stubs for protos/baton/v1/*.proto next to the .proto files.
# Run from anywhere; uses the active Python's grpc_tools. The stubs are committed.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root/protos"
python -m grpc_tools.protoc \
  --proto_path=. \
  --python_out=. \
  --pyi_out=. \
  --grpc_python_out=. \
  baton/v1/inference.proto baton/v1/admin.proto
# protoc writes `from baton.v1 import ...`; the package is importable as `protos.baton.v1`.
sed -i 's/^from baton\.v1 import /from protos.baton.v1 import /' \
  baton/v1/*_pb2_grpc.py baton/v1/*_pb2.py baton/v1/*_pb2.pyi
