"""Real rdma-agentd processes for the Python tests: each in a fresh runtime
dir, optionally inside a network namespace, ready once it logs that it
serves its sockets; stop() returns its exit status."""

import os
import queue
import shutil
import subprocess
import tempfile
import threading


class Agent:
    """rdma-agentd with the memory and tcp backends, tcp and Peer listeners
    on `address` (in `netns` when given)."""

    def __init__(self, agentd, address="127.0.0.1", netns=None, flags=()):
        self.dir = tempfile.mkdtemp(prefix="rapy.", dir="/tmp")
        self.socket = os.path.join(self.dir, "agent.sock")
        self.log = []
        prefix = ["ip", "netns", "exec", netns] if netns else []
        self.process = subprocess.Popen(
            prefix + [agentd, "--runtime_dir=" + self.dir, "--state_dir=" + self.dir,
                      "--backends=memory,tcp", "--tcp_listen=%s:0" % address,
                      "--peer_listen=%s:0" % address, "--log_level=info"] + list(flags),
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
            line = lines.get(timeout=30)  # queue.Empty fails the caller
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
