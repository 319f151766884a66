#!/bin/sh
# Generates the rdma.agent.v1 Python stubs (messages + gRPC) into OUT_DIR, for
# use of rdma_agent_client.py outside Bazel:
#   client/python/generate_stubs.sh OUT_DIR [PROTO_ROOT]
#   PYTHONPATH=OUT_DIR:client/python /usr/bin/python3 ...
# Needs protoc and grpc_python_plugin (Debian: protobuf-compiler,
# protobuf-compiler-grpc). Bazel runs the same script (//client/python:stubs).
set -eu
out="$1"
root="${2:-$(dirname "$0")/../../proto}"
mkdir -p "$out"
protoc -I"$root" \
  --python_out="$out" \
  --grpc_python_out="$out" \
  --plugin=protoc-gen-grpc_python="$(command -v grpc_python_plugin)" \
  "$root/rdma/agent/v1/types.proto" \
  "$root/rdma/agent/v1/agent.proto" \
  "$root/rdma/agent/v1/attach.proto" \
  "$root/rdma/agent/v1/remote_buffer.proto"
