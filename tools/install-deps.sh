#!/usr/bin/env bash
# Installs the Debian 12 packages rdma-agentd needs to build, run and test.
# Idempotent: does nothing when everything is already there.
set -euo pipefail

PACKAGES=(
  bazel-bootstrap bazel-rules-java
  g++ libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libibverbs-dev rdma-core ibverbs-utils libnuma-dev
  libspdlog-dev libabsl-dev libgtest-dev libgmock-dev libcli11-dev libsystemd-dev prometheus-cpp-dev libcivetweb-dev
  iproute2 procps python3 python3-grpcio python3-protobuf python3-yaml systemd
  python3-build python3-setuptools python3-venv python3-wheel python3-torch python3-numpy mypy
  iperf3 ucx-utils prometheus groff-base bsdextrautils
  etcd-server etcd-client
  clang-14 libclang-rt-14-dev clang-format-14
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "install-deps: missing packages: ${missing[*]} (run as root to install)" >&2
    exit 1
  fi
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Grafana's own dashboard schema (its TypeScript types) and the TypeScript
# compiler, from the npm registry: //tests/deploy:grafana_dashboard_test
# type-checks deploy/monitoring/grafana-dashboard.json against them, as no
# Grafana server is packaged for Debian. Pinned; installed once.
NODE_TOOLS=/usr/local/lib/rdma-agentd/node-tools
NODE_PACKAGES=(typescript@5.9.3 @grafana/schema@13.2.3)
if ! command -v npm >/dev/null; then
  if [[ $(id -u) -ne 0 ]]; then
    echo "install-deps: missing npm (run as root to install)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
if [[ ! -f "$NODE_TOOLS/.installed" ]] ||
   [[ "$(cat "$NODE_TOOLS/.installed")" != "${NODE_PACKAGES[*]}" ]]; then
  if [[ $(id -u) -ne 0 ]]; then
    echo "install-deps: missing $NODE_TOOLS (run as root to install)" >&2
    exit 1
  fi
  echo "install-deps: installing ${NODE_PACKAGES[*]} into $NODE_TOOLS"
  mkdir -p "$NODE_TOOLS"
  npm install --prefix "$NODE_TOOLS" --no-audit --no-fund --silent \
    "${NODE_PACKAGES[@]}"
  echo "${NODE_PACKAGES[*]}" > "$NODE_TOOLS/.installed"
fi
