"""Runs every program of examples/ as a user would, each side in its own
process of the venv the rdma-agent wheel is installed in, against two real
agents (two "hosts" on loopback, so bytes cross over tcp).

Run by python_venv_test.sh:  python_examples_test.py --agentd PATH/rdma-agentd
"""

import argparse
import os
import subprocess
import sys
import unittest

import junit
from agents import Agent
from rdma_agent import AgentClient

AGENTD = None
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")


class ExamplesTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.hosts = [Agent(AGENTD), Agent(AGENTD)]

    @classmethod
    def tearDownClass(cls):
        codes = [host.stop() for host in cls.hosts]
        assert codes == [0, 0], codes

    def start(self, host, *args):
        return subprocess.Popen(
            [sys.executable, os.path.join(EXAMPLES, args[0])] + list(args[1:]),
            env=dict(os.environ, RDMA_AGENT_SOCKET=self.hosts[host].socket),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def first_line(self, process):
        line = process.stdout.readline().strip()
        self.assertTrue(line, process.stderr.read() if process.poll() is not None else "")
        return line

    def finish(self, process):
        out, err = process.communicate(timeout=120)
        self.assertEqual(process.returncode, 0, err)
        return out

    def tearDown(self):
        for host in self.hosts:  # every example cleaned up after itself
            with AgentClient(host.socket) as client:
                self.assertEqual(list(client.list_buffers()), [])

    def test_tensor_transfer_and_asyncio_reads(self):
        owner = self.start(0, "tensor_transfer.py", "owner")
        context = self.first_line(owner)
        try:
            out = self.finish(self.start(1, "tensor_transfer.py", "reader", context))
            expected = sum(i % 2048 for i in range(512 * 1024))
            self.assertEqual(out.split(), ["ok", str(expected), "via", "tcp"])
            out = self.finish(self.start(1, "asyncio_reads.py", context))
            self.assertEqual(out.split()[:2], ["ok", "8"])
        finally:
            self.finish(owner)  # its stdin closes: it stops serving

    def test_kv_block_pool(self):
        decode = self.start(0, "kv_block_pool.py", "decode")
        context = self.first_line(decode)
        out = self.finish(self.start(1, "kv_block_pool.py", "prefill", context))
        self.assertEqual(out.strip(), "sent 3 blocks via tcp")
        self.assertEqual(self.finish(decode).strip(), "ok req-7")


def main():
    global AGENTD
    parser = argparse.ArgumentParser()
    parser.add_argument("--agentd")
    args, rest = parser.parse_known_args()
    AGENTD = args.agentd
    return junit.main(argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
    sys.exit(main())
