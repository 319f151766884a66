"""What registering a tensor the caller already has costs, next to the
workaround it replaces, on one rdma-agentd (memory backend: the transfer
itself is one memcpy inside the agent, so the client-side costs show).

For each size: register(tensor) in place (one copy of its pages onto a memfd,
once), then READs of a peer buffer straight into the tensor; against the
workaround: READ into an attached buffer, then copy_ from a frombuffer view
into the tensor (a second copy at every transfer). Prints a table of medians.

    bench/python_register_bench.py --socket /run/rdma-agentd/agent.sock [--rounds 5]
"""

import argparse
import statistics
import time

import torch

from rdma_agent import AgentClient, Op

MIB = 1 << 20


def timed(call):
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes_mib", default="1,16,256")
    args = parser.parse_args()
    rows = []
    with AgentClient(args.socket, timeout=60) as agent:
        for size in [int(s) * MIB for s in args.sizes_mib.split(",")]:
            peer = agent.attach(size)
            register, direct, workaround = [], [], []
            for _ in range(args.rounds):
                tensor = torch.empty(size, dtype=torch.uint8)
                tensor.fill_(1)  # its pages exist, as a framework's tensors do
                buffer = None

                def do_register():
                    nonlocal buffer
                    buffer = agent.register(tensor, share_edge_pages=True)

                register.append(timed(do_register))
                read = [Op("read", tensor, remote=peer)]
                direct.append(timed(lambda: agent.submit(read, timeout=60)))
                buffer.close()
                staging = agent.attach(size)
                view = torch.frombuffer(staging.memory, dtype=torch.uint8)
                staged = [Op("read", staging, remote=peer)]
                workaround.append(timed(lambda: (agent.submit(staged, timeout=60),
                                                 tensor.copy_(view))))
                del view
                staging.close()
            peer.close()
            rows.append((size, statistics.median(register), statistics.median(direct),
                         statistics.median(workaround)))
    print("| size | register in place (once) | READ into it | READ + copy_ (workaround) |")
    print("|---|---|---|---|")
    for size, register, direct, workaround in rows:
        print("| %d MiB | %.2f ms (%.1f GB/s) | %.2f ms | %.2f ms |" % (
            size // MIB, register * 1e3, size / register / 1e9, direct * 1e3,
            workaround * 1e3))


if __name__ == "__main__":
    main()
