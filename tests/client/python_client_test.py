"""Tests of the rdma_agent client, installed from its wheel, against a real
rdma-agentd.

Run by python_venv_test.sh with the Python of a venv the wheel is installed in:
    python_client_test.py --agentd PATH/rdma-agentd
The module also plays a second client process (--child) for the
cross-process test.
"""

import argparse
import asyncio
import base64
import concurrent.futures
import os
import time
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import unittest

import grpc

import junit
import rdma_agent
from rdma_agent import AgentClient, AgentError, Op, decode_context
from rdma_agent.proto import types_pb2

AGENTD = None
MIB = 1 << 20


def pattern(seed, size):
    return random.Random(seed).randbytes(size)


class Agent:
    """A real rdma-agentd in a fresh short runtime dir; ready once it logs
    that it serves its sockets."""

    def __init__(self, flags=()):
        self.dir = tempfile.mkdtemp(prefix="rac.", dir="/tmp")
        self.socket = os.path.join(self.dir, "agent.sock")
        self.log = []
        self.process = subprocess.Popen(
            [AGENTD, "--runtime_dir=" + self.dir, "--state_dir=" + self.dir,
             "--backends=memory",
             "--peer_listen=127.0.0.1:0", "--log_level=debug"] + list(flags),
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
            line = lines.get(timeout=30)  # queue.Empty fails the test
            if line is None:
                raise RuntimeError("rdma-agentd exited:\n" + "\n".join(self.log))
            if "serving unix://" in line:
                return

    def stop(self):
        self.process.terminate()
        try:
            code = self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(timeout=30)
            self.drainer.join(timeout=30)
            self.process.stdout.close()
            shutil.rmtree(self.dir, ignore_errors=True)
        return code


class PythonClientTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        # One transfer worker: a transfer queued behind a long one stays
        # queued until that one ends.
        cls.agent = Agent(["--transfer_workers=1"])

    @classmethod
    def tearDownClass(cls):
        # A clean SIGTERM shutdown removes the sockets.
        code = cls.agent.stop()
        assert code == 0, "rdma-agentd exited with %s" % code

    def setUp(self):
        self.client = AgentClient(self.agent.socket, timeout=30)

    def tearDown(self):
        for info in self.client.list_buffers():
            self.client.release(info.buffer_id)
        self.client.close()

    def assertCode(self, code, call, *args):
        with self.assertRaises(AgentError) as raised:
            call(*args)
        self.assertEqual(raised.exception.code, code, raised.exception)

    def test_info(self):
        info = self.client.info()
        self.assertTrue(info.agent_id)
        self.assertNotEqual(info.epoch, 0)
        self.assertEqual([b.name for b in info.backends], ["memory"])

    def check_shared(self, buffer):
        """The mapping is the agent's memory: both ways, no copy."""
        self.assertEqual(bytes(buffer.memory), bytes(buffer.size))
        buffer.memory[5:1005] = pattern(1, 1000)
        expected = bytearray(buffer.size)
        expected[5:1005] = pattern(1, 1000)
        self.assertEqual(self.client.read_buffer(buffer.id, 0, buffer.size), bytes(expected))
        self.client.write_buffer(buffer.id, 2001, pattern(2, 333))
        expected[2001:2334] = pattern(2, 333)
        self.assertEqual(bytes(buffer.memory), bytes(expected))
        context = decode_context(buffer.remote_context)
        self.assertEqual(context.buffer_id, buffer.id)
        self.assertEqual(context.size_bytes, buffer.size)
        self.assertEqual(len(context.token), 16)
        self.assertEqual(buffer.backends, ["memory"])

    def test_allocate_maps_the_agents_memory(self):
        with self.client.allocate(4099, "read_write", "py-allocated") as buffer:
            self.assertEqual(buffer.size, 4099)
            self.check_shared(buffer)
            [info] = self.client.list_buffers()
            self.assertEqual((info.buffer_id, info.label, info.agent_allocated),
                             (buffer.id, "py-allocated", True))
        # Leaving the block released it.
        self.assertEqual(self.client.list_buffers(), [])

    def test_attach_hands_over_our_memfd(self):
        with self.client.attach(4099, "read_write", "py-attached") as buffer:
            self.assertEqual(buffer.size, 4099)
            self.check_shared(buffer)
            [info] = self.client.list_buffers()
            self.assertEqual((info.buffer_id, info.label, info.agent_allocated),
                             (buffer.id, "py-attached", False))
        self.assertEqual(self.client.list_buffers(), [])

    def test_register_dmabuf_needs_a_nic_and_says_which_memory(self):
        # A memfd stands in for a GPU's dma-buf; this agent has no NIC
        # backend (ibverbs) to register device memory with.
        fd = os.memfd_create("py-dmabuf", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, 8192)
            with self.assertRaises(AgentError) as raised:
                self.client.register_dmabuf(fd, 4096, 4096, kind="cuda", device=2)
            self.assertEqual(raised.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("CUDA device memory (device 2)", str(raised.exception))
            # Checked on the attach socket before any backend is asked.
            with self.assertRaises(AgentError) as raised:
                self.client.register_dmabuf(fd, 4096, 8192, kind="rocm")
            self.assertEqual(raised.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("ends past the dma-buf", str(raised.exception))
            # The PCI address goes with it, and is checked there too.
            with self.assertRaises(AgentError) as raised:
                self.client.register_dmabuf(fd, 4096, 4096, pci_bus_id="../../etc")
            self.assertEqual(raised.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("is not a PCI address", str(raised.exception))
            with self.assertRaises(AgentError) as raised:
                self.client.register_dmabuf(fd, 4096, 4096, pci_bus_id="00000000:3B:00.0")
            self.assertEqual(raised.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertCode(grpc.StatusCode.INVALID_ARGUMENT,
                            self.client.register_dmabuf, fd, 0, 4096,
                            types_pb2.MEMORY_KIND_HOST)
        finally:
            os.close(fd)
        self.assertEqual(self.client.list_buffers(), [])

    def test_submit_moves_every_byte_both_ways(self):
        size_a, size_b = 3 * MIB + 13, 3 * MIB + 7
        with self.client.attach(size_a) as a, self.client.allocate(size_b) as b:
            cases = [
                # (local, remote, type, local_offset, length, remote_offset)
                (b, a, "read", 3, 3 * MIB, 5),
                (a, b, "read", 5, 3 * MIB, 3),
                (b, a, "write", 7, 3 * MIB, 13),
                (a, b, "write", 13, 3 * MIB, 7),
                (b, a, "read", size_b - 1, 1, size_a - 1),
                (a, b, "write", 1, 4097, 2),
            ]
            for local, remote, kind, local_offset, length, remote_offset in cases:
                with self.subTest(kind=kind, local=local.id, length=length):
                    local.memory[:] = pattern(10, local.size)
                    remote.memory[:] = pattern(20, remote.size)
                    local_before = bytearray(local.memory)
                    remote_before = bytearray(remote.memory)
                    [result] = self.client.submit(
                        [Op(kind, local.id, local_offset, length, remote.remote_context,
                            remote_offset)], timeout=30)
                    self.assertTrue(result.ok, result)
                    self.assertEqual(result.backend, "memory")
                    if kind == "read":
                        local_before[local_offset:local_offset + length] = \
                            remote_before[remote_offset:remote_offset + length]
                    else:
                        remote_before[remote_offset:remote_offset + length] = \
                            local_before[local_offset:local_offset + length]
                    self.assertTrue(bytes(local.memory) == bytes(local_before))
                    self.assertTrue(bytes(remote.memory) == bytes(remote_before))

    def test_submit_reports_each_op(self):
        with self.client.attach(100, "read") as source, self.client.allocate(100) as target:
            results = self.client.submit([
                Op("read", target.id, 0, 10, source.remote_context, 0),
                Op("read", target.id, 0, 10, source.remote_context, 95),
                Op("write", target.id, 0, 10, source.remote_context, 0),
                Op("read", 999999, 0, 10, source.remote_context, 0),
            ], timeout=10)
            self.assertEqual([r.code for r in results],
                             [grpc.StatusCode.OK, grpc.StatusCode.OUT_OF_RANGE,
                              grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND])
            self.assertTrue(all(r.message for r in results[1:]), results)
            self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.submit, [])

    def test_errors_carry_status_codes(self):
        buffer = self.client.allocate(64)
        self.assertCode(grpc.StatusCode.OUT_OF_RANGE, self.client.read_buffer, buffer.id, 60, 5)
        self.assertCode(grpc.StatusCode.OUT_OF_RANGE, self.client.read_buffer, buffer.id,
                        (1 << 64) - 1, 2)
        self.assertCode(grpc.StatusCode.OUT_OF_RANGE, self.client.write_buffer, buffer.id,
                        64, b"x")
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.read_buffer, 999999, 0, 1)
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.allocate, 0)
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.attach, 0)
        buffer.release()
        self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, buffer.release)
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.release, buffer.id)
        buffer.close()  # does not release again
        self.assertCode(grpc.StatusCode.UNAVAILABLE, AgentClient,
                        os.path.join(self.agent.dir, "missing.sock"), None, 0.5)

    def test_bad_arguments_are_value_and_type_errors_listing_the_valid_values(self):
        with self.client.allocate(64) as buffer:
            context = buffer.remote_context
            cases = [
                # (call, exception type, words of the message)
                (lambda: Op("put", buffer.id, remote=context), ValueError,
                 ["Op: type 'put'", "'read', 'write'"]),
                (lambda: Op("read", buffer.id, -1, remote=context), ValueError,
                 ["Op: local_offset -1", ">= 0"]),
                (lambda: Op("read", buffer.id, 0, -5, context), ValueError, ["Op: length -5"]),
                (lambda: Op("read", buffer.id, "0", remote=context), TypeError,
                 ["Op: local_offset must be an int", "not str"]),
                (lambda: Op("read", buffer.id), ValueError, ["Op: remote is empty"]),
                (lambda: Op("read", buffer.id, remote="text"), TypeError,
                 ["Op: remote must be a remote context"]),
                (lambda: self.client.allocate(64, access="rw"), ValueError,
                 ["allocate: access 'rw'", "'read', 'write', 'read_write'"]),
                (lambda: self.client.attach(64, lifetime="forever"), ValueError,
                 ["attach: lifetime 'forever'", "'agent', 'process', 'connection'"]),
                (lambda: self.client.register(64, access=7), ValueError,
                 ["register: access 7"]),
                (lambda: self.client.attach(-3), ValueError,
                 ["attach: size -3", "positive number of bytes"]),
                (lambda: self.client.allocate(1.5), TypeError,
                 ["allocate: size must be an int"]),
                (lambda: self.client.register(object()), TypeError,
                 ["register_memory must be a torch CPU tensor"]),
                (lambda: self.client.submit([("read", buffer.id)]), TypeError,
                 ["op 0 must be an rdma_agent.Op"]),
                (lambda: self.client.submit([Op("read", bytearray(8), remote=context)]),
                 ValueError, ["op 0: local:", "not inside a registration of this client"]),
                (lambda: self.client.submit([Op("read", buffer, 65, remote=context)]),
                 ValueError, ["op 0: local_offset 65 is past the 64 bytes"]),
            ]
            for index, (call, kind, words) in enumerate(cases):
                with self.subTest(case=index, kind=kind.__name__):
                    with self.assertRaises(kind) as raised:
                        call()
                    # One hierarchy: every refusal is an AgentError with a code.
                    self.assertIsInstance(raised.exception, AgentError)
                    self.assertEqual(raised.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                    for word in words:
                        self.assertIn(word, str(raised.exception))
            self.assertEqual([b.buffer_id for b in self.client.list_buffers()], [buffer.id])

    def test_refusals_of_the_agent_are_subclasses_by_code(self):
        with self.assertRaises(rdma_agent.NotFoundError) as raised:
            self.client.read_buffer(999999, 0, 1)
        self.assertEqual(raised.exception.code, grpc.StatusCode.NOT_FOUND)
        with self.client.allocate(64) as buffer:
            with self.assertRaises(rdma_agent.OutOfRangeError):
                self.client.read_buffer(buffer.id, 60, 5)
            with self.assertRaises(rdma_agent.InvalidArgumentError) as raised:
                self.client.submit([])  # the agent's refusal, raised the same way
            self.assertIsInstance(raised.exception, ValueError)

    def test_op_defaults_move_the_rest_of_the_buffer(self):
        with self.client.attach(8192) as a, self.client.allocate(5000) as b:
            a.memory[:] = pattern(30, 8192)
            b.memory[:] = pattern(31, 5000)
            # From offset 0, the rest of the local buffer cut to the remote's rest.
            [result] = self.client.submit([Op("write", b, remote=a)])
            self.assertTrue(result.ok, result)
            self.assertEqual(bytes(a.memory[:5000]), bytes(b.memory))
            self.assertEqual(bytes(a.memory[5000:]), pattern(30, 8192)[5000:])
            # Offsets given, length left out: the rest from there.
            b.memory[:] = pattern(32, 5000)
            [result] = self.client.submit([Op("read", a.id, 3000, remote=b.remote_context,
                                              remote_offset=100)])
            self.assertTrue(result.ok, result)
            expected = bytearray(pattern(30, 8192)[:5000]) + bytearray(pattern(30, 8192)[5000:])
            expected[:5000] = pattern(31, 5000)
            expected[3000:3000 + 4900] = pattern(32, 5000)[100:]
            self.assertEqual(bytes(a.memory), bytes(expected))

    def test_socket_from_the_environment(self):
        old = os.environ.get("RDMA_AGENT_SOCKET")
        os.environ["RDMA_AGENT_SOCKET"] = self.agent.socket
        try:
            with AgentClient(timeout=30) as client:
                self.assertEqual(client.info().agent_id, self.client.info().agent_id)
        finally:
            if old is None:
                del os.environ["RDMA_AGENT_SOCKET"]
            else:
                os.environ["RDMA_AGENT_SOCKET"] = old

    def test_missing_socket_fails_at_once_with_the_errno(self):
        started = time.monotonic()
        with self.assertRaises(AgentError) as raised:
            AgentClient(os.path.join(self.agent.dir, "missing.sock"), timeout=30)
        self.assertLess(time.monotonic() - started, 5)
        self.assertEqual(raised.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertIn("No such file or directory", raised.exception.message)

    def test_unmapped_registration_outlives_the_call(self):
        response = self.client.register(128, "read", "unmapped")
        self.client.write_buffer(response.buffer_id, 1, b"abc")
        self.assertEqual(self.client.read_buffer(response.buffer_id, 0, 5), b"\0abc\0")
        self.client.release(response.buffer_id)

    def test_buffers_live_with_the_process_unless_asked_to_live_with_the_agent(self):
        with self.client.allocate(64) as allocated, \
                self.client.attach(64) as attached, \
                self.client.attach(64, lifetime="agent") as kept:
            registered = self.client.register(64, lifetime="agent")
            self.assertEqual(allocated.lifetime, types_pb2.LIFETIME_CLIENT_PROCESS)
            self.assertEqual(attached.lifetime, types_pb2.LIFETIME_CLIENT_PROCESS)
            self.assertEqual(kept.lifetime, types_pb2.LIFETIME_AGENT)
            self.assertEqual(registered.lifetime, types_pb2.LIFETIME_AGENT)
            # Unmapped registrations live with the process too, unless asked.
            by_default = self.client.register(64)
            self.assertEqual(by_default.lifetime, types_pb2.LIFETIME_CLIENT_PROCESS)
            self.client.release(by_default.buffer_id)
            infos = {info.buffer_id: info for info in self.client.list_buffers()}
            self.assertEqual(infos[allocated.id].lifetime, types_pb2.LIFETIME_CLIENT_PROCESS)
            self.assertEqual(infos[registered.buffer_id].lifetime, types_pb2.LIFETIME_AGENT)
            for info in infos.values():
                self.assertEqual(info.owner_uid, os.geteuid())
                self.assertEqual(info.owner_pid, os.getpid())
                self.assertGreater(info.create_time.ToNanoseconds(), 0)
                self.assertGreaterEqual(info.last_use_time.ToNanoseconds(),
                                        info.create_time.ToNanoseconds())
            self.client.release(registered.buffer_id)

    def test_a_killed_process_takes_its_buffers_along(self):
        child = subprocess.Popen(
            [sys.executable, __file__, "--child_to_kill", self.agent.socket],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            line = child.stdout.readline().split()
            self.assertEqual(line[0], "ready", line)
            bound, kept, unmapped = int(line[1]), int(line[2]), int(line[3])
            self.assertEqual({bound, kept, unmapped} -
                             {i.buffer_id for i in self.client.list_buffers()}, set())
            child.kill()
            child.wait(timeout=30)
            deadline = time.monotonic() + 10
            while {bound, unmapped} & {i.buffer_id for i in self.client.list_buffers()}:
                self.assertLess(time.monotonic(), deadline, "the dead child's buffer stayed")
                time.sleep(0.01)
            self.assertIn(kept, {i.buffer_id for i in self.client.list_buffers()})
            self.client.release(kept)
        finally:
            child.stdin.close()
            child.stdout.close()
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)

    def test_every_users_buffers_are_for_root(self):
        with self.client.allocate(64) as mine:
            if os.geteuid() == 0:
                self.assertIn(mine.id, [i.buffer_id for i in self.client.list_buffers(True)])
            else:
                self.assertCode(grpc.StatusCode.PERMISSION_DENIED,
                                self.client.list_buffers, True)

    def test_another_process_shares_bytes_through_the_agent(self):
        # The child attaches a buffer with pattern 7 and prints its context.
        child = subprocess.Popen(
            [sys.executable, __file__, "--child", self.agent.socket],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            line = child.stdout.readline().split()
            self.assertEqual(line[0], "ready", line)
            context = base64.b64decode(line[1])
            with self.client.allocate(MIB + 1) as mine:
                mine.memory[:] = pattern(8, MIB + 1)
                [result] = self.client.submit(
                    [Op("read", mine.id, 1, MIB, context, 0)], timeout=30)
                self.assertTrue(result.ok, result)
                self.assertTrue(bytes(mine.memory[1:MIB + 1]) == pattern(7, MIB))
                self.assertEqual(mine.memory[0], pattern(8, MIB + 1)[0])
                [result] = self.client.submit(
                    [Op("write", mine.id, 0, 10, context, 3)], timeout=30)
                self.assertTrue(result.ok, result)
                written = bytes(mine.memory[0:10])
            # The child checks its own mapping: bytes 3..12 are ours now.
            child.stdin.write("check %s\n" % written.hex())
            child.stdin.flush()
            self.assertEqual(child.stdout.readline().strip(), "ok")
        finally:
            child.stdin.close()
            code = child.wait(timeout=30)
            child.stdout.close()
            self.assertEqual(code, 0)


class AsyncTransferTest(unittest.TestCase):
    """submit_async() and its Transfer: wait, poll, cancel, futures, asyncio.
    The tests' clients share one user; any of them may watch."""

    @classmethod
    def setUpClass(cls):
        cls.agent = Agent(["--transfer_workers=1"])

    @classmethod
    def tearDownClass(cls):
        assert cls.agent.stop() == 0

    def setUp(self):
        self.client = AgentClient(self.agent.socket, timeout=30)

    def tearDown(self):
        for info in self.client.list_buffers():
            self.client.release(info.buffer_id)
        self.client.close()

    def watch_threads(self):
        return [t for t in threading.enumerate() if t.name == "rdma-xfer-watch"]

    def long_transfer(self, size=64 * MIB, count=1024):
        """A transfer that copies `size` bytes `count` times (64 GiB: many
        seconds on the memory backend; cancel() stops it at once), with its
        local buffer zeroed and the source 0x5a."""
        local = self.client.allocate(size)
        source = self.client.allocate(size)
        source.memory[:] = b"\x5a" * size
        transfer = self.client.submit_async(
            [Op("read", local.id, 0, size, source.remote_context, 0)] * count, timeout=300)
        return transfer, local, source

    def test_wait_poll_and_futures_of_a_done_transfer(self):
        with self.client.allocate(MIB + 3) as a, self.client.attach(MIB + 3) as b:
            b.memory[:] = pattern(3, MIB + 3)
            before = time.time()
            transfer = self.client.submit_async(
                [Op("read", a.id, 3, MIB, b.remote_context, 1)], timeout=30)
            self.assertGreater(transfer.transfer_id, 0)
            end = transfer.wait(30)
            self.assertEqual(end.state, rdma_agent.DONE)
            self.assertTrue(end.ok and end.ended)
            self.assertEqual(end.transfer_id, transfer.transfer_id)
            [result] = end.results
            self.assertTrue(result.ok, result)
            self.assertEqual(result.backend, "memory")
            self.assertTrue(bytes(a.memory[3:MIB + 3]) == pattern(3, MIB + 3)[1:MIB + 1])
            self.assertEqual((end.bytes_total, end.bytes_done), (MIB, MIB))
            self.assertGreaterEqual(end.create_time, before - 1)
            self.assertGreaterEqual(end.start_time, end.create_time)
            self.assertGreaterEqual(end.end_time, end.start_time)
            # The end is kept here: no RPC asks for it again.
            self.assertEqual(transfer.poll(), end)
            self.assertEqual(transfer.result(), end)
            self.assertEqual(transfer.future.result(timeout=30), end)
            self.assertTrue(transfer.done())
            self.assertEqual(transfer.cancel(), end)  # ended: nothing changes
            # The watch that delivered it read nothing: another client of the
            # user still finds it, once (its poll is the read).
            with AgentClient(self.agent.socket, timeout=30, watch=False) as other:
                self.assertEqual(other.transfer(end.transfer_id).poll(), end)
                self.assertCode(grpc.StatusCode.NOT_FOUND, other.transfer(end.transfer_id).poll)

    def assertCode(self, code, call, *args):
        with self.assertRaises(AgentError) as raised:
            call(*args)
        self.assertEqual(raised.exception.code, code, raised.exception)

    def test_a_failed_op_ends_the_transfer_failed(self):
        with self.client.allocate(4096) as a:
            transfer = self.client.submit_async([
                Op("read", a.id, 0, 10, a.remote_context, 100),
                Op("read", a.id, 0, 10, a.remote_context, 4090)], timeout=30)
            end = transfer.wait(30)
            self.assertEqual(end.state, rdma_agent.FAILED)
            self.assertFalse(end.ok)
            self.assertEqual([r.code for r in end.results],
                             [grpc.StatusCode.OK, grpc.StatusCode.OUT_OF_RANGE])
            # The refused op counts for nothing.
            self.assertEqual((end.bytes_total, end.bytes_done), (10, 10))
            self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.submit_async, [])

    def test_await_and_gather_in_asyncio(self):
        with self.client.allocate(64 * 4096) as a, self.client.allocate(64 * 4096) as b:
            b.memory[:] = pattern(5, 64 * 4096)

            async def main():
                transfers = [self.client.submit_async(
                    [Op("read", a.id, i * 4096, 4096, b.remote_context, i * 4096)])
                    for i in range(64)]
                first = await transfers[0]
                rest = await asyncio.wait_for(asyncio.gather(*transfers[1:]), 60)
                return [first] + rest

            ends = asyncio.run(main())
            self.assertEqual(len(ends), 64)
            self.assertTrue(all(e.state == rdma_agent.DONE for e in ends), ends)
            self.assertEqual(len({e.transfer_id for e in ends}), 64)
            self.assertTrue(bytes(a.memory) == bytes(b.memory))

    def test_two_hundred_futures_resolved_by_one_watch_thread(self):
        with self.client.allocate(200 * 4096) as a, self.client.allocate(200 * 4096) as b:
            b.memory[:] = pattern(6, 200 * 4096)
            calls = {}
            lock = threading.Lock()

            def count(future):
                with lock:
                    end = future.result()
                    calls[end.transfer_id] = calls.get(end.transfer_id, 0) + 1

            transfers = []
            for i in range(200):
                transfer = self.client.submit_async(
                    [Op("read", a.id, i * 4096, 4096, b.remote_context, i * 4096)])
                transfer.future.add_done_callback(count)
                transfers.append(transfer)
            done, not_done = concurrent.futures.wait([t.future for t in transfers], 60)
            self.assertEqual(not_done, set())
            self.assertEqual(len(self.watch_threads()), 1)
            time.sleep(0.2)
            self.assertEqual(calls, {t.transfer_id: 1 for t in transfers})
            self.assertTrue(all(t.future.result().ok for t in transfers))
            self.assertTrue(bytes(a.memory) == bytes(b.memory))

    def test_poll_wait_and_cancel_of_a_running_and_a_queued_transfer(self):
        running, local, source = self.long_transfer()
        with self.client.allocate(4096) as small:
            queued = self.client.submit_async(
                [Op("read", small.id, 0, 4096, source.remote_context, 0)], timeout=300)
            deadline = time.monotonic() + 60
            while local.memory[0] != 0x5a:
                self.assertLess(time.monotonic(), deadline, "the transfer never moved a byte")
                time.sleep(0.005)
            now = running.poll()
            self.assertEqual(now.state, rdma_agent.PENDING)
            self.assertEqual(now.results, [])
            self.assertIsNotNone(now.start_time)
            self.assertIsNone(now.end_time)
            self.assertEqual(queued.poll().start_time, None)  # still queued
            self.assertCode(grpc.StatusCode.DEADLINE_EXCEEDED, running.wait, 0.2)
            with self.assertRaises(TimeoutError):
                running.result(0.1)
            self.assertFalse(running.future.done())

            never = queued.cancel()
            self.assertEqual(never.state, rdma_agent.CANCELLED)
            self.assertEqual([r.code for r in never.results], [grpc.StatusCode.CANCELLED])
            self.assertIsNone(never.start_time)
            self.assertEqual(bytes(small.memory), bytes(4096))

            stopped = running.cancel()
            # Nothing of it writes into `local` once cancel() has returned.
            local.memory[:] = b"\xc3" * len(local.memory)
            self.assertEqual(stopped.state, rdma_agent.CANCELLED)
            self.assertIn(grpc.StatusCode.CANCELLED, [r.code for r in stopped.results])
            time.sleep(0.5)
            self.assertTrue(bytes(local.memory) == b"\xc3" * len(local.memory))
            self.assertEqual(running.wait(0), stopped)
            self.assertEqual(running.future.result(timeout=30), stopped)
        local.close()
        source.close()

    def test_closing_the_client_fails_pending_futures(self):
        with AgentClient(self.agent.socket, timeout=30) as watching:
            size = 64 * MIB
            local, source = watching.allocate(size), watching.allocate(size)
            transfer = watching.submit_async(
                [Op("read", local.id, 0, size, source.remote_context, 0)] * 1024, timeout=300)
            self.assertEqual(len(self.watch_threads()), 1)
        with self.assertRaises(AgentError) as raised:
            transfer.future.result(timeout=30)
        self.assertEqual(raised.exception.code, grpc.StatusCode.CANCELLED)
        self.assertIn("closed", raised.exception.message)
        self.assertEqual(self.watch_threads(), [])
        # The transfer runs on; another client of the user stops it.
        with AgentClient(self.agent.socket, timeout=30, watch=False) as other:
            self.assertEqual(other.transfer(transfer.transfer_id).cancel().state,
                             rdma_agent.CANCELLED)

    def test_two_watching_clients_both_get_every_end(self):
        running, local, source = self.long_transfer()  # holds the one worker
        with AgentClient(self.agent.socket, timeout=30) as other, \
                self.client.allocate(20 * 4096) as a:
            mine = [self.client.submit_async(
                [Op("read", a.id, i * 4096, 4096, source.remote_context, 0)], timeout=300)
                for i in range(20)]
            # The other client follows each one while it is still queued.
            theirs = [other.transfer(t.transfer_id) for t in mine]
            self.assertEqual(len(self.watch_threads()), 2)
            running.cancel()
            for transfers in (mine, theirs):
                done, not_done = concurrent.futures.wait([t.future for t in transfers], 60)
                self.assertEqual(not_done, set(), "the watches split the ends")
                self.assertTrue(all(t.future.result().state == rdma_agent.DONE
                                    for t in transfers))
            # Delivered twice, read by nobody: a third client still reads each.
            with AgentClient(self.agent.socket, timeout=30, watch=False) as third:
                for t in mine:
                    self.assertEqual(third.transfer(t.transfer_id).poll().state,
                                     rdma_agent.DONE)
        local.close()
        source.close()

    def test_a_watching_client_that_goes_away_takes_no_end_with_it(self):
        with self.client.allocate(4096) as a:
            with AgentClient(self.agent.socket, timeout=30) as watching:
                transfer = watching.submit_async(
                    [Op("read", a.id, 0, 10, a.remote_context, 100)])
                end = transfer.future.result(timeout=30)  # its watch delivered it
            # Gone with it in hand: the end is still the agent's to give.
            with AgentClient(self.agent.socket, timeout=30, watch=False) as other:
                self.assertEqual(other.transfer(transfer.transfer_id).wait(30), end)

    def test_without_the_watch_wait_asks_the_agent(self):
        with AgentClient(self.agent.socket, timeout=30, watch=False) as quiet, \
                quiet.allocate(4096) as a:
            transfer = quiet.submit_async([Op("read", a.id, 0, 10, a.remote_context, 100)])
            self.assertEqual(self.watch_threads(), [])
            self.assertFalse(transfer.future.done())  # nobody pushes it
            end = transfer.wait(30)
            self.assertEqual(end.state, rdma_agent.DONE)
            self.assertEqual(transfer.future.result(timeout=0), end)
            self.assertCode(grpc.StatusCode.NOT_FOUND, quiet.transfer(999999).wait, 1)

    def test_a_transfer_submitted_elsewhere_by_id(self):
        with AgentClient(self.agent.socket, timeout=30, watch=False) as other, \
                other.allocate(4096) as a:
            submitted = other.submit_async([Op("read", a.id, 0, 10, a.remote_context, 100)])
            followed = self.client.transfer(submitted.transfer_id)
            self.assertEqual(followed.wait(30).state, rdma_agent.DONE)
            self.assertEqual(followed.future.result(timeout=30).state, rdma_agent.DONE)
            self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.transfer(999999).wait, 1)


class NotificationTest(unittest.TestCase):
    """submit_notify(), submit_async(notification=...), get_notifications()
    and watch_notifications() on one agent: the target is its own buffer."""

    @classmethod
    def setUpClass(cls):
        cls.agent = Agent([])

    @classmethod
    def tearDownClass(cls):
        assert cls.agent.stop() == 0

    def setUp(self):
        self.client = AgentClient(self.agent.socket, timeout=30)

    def tearDown(self):
        for info in self.client.list_buffers():
            self.client.release(info.buffer_id)
        self.client.close()

    def test_notify_then_poll_and_stream(self):
        agent_id = self.client.info().agent_id
        with self.client.attach(8192) as src, self.client.allocate(8192) as dst:
            src.memory[:] = pattern(4, 8192)
            sent = self.client.submit_notify(
                [Op("write", src.id, 100, 1000, dst.remote_context, 7)], "ready", timeout=20)
            self.assertTrue(sent.results[0].ok, sent)
            [result] = sent.notifications
            self.assertEqual((result.code, result.buffer_id, result.agent_id, result.backend),
                             (grpc.StatusCode.OK, dst.id, agent_id, "memory"))
            batch = self.client.get_notifications(wait=5)
            self.assertEqual(batch.dropped, 0)
            [got] = batch.notifications
            # Numbered per user on this agent (other tests of the class too).
            self.assertEqual((got.from_agent_id, got.buffer_id, got.data),
                             (agent_id, dst.id, b"ready"))
            self.assertGreaterEqual(got.sequence, 1)
            self.assertGreater(got.receive_time, 0)
            self.assertTrue(bytes(dst.memory[7:1007]) == bytes(src.memory[100:1100]))
            self.assertEqual(self.client.get_notifications().notifications, [])

            # Asynchronously, received on a stream.
            transfer = self.client.submit_async(
                [Op("write", src.id, 0, 10, dst.remote_context, 0)], notification=b"\x00bin")
            end = transfer.result(timeout=20)
            self.assertTrue(end.ok, end)
            [result] = end.notifications
            self.assertTrue(result.ok, result)
            with self.client.watch_notifications() as stream:
                notification, dropped = next(iter(stream))
            self.assertEqual((notification.data, notification.sequence, dropped),
                             (b"\x00bin", got.sequence + 1, 0))

    def test_notifications_in_asyncio(self):
        with self.client.attach(64) as src, self.client.allocate(64) as dst:
            async def main():
                async with self.client.watch_notifications() as stream:
                    events = stream.__aiter__()
                    # Sent from another thread while this loop awaits.
                    sender = asyncio.get_running_loop().run_in_executor(
                        None, self.client.submit_notify,
                        [Op("write", src.id, 0, 8, dst.remote_context, 0)], "aio", 20)
                    notification, dropped = await asyncio.wait_for(events.__anext__(), 20)
                    sent = await sender
                    return notification, dropped, sent
            notification, dropped, sent = asyncio.run(main())
            self.assertTrue(sent.notifications[0].ok, sent)
            self.assertEqual((notification.data, notification.buffer_id, dropped),
                             (b"aio", dst.id, 0))

    def test_failed_op_sends_nothing_and_oversized_is_refused(self):
        with self.client.allocate(64) as src, self.client.allocate(64) as dst:
            sent = self.client.submit_notify(
                [Op("write", src.id, 0, 10, dst.remote_context, 60)], "never", timeout=20)
            self.assertEqual(sent.results[0].code, grpc.StatusCode.OUT_OF_RANGE)
            self.assertEqual(sent.notifications, [])
            self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.submit_notify,
                            [Op("write", src.id, 0, 10, dst.remote_context, 0)], b"x" * 4097)
            self.assertEqual(self.client.get_notifications(wait=0.2).notifications, [])

    def assertCode(self, code, call, *args):
        with self.assertRaises(AgentError) as raised:
            call(*args)
        self.assertEqual(raised.exception.code, code, raised.exception)


def child(socket_path):
    with AgentClient(socket_path, timeout=30) as client:
        with client.attach(MIB, "read_write") as buffer:
            buffer.memory[:] = pattern(7, MIB)
            print("ready", base64.b64encode(buffer.remote_context).decode(), flush=True)
            for line in sys.stdin:
                words = line.split()
                if words and words[0] == "check":
                    expected = bytearray(pattern(7, MIB))
                    expected[3:13] = bytes.fromhex(words[1])
                    print("ok" if bytes(buffer.memory) == bytes(expected) else "mismatch",
                          flush=True)
    return 0


def child_to_kill(socket_path):
    """Registers a buffer with the default lifetime, one with the agent's and
    an unmapped one with the default lifetime, prints "ready BOUND KEPT
    UNMAPPED" and waits to be killed."""
    client = AgentClient(socket_path, timeout=30)
    bound = client.attach(4096)
    kept = client.attach(4096, lifetime="agent")
    unmapped = client.register(4096)
    print("ready", bound.id, kept.id, unmapped.buffer_id, flush=True)
    sys.stdin.read()
    return 0


def main():
    global AGENTD
    parser = argparse.ArgumentParser()
    parser.add_argument("--agentd")
    parser.add_argument("--child")
    parser.add_argument("--child_to_kill")
    args, rest = parser.parse_known_args()
    if args.child:
        return child(args.child)
    if args.child_to_kill:
        return child_to_kill(args.child_to_kill)
    AGENTD = args.agentd
    return junit.main(argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
    sys.exit(main())
