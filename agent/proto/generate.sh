#!/usr/bin/env bash
# Regenerate agent/podresources_pb2.py and agent/podresources_pb2_grpc.py from the kubelet's proto.
# Needs grpcio-tools (the version that matches the grpcio pin); the output is deterministic.
set -euo pipefail
cd "$(dirname "$0")/../.."
# -Iagent=agent/proto: the proto is compiled as "agent/podresources.proto", so the stubs import
# each other as agent.podresources_pb2 and live in the agent package.
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -Iagent=agent/proto \
    --python_out=. --grpc_python_out=. agent/podresources.proto
