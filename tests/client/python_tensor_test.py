"""Tensors and arrays with the rdma_agent package (installed from its wheel)
against real rdma-agentd processes: views of registered memory outlive
close(), born-registered tensors and arrays, and memory the caller already
has, moved between two agents.

Run by python_venv_test.sh:  python_tensor_test.py --agentd PATH/rdma-agentd
"""

import argparse
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import unittest

import junit
from rdma_agent import AgentClient

AGENTD = None


def pattern(seed, size):
    return random.Random(seed).randbytes(size)


class Agent:
    """A real rdma-agentd in a fresh runtime dir (memory and tcp backends on
    loopback); ready once it logs that it serves its sockets."""

    def __init__(self, flags=()):
        self.dir = tempfile.mkdtemp(prefix="rat.", dir="/tmp")
        self.socket = os.path.join(self.dir, "agent.sock")
        self.log = []
        self.process = subprocess.Popen(
            [AGENTD, "--runtime_dir=" + self.dir, "--state_dir=" + self.dir,
             "--backends=memory,tcp", "--tcp_listen=127.0.0.1:0",
             "--peer_listen=127.0.0.1:0", "--log_level=info"] + list(flags),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        lines = queue.Queue()

        def drain():
            for raw in self.process.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                self.log.append(line)
                lines.put(line)
            lines.put(None)

        self.drainer = threading.Thread(target=drain, daemon=True)
        self.drainer.start()
        while True:
            line = lines.get(timeout=30)
            if line is None:
                raise RuntimeError("rdma-agentd exited:\n" + "\n".join(self.log))
            if "serving unix://" in line:
                return

    def stop(self):
        self.process.terminate()
        try:
            return self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(timeout=30)
            self.drainer.join(timeout=30)
            self.process.stdout.close()
            shutil.rmtree(self.dir, ignore_errors=True)


def run_python(socket_path, program):
    """Runs `program` in a fresh interpreter of this venv with SOCKET set;
    returns (exit status, output)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(program)],
                          env=dict(os.environ, SOCKET=socket_path),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    return done.returncode, done.stdout.decode(errors="replace")


class ViewsOutliveCloseTest(unittest.TestCase):
    """close() never unmaps memory that a live view points at. Each case runs
    in its own interpreter: a failure here is a crash (rc -11), which must
    not take the test runner with it."""

    @classmethod
    def setUpClass(cls):
        cls.agent = Agent()

    @classmethod
    def tearDownClass(cls):
        assert cls.agent.stop() == 0

    def test_torch_frombuffer_view_used_after_close(self):
        code, output = run_python(self.agent.socket, """
            import os, torch
            from rdma_agent import AgentClient
            with AgentClient(os.environ["SOCKET"]) as agent:
                buffer = agent.attach(1 << 20)
                view = torch.frombuffer(buffer.memory, dtype=torch.uint8)
                view[:] = 7
                buffer.close()
                view[10:20] = 9          # still this process's memory
                print("sum", int(view.sum()))
        """)
        self.assertEqual(code, 0, output)
        self.assertIn("sum %d" % (7 * ((1 << 20) - 10) + 9 * 10), output)

    def test_numpy_view_alive_at_close(self):
        code, output = run_python(self.agent.socket, """
            import os, numpy
            from rdma_agent import AgentClient
            with AgentClient(os.environ["SOCKET"]) as agent:
                buffer = agent.allocate(4096)
                view = numpy.frombuffer(buffer.memory, dtype=numpy.uint8)
                buffer.memory[0:3] = b"abc"
                buffer.close()           # no BufferError
                print("ids", [b.buffer_id for b in agent.list_buffers()])
                print("view", bytes(view[0:3]))
        """)
        self.assertEqual(code, 0, output)
        self.assertIn("ids []", output)      # released all the same
        self.assertIn("view b'abc'", output)


def main():
    global AGENTD
    parser = argparse.ArgumentParser()
    parser.add_argument("--agentd")
    args, rest = parser.parse_known_args()
    AGENTD = args.agentd
    return junit.main(argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
    sys.exit(main())
