#!/bin/sh
# Generates the rdma.agent.v1 Python stubs (messages + gRPC) as the package
# rdma_agent._proto.rdma.agent.v1 under OUT_DIR (OUT_DIR/rdma_agent/_proto/...),
# with their imports rewritten to that package, so that nothing lands in a
# top-level `rdma` package:
#   client/python/generate_stubs.sh client/python      # a working tree
#   PYTHONPATH=client/python /usr/bin/python3 -c 'import rdma_agent'
# Needs protoc and grpc_python_plugin (Debian: protobuf-compiler,
# protobuf-compiler-grpc). Bazel runs the same script (//client/python:stubs).
set -eu
out="$1"
root="${2:-$(dirname "$0")/../../proto}"
stubs="$out/rdma_agent/_proto"
mkdir -p "$stubs/rdma/agent/v1"
protoc -I"$root" \
  --python_out="$stubs" \
  --pyi_out="$stubs" \
  --grpc_python_out="$stubs" \
  --plugin=protoc-gen-grpc_python="$(command -v grpc_python_plugin)" \
  "$root/rdma/agent/v1/types.proto" \
  "$root/rdma/agent/v1/agent.proto" \
  "$root/rdma/agent/v1/attach.proto" \
  "$root/rdma/agent/v1/remote_buffer.proto"
for file in "$stubs"/rdma/agent/v1/*.py; do
  sed -i 's/^from rdma\.agent\.v1 import /from rdma_agent._proto.rdma.agent.v1 import /' "$file"
done
for package in "$stubs" "$stubs/rdma" "$stubs/rdma/agent" "$stubs/rdma/agent/v1"; do
  echo '"""Generated from proto/rdma/agent/v1 by generate_stubs.sh."""' >"$package/__init__.py"
done
