"""KV-cache blocks between a prefill and a decode host, with a notification.

Each side keeps its blocks in a BlockPool (one born-registered tensor, one
remote context for all blocks). The decode side prints its pool's context
and waits; the prefill side fills three blocks, writes them into three free
blocks of the decode pool and notifies "req-7"; the notification reaches
the decode side only after the bytes have landed, so it reads them at once.

    python3 kv_block_pool.py decode           # prints CONTEXT, then "ok ..."
    python3 kv_block_pool.py prefill CONTEXT  # prints "sent ..."
"""

import base64
import sys

import torch

from rdma_agent import AgentClient, BlockPool

BLOCK = (16, 8, 64)  # tokens, heads, head size: 16 KiB of float16


def block_values(block):
    return torch.full(BLOCK, float(block % 97), dtype=torch.float16)


def decode(agent):
    pool = BlockPool(agent, num_blocks=64, block_shape=BLOCK, dtype=torch.float16)
    print(base64.b64encode(pool.context).decode(), flush=True)
    while True:  # the first notification for our pool
        batch = agent.get_notifications(wait=30)
        mine = [n for n in batch.notifications if n.buffer_id == pool.buffer.id]
        if mine:
            break
    assert mine[0].data == b"req-7 blocks 10,11,12", mine[0]
    for block in (10, 11, 12):
        assert torch.equal(pool.blocks[block], block_values(block - 10 + 3)), block
    assert int(pool.blocks[13].count_nonzero()) == 0
    print("ok req-7", flush=True)


def prefill(agent, context):
    pool = BlockPool(agent, num_blocks=8, block_shape=BLOCK, dtype=torch.float16)
    ids = pool.allocate(3)
    for block in ids:
        pool.blocks[block].copy_(block_values(block + 3))
    sent = agent.submit_notify(pool.ops("write", ids, remote=context, remote_blocks=[10, 11, 12]),
                               b"req-7 blocks 10,11,12", timeout=30)
    assert all(r.ok for r in sent.results) and sent.notifications[0].ok, sent
    pool.free(ids)
    print("sent 3 blocks via", sent.results[0].backend, flush=True)


if __name__ == "__main__":
    with AgentClient() as agent:
        if sys.argv[1] == "decode":
            decode(agent)
        else:
            prefill(agent, base64.b64decode(sys.argv[2]))
