"""Real rdma-agentd processes for the Python tests: each in a fresh runtime
dir, optionally inside a network namespace, ready once it logs that it
serves its sockets; stop() returns its exit status, kill() and restart()
crash it and start it again in the same dir. Etcd is a real etcd server
(Debian's etcd-server) for agents started with --directory."""

import os
import socket
import queue
import shutil
import subprocess
import tempfile
import threading
import time


class Agent:
    """rdma-agentd with the memory and tcp backends, tcp and Peer listeners
    on `address` (in `netns` when given)."""

    def __init__(self, agentd, address="127.0.0.1", netns=None, flags=()):
        self.dir = tempfile.mkdtemp(prefix="rapy.", dir="/tmp")
        self.socket = os.path.join(self.dir, "agent.sock")
        self.log = []
        prefix = ["ip", "netns", "exec", netns] if netns else []
        self.argv = prefix + [
            agentd, "--runtime_dir=" + self.dir, "--state_dir=" + self.dir,
            "--backends=memory,tcp", "--tcp_listen=%s:0" % address,
            "--peer_listen=%s:0" % address, "--log_level=info"] + list(flags)
        self._launch()

    def _launch(self):
        self.process = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
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

    def kill(self):
        """SIGKILL, as a crash; the runtime dir stays for restart()."""
        self.process.kill()
        self.process.wait(timeout=30)
        self.drainer.join(timeout=30)
        self.process.stdout.close()

    def restart(self):
        """Starts the agent again in the same runtime dir (same socket, same
        agent id, a new epoch) after kill()."""
        self._launch()

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


def free_port():
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Etcd:
    """One etcd member on loopback, its data in a temporary directory; ready
    once `etcdctl endpoint health` answers. `directory` is the agents'
    --directory value."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="etcd.", dir="/tmp")
        self.endpoint = "127.0.0.1:%d" % free_port()
        self.directory = "etcd://" + self.endpoint
        peer = "http://127.0.0.1:%d" % free_port()
        self.log = open(os.path.join(self.dir, "etcd.log"), "wb")
        self.process = subprocess.Popen(
            ["etcd", "--name=test", "--data-dir=" + os.path.join(self.dir, "data"),
             "--listen-client-urls=http://" + self.endpoint,
             "--advertise-client-urls=http://" + self.endpoint,
             "--listen-peer-urls=" + peer, "--initial-advertise-peer-urls=" + peer,
             "--initial-cluster=test=" + peer, "--logger=zap", "--log-level=error"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            health = subprocess.run(
                ["etcdctl", "--endpoints=http://" + self.endpoint, "--command-timeout=1s",
                 "endpoint", "health"], env=dict(os.environ, ETCDCTL_API="3"),
                capture_output=True)
            if health.returncode == 0:
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("etcd did not answer at %s: %s" % (
                    self.endpoint, health.stderr.decode(errors="replace")))
            time.sleep(0.1)

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
