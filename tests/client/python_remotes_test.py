"""Imported remotes and prepared transfers from the rdma_agent package,
installed from its wheel, against a real rdma-agentd (memory and tcp
backends), with a real second user (uid 65534 through setpriv) for the
scoping of handles.

Run by python_venv_test.sh as root:
    python_remotes_test.py --agentd PATH/rdma-agentd
"""

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import unittest

import grpc

import agents
import junit
import rdma_agent
from rdma_agent import AgentClient, AgentError, Op

AGENTD = None
NOBODY = 65534
SIZE = 64 * 1024


def pattern(seed, size):
    return random.Random(seed).randbytes(size)


# What the second user runs: its own client, then root's handle named in a
# Submit, a ReleaseRemote and a PrepareTransfer. Prints one code per line.
SECOND_USER = r"""
import sys
from rdma_agent import AgentClient, AgentError
from rdma_agent.proto import agent_pb2
socket_path, handle = sys.argv[1], int(sys.argv[2])
with AgentClient(socket_path, timeout=30) as agent:
    with agent.attach(4096) as mine:
        op = agent_pb2.Op(type=1, local_buffer_id=mine.id, length=16, remote_handle=handle)
        response = agent.stub.Submit(agent_pb2.SubmitRequest(ops=[op]), timeout=30)
        print("submit", response.results[0].code, response.results[0].message)
        for name, call in [
                ("release", lambda: agent.stub.ReleaseRemote(
                    agent_pb2.ReleaseRemoteRequest(remote_handle=handle), timeout=30)),
                ("prepare", lambda: agent.stub.PrepareTransfer(
                    agent_pb2.PrepareTransferRequest(ops=[op]), timeout=30))]:
            try:
                call()
                print(name, 0)
            except Exception as error:
                print(name, error.code().value[0], error.details())
        print("list", len(agent.list_remotes()))
"""


class RemotesTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.agent = agents.Agent(AGENTD)
        os.chmod(cls.agent.dir, 0o755)  # the second user reaches the sockets

    @classmethod
    def tearDownClass(cls):
        code = cls.agent.stop()
        assert code == 0, "rdma-agentd exited with %s" % code

    def setUp(self):
        self.client = AgentClient(self.agent.socket, timeout=30)
        self.addCleanup(self.client.close)
        self.local = self.client.attach(SIZE, label="local")
        self.target = self.client.attach(SIZE, label="target")
        self.addCleanup(self.local.close)
        self.addCleanup(self.target.close)
        self.local.memory[:] = pattern(1, SIZE)
        self.target.memory[:] = pattern(2, SIZE)
        self.addCleanup(self.release_handles)

    def release_handles(self):
        for handle in self.client.list_remotes():
            handle.close()

    def assertResultCode(self, result, code, op_index=0):
        self.assertEqual(result.code, code, result)
        self.assertTrue(result.message.startswith("op %d" % op_index), result.message)

    def test_import_remote_describes_the_context(self):
        with self.client.import_remote(self.target) as handle:
            self.assertNotEqual(handle.id, 0)
            self.assertEqual(handle.agent_id, self.client.info().agent_id)
            self.assertEqual(handle.buffer_id, self.target.id)
            self.assertEqual(handle.size_bytes, SIZE)
            self.assertIn("memory", handle.backends)
            [listed] = self.client.list_remotes()
            self.assertEqual((listed.id, listed.buffer_id, listed.size_bytes),
                             (handle.id, self.target.id, SIZE))
        # Leaving the block released it.
        self.assertEqual(self.client.list_remotes(), [])
        self.assertTrue(handle.released)

    def test_ops_naming_a_handle_move_exactly_their_bytes(self):
        handle = self.client.import_remote(self.target.remote_context)
        expected_target = bytearray(self.target.memory)
        expected_local = bytearray(self.local.memory)
        # A write of 5000 bytes from local 100 to target 777, a read of 3000
        # bytes from target 40000 into local 9000.
        results = self.client.submit([
            Op("write", self.local, 100, 5000, handle, 777),
            Op("read", self.local, 9000, 3000, handle, 40000)])
        self.assertEqual([r.code for r in results], [grpc.StatusCode.OK] * 2, results)
        self.assertEqual(results[0].backend, "memory")
        expected_target[777:5777] = expected_local[100:5100]
        expected_local[9000:12000] = expected_target[40000:43000]
        self.assertEqual(bytes(self.target.memory), bytes(expected_target))
        self.assertEqual(bytes(self.local.memory), bytes(expected_local))

    def test_length_defaults_to_the_rest_of_the_handles_buffer(self):
        handle = self.client.import_remote(self.target)
        [result] = self.client.submit([Op("read", self.local, 0, None, handle, SIZE - 100)])
        self.assertTrue(result.ok, result)
        expected = pattern(2, SIZE)[SIZE - 100:] + pattern(1, SIZE)[100:]
        self.assertEqual(bytes(self.local.memory), expected)

    def test_a_released_handle_is_not_found(self):
        handle = self.client.import_remote(self.target)
        handle.release()
        self.assertEqual(self.client.list_remotes(), [])
        [result] = self.client.submit([Op("write", self.local, 0, 64, handle)])
        self.assertResultCode(result, grpc.StatusCode.NOT_FOUND)
        self.assertEqual(bytes(self.target.memory), pattern(2, SIZE))
        with self.assertRaises(rdma_agent.FailedPreconditionError):
            handle.release()
        # Another object naming the same id asks the agent: NOT_FOUND.
        with self.assertRaises(rdma_agent.NotFoundError):
            rdma_agent.RemoteHandle(self.client, rdma_agent.proto.agent_pb2.RemoteHandleInfo(
                remote_handle=handle.id)).release()

    def test_bad_contexts_are_refused(self):
        with self.assertRaises(rdma_agent.InvalidArgumentError):
            self.client.import_remote(b"\xff\x00 not a context")
        with self.assertRaises(rdma_agent.InvalidArgumentError):
            self.client.import_remote(b"")
        with self.assertRaises(rdma_agent.ArgumentTypeError):
            self.client.import_remote("text")  # type: ignore[arg-type]
        with self.assertRaises(rdma_agent.ArgumentTypeError):
            Op("read", self.local, remote=42)

    def test_another_users_handle_is_unknown_to_them(self):
        handle = self.client.import_remote(self.target)
        package = tempfile.mkdtemp(prefix="rapy-pkg.", dir="/tmp")
        self.addCleanup(shutil.rmtree, package, True)
        os.chmod(package, 0o755)
        shutil.copytree(os.path.dirname(rdma_agent.__file__),
                        os.path.join(package, "rdma_agent"))
        run = subprocess.run(
            ["setpriv", "--reuid=%d" % NOBODY, "--regid=%d" % NOBODY, "--clear-groups",
             "/usr/bin/python3", "-c", SECOND_USER, self.agent.socket, str(handle.id)],
            env={"PYTHONPATH": package, "PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin"},
            capture_output=True, text=True, timeout=120)
        self.assertEqual(run.returncode, 0, run.stderr)
        lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
        not_found = str(grpc.StatusCode.NOT_FOUND.value[0])
        self.assertTrue(lines["submit"].startswith(not_found + " op 0"), lines)
        self.assertTrue(lines["release"].startswith(not_found), lines)
        self.assertTrue(lines["prepare"].startswith(not_found), lines)
        self.assertEqual(lines["list"], "0")
        # Untouched, and still the owner's.
        self.assertEqual(bytes(self.target.memory), pattern(2, SIZE))
        [result] = self.client.submit([Op("read", self.local, 0, 16, handle)])
        self.assertTrue(result.ok, result)

    def test_a_prepared_transfer_runs_again_and_again(self):
        handle = self.client.import_remote(self.target)
        ops = [Op("write", self.local, 0, 4096, handle, 8192),
               Op("write", self.local, 4096, 100, self.target, 20000),  # a context
               Op("read", self.local, 30000, 2000, handle, 50000)]
        with self.client.prepare_transfer(ops) as prepared:
            self.assertEqual(prepared.op_count, 3)
            # The ops are fixed: releasing the handle changes nothing.
            handle.release()
            for seed in (10, 11, 12):
                local = bytearray(pattern(seed, SIZE))
                self.local.memory[:] = local
                if seed == 12:
                    end = prepared.submit_async(timeout=30).wait(timeout=60)
                    self.assertTrue(end.ok, end)
                    results = end.results
                else:
                    results = prepared.submit(timeout=30)
                self.assertEqual([r.code for r in results], [grpc.StatusCode.OK] * 3, results)
                target = bytearray(pattern(2, SIZE))
                target[8192:12288] = local[0:4096]
                target[20000:20100] = local[4096:4196]
                local[30000:32000] = target[50000:52000]
                self.assertEqual(bytes(self.target.memory), bytes(target))
                self.assertEqual(bytes(self.local.memory), bytes(local))
                self.target.memory[:] = pattern(2, SIZE)
        self.assertTrue(prepared.released)
        with self.assertRaises(rdma_agent.NotFoundError):
            prepared.submit()
        with self.assertRaises(rdma_agent.NotFoundError):
            prepared.submit_async()
        with self.assertRaises(rdma_agent.FailedPreconditionError):
            prepared.release()

    def test_a_bad_op_fails_the_preparation_naming_it(self):
        handle = self.client.import_remote(self.target)
        handle.release()
        with self.assertRaises(AgentError) as raised:
            self.client.prepare_transfer([Op("write", self.local, 0, 16, self.target),
                                          Op("write", self.local, 0, 16, handle)])
        self.assertEqual(raised.exception.code, grpc.StatusCode.NOT_FOUND, raised.exception)
        self.assertIn("op 1", raised.exception.message)
        with self.assertRaises(rdma_agent.OutOfRangeError) as raised:
            self.client.prepare_transfer([Op("write", self.local, 0, 16, self.target, SIZE)])
        self.assertIn("op 0", raised.exception.message)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--agentd", required=True)
    options, rest = parser.parse_known_args()
    AGENTD = options.agentd
    sys.exit(junit.main(argv=sys.argv[:1] + rest))
