"""A pool of fixed-size blocks in one born-registered tensor: KV-cache
blocks that peers read and write by block id.

    pool = BlockPool(agent, num_blocks=1024, block_shape=(16, 8, 128),
                     dtype=torch.float16)
    ids = pool.allocate(3)                 # free block ids, lowest first
    pool.blocks[ids[0]].copy_(kv)          # a block is a view of the tensor
    ops = pool.ops("write", ids, remote=peer_pool_context, remote_blocks=[7, 8, 9])
    agent.submit_notify(ops, b"req-1 blocks ready")
    pool.free(ids)

One registration holds every block, so one remote context (`context`)
reaches them all: a peer needs the context and block ids, nothing per block.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from rdma_agent.client import AgentClient, Buffer, Op, Remote
from rdma_agent.errors import invalid

__all__ = ["BlockPool"]


class BlockPool:
    """`num_blocks` blocks of `block_shape` and `dtype` in one torch tensor
    born registered with `agent` (`blocks`, shape (num_blocks, *block_shape)).
    allocate()/free() hand out block ids; ops() makes the Ops that move
    blocks between this pool and a peer's pool of the same block size.
    Thread-safe. The registration lives as long as the pool's tensor."""

    def __init__(self, agent: AgentClient, num_blocks: int, block_shape: Sequence[int],
                 dtype: Any = None, access: str | int = "read_write", label: str = "") -> None:
        if num_blocks <= 0:
            raise invalid("BlockPool: num_blocks %d must be positive" % num_blocks)
        self.blocks = agent.tensor((num_blocks,) + tuple(block_shape), dtype, access,
                                   label or "block-pool")
        self.num_blocks = num_blocks
        self.block_bytes = self.blocks[0].numel() * self.blocks.element_size()
        self.buffer: Buffer = agent.buffer_of(self.blocks)[0]
        self._lock = threading.Lock()
        self._free = list(range(num_blocks))

    @property
    def context(self) -> bytes:
        """The remote context peers need to reach every block."""
        return self.buffer.remote_context

    def allocate(self, count: int) -> list[int]:
        """`count` free block ids (lowest first); InvalidArgumentError
        (a ValueError) naming how many are free when too few are."""
        with self._lock:
            if count < 0 or count > len(self._free):
                raise invalid("BlockPool.allocate: %d blocks asked, %d of %d free"
                              % (count, len(self._free), self.num_blocks))
            self._free.sort()
            taken, self._free = self._free[:count], self._free[count:]
            return taken

    def free(self, block_ids: Sequence[int]) -> None:
        """Returns blocks to the pool; a block not allocated is refused."""
        with self._lock:
            ids = [int(b) for b in block_ids]
            free = set(self._free)
            for block in ids:
                if not 0 <= block < self.num_blocks or block in free:
                    raise invalid("BlockPool.free: block %d is not allocated" % block)
                free.add(block)
            self._free.extend(ids)

    def free_count(self) -> int:
        with self._lock:
            return len(self._free)

    def ops(self, type: str, block_ids: Sequence[int], remote: Remote | BlockPool,
            remote_blocks: Sequence[int] | None = None) -> list[Op]:
        """One Op per block: "read" brings remote block remote_blocks[i]
        into block_ids[i], "write" sends it there (remote_blocks defaults to
        the same ids). `remote` is the other pool's context (or the pool,
        when both are this process's); its blocks have the same size."""
        if isinstance(remote, BlockPool):
            remote = remote.context
        targets = list(block_ids if remote_blocks is None else remote_blocks)
        if len(targets) != len(block_ids):
            raise invalid("BlockPool.ops: %d local blocks for %d remote ones"
                          % (len(block_ids), len(targets)))
        ops = []
        for local, far in zip(block_ids, targets):
            if not 0 <= int(local) < self.num_blocks:
                raise invalid("BlockPool.ops: block %d of a pool of %d"
                              % (int(local), self.num_blocks))
            ops.append(Op(type, self.buffer.id, int(local) * self.block_bytes, self.block_bytes,
                          remote, int(far) * self.block_bytes))
        return ops
