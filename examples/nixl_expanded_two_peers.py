"""The two-peer flow of NIXL's examples/python/expanded_two_peers.py, written
against NIXL's documented Python API; only the import names rdma_agent.nixl.

The target registers a 16x32 tensor of ones and sends its row descriptors
and layout (pickled, as the example does). The initiator prepares both sides
once and makes four READs of three rows each (remote rows reversed) with
make_prepped_xfer, writes random halves of rows 12..15 of the target with
initialize_xfer (from tuples, then from an Nx3 numpy array), and reposts
the four READs with new notifications. The target waits for all eight READ
notifications and both WRITE notifications and checks that zeros landed in
its rows 12..15; the initiator checks that it holds ones in rows 0..11.

    nixl_expanded_two_peers.py --mode target|initiator --ip TARGET_IP --port PORT
"""

import argparse
import pickle
import random
import sys

import numpy as np
import torch

from rdma_agent.nixl import nixl_agent, nixl_agent_config


def wait_all(agent, handles, what):
    pending = list(handles)
    while pending:
        for handle in list(pending):
            state = agent.check_xfer_state(handle)
            if state == "ERR":
                sys.exit("a %s transfer failed" % what)
            if state == "DONE":
                pending.remove(handle)


def target(agent, tensor):
    rows = agent.get_xfer_descs([tensor[i, :] for i in range(tensor.shape[0])])
    layout = (tensor.data_ptr(), int(tensor.shape[0]),
              int(tensor.shape[1] * tensor.element_size()), 0, "cpu")
    while not agent.check_remote_metadata("initiator"):
        pass
    agent.send_notif("initiator", pickle.dumps((agent.get_serialized_descs(rows), layout)))
    reads = {b"Read idx %d,%d,%d" % (s, s + 4, s + 8) for s in range(4)}
    reads |= {r + b" again" for r in reads}
    writes = 2
    while reads or writes:
        for message in agent.get_new_notifs().get("initiator", []):
            if message in reads:
                reads.remove(message)
            elif message.startswith(b"Write") and writes:
                writes -= 1
    if not torch.any(tensor[12:, :] == 0.0):
        sys.exit("target: no zeros were written into rows 12..15")
    if not torch.equal(tensor[:12], torch.ones((12, 32))):
        sys.exit("target: rows 0..11 changed")
    print("target: data verification passed", flush=True)


def initiator(agent, tensor, ip, port):
    agent.send_local_metadata(ip, port)
    agent.fetch_remote_metadata("target", ip, port)
    notifs = agent.get_new_notifs()
    while not notifs:
        notifs = agent.get_new_notifs()
    serialized, layout = pickle.loads(notifs["target"][0])
    remote_rows = agent.deserialize_descs(serialized)
    while not agent.check_remote_metadata("target"):
        pass

    # Fixed blocks: prepare both sides once, then transfer by index.
    local_rows = agent.get_xfer_descs([tensor[i, :] for i in range(tensor.shape[0])])
    local_side = agent.prep_xfer_dlist("", local_rows)
    remote_side = agent.prep_xfer_dlist("target", remote_rows)
    reads = []
    for start in range(4):
        rows = [start, start + 4, start + 8]
        reads.append(agent.make_prepped_xfer(
            "READ", local_side, rows, remote_side, rows[::-1],
            b"Read idx %d,%d,%d" % tuple(rows)))

    # Locations chosen at transfer time: random halves of rows 12..15.
    base, _, row_bytes, remote_dev, remote_mem = layout
    half = row_bytes // 2
    random.seed(0)
    starts = {r: random.choice((0, half)) for r in range(12, 16)}

    def halves(rows):
        local = [(tensor[r, :].data_ptr() + starts[r], half, 0) for r in rows]
        remote = [(base + r * row_bytes + starts[r], half, remote_dev) for r in rows]
        return local, remote

    local, remote = halves((12, 13))
    first_write = agent.initialize_xfer(
        "WRITE", agent.get_xfer_descs(local, mem_type="cpu"),
        agent.get_xfer_descs(remote, mem_type=remote_mem), "target", b"Write rows 12,13")
    local, remote = halves((14, 15))
    second_write = agent.initialize_xfer(
        "WRITE", agent.get_xfer_descs(np.array(local, dtype=np.uint64), mem_type="cpu"),
        agent.get_xfer_descs(np.array(remote, dtype=np.uint64), mem_type=remote_mem),
        "target", b"Write rows 14,15")

    for handle in reads:
        if agent.transfer(handle) == "ERR":
            sys.exit("posting a READ failed")
    wait_all(agent, reads, "READ")
    writes = [first_write, second_write]
    for handle in writes:
        if agent.transfer(handle) == "ERR":
            sys.exit("posting a WRITE failed")
    wait_all(agent, writes, "WRITE")
    for start, handle in enumerate(reads):
        notif = b"Read idx %d,%d,%d again" % (start, start + 4, start + 8)
        if agent.transfer(handle, notif) == "ERR":
            sys.exit("reposting a READ failed")
    wait_all(agent, reads, "reposted READ")

    expected = torch.zeros_like(tensor)
    expected[:12, :] = 1.0
    if not torch.equal(tensor, expected):
        sys.exit("initiator: data verification failed")
    telemetry = agent.get_xfer_telemetry(reads[0])
    if telemetry.totalBytes != 3 * row_bytes or telemetry.descCount != 3:
        sys.exit("initiator: telemetry %r" % telemetry)
    print("initiator: data verification passed", flush=True)

    agent.remove_remote_agent("target")
    for handle in reads + writes:
        agent.release_xfer_handle(handle)
    agent.release_dlist_handle(local_side)
    agent.release_dlist_handle(remote_side)
    agent.invalidate_local_metadata(ip, port)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ip", required=True)
    parser.add_argument("--port", type=int, default=5555)
    parser.add_argument("--backend", default="UCX")
    parser.add_argument("--mode", default="initiator")
    args = parser.parse_args()

    port = args.port if args.mode == "target" else 0
    agent = nixl_agent(args.mode, nixl_agent_config(True, True, port, backends=[args.backend]))
    fill = torch.ones if args.mode == "target" else torch.zeros
    tensor = fill((16, 32), dtype=torch.float32)
    registered = agent.register_memory(tensor)
    print(args.mode, "registered", flush=True)  # the initiator starts after this
    if args.mode == "target":
        target(agent, tensor)
    else:
        initiator(agent, tensor, args.ip, args.port)
    agent.deregister_memory(registered)
    print(args.mode, "complete", flush=True)


if __name__ == "__main__":
    main()
