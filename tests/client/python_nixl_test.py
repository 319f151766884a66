"""rdma_agent.nixl between two hosts: two rdma-agentd in two network
namespaces joined by a veth pair, and in each namespace one side of a NIXL
flow (examples/nixl_*.py: our own copies of NIXL's basic_two_peers and
expanded_two_peers examples, and the flow of vLLM's NIXL connector), each side a separate
process of the venv the rdma-agent wheel is installed in. Needs root (it
fails, never skips, without it).

Run by python_venv_test.sh:  python_nixl_test.py --agentd PATH/rdma-agentd
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import junit
from agents import Agent
from rdma_agent import AgentClient

AGENTD = None
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
# 10.78/16 and "rapy" namespaces: apart from the C++ tests' 10.77 and "ratcp".
ADDRESSES = ("10.78.0.1", "10.78.0.2")


def run(*command):
    subprocess.run(command, check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


class Namespaces:
    """Two network namespaces ("hosts") joined by a veth pair."""

    def __init__(self):
        stem = "rapy%dx" % os.getpid()
        self.names = (stem + "a", stem + "b")
        links = ("p%da" % (os.getpid() % 1000000), "p%db" % (os.getpid() % 1000000))
        self.created = []
        for name in self.names:
            run("ip", "netns", "add", name)
            self.created.append(name)
        run("ip", "link", "add", links[0], "netns", self.names[0], "type", "veth",
            "peer", "name", links[1], "netns", self.names[1])
        for name, link, address in zip(self.names, links, ADDRESSES):
            run("ip", "-n", name, "link", "set", "lo", "up")
            run("ip", "-n", name, "addr", "add", address + "/24", "dev", link)
            run("ip", "-n", name, "link", "set", link, "up")

    def delete(self):
        for name in self.created:
            subprocess.run(["ip", "netns", "delete", name], check=False)


class NixlTwoHostsTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        if os.geteuid() != 0:
            raise RuntimeError("python_nixl_test needs root (network namespaces)")
        cls.namespaces = Namespaces()
        try:
            cls.agents = [Agent(AGENTD, address, name)
                          for name, address in zip(cls.namespaces.names, ADDRESSES)]
        except BaseException:
            cls.namespaces.delete()
            raise

    @classmethod
    def tearDownClass(cls):
        codes = [agent.stop() for agent in cls.agents]
        cls.namespaces.delete()
        assert codes == [0, 0], codes

    def start(self, side, script, *args):
        """Runs a flow script in namespace `side` against that side's agent."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces.names[side], sys.executable,
             os.path.join(EXAMPLES, script)] + list(args),
            env=dict(os.environ, RDMA_AGENT_SOCKET=self.agents[side].socket),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def started(self, process, line):
        """Waits for `line` from a flow (it prepared its side), keeping what
        it printed for finish()."""
        seen = []
        for raw in process.stdout:
            seen.append(raw)
            if raw.decode(errors="replace").strip() == line:
                process.early = b"".join(seen)
                return process
        process.wait(timeout=30)
        self.fail("%s never came:\n%s" % (line, b"".join(seen).decode(errors="replace")))

    def finish(self, *processes):
        outputs = []
        for process in processes:
            try:
                output, _ = process.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                for other in processes:
                    other.kill()
                output, _ = process.communicate()
                self.fail("a flow timed out:\n" + output.decode(errors="replace"))
            output = getattr(process, "early", b"") + output
            outputs.append((process.returncode, output.decode(errors="replace")))
        for code, output in outputs:
            self.assertEqual(code, 0, "\n\n".join(o for _, o in outputs))
        return [output for _, output in outputs]

    def assertNothingLeft(self):
        for agent in self.agents:
            with AgentClient(agent.socket, timeout=30) as client:
                self.assertEqual(list(client.list_buffers()), [])

    def test_basic_two_peers(self):
        target = self.started(
            self.start(0, "nixl_basic_two_peers.py", "--mode", "target",
                       "--ip", ADDRESSES[0], "--port", "5555"),
            "target registered")
        initiator = self.start(1, "nixl_basic_two_peers.py", "--mode", "initiator",
                               "--ip", ADDRESSES[0], "--port", "5555")
        target_out, initiator_out = self.finish(target, initiator)
        self.assertIn("target: the initiator read every row", target_out)
        self.assertIn("initiator: data verification passed", initiator_out)
        self.assertNothingLeft()

    def test_expanded_two_peers(self):
        target = self.started(
            self.start(0, "nixl_expanded_two_peers.py", "--mode", "target",
                       "--ip", ADDRESSES[0], "--port", "5556"),
            "target registered")
        initiator = self.start(1, "nixl_expanded_two_peers.py", "--mode", "initiator",
                               "--ip", ADDRESSES[0], "--port", "5556")
        target_out, initiator_out = self.finish(target, initiator)
        self.assertIn("target: data verification passed", target_out)
        self.assertIn("initiator: data verification passed", initiator_out)
        self.assertNothingLeft()

    def test_connector_flow(self):
        shared = tempfile.mkdtemp(prefix="ranc.", dir="/tmp")
        try:
            prefill = self.started(self.start(0, "nixl_connector_flow.py", "--mode", "prefill",
                                              "--dir", shared), "prefill registered")
            decode = self.start(1, "nixl_connector_flow.py", "--mode", "decode",
                                "--dir", shared)
            prefill_out, decode_out = self.finish(prefill, decode)
        finally:
            shutil.rmtree(shared, ignore_errors=True)
        self.assertIn("prefill: req-1 done", prefill_out)
        # Across the namespaces the bytes go over tcp.
        self.assertIn("decode: data verification passed, backend tcp", decode_out)
        self.assertNothingLeft()


def main():
    global AGENTD
    parser = argparse.ArgumentParser()
    parser.add_argument("--agentd")
    args, rest = parser.parse_known_args()
    AGENTD = args.agentd
    return junit.main(argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
    sys.exit(main())
