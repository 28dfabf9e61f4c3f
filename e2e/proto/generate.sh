#!/usr/bin/env bash
# Regenerate e2e/deviceplugin_pb2.py and e2e/deviceplugin_pb2_grpc.py from the kubelet's proto.
# Needs grpcio-tools (the version that matches the grpcio pin); the output is deterministic.
set -euo pipefail
cd "$(dirname "$0")/../.."
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -Ie2e=e2e/proto \
    --python_out=. --grpc_python_out=. e2e/deviceplugin.proto
