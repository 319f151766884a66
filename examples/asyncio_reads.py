"""Many transfers at once from asyncio: read a peer's tensor (the owner of
tensor_transfer.py) in eight slices, each an asynchronous transfer, and
await them together. No thread per transfer: one watch stream per client.

    python3 asyncio_reads.py CONTEXT           # prints "ok <slices>"
"""

import asyncio
import base64
import sys

import torch

from rdma_agent import AgentClient, Op, decode_context


async def main(context):
    size = decode_context(context).size_bytes
    with AgentClient() as agent:
        mine = agent.tensor(size, torch.uint8)
        step = size // 8
        transfers = [agent.submit_async([Op("read", mine[i * step:(i + 1) * step],
                                            remote=context, remote_offset=i * step)],
                                        timeout=30)
                     for i in range(8)]
        ends = await asyncio.gather(*transfers)
        assert all(end.ok for end in ends), ends
        print("ok", len(ends), int(mine.sum()), flush=True)


if __name__ == "__main__":
    asyncio.run(main(base64.b64decode(sys.argv[1])))
