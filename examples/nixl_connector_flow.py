"""The flow of vLLM's NIXL connector, against rdma_agent.nixl: KV-cache
regions the framework allocated itself, registered as (addr, len, device,
name) tuples; per-block descriptor lists prepared once; block reads by
numpy int64 block ids with a notification; telemetry after DONE.

The prefill side owns 16 blocks per layer (2 layers, one tensor each) and
publishes its agent metadata and cache layout in DIR (the connector's own
handshake channel; a file here). The decode side loads it
(add_remote_agent returns the peer's name), reads prefill blocks [3, 7, 1]
of every layer into its blocks [0, 1, 2] with one make_prepped_xfer per
layer, checks every byte of its caches (the blocks read and all others)
and notifies "req-1". The prefill side waits for that notification.

    nixl_connector_flow.py --mode prefill|decode --dir DIR
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from rdma_agent.nixl import nixl_agent, nixl_agent_config

LAYERS = 2
BLOCKS = 16
# Blocks need not be whole pages; each cache is large enough for its own
# pages (the allocator maps it apart), as real KV caches are.
BLOCK_BYTES = 16384 + 512


def caches(seed):
    """One cache tensor per layer, filled per block with (layer, block, seed)."""
    result = []
    for layer in range(LAYERS):
        cache = torch.empty((BLOCKS, BLOCK_BYTES), dtype=torch.uint8)
        for block in range(BLOCKS):
            cache[block].fill_((layer * 31 + block * 7 + seed) % 251)
        result.append(cache)
    return result


def block_descs(base_addresses):
    return [(base + block * BLOCK_BYTES, BLOCK_BYTES, 0)
            for base in base_addresses for block in range(BLOCKS)]


def publish(path, payload):
    with open(path + ".tmp", "w") as file:
        json.dump(payload, file)
    os.rename(path + ".tmp", path)


def wait_for(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit("nothing at %s" % path)
        time.sleep(0.02)
    with open(path) as file:
        return json.load(file)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()

    agent = nixl_agent(args.mode, nixl_agent_config(backends=["UCX"]))
    kv = caches(seed=1 if args.mode == "prefill" else 2)
    regions = [(c.data_ptr(), c.numel() * c.element_size(), 0, "") for c in kv]
    registered = agent.register_memory(agent.get_reg_descs(regions, "DRAM"))
    bases = [c.data_ptr() for c in kv]
    local_blocks = agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs(bases), "DRAM")
    print(args.mode, "registered", flush=True)

    if args.mode == "prefill":
        publish(os.path.join(args.dir, "prefill.json"), {
            "metadata": agent.get_agent_metadata().decode(), "bases": bases})
        while not agent.check_remote_xfer_done("decode", b"req-1"):
            time.sleep(0.001)
        # Read, not written: the prefill caches are as they were.
        if any(not torch.equal(a, b) for a, b in zip(kv, caches(seed=1))):
            sys.exit("prefill: its caches changed")
        print("prefill: req-1 done", flush=True)
    else:
        published = wait_for(os.path.join(args.dir, "prefill.json"))
        name = agent.add_remote_agent(published["metadata"].encode())
        if name != "prefill":
            sys.exit("add_remote_agent returned %r" % name)
        remote_blocks = agent.prep_xfer_dlist(name, block_descs(published["bases"]), "DRAM")
        local_ids = np.array([0, 1, 2], dtype=np.int64)
        remote_ids = np.array([3, 7, 1], dtype=np.int64)
        handles = []
        for layer in range(LAYERS):
            handles.append(agent.make_prepped_xfer(
                "READ", local_blocks, local_ids + layer * BLOCKS, remote_blocks,
                remote_ids + layer * BLOCKS,
                notif_msg=b"req-1" if layer == LAYERS - 1 else b""))
        for handle in handles:
            if agent.transfer(handle) != "PROC":
                sys.exit("posting failed")
        for handle in handles:
            while (state := agent.check_xfer_state(handle)) == "PROC":
                time.sleep(0.001)
            if state != "DONE":
                sys.exit("decode: transfer state %s" % state)
            telemetry = agent.get_xfer_telemetry(handle)
            if telemetry.totalBytes != 3 * BLOCK_BYTES or telemetry.descCount != 3 or \
                    telemetry.xferDuration < 0 or telemetry.startTime <= 0:
                sys.exit("decode: telemetry %r" % telemetry)
        expected = caches(seed=2)
        prefill = caches(seed=1)
        for layer in range(LAYERS):
            for local, remote in zip(local_ids.tolist(), remote_ids.tolist()):
                expected[layer][local] = prefill[layer][remote]
        if any(not torch.equal(a, b) for a, b in zip(kv, expected)):
            sys.exit("decode: data verification failed")
        print("decode: data verification passed, backend %s"
              % agent.query_xfer_backend(handles[0]), flush=True)
        for handle in handles:
            agent.release_xfer_handle(handle)
        agent.release_dlist_handle(remote_blocks)
    agent.release_dlist_handle(local_blocks)
    agent.deregister_memory(registered)
    print(args.mode, "complete", flush=True)


if __name__ == "__main__":
    main()
