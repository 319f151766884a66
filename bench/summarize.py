#!/usr/bin/python3
"""Prints compare.sh's table from the files one run left in its work dir.

Usage: summarize.py WORK_DIR

WORK_DIR holds meta.txt (key=value lines) and one directory per round,
round-1, round-2, ...: bench.txt (rdma-agent-bench's "name key=value" lines),
iperf1.json.1, iperfN.json.1 and iperfNproc.json.1..N (iperf3 -J: 1 stream,
N streams, N processes of 1 stream), ucx_lat.log and ucx_bw.log
(ucx_perftest). Each figure of the table is the best round (highest rate,
lowest latency); each ratio is the median of the rounds' own ratios (the
tools of one round ran minutes apart at most, so share its noise), with
their range. Every round is printed too.
"""

import glob
import json
import os
import re
import sys


def read_meta(work):
    meta = {}
    with open(os.path.join(work, "meta.txt")) as f:
        for line in f:
            key, _, value = line.rstrip("\n").partition("=")
            meta[key] = value
    return meta


def read_bench(path):
    """{line name: {key: value}} from rdma-agent-bench's output."""
    lines = {}
    if not os.path.exists(path):
        return lines
    with open(path) as f:
        for line in f:
            words = line.split()
            if not words:
                continue
            fields = {}
            if len(words) > 1 and words[1].startswith("failed="):
                fields["failed"] = line.split("failed=", 1)[1].strip()
                lines[words[0]] = fields
                continue
            for word in words[1:]:
                key, sep, value = word.partition("=")
                if sep:
                    fields[key] = value
            lines[words[0]] = fields
    return lines


def read_iperf(path):
    """MiB/s received by every client of one run (path.1, path.2, ...)."""
    total = 0.0
    files = glob.glob(path + ".*")
    try:
        for name in files:
            with open(name) as f:
                data = json.load(f)
            total += data["end"]["sum_received"]["bits_per_second"] / 8 / 2**20
    except (OSError, ValueError, KeyError):
        return None
    return total if files else None


def read_ucx(path):
    """ucx_perftest's Final line: {p50_us, avg_us, MiB_per_s, msg_per_s}."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("Final:"):
                    v = line.split()
                    # Final: iters p50 avg overall bw_avg bw_overall mr_avg mr_overall
                    return {"p50_us": float(v[2]), "avg_us": float(v[3]),
                            "MiB_per_s": float(v[6]), "msg_per_s": float(v[8])}
    except (OSError, ValueError, IndexError):
        pass
    return None


def number(fields, key):
    try:
        return float(fields[key])
    except (KeyError, TypeError, ValueError):
        return None


class Rounds:
    """Every round's value of each measure, by name."""

    def __init__(self, work):
        self.rounds = []
        dirs = sorted(glob.glob(os.path.join(work, "round-*")),
                      key=lambda d: int(d.rsplit("-", 1)[1]))
        for d in dirs:
            bench = read_bench(os.path.join(d, "bench.txt"))
            values = {}
            for name, fields in bench.items():
                for key, value in fields.items():
                    try:
                        values[f"{name}.{key}"] = float(value)
                    except ValueError:
                        values[f"{name}.{key}"] = value
            values["iperf1"] = read_iperf(os.path.join(d, "iperf1.json"))
            values["iperfN"] = read_iperf(os.path.join(d, "iperfN.json"))
            values["iperfNproc"] = read_iperf(os.path.join(d, "iperfNproc.json"))
            lat = read_ucx(os.path.join(d, "ucx_lat.log")) or {}
            bw = read_ucx(os.path.join(d, "ucx_bw.log")) or {}
            values["ucx_lat.p50_us"] = lat.get("p50_us")
            values["ucx_bw.msg_per_s"] = bw.get("msg_per_s")
            self.rounds.append(values)

    def all(self, key):
        return [r.get(key) for r in self.rounds]

    def best(self, key, lowest=False):
        values = [v for v in self.all(key) if isinstance(v, float)]
        if not values:
            return None
        return min(values) if lowest else max(values)

    def ratios(self, numerator, denominator=None, scale=1.0):
        """Each round's numerator / denominator (or numerator / scale)."""
        out = []
        for values in self.rounds:
            a = values.get(numerator)
            b = values.get(denominator) if denominator else scale
            if isinstance(a, float) and isinstance(b, float) and b:
                out.append(a / b)
        return out

    def text(self, key):
        for r in self.rounds:
            if isinstance(r.get(key), str):
                return r[key]
        return None


def fmt(value, decimals=0):
    if value is None:
        return "—"
    if decimals == 0 and abs(value) >= 1000:
        return f"{value:,.0f}".replace(",", " ")
    return f"{value:.{decimals}f}"


def size_label(value):
    """4096 -> "4 KiB", 268435456 -> "256 MiB"."""
    if not isinstance(value, float):
        return "?"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift and value % (1 << shift) == 0:
            return f"{int(value) >> shift} {unit}"
    return f"{int(value)} B"


def count(value):
    return str(int(value)) if isinstance(value, float) else "?"


def ratio(a, b):
    return a / b if a is not None and b else None


def median(values):
    if not values:
        return None
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def spread(values, decimals=2):
    """"median (min–max)" of per-round ratios."""
    if not values:
        return "—"
    if len(values) == 1:
        return fmt(values[0], decimals)
    return (f"{fmt(median(values), decimals)} "
            f"({fmt(min(values), decimals)}–{fmt(max(values), decimals)})")


def verdict(value, target, higher_is_better=True):
    if value is None:
        return "—"
    met = value >= target if higher_is_better else value <= target
    return "met" if met else "not met"


def main():
    work = sys.argv[1]
    meta = read_meta(work)
    r = Rounds(work)
    n = meta.get("streams", "?")
    rows = []

    def row(measure, agent, peer, value, target, met):
        rows.append((measure, agent, peer, value, target, met))

    floor = r.best("lat_floor.p50_us", lowest=True)
    getinfo = r.best("lat_getinfo.p50_us", lowest=True)
    rtt = r.best("lat_tcp_rtt.p50_us", lowest=True)
    lat_bytes = size_label(r.best("lat_read.bytes"))
    small = size_label(r.best("ops_write.op_bytes"))
    small_batch = count(r.best("ops_write.batch"))
    for op in ("read", "write"):
        p50 = r.best(f"lat_{op}.p50_us", lowest=True)
        p99 = r.best(f"lat_{op}.p99_us", lowest=True)
        q = r.ratios(f"lat_floor.{op}_ratio", scale=1.0)
        row(f"{lat_bytes} {op.upper()} latency p50 / p99, µs",
            f"{fmt(p50, 1)} / {fmt(p99, 1)}",
            f"floor {fmt(floor, 1)} = GetInfo {fmt(getinfo, 1)} + TCP RTT {fmt(rtt, 1)}",
            spread(q), "≤ 1.3", verdict(median(q), 1.3, higher_is_better=False))
    ucx_lat = r.best("ucx_lat.p50_us", lowest=True)
    row("reference: `ucp_put_lat -s 8` p50, µs", "—",
        f"{fmt(ucx_lat, 1)} one-way (RTT/2; ≈ {fmt(ucx_lat and 2 * ucx_lat, 1)} RTT)",
        "—", "—", "—")

    ucx_bw = r.best("ucx_bw.msg_per_s")
    for op in ("write", "read"):
        ops = r.best(f"ops_{op}.ops_per_s")
        q = r.ratios(f"ops_{op}.ops_per_s", "ucx_bw.msg_per_s")
        row(f"{small} {op.upper()} × {small_batch} per Submit, ops/s", fmt(ops),
            f"`ucp_put_bw -s 4096` {fmt(ucx_bw)} msg/s", spread(q), "≥ 1.5",
            verdict(median(q), 1.5))
    # rdma-agent-bench's `async` test: 8 transfers kept in flight.
    async_ops = r.best("async_write.ops_per_s")
    q = r.ratios("async_write.ops_per_s", "ucx_bw.msg_per_s")
    row(f"async: {small} WRITE × {small_batch}, 8 transfers in flight "
        "(`async_write`)",
        fmt(async_ops) if async_ops else "not run",
        f"`ucp_put_bw -s 4096` {fmt(ucx_bw)} msg/s", spread(q), "≥ 1.5",
        verdict(median(q), 1.5))

    # The shared-memory ring, each figure beside the same run's Submit.
    ring_rtt = r.best("ring_tcp_rtt.p50_us", lowest=True)
    for op in ("write", "read"):
        p50 = r.best(f"ring_tcp_{op}.p50_us", lowest=True)
        q = r.ratios(f"ring_tcp_{op}.p50_us", "ring_tcp_rtt.p50_us")
        over = [a - b for a, b in zip(r.all(f"ring_tcp_{op}.p50_us"),
                                      r.all("ring_tcp_rtt.p50_us"))
                if isinstance(a, float) and isinstance(b, float)]
        row(f"ring: {lat_bytes} {op.upper()} over tcp p50, µs",
            f"{fmt(p50, 1)} (p50 − RTT: {fmt(median(over), 1)}, median)",
            f"TCP RTT {fmt(ring_rtt, 1)}; Submit WRITE "
            f"{fmt(r.best('ring_submit_tcp_write.p50_us', lowest=True), 1)}; "
            f"`ucp_put_lat` RTT ≈ {fmt(ucx_lat and 2 * ucx_lat, 1)}",
            spread(q) + " × RTT", "≤ RTT + 10 µs",
            verdict(median(over), 10.0, higher_is_better=False))
    q = r.ratios("ring_tcp_ratio.submit_vs_ring_write", scale=1.0)
    row(f"ring: Submit / ring, {lat_bytes} WRITE over tcp p50", "—", "—",
        spread(q), "—", "—")
    ring_batch = count(r.best("ring_tcp_ops_write.batch"))
    ring_ops = r.best("ring_tcp_ops_write.ops_per_s")
    q = r.ratios("ring_tcp_ops_ratio.ring_vs_submit", scale=1.0)
    q_async = r.ratios("ring_tcp_ops_write.ops_per_s", "async_write.ops_per_s")
    q_ucx = r.ratios("ring_tcp_ops_write.ops_per_s", "ucx_bw.msg_per_s")
    row(f"ring: {small} WRITE × {ring_batch}, 4 batches in flight, ops/s",
        fmt(ring_ops),
        f"Submit × {ring_batch} {fmt(r.best('ring_tcp_ops_submit_write.ops_per_s'))} "
        f"(ratio {spread(q)}); `ucp_put_bw` ratio {spread(q_ucx)}",
        spread(q_async) + " × async", "≥ 1.3 × async", verdict(median(q_async), 1.3))
    mem_ring = r.best("ring_mem_write.p50_us", lowest=True)
    q = r.ratios("ring_ratio.submit_vs_ring", scale=1.0)
    row(f"ring: {lat_bytes} WRITE, memory backend, p50 µs", fmt(mem_ring, 1),
        f"Submit {fmt(r.best('ring_submit_mem_write.p50_us', lowest=True), 1)} "
        f"(ratio {spread(q)})", fmt(median(
            [v for v in r.all("ring_mem_write.p50_us") if isinstance(v, float)]), 1) + " µs",
        "≤ 5 µs", verdict(median([v for v in r.all("ring_mem_write.p50_us")
                                 if isinstance(v, float)]), 5.0, higher_is_better=False))
    # The ring's memory op rate and RUN_PREPARED repost, each beside the same
    # run's Submit of the same ops.
    mem_ops = [v for v in r.all("ring_mem_ops_write.ops_per_s")
               if isinstance(v, float)]
    q = r.ratios("ring_mem_ops_ratio.ring_vs_submit", scale=1.0)
    row(f"ring: {small} WRITE × {count(r.best('ring_mem_ops_write.batch'))}, "
        "memory backend, 4 batches in flight, ops/s",
        fmt(r.best("ring_mem_ops_write.ops_per_s")),
        f"Submit × {count(r.best('ring_mem_ops_write.batch'))} "
        f"{fmt(r.best('ring_mem_ops_submit_write.ops_per_s'))} (ratio {spread(q)})",
        (fmt(median(mem_ops) / 1e6, 2) + " M") if mem_ops else "—", "≥ 2.5 M",
        verdict(median(mem_ops), 2.5e6) if mem_ops else "—")
    q = r.ratios("ring_prepared_ratio.ring_prepared_vs_contexts", scale=1.0)
    row(f"ring: prepared {size_label(r.best('ring_prepared.op_bytes'))} × "
        f"{count(r.best('ring_prepared.batch'))} reposted by one RUN_PREPARED "
        "entry, ops/s",
        fmt(r.best("ring_prepared.ops_per_s")),
        f"contexts in every Submit "
        f"{fmt(r.best('ring_prepared_submit_contexts.ops_per_s'))}",
        spread(q), "≥ 2", verdict(median(q), 2.0))
    py_ring = [v for v in r.all("py_ring_mem_write.p50_us") if isinstance(v, float)]
    q = r.ratios("py_ring_ratio.submit_vs_ring", scale=1.0)
    row(f"Python ring: {lat_bytes} WRITE, memory backend, p50 µs",
        fmt(r.best("py_ring_mem_write.p50_us", lowest=True), 1),
        f"Python submit "
        f"{fmt(r.best('py_submit_mem_write.p50_us', lowest=True), 1)} (ratio {spread(q)})",
        fmt(median(py_ring), 1) + " µs", "≤ 20 µs",
        verdict(median(py_ring), 20.0, higher_is_better=False))
    py_auto = [v for v in r.all("py_auto_mem_write.p50_us") if isinstance(v, float)]
    q = r.ratios("py_ring_ratio.submit_vs_auto", scale=1.0)
    row(f"Python submit() through its own ring: {lat_bytes} WRITE, memory, p50 µs",
        fmt(r.best("py_auto_mem_write.p50_us", lowest=True), 1),
        f"Python submit over gRPC "
        f"{fmt(r.best('py_submit_mem_write.p50_us', lowest=True), 1)} (ratio {spread(q)})",
        (fmt(median(py_auto), 1) + " µs") if py_auto else "—", "≤ 20 µs",
        verdict(median(py_auto), 20.0, higher_is_better=False) if py_auto else "—")
    idle = [v for v in r.all("ring_idle.cpu_percent") if isinstance(v, float)]
    row("ring: agent CPU with 8 idle sessions, % of a core over 10 s",
        fmt(median(idle), 2) if idle else "—", "—",
        " / ".join(fmt(v, 2) for v in idle) or "—", "< 1 %",
        verdict(median(idle), 1.0, higher_is_better=False) if idle else "—")
    q = r.ratios("prepared_ratio.prepared_vs_contexts", scale=1.0)
    row(f"prepared {size_label(r.best('prepared_prepared.op_bytes'))} × "
        f"{count(r.best('prepared_prepared.batch'))} reposted, ops/s",
        fmt(r.best("prepared_prepared.ops_per_s")),
        f"contexts in every Submit {fmt(r.best('prepared_contexts.ops_per_s'))}; "
        f"handles {fmt(r.best('prepared_handles.ops_per_s'))}",
        spread(q), "≥ 2", verdict(median(q), 2.0))

    iperf_n = r.best("iperfN")
    iperf_nproc = r.best("iperfNproc")
    kv = (f"{size_label(r.best('kv_write.op_bytes'))} × "
          f"{count(r.best('kv_write.batch'))} per Submit")
    bulk = f"{size_label(r.best('bulk_write.op_bytes'))} per Submit"
    for prefix, label, target in (("kv", kv, 0.9), ("bulk", bulk, 1.0)):
        for op in ("write", "read"):
            mibs = r.best(f"{prefix}_{op}.MiB_per_s")
            q = r.ratios(f"{prefix}_{op}.MiB_per_s", "iperfN")
            q_proc = r.ratios(f"{prefix}_{op}.MiB_per_s", "iperfNproc")
            row(f"{label} {op.upper()}, MiB/s", fmt(mibs),
                f"`iperf3 -P {n}` {fmt(iperf_n)}; {n} × `iperf3` "
                f"{fmt(iperf_nproc)} (ratio {spread(q_proc)})", spread(q),
                f"≥ {target:.1f}", verdict(median(q), target))

    mem = r.best("mem_write.ops_per_s")
    mem_label = (f"{size_label(r.best('mem_write.op_bytes'))} × "
                 f"{count(r.best('mem_write.batch'))}")
    q = r.ratios("mem_write.ops_per_s", scale=1e6)
    row(f"memory backend {mem_label} per Submit, ops/s", fmt(mem), "—",
        spread(q) + " M", "≥ 1 M", verdict(median(q), 1.0))

    reg = r.best("register_release.per_s")
    gi2 = r.best("getinfo_x2.per_s")
    q = r.ratios("register_ratio.ratio", scale=1.0)
    row(f"Register + Release {size_label(r.best('register_release.bytes'))}"
        ", per s", fmt(reg),
        f"2 × GetInfo {fmt(gi2)} per s", spread(q), "≥ 0.9",
        verdict(median(q), 0.9))

    agg = r.best("clients_write.ops_per_s")
    clients = r.text("clients_write.clients") or fmt(
        r.best("clients_write.clients"))
    # Shares of the round with the best aggregate.
    shares = "—"
    for values in r.rounds:
        if values.get("clients_write.ops_per_s") == agg and agg is not None:
            shares = (f"share min {values['clients_write.min_share']:.3f} / "
                      f"max {values['clients_write.max_share']:.3f} "
                      f"(fair {1 / values['clients_write.clients']:.3f}), "
                      f"Jain {values['clients_write.jain']:.3f}")
    single = r.best("ops_write.ops_per_s")
    row(f"{clients} clients × {small} WRITE × {small_batch} per Submit, "
        "aggregate ops/s",
        fmt(agg), f"1 client {fmt(single)}; {shares}",
        spread(r.ratios("clients_write.ops_per_s", "ops_write.ops_per_s")),
        "—", "—")

    print("Figures: the best round of each; ratio: the median of the rounds' "
          "own ratios (min–max), judged against the target.")
    print()
    print("| measure | rdma-agentd | peer / floor (same run) | ratio | target | |")
    print("|---|---:|---|---:|---|---|")
    for measure, agent, peer, value, target, met in rows:
        print(f"| {measure} | {agent} | {peer} | {value} | {target} | {met} |")

    print()
    print(f"{lat_bytes} READ latency, where the time goes "
          "(p50 µs, median of the rounds):")

    def diffs(a, b):
        out = []
        for values in r.rounds:
            x, y = values.get(a), values.get(b)
            if isinstance(x, float) and isinstance(y, float):
                out.append(x - y)
        return median(out)

    parts = [
        ("GetInfo: one gRPC unary call to agent A", "lat_getinfo.p50_us", None),
        ("Submit whose op is rejected (no backend)", "lat_submit_rejected.p50_us",
         None),
        (f"{lat_bytes} WRITE over the memory backend", "lat_mem_write.p50_us",
         None),
        (f"{lat_bytes} READ over tcp", "lat_read.p50_us", None),
        ("TCP round trip A -> B (bench ping-pong)", "lat_tcp_rtt.p50_us", None),
        ("  Submit machinery = memory op - GetInfo", "lat_mem_write.p50_us",
         "lat_getinfo.p50_us"),
        ("  tcp data plane = READ - memory op", "lat_read.p50_us",
         "lat_mem_write.p50_us"),
    ]
    for label, a, b in parts:
        value = diffs(a, b) if b else median(
            [v for v in r.all(a) if isinstance(v, float)])
        print(f"  {label:44s} {fmt(value, 1)}")

    print()
    print("References, no agent (MiB/s):")
    print(f"  iperf3 -l 1M, 1 stream            {fmt(r.best('iperf1'))}")
    print(f"  iperf3 -l 1M, -P {n}               {fmt(iperf_n)}")
    print(f"  iperf3 -l 1M, {n} processes at once {fmt(iperf_nproc)}")
    cold = size_label(r.best("socket_cold.window_bytes"))
    print(f"  socket, {n} streams, cold {cold} each   "
          f"{fmt(r.best('socket_cold.MiB_per_s'))}   (rdma-agent-bench --tests=socket)")
    print(f"  socket, {n} streams, hot 1 MiB each     "
          f"{fmt(r.best('socket_hot.MiB_per_s'))}")

    print()
    print("Every round:")
    per_round = [
        ("lat_getinfo.p50_us", "GetInfo p50 µs", 1),
        ("lat_tcp_rtt.p50_us", "TCP RTT p50 µs", 1),
        ("lat_read.p50_us", f"READ {lat_bytes} p50 µs", 1),
        ("lat_write.p50_us", f"WRITE {lat_bytes} p50 µs", 1),
        ("lat_floor.read_ratio", "READ / floor", 2),
        ("lat_floor.write_ratio", "WRITE / floor", 2),
        ("ucx_lat.p50_us", "ucp_put_lat p50 µs", 1),
        ("ops_write.ops_per_s", f"{small} WRITE ops/s", 0),
        ("ops_read.ops_per_s", f"{small} READ ops/s", 0),
        ("ucx_bw.msg_per_s", "ucp_put_bw msg/s", 0),
        ("kv_write.MiB_per_s", "kv WRITE MiB/s", 0),
        ("kv_read.MiB_per_s", "kv READ MiB/s", 0),
        ("bulk_write.MiB_per_s", "bulk WRITE MiB/s", 0),
        ("bulk_read.MiB_per_s", "bulk READ MiB/s", 0),
        ("iperfN", f"iperf3 -P {n} MiB/s", 0),
        ("iperf1", "iperf3 -P 1 MiB/s", 0),
        ("iperfNproc", f"{n} x iperf3 MiB/s", 0),
        ("socket_cold.MiB_per_s", "socket cold MiB/s", 0),
        ("socket_hot.MiB_per_s", "socket hot MiB/s", 0),
        ("mem_write.ops_per_s", "memory ops/s", 0),
        ("register_release.per_s", "Register+Release /s", 0),
        ("getinfo_x2.per_s", "2 x GetInfo /s", 0),
        ("clients_write.ops_per_s", "clients aggregate ops/s", 0),
        ("clients_write.min_share", "clients min share", 3),
        ("clients_write.max_share", "clients max share", 3),
        ("ring_tcp_rtt.p50_us", "ring: TCP RTT p50 µs", 1),
        ("ring_tcp_write.p50_us", f"ring: WRITE {lat_bytes} tcp µs", 1),
        ("ring_tcp_read.p50_us", f"ring: READ {lat_bytes} tcp µs", 1),
        ("ring_submit_tcp_write.p50_us", "ring: Submit WRITE tcp µs", 1),
        ("ring_tcp_ops_write.ops_per_s", "ring: tcp WRITE ops/s", 0),
        ("ring_tcp_ops_submit_write.ops_per_s", "ring: Submit beside ops/s", 0),
        ("async_write.ops_per_s", "async WRITE ops/s", 0),
        ("ring_mem_write.p50_us", "ring: memory WRITE µs", 1),
        ("ring_submit_mem_write.p50_us", "ring: Submit memory µs", 1),
        ("py_ring_mem_write.p50_us", "Python ring memory µs", 1),
        ("py_auto_mem_write.p50_us", "Python submit() ring µs", 1),
        ("py_submit_mem_write.p50_us", "Python gRPC submit µs", 1),
        ("prepared_ratio.prepared_vs_contexts", "prepared / contexts", 2),
    ]
    for key, label, decimals in per_round:
        values = " / ".join(fmt(v if isinstance(v, float) else None, decimals)
                            for v in r.all(key))
        print(f"  {label:26s} {values}")
    failed = []
    for i, values in enumerate(r.rounds, 1):
        for key, value in values.items():
            if key.endswith(".failed"):
                failed.append(f"round {i}: {key[:-7]}: {value}")
    for line in failed:
        print("FAILED " + line)

    print()
    print(f"({meta.get('rounds')} rounds, best round each; "
          f"{meta.get('nproc')} cores; load {meta.get('load_start')} at start, "
          f"{meta.get('load_end')} at end; {meta.get('date')}; "
          f"agent flags: {meta.get('agent_flags') or '(defaults)'}; "
          f"tcp connections_per_peer {n})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
