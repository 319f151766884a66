#!/usr/bin/env bash
# Installs what is missing, builds rdma-agentd and runs it in the foreground
# with defaults (socket unix:///run/rdma-agentd/agent.sock). Extra arguments
# are passed to rdma-agentd, e.g. tools/run.sh --log_level=debug.
set -euo pipefail
cd "$(dirname "$0")/.."

tools/install-deps.sh
# Users run optimized builds (tests build the default fastbuild), stamped
# with the revision --version reports.
bazel build -c opt --config=release //daemon:rdma-agentd //client:rdma-agentctl
mkdir -p bin
install -m 0755 bazel-out/k8-opt/bin/daemon/rdma-agentd \
  bazel-out/k8-opt/bin/client/rdma-agentctl bin/

cat <<'MSG'
rdma-agentd is starting in the foreground (Ctrl-C stops it). From another shell:
  bin/rdma-agentctl info
  bin/rdma-agentctl register --size 4096 --access read_write
MSG
exec bin/rdma-agentd "$@"
