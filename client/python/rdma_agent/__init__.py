"""rdma_agent: the Python client of rdma-agentd.

    import rdma_agent

    with rdma_agent.AgentClient() as agent:              # $RDMA_AGENT_SOCKET
        with agent.attach(1 << 20) as mine:              # memfd handed to the agent
            mine.memory[0:5] = b"hello"                  # the agent's bytes, no copy
            agent.submit([rdma_agent.Op("write", mine, remote=peer)])

`AgentClient.open_ring()` opens a shared-memory ring session
(`rdma_agent.ring`): ops without a gRPC call per batch. `rdma_agent.nixl`
offers the same over NIXL's Python API; `rdma_agent.proto` holds the
generated rdma.agent.v1 messages.
"""

from rdma_agent.client import *  # noqa: F401,F403
from rdma_agent.errors import *  # noqa: F401,F403
from rdma_agent.pool import BlockPool  # noqa: F401
from rdma_agent.ring import Ring, RingCompletion  # noqa: F401
from rdma_agent import client as _client, errors as _errors

__all__ = _client.__all__ + [n for n in _errors.__all__ if n not in _client.__all__] + \
    ["BlockPool", "Ring", "RingCompletion"]
