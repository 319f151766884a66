#!/usr/bin/env bash
# rdma-agentd next to the tools it is judged by, in one run on one machine,
# between two network namespaces joined by a veth pair (two "hosts"):
#
#   namespace A (10.77.0.1)                    namespace B (10.77.0.2)
#   rdma-agentd A  <── tcp data plane ──>      rdma-agentd B
#   rdma-agent-bench (client of A; registers   rdma-agent-bench --serve_socket_peer
#     its remote buffers through B's socket)     (TCP ping-pong and sink)
#   iperf3 -c, ucx_perftest client             iperf3 -s, ucx_perftest server
#
# Each round runs every tool once, each peer right before the bench tests it
# is compared with, so that the noise of a shared machine hits both alike:
#   UCX_TLS=tcp ucx_perftest -t ucp_put_lat -s 8   then  bench latency
#   ucx_perftest -t ucp_put_bw -s 4096             then  bench ops, async
#     and bench ring_tcp (the ring's 8 B latency and 4 KiB WRITE rate over
#     tcp, each beside the same run's Submit)
#   iperf3 -l 1M: 1 stream, N streams (N = the agent's tcp
#     connections_per_peer) and N processes of 1 stream at once (iperf3 3.12
#     runs one process on one thread)              then  bench kv, bulk, socket
#   bench memory, prepared, ring, register, clients, and
#     bench/python_ring_bench.py (their references are in the bench)
#   bench ring_idle: agent A's CPU (/proc/PID/stat) while 8 ring sessions
#     idle for 10 s (the agents allow 16 sessions per user for it; the
#     default is 4)
# The table (bench/summarize.py) shows each figure's best round, each ratio
# as the median of the rounds' own ratios, and every round.
#
# Usage: bench/compare.sh [--bin_dir DIR] [--seconds N] [--rounds N]
#                         [--netns PREFIX] [--keep DIR]
#                         [-- extra rdma-agentd flags, e.g. --tcp_chunk_bytes=N]
#   --seconds   length of each iperf3 run and of each bench throughput test
#   --netns     namespaces PREFIX-a/PREFIX-b, veth PREFIX-va/PREFIX-vb (rat)
#   --keep      copy the raw outputs (agent logs, bench, iperf3, ucx) there
#   Binaries come from DIR, else from the runfiles of
#   `bazel run -c opt //bench:compare`, else from an optimised build made
#   here (`bazel build -c opt ...`, then `bazel info -c opt bazel-bin`).
#   Needs root (namespaces), iproute2, iperf3 and ucx-utils (Debian
#   packages) and /usr/bin/python3.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR=""
SECONDS_PER_TEST=3
ROUNDS=3
PREFIX=rat
KEEP=""
AGENT_FLAGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bin_dir) BIN_DIR="$2"; shift 2 ;;
    --seconds) SECONDS_PER_TEST="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --netns) PREFIX="$2"; shift 2 ;;
    --keep) KEEP="$2"; shift 2 ;;
    --) shift; AGENT_FLAGS=("$@"); break ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ $(id -u) -eq 0 ]] || { echo "compare.sh creates network namespaces: run it as root" >&2; exit 1; }

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUNFILES="${BASH_SOURCE[0]}.runfiles/rdma_agentd"
if [[ -z "$BIN_DIR" && -x "$RUNFILES/daemon/rdma-agentd" ]]; then
  # bazel run -c opt //bench:compare
  BIN_DIR="$RUNFILES"
  SCRIPT_DIR="$RUNFILES/bench"
elif [[ -z "$BIN_DIR" ]]; then
  (cd "$ROOT" && bazel build -c opt //daemon:rdma-agentd //bench:rdma-agent-bench \
     //client/python:stubs >&2)
  BIN_DIR="$(cd "$ROOT" && bazel info -c opt bazel-bin 2>/dev/null)"
fi
AGENTD="$BIN_DIR/daemon/rdma-agentd"
BENCH="$BIN_DIR/bench/rdma-agent-bench"
SUMMARIZE="$SCRIPT_DIR/summarize.py"
for tool in ip iperf3 ucx_perftest /usr/bin/python3 "$AGENTD" "$BENCH" "$SUMMARIZE"; do
  command -v "$tool" >/dev/null || [[ -e "$tool" ]] || { echo "missing: $tool" >&2; exit 1; }
done

# The rdma_agent package for python_ring_bench.py: the runfiles hold it whole;
# otherwise the sources with the stubs generated into BIN_DIR, copied
# together into the work dir below.
PY_SOURCES="$ROOT/client/python/rdma_agent"
[[ -d "$BIN_DIR/client/python/rdma_agent/_proto" ]] ||
  { echo "missing: the rdma_agent stubs (bazel build -c opt //client/python:stubs)" >&2; exit 1; }

NS_A="$PREFIX-a"; NS_B="$PREFIX-b"
DEV_A="$PREFIX-va"; DEV_B="$PREFIX-vb"
ADDR_A=10.77.0.1; ADDR_B=10.77.0.2
SOCKET_PEER_PORT=7479
for ns in "$NS_A" "$NS_B"; do
  if ip netns list | awk '{print $1}' | grep -qxF "$ns"; then
    echo "network namespace $ns exists: another compare.sh running? (else: ip netns delete $ns)" >&2
    exit 1
  fi
done

WORK="$(mktemp -d /tmp/rdma-bench.XXXXXX)"
if [[ "$BIN_DIR" == "$RUNFILES" ]]; then
  PY_PATH="$RUNFILES/client/python"
else
  PY_PATH="$WORK/python"
  mkdir -p "$PY_PATH"
  cp -r "$PY_SOURCES" "$PY_PATH/"
  cp -r "$BIN_DIR/client/python/rdma_agent/_proto" "$PY_PATH/rdma_agent/"
fi
PIDS=()
cleanup() {
  local status=$?
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  ip netns delete "$NS_A" 2>/dev/null || true  # takes the veth pair with it
  ip netns delete "$NS_B" 2>/dev/null || true
  if [[ -n "$KEEP" ]]; then mkdir -p "$KEEP" && cp -r "$WORK"/. "$KEEP"/; fi
  rm -rf "$WORK"
  exit $status
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The two "hosts".
ip netns add "$NS_A"
ip netns add "$NS_B"
ip link add "$DEV_A" netns "$NS_A" type veth peer name "$DEV_B" netns "$NS_B"
ip -n "$NS_A" addr add "$ADDR_A/24" dev "$DEV_A"
ip -n "$NS_B" addr add "$ADDR_B/24" dev "$DEV_B"
for pair in "$NS_A $DEV_A" "$NS_B $DEV_B"; do
  set -- $pair
  ip -n "$1" link set lo up
  ip -n "$1" link set "$2" up
done
# Commands run in a namespace through these (arrays, not functions: a
# background "${IN_B[@]}" cmd & leaves $! naming cmd itself, since ip execs
# it, so the cleanup's kill reaches it).
IN_A=(ip netns exec "$NS_A")
IN_B=(ip netns exec "$NS_B")

# Waits (bounded) for a file to appear.
wait_for() {
  for _ in $(seq 1 300); do [[ -e "$1" ]] && return 0; sleep 0.1; done
  echo "timed out waiting for $1" >&2; return 1
}

# The rdma-agentd pair and the bench's TCP peer, started once.
start_agent() {  # side namespace address
  mkdir -p "$WORK/$1"
  ip netns exec "$2" "$AGENTD" --runtime_dir="$WORK/$1" --state_dir="$WORK/$1" \
    --backends=memory,tcp --tcp_listen="$3:7471" --peer_listen="$3:7470" \
    --advertise_host="$3" --log_level=warn --max_ring_sessions_per_user=16 \
    ${AGENT_FLAGS[@]+"${AGENT_FLAGS[@]}"} \
    >"$WORK/agentd-$1.log" 2>&1 &
  PIDS+=($!)
}
start_agent a "$NS_A" "$ADDR_A"
AGENT_A_PID="${PIDS[-1]}"  # ip netns exec execs the agent: its own pid
start_agent b "$NS_B" "$ADDR_B"
"${IN_B[@]}" "$BENCH" --serve_socket_peer="$ADDR_B:$SOCKET_PEER_PORT" >"$WORK/socket-peer.log" 2>&1 &
PIDS+=($!)
wait_for "$WORK/a/agent.sock"
wait_for "$WORK/b/agent.sock"

BENCH_ARGS=(--local="unix://$WORK/a/agent.sock" --remote="unix://$WORK/b/agent.sock"
            --socket_peer="$ADDR_B:$SOCKET_PEER_PORT" --seconds="$SECONDS_PER_TEST")
"${IN_A[@]}" "$BENCH" "${BENCH_ARGS[@]}" --tests=info >"$WORK/info.txt"
STREAMS="$(sed -n 's/.*tcp_connections_per_peer=\([0-9]*\).*/\1/p' "$WORK/info.txt")"
[[ -n "$STREAMS" ]] || { echo "agent A reports no tcp connections_per_peer" >&2; cat "$WORK/info.txt" >&2; exit 1; }

PORT=5200
# iperf3 -l 1M: `processes` clients at once, each with `streams` streams;
# client k writes output.json.k. (iperf3 before 3.16, Debian 12's 3.12
# included, runs all the streams of one process on one thread: -P N does not
# use N cores, N processes do.)
iperf_once() {  # processes streams output.json
  local servers=() clients=() k
  for k in $(seq 1 "$1"); do
    PORT=$((PORT + 1))
    "${IN_B[@]}" iperf3 -s -1 -p "$PORT" >"$WORK/iperf3-server.log" 2>&1 &
    servers+=($!)
    PIDS+=($!)
  done
  sleep 0.5
  for k in $(seq 1 "$1"); do
    "${IN_A[@]}" iperf3 -c "$ADDR_B" -p "$((PORT - $1 + k))" -l 1M -P "$2" \
      -t "$SECONDS_PER_TEST" -J >"$3.$k" &
    clients+=($!)
  done
  for pid in "${clients[@]}" "${servers[@]}"; do wait "$pid" 2>/dev/null || true; done
}

# ucx_perftest picks its devices from UCX_NET_DEVICES: only the veth.
ucx_once() {  # output.log ucx_perftest-args...
  local out="$1"; shift
  PORT=$((PORT + 1))
  "${IN_B[@]}" env UCX_TLS=tcp UCX_NET_DEVICES="$DEV_B" timeout 120 ucx_perftest -p "$PORT" \
    >"$out.server" 2>&1 &
  local server=$!
  PIDS+=($server)
  sleep 1
  "${IN_A[@]}" env UCX_TLS=tcp UCX_NET_DEVICES="$DEV_A" timeout 120 ucx_perftest "$ADDR_B" \
    -p "$PORT" "$@" >"$out" 2>&1 || true
  wait "$server" 2>/dev/null || true
}

bench_part() {  # round-dir tests: appends to round-dir/bench.txt
  "${IN_A[@]}" "$BENCH" "${BENCH_ARGS[@]}" --tests="$2" >>"$1/bench.txt" 2>>"$1/bench.err" || true
}

python_ring_part() {  # round-dir: the Python ring's rows, appended likewise
  "${IN_A[@]}" env PYTHONPATH="$PY_PATH" PYTHONDONTWRITEBYTECODE=1 /usr/bin/python3 \
    "$SCRIPT_DIR/python_ring_bench.py" --socket="$WORK/a/agent.sock" \
    >>"$1/bench.txt" 2>>"$1/bench.err" || echo "py_ring_mem_write failed=exit $?" >>"$1/bench.txt"
}

# Agent A's CPU time (user + system clock ticks) from /proc.
agent_ticks() { awk '{print $14 + $15}' "/proc/$AGENT_A_PID/stat"; }

ring_idle_part() {  # round-dir: agent A's CPU while 8 ring sessions idle
  local out="$1/ring_idle.txt" start end
  "${IN_A[@]}" "$BENCH" "${BENCH_ARGS[@]}" --seconds=10 --tests=ring_idle >"$out" \
    2>>"$1/bench.err" &
  local bench=$!
  for _ in $(seq 1 300); do grep -q ring_idle_start "$out" && break; sleep 0.1; done
  start="$(agent_ticks)"
  wait "$bench" || true
  end="$(agent_ticks)"
  if grep -q ring_idle_end "$out"; then
    # The bench idles 10 s between the two lines; the ticks also hold the
    # few ms of its last report and of the sessions closing.
    echo "ring_idle cpu_percent=$(awk -v t=$((end - start)) -v hz="$(getconf CLK_TCK)" \
      'BEGIN {printf "%.2f", 100 * t / hz / 10}')" >>"$1/bench.txt"
  else
    echo "ring_idle failed=1" >>"$1/bench.txt"
  fi
}

load() { cut -d' ' -f1-3 /proc/loadavg; }
{
  echo "date=$(date -u +%Y-%m-%dT%H:%MZ)"
  echo "load_start=$(load)"
  echo "nproc=$(nproc)"
  echo "rounds=$ROUNDS"
  echo "streams=$STREAMS"
  echo "agent_flags=${AGENT_FLAGS[*]+"${AGENT_FLAGS[*]}"}"
} >"$WORK/meta.txt"

for round in $(seq 1 "$ROUNDS"); do
  R="$WORK/round-$round"
  mkdir -p "$R"
  echo "round $round/$ROUNDS: iperf3, ucx_perftest, rdma-agent-bench" >&2
  # Each peer runs right before the bench tests it is compared with.
  ucx_once "$R/ucx_lat.log" -t ucp_put_lat -s 8 -n 20000
  bench_part "$R" latency
  ucx_once "$R/ucx_bw.log" -t ucp_put_bw -s 4096 -n 300000
  bench_part "$R" ops,async,ring_tcp
  iperf_once 1 1 "$R/iperf1.json"
  iperf_once 1 "$STREAMS" "$R/iperfN.json"
  iperf_once "$STREAMS" 1 "$R/iperfNproc.json"
  bench_part "$R" kv,bulk,socket
  bench_part "$R" memory,prepared,ring,register,clients
  python_ring_part "$R"
  ring_idle_part "$R"
done
echo "load_end=$(load)" >>"$WORK/meta.txt"

echo
cat "$WORK/info.txt"
/usr/bin/python3 "$SUMMARIZE" "$WORK"
