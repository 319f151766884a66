"""One small WRITE between two buffers of one rdma-agentd (memory backend)
from Python, four ways, interleaved in blocks of 100 so that a noisy
moment hits all alike: through the shared-memory ring (rdma_agent.ring,
post one entry and spin for its completion), by AgentClient.submit()
carrying the remote context, which goes through the client's own ring
(ring=True, the default), and over gRPC (ring=False) by Submit naming an
imported handle and by Submit carrying the remote context. Prints
rdma-agent-bench's "name key=value" lines (compare.sh adds them to its
rounds):

    py_ring_mem_write  p50_us=... p99_us=... mean_us=... min_us=... samples=...
    py_auto_mem_write ...         (submit() through the client's ring)
    py_submit_mem_write ...       (a remote context in every gRPC Submit)
    py_handle_mem_write ...       (an imported handle in every gRPC Submit)
    py_ring_ratio submit_vs_ring=... submit_vs_auto=...

    PYTHONPATH=client/python bench/python_ring_bench.py --socket /run/rdma-agentd/agent.sock
"""

import argparse
import time

from rdma_agent import AgentClient, Op


def summary(samples):
    ordered = sorted(samples)
    n = len(ordered)
    return {"p50_us": ordered[n // 2] * 1e6, "p99_us": ordered[min(n - 1, n * 99 // 100)] * 1e6,
            "mean_us": sum(ordered) / n * 1e6, "min_us": ordered[0] * 1e6, "samples": n}


def line(name, fields):
    return "%-18s %s" % (name, " ".join(
        "%s=%s" % (k, ("%d" % v) if isinstance(v, int) else ("%.2f" % v))
        for k, v in fields.items()))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", default=None)
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--bytes", type=int, default=8)
    parser.add_argument("--spin", type=float, default=1e-3,
                        help="seconds the ring spins for a completion before it blocks")
    args = parser.parse_args()
    with AgentClient(args.socket, timeout=60, ring=False) as agent, \
            AgentClient(args.socket, timeout=60) as auto, \
            agent.attach(4096, label="bench") as local, \
            agent.attach(4096, label="bench") as target, \
            agent.import_remote(target) as handle, \
            agent.open_ring(64) as ring:
        by_ring = [Op("write", local, 0, args.bytes, handle)]
        by_context = [Op("write", local, 0, args.bytes, target)]

        def ring_write():
            ring.post(by_ring)
            [end] = ring.wait(timeout=60, spin=args.spin)
            if not end.ok or end.backend != "memory":
                raise RuntimeError("ring: %s" % (end,))

        def submit(ops, client=agent):
            [result] = client.submit(ops, timeout=60)
            if not result.ok or result.backend != "memory":
                raise RuntimeError("submit: %s" % (result,))

        kinds = [("py_ring_mem_write", ring_write),
                 ("py_auto_mem_write", lambda: submit(by_context, auto)),
                 ("py_submit_mem_write", lambda: submit(by_context)),
                 ("py_handle_mem_write", lambda: submit(by_ring))]
        samples = {name: [] for name, _ in kinds}
        block = 100
        for done in range(-args.warmup, args.iterations, block):
            for name, call in kinds:
                for i in range(done, min(done + block, args.iterations)):
                    started = time.perf_counter()
                    call()
                    if i >= 0:
                        samples[name].append(time.perf_counter() - started)
        if auto.ring_batches == 0:
            raise RuntimeError("submit() never used its ring: %s" % (auto.ring_unavailable,))
    results = {name: summary(samples[name]) for name, _ in kinds}
    for name, _ in kinds:
        print(line(name, dict(results[name], bytes=args.bytes)))
    print(line("py_ring_ratio", {
        "submit_vs_ring": results["py_submit_mem_write"]["p50_us"] /
        results["py_ring_mem_write"]["p50_us"],
        "submit_vs_auto": results["py_submit_mem_write"]["p50_us"] /
        results["py_auto_mem_write"]["p50_us"]}))


if __name__ == "__main__":
    main()
