#!/bin/bash
# A few seconds of every rdma-agent-bench test between two agents on
# loopback (no namespaces, no root, no iperf3/ucx_perftest), then
# summarize.py over that output: the bench and compare.sh's table keep
# working. Measures nothing.
set -euo pipefail
RUNFILES="${TEST_SRCDIR}/rdma_agentd"
AGENTD="$RUNFILES/daemon/rdma-agentd"
BENCH="$RUNFILES/bench/rdma-agent-bench"
SUMMARIZE="$RUNFILES/bench/summarize.py"

# Unix socket paths must stay short: not under TEST_TMPDIR.
WORK="$(mktemp -d /tmp/rdma-bench-smoke.XXXXXX)"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

for side in a b; do
  mkdir -p "$WORK/$side"
  "$AGENTD" --runtime_dir="$WORK/$side" --state_dir="$WORK/$side" \
    --backends=memory,tcp --tcp_listen=127.0.0.1:0 --peer_listen=127.0.0.1:0 \
    --advertise_host=127.0.0.1 --log_level=warn >"$WORK/agentd-$side.log" 2>&1 &
  PIDS+=($!)
done
for side in a b; do
  for _ in $(seq 1 300); do [[ -e "$WORK/$side/agent.sock" ]] && break; sleep 0.1; done
done

mkdir -p "$WORK/round-1"
status=0
"$BENCH" --local="unix://$WORK/a/agent.sock" --remote="unix://$WORK/b/agent.sock" \
  --seconds=0.1 --latency_iterations=20 --warmup_iterations=5 \
  --size=$((4 << 20)) --clients=2 --socket_passes=2 \
  >"$WORK/round-1/bench.txt" || status=$?
cat "$WORK/round-1/bench.txt"
if [[ $status -ne 0 ]]; then
  echo "FAIL: rdma-agent-bench exited $status"
  cat "$WORK"/agentd-*.log
  exit 1
fi
for line in info lat_getinfo lat_tcp_rtt lat_read lat_write lat_floor \
    ops_write ops_read async_write kv_write kv_read bulk_write bulk_read \
    mem_write prepared_contexts prepared_handles prepared_prepared prepared_ratio \
    ring_getinfo ring_submit_mem_write ring_mem_write ring_ratio \
    ring_mem_ops_submit_write ring_mem_ops_write ring_mem_ops_ratio \
    ring_prepared_submit_contexts ring_prepared ring_prepared_ratio \
    ring_tcp_rtt ring_submit_tcp_write ring_tcp_write ring_tcp_read ring_tcp_ratio \
    ring_tcp_ops_submit_write ring_tcp_ops_write ring_tcp_ops_ratio \
    register_release getinfo_x2 register_ratio clients_write \
    socket_cold socket_hot; do
  grep -q "^$line " "$WORK/round-1/bench.txt" || { echo "FAIL: no $line line"; exit 1; }
done
if grep -q "failed=" "$WORK/round-1/bench.txt"; then echo "FAIL: a test failed"; exit 1; fi
grep -q "^async_write .*ops_per_s=" "$WORK/round-1/bench.txt" ||
  { echo "FAIL: async_write measured nothing"; exit 1; }

printf 'date=now\nload_start=0\nload_end=0\nnproc=1\nrounds=1\nstreams=2\nagent_flags=\n' \
  >"$WORK/meta.txt"
/usr/bin/python3 "$SUMMARIZE" "$WORK" >"$WORK/table.txt"
cat "$WORK/table.txt"
grep -q "^| 8 B READ latency" "$WORK/table.txt" || { echo "FAIL: no table"; exit 1; }
echo PASS
