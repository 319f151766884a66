"""The two-peer flow of NIXL's examples/python/basic_two_peers.py, written
against NIXL's documented Python API; only the import names rdma_agent.nixl.

The target registers a 10x16 tensor of ones and sends the descriptors of its
rows; the initiator reads every row into its zeros with one READ that
notifies the target, and checks the bytes.

    nixl_basic_two_peers.py --mode target --ip TARGET_IP --port PORT
    nixl_basic_two_peers.py --mode initiator --ip TARGET_IP --port PORT
"""

import argparse
import sys

import torch

from rdma_agent.nixl import nixl_agent, nixl_agent_config


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ip", required=True)
    parser.add_argument("--port", type=int, default=5555)
    parser.add_argument("--mode", default="initiator")
    args = parser.parse_args()

    # Only the target listens on the known port.
    port = args.port if args.mode == "target" else 0
    agent = nixl_agent(args.mode, nixl_agent_config(True, True, port))
    fill = torch.ones if args.mode == "target" else torch.zeros
    tensor = fill((10, 16), dtype=torch.float32)
    registered = agent.register_memory(tensor)
    print(args.mode, "registered", flush=True)  # the initiator starts after this
    if not registered:
        sys.exit("registration failed")

    if args.mode == "target":
        rows = agent.get_xfer_descs([tensor[i, :] for i in range(tensor.shape[0])])
        serialized = agent.get_serialized_descs(rows)
        while not agent.check_remote_metadata("initiator"):
            pass
        agent.send_notif("initiator", serialized)
        while True:
            notifs = agent.get_new_notifs()
            if b"Done_reading" in notifs.get("initiator", []):
                break
        print("target: the initiator read every row", flush=True)
    else:
        agent.fetch_remote_metadata("target", args.ip, args.port)
        agent.send_local_metadata(args.ip, args.port)
        notifs = agent.get_new_notifs()
        while not notifs:
            notifs = agent.get_new_notifs()
        remote_rows = agent.deserialize_descs(notifs["target"][0])
        local_rows = agent.get_xfer_descs([tensor[i, :] for i in range(tensor.shape[0])])
        while not agent.check_remote_metadata("target"):
            pass
        handle = agent.initialize_xfer("READ", local_rows, remote_rows, "target",
                                       "Done_reading")
        if agent.transfer(handle) == "ERR":
            sys.exit("posting the transfer failed")
        while True:
            state = agent.check_xfer_state(handle)
            if state == "ERR":
                sys.exit("the transfer failed")
            if state == "DONE":
                break
        if not torch.equal(tensor, torch.ones((10, 16))):
            sys.exit("initiator: data verification failed")
        print("initiator: data verification passed", flush=True)
        agent.remove_remote_agent("target")
        agent.release_xfer_handle(handle)
        agent.invalidate_local_metadata(args.ip, args.port)

    agent.deregister_memory(registered)
    print(args.mode, "complete", flush=True)


if __name__ == "__main__":
    main()
