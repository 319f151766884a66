#!/usr/bin/env bash
# Side-by-side bandwidth on loopback, in one run on one machine:
#   iperf3 -l 1M, single stream            (the TCP ceiling)
#   ucx_perftest, UCX_TLS=tcp, 1 MiB put and get
#   rdma-agent-bench between two rdma-agentd (tcp backend)
# then prints a table and the ratios the TCP backend is held to:
#   256 MiB write and read >= 0.9x iperf3; 1 MiB put/get >= 3x ucx_perftest.
#
# Usage: bench/compare.sh [--bin_dir DIR] [--seconds N] [--rounds N]
#                         [-- extra rdma-agentd flags, e.g. --tcp_chunk_bytes=N]
#   Each round runs iperf3 (N seconds), ucx_perftest put and get and the bench
#   once, interleaved; the table shows each tool's best round.
#   Binaries come from DIR, else from the runfiles of
#   `bazel run -c opt //bench:compare`, else from an optimised build made
#   here (`bazel build -c opt ...`, then `bazel info -c opt bazel-bin`).
#   Needs iperf3 and ucx-utils (Debian packages) and python3.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR=""
SECONDS_PER_TEST=3
ROUNDS=3
AGENT_FLAGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bin_dir) BIN_DIR="$2"; shift 2 ;;
    --seconds) SECONDS_PER_TEST="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --) shift; AGENT_FLAGS=("$@"); break ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

RUNFILES="${BASH_SOURCE[0]}.runfiles/rdma_agentd"
if [[ -z "$BIN_DIR" && -x "$RUNFILES/daemon/rdma-agentd" ]]; then
  # bazel run -c opt //bench:compare
  BIN_DIR="$RUNFILES"
elif [[ -z "$BIN_DIR" ]]; then
  (cd "$ROOT" && bazel build -c opt //daemon:rdma-agentd //bench:rdma-agent-bench >&2)
  BIN_DIR="$(cd "$ROOT" && bazel info -c opt bazel-bin 2>/dev/null)"
fi
AGENTD="$BIN_DIR/daemon/rdma-agentd"
BENCH="$BIN_DIR/bench/rdma-agent-bench"
for tool in iperf3 ucx_perftest "$AGENTD" "$BENCH"; do
  command -v "$tool" >/dev/null || { echo "missing: $tool" >&2; exit 1; }
done

WORK="$(mktemp -d /tmp/rdma-bench.XXXXXX)"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

# A free TCP port on loopback.
free_port() {
  /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Waits (bounded) for a file to appear.
wait_for() {
  for _ in $(seq 1 300); do [[ -e "$1" ]] && return 0; sleep 0.1; done
  echo "timed out waiting for $1" >&2; return 1
}

# Each round runs every tool once, interleaved, so that the noise of a shared
# 2-core machine hits all of them alike; each figure is the best round.
best() { /usr/bin/python3 -c 'import sys; v=[float(x) for x in sys.argv[1:] if x]; print("%.1f" % max(v) if v else "nan")' "$@"; }

iperf_once() {
  local port
  port="$(free_port)"
  iperf3 -s -1 -p "$port" >"$WORK/iperf3-server.log" 2>&1 &
  local server=$!
  PIDS+=($server)
  sleep 0.5
  iperf3 -c 127.0.0.1 -p "$port" -l 1M -t "$SECONDS_PER_TEST" -J >"$WORK/iperf3.json"
  wait "$server" 2>/dev/null || true
  /usr/bin/python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("%.1f" % (d["end"]["sum_received"]["bits_per_second"]/8/2**20))' "$WORK/iperf3.json"
}

ucx_once() {  # test name -> overall bandwidth (ucx_perftest's "MB/s" = MiB/s)
  local test="$1" port
  port="$(free_port)"
  UCX_TLS=tcp ucx_perftest -p "$port" >"$WORK/ucx-server-$test.log" 2>&1 &
  local server=$!
  PIDS+=($server)
  sleep 1
  UCX_TLS=tcp ucx_perftest 127.0.0.1 -p "$port" -t "$test" -s 1048576 -n 2000 \
    >"$WORK/ucx-$test.log" 2>&1
  wait "$server" 2>/dev/null || true
  awk '/^Final:/ {print $7}' "$WORK/ucx-$test.log"
}

# The rdma-agentd pair, started once.
for side in a b; do
  mkdir -p "$WORK/$side"
  "$AGENTD" --runtime_dir="$WORK/$side" --state_dir="$WORK/$side" --backends=memory,tcp \
    --tcp_listen=127.0.0.1:0 --peer_listen=127.0.0.1:0 \
    --advertise_host=127.0.0.1 --log_level=warn ${AGENT_FLAGS[@]+"${AGENT_FLAGS[@]}"} \
    >"$WORK/agentd-$side.log" 2>&1 &
  PIDS+=($!)
done
wait_for "$WORK/a/agent.sock"
wait_for "$WORK/b/agent.sock"

value() { awk -v name="$1" '$1 ~ "^"name {print $4}' "$2"; }
IPERF=(); UCX_PUT=(); UCX_GET=(); WRITE=(); READ=(); PUT=(); GET=(); COLD=(); HOT=()
for round in $(seq 1 "$ROUNDS"); do
  IPERF+=("$(iperf_once)")
  UCX_PUT+=("$(ucx_once ucp_put_bw)")
  UCX_GET+=("$(ucx_once ucp_get)")
  "$BENCH" --local="unix://$WORK/a/agent.sock" --remote="unix://$WORK/b/agent.sock" \
    >"$WORK/bench-$round.txt"
  WRITE+=("$(value write_ "$WORK/bench-$round.txt")")
  READ+=("$(value read_ "$WORK/bench-$round.txt")")
  PUT+=("$(value put_ "$WORK/bench-$round.txt")")
  GET+=("$(value get_ "$WORK/bench-$round.txt")")
  COLD+=("$(value socket_cold "$WORK/bench-$round.txt")")
  HOT+=("$(value socket_hot "$WORK/bench-$round.txt")")
  echo "round $round (MiB/s): iperf3 ${IPERF[-1]}  ucx put ${UCX_PUT[-1]} get ${UCX_GET[-1]}  agent write ${WRITE[-1]} read ${READ[-1]} put ${PUT[-1]} get ${GET[-1]}  socket cold ${COLD[-1]} hot ${HOT[-1]}"
done
IPERF_MIBS="$(best "${IPERF[@]}")"
UCX_PUT="$(best "${UCX_PUT[@]}")"; UCX_GET="$(best "${UCX_GET[@]}")"
WRITE="$(best "${WRITE[@]}")"; READ="$(best "${READ[@]}")"
PUT="$(best "${PUT[@]}")"; GET="$(best "${GET[@]}")"
COLD="$(best "${COLD[@]}")"; HOT="$(best "${HOT[@]}")"

ratio() { /usr/bin/python3 -c 'import sys; print("%.2f" % (float(sys.argv[1])/float(sys.argv[2])))' "$1" "$2"; }
echo
printf '%-34s %12s %12s %8s %s\n' "test" "rdma-agentd" "peer" "ratio" "target"
printf '%-34s %12s %12s %8s %s\n' "256 MiB write vs iperf3 -l 1M" "$WRITE" "$IPERF_MIBS" "$(ratio "$WRITE" "$IPERF_MIBS")" ">= 0.90"
printf '%-34s %12s %12s %8s %s\n' "256 MiB read  vs iperf3 -l 1M" "$READ" "$IPERF_MIBS" "$(ratio "$READ" "$IPERF_MIBS")" ">= 0.90"
printf '%-34s %12s %12s %8s %s\n' "1 MiB put vs ucx_perftest put_bw" "$PUT" "$UCX_PUT" "$(ratio "$PUT" "$UCX_PUT")" ">= 3.00"
printf '%-34s %12s %12s %8s %s\n' "1 MiB get vs ucx_perftest get" "$GET" "$UCX_GET" "$(ratio "$GET" "$UCX_GET")" ">= 3.00"
echo
echo "References (no agent; one loopback TCP stream in rdma-agent-bench, send/recv 1 MiB calls):"
printf '%-34s %12s\n' "socket, 256 MiB cold buffers" "$COLD"
printf '%-34s %12s\n' "socket, 1 MiB hot buffer" "$HOT"
printf '%-34s %12s %8s\n' "256 MiB write vs cold socket" "$WRITE" "$(ratio "$WRITE" "$COLD")"
printf '%-34s %12s %8s\n' "256 MiB read  vs cold socket" "$READ" "$(ratio "$READ" "$COLD")"
echo "(MiB/s, best of $ROUNDS rounds; $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%Y-%m-%dT%H:%MZ))"
