"""A tensor from one host to another.

The owner makes a tensor born registered, fills it and prints its remote
context; the reader registers a tensor it already has and reads the owner's
into it with one op. Run each on its host, with RDMA_AGENT_SOCKET naming
the local agent if it is not at /run/rdma-agentd/agent.sock:

    python3 tensor_transfer.py owner            # prints CONTEXT, serves until stdin closes
    python3 tensor_transfer.py reader CONTEXT   # prints "ok <sum>"
"""

import base64
import sys

import torch

from rdma_agent import AgentClient, Op

SHAPE = (512, 1024)


def owner(agent):
    weights = agent.tensor(SHAPE, torch.float16)           # born registered
    weights.copy_(torch.arange(SHAPE[0] * SHAPE[1]).view(SHAPE) % 2048)
    context = agent.buffer_of(weights)[0].remote_context
    print(base64.b64encode(context).decode(), flush=True)  # any channel will do
    sys.stdin.read()                                       # serve until told to stop


def reader(agent, context):
    kv = torch.empty(SHAPE, dtype=torch.float16)           # a tensor we already have
    # Registered in place; it shares its first and last page with other
    # objects of this process, which the peer could then reach: say so.
    with agent.register(kv, share_edge_pages=True):
        [result] = agent.submit([Op("read", kv, remote=context)], timeout=30)
        assert result.ok, result
    expected = torch.arange(SHAPE[0] * SHAPE[1]).view(SHAPE) % 2048
    assert torch.equal(kv, expected.to(torch.float16)), "bytes differ"
    print("ok", int(kv.float().sum()), "via", result.backend, flush=True)


if __name__ == "__main__":
    with AgentClient() as agent:                           # $RDMA_AGENT_SOCKET
        if sys.argv[1] == "owner":
            owner(agent)
        else:
            reader(agent, base64.b64decode(sys.argv[2]))
