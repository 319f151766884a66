"""The Python shared-memory ring (rdma_agent.ring, protocol version 2),
installed from its wheel, against a real rdma-agentd: bytes moved and
checked around each op, failed ops and their messages, pipelined batches,
prepared runs, notifications through the payload area, CANCEL (of an
unknown tag, and of a batch held by a stopped peer agent over tcp), a ring
the agent stops for a lying tail, and an agent killed under a ring. The
header checks and the stop reason's bounds run on crafted mappings.

Run by python_venv_test.sh:
    python_ring_test.py --agentd PATH/rdma-agentd
"""

import argparse
import mmap
import os
import random
import signal
import socket
import struct
import sys
import time
import unittest

import grpc

import agents
import junit
import rdma_agent
from rdma_agent import AgentClient, Op
from rdma_agent import ring as ring_module

AGENTD = None
SIZE = 64 * 1024


def pattern(seed, size):
    return random.Random(seed).randbytes(size)


class RingTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.agent = agents.Agent(AGENTD)

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
        self.handle = self.client.import_remote(self.target)
        self.addCleanup(self.handle.close)
        self.ring = self.client.open_ring(8)
        self.addCleanup(self.ring.close)

    def test_ops_move_exactly_their_bytes(self):
        self.assertEqual(self.ring.entries, 8)
        local, target = bytearray(pattern(1, SIZE)), bytearray(pattern(2, SIZE))
        results = self.ring.submit([Op("write", self.local, 100, 5000, self.handle, 777),
                                    Op("read", self.local, 9000, 3000, self.handle, 40000)],
                                   timeout=10)
        self.assertEqual([(r.code, r.message, r.backend) for r in results],
                         [(grpc.StatusCode.OK, "", "memory")] * 2)
        target[777:5777] = local[100:5100]
        local[9000:12000] = target[40000:43000]
        self.assertEqual(bytes(self.target.memory), bytes(target))
        self.assertEqual(bytes(self.local.memory), bytes(local))
        self.assertEqual(self.ring.in_flight, 0)

    def test_batches_go_round_the_ring_many_times(self):
        target = bytearray(pattern(2, SIZE))
        for i in range(50):  # 150 entries through 8 slots
            ops = [Op("write", self.local, i * 300 + k * 100, 100, self.handle,
                      SIZE - (i * 300 + k * 100) - 100) for k in range(3)]
            results = self.ring.submit(ops)
            self.assertTrue(all(r.ok for r in results), (i, results))
            for k in range(3):
                start = i * 300 + k * 100
                target[SIZE - start - 100:SIZE - start] = self.local.memory[start:start + 100]
        self.assertEqual(bytes(self.target.memory), bytes(target))

    def test_a_failed_op_has_its_message_and_the_others_run(self):
        results = self.ring.submit([Op("write", self.local, 0, 64, self.handle),
                                    Op("write", self.local, 0, 64, self.handle, SIZE - 32)])
        self.assertTrue(results[0].ok, results[0])
        self.assertEqual(results[1].code, grpc.StatusCode.OUT_OF_RANGE, results[1])
        self.assertTrue(results[1].message.startswith("op 1:"), results[1].message)
        expected = bytearray(pattern(2, SIZE))
        expected[0:64] = pattern(1, SIZE)[0:64]
        self.assertEqual(bytes(self.target.memory), bytes(expected))

    def test_an_unknown_buffer_id_is_not_found(self):
        [result] = self.ring.submit([Op("read", 987654321, 0, 16, self.handle)])
        self.assertEqual(result.code, grpc.StatusCode.NOT_FOUND, result)
        self.assertTrue(result.message.startswith("op 0:"), result.message)
        self.assertEqual(bytes(self.target.memory), pattern(2, SIZE))

    def test_the_batch_timeout_and_tags_reach_the_agent(self):
        # Past --max_submit_timeout: every op of the batch is refused, naming
        # the timeout; nothing moves.
        ops = [Op("write", self.local, 0, 16, self.handle),
               Op("write", self.local, 16, 16, self.handle, 16)]
        tags = [(1 << 64) - 1, 0]
        self.ring.post(ops, timeout=1e6, tags=tags)
        ends = []
        while len(ends) < 2:
            ends += self.ring.wait(timeout=30)
        self.assertEqual([e.tag for e in ends], tags)
        for index, end in enumerate(ends):
            self.assertEqual(end.code, grpc.StatusCode.INVALID_ARGUMENT, end)
            self.assertTrue(end.message.startswith("op %d:" % index), end.message)
            self.assertIn("timeout", end.message)
        self.assertEqual(bytes(self.target.memory), pattern(2, SIZE))
        with self.assertRaises(rdma_agent.InvalidArgumentError):
            self.ring.post(ops, timeout=0)

    def test_two_batches_pipelined(self):
        first = self.ring.post([Op("write", self.local, 0, 4096, self.handle, 0),
                                Op("write", self.local, 4096, 4096, self.handle, 8192)],
                               tags=[11, 12])
        second = self.ring.post([Op("read", self.local, 20000, 4096, self.handle, 30000)],
                                timeout=10)
        self.assertEqual(first, [11, 12])
        self.assertEqual(self.ring.in_flight, 3)
        ends = []
        deadline = time.monotonic() + 30
        while len(ends) < 3 and time.monotonic() < deadline:
            ends += self.ring.wait(timeout=30)
        # Batches run asynchronously: they may end in either order, each
        # batch's completions together and in entry order.
        self.assertIn([e.tag for e in ends], [[11, 12] + second, second + [11, 12]])
        self.assertTrue(all(e.ok for e in ends), ends)
        local, target = bytearray(pattern(1, SIZE)), bytearray(pattern(2, SIZE))
        local[20000:24096] = target[30000:34096]
        target[0:4096] = local[0:4096]
        target[8192:12288] = local[4096:8192]
        self.assertEqual(bytes(self.local.memory), bytes(local))
        self.assertEqual(bytes(self.target.memory), bytes(target))

    def test_submit_keeps_earlier_completions_for_reap(self):
        [tag] = self.ring.post([Op("write", self.local, 0, 16, self.handle)])
        [result] = self.ring.submit([Op("read", 987654321, 0, 16, self.handle)])
        self.assertEqual(result.code, grpc.StatusCode.NOT_FOUND)
        # The earlier batch ends before or after this one: either way its
        # completion is reaped, once.
        ends = self.ring.reap()
        while not ends:
            ends = self.ring.wait(timeout=30)
        self.assertEqual([(e.tag, e.code) for e in ends], [(tag, grpc.StatusCode.OK)])
        self.assertEqual(self.ring.reap(), [])
        self.assertEqual(self.ring.in_flight, 0)

    def test_a_blocked_wait_is_woken(self):
        self.ring.post([Op("write", self.local, 0, 16, self.handle)])
        [end] = self.ring.wait(timeout=30, spin=0)
        self.assertTrue(end.ok, end)
        with self.assertRaises(rdma_agent.DeadlineExceededError):
            self.ring.wait(timeout=0.2, spin=0)

    def test_a_full_ring_posts_nothing(self):
        ops = [Op("write", self.local, i, 1, self.handle, i) for i in range(9)]
        with self.assertRaises(rdma_agent.ResourceExhaustedError):
            self.ring.post(ops)
        self.assertEqual(self.ring.in_flight, 0)
        self.ring.post(ops[:8])
        with self.assertRaises(rdma_agent.ResourceExhaustedError):
            self.ring.post(ops[8:])

    def test_a_prepared_run_is_one_completion(self):
        local, target = pattern(1, SIZE), bytearray(pattern(2, SIZE))
        with self.client.prepare_transfer(
                [Op("write", self.local, 100, 3000, self.handle, 5000),
                 Op("write", self.local, 20000, 700, self.handle, 60000)]) as layer:
            self.assertEqual(self.ring.run_prepared(layer, timeout=10, tag=42), 42)
            [end] = self.ring.wait(timeout=30)
            self.assertEqual((end.tag, end.code, end.message, end.backend),
                             (42, grpc.StatusCode.OK, "", "memory"))
            target[5000:8000] = local[100:3100]
            target[60000:60700] = local[20000:20700]
            self.assertEqual(bytes(self.target.memory), bytes(target))
            self.assertEqual(bytes(self.local.memory), local)
            # By id too, with a tag the ring hands out.
            self.target.memory[:] = pattern(2, SIZE)
            tag = self.ring.run_prepared(layer.id)
            [end] = self.ring.wait(timeout=30)
            self.assertEqual((end.tag, end.code), (tag, grpc.StatusCode.OK))
            self.assertEqual(bytes(self.target.memory), bytes(target))
        # Released: an unknown id.
        self.ring.run_prepared(layer.id, tag=43)
        [end] = self.ring.wait(timeout=30)
        self.assertEqual((end.tag, end.code), (43, grpc.StatusCode.NOT_FOUND), end)
        with self.assertRaises(rdma_agent.ArgumentTypeError):
            self.ring.run_prepared("1")
        with self.assertRaises(rdma_agent.InvalidArgumentError):
            self.ring.run_prepared(0)
        with self.assertRaises(rdma_agent.InvalidArgumentError):
            self.ring.run_prepared(layer.id, tag=1 << 64)
        self.assertEqual(self.ring.in_flight, 0)

    def test_a_failing_prepared_run_reports_its_first_failed_op(self):
        other = self.client.attach(SIZE, label="other")
        other.memory[:] = pattern(3, SIZE)
        other_handle = self.client.import_remote(other)
        with self.client.prepare_transfer(
                [Op("write", self.local, 0, 1000, self.handle, 0),
                 Op("write", self.local, 1000, 1000, other_handle, 0),
                 Op("write", self.local, 2000, 1000, self.handle, 9000)]) as layer:
            other_handle.close()
            other.close()  # op 1 now names a buffer that is gone
            self.ring.run_prepared(layer, timeout=10, tag=7)
            [end] = self.ring.wait(timeout=30)
        self.assertEqual(end.tag, 7)
        self.assertNotEqual(end.code, grpc.StatusCode.OK, end)
        self.assertTrue(end.message.startswith("op 1:"), end.message)
        # The other ops ran, and nothing else moved.
        local, target = pattern(1, SIZE), bytearray(pattern(2, SIZE))
        target[0:1000] = local[0:1000]
        target[9000:10000] = local[2000:3000]
        self.assertEqual(bytes(self.target.memory), bytes(target))
        self.assertEqual(bytes(self.local.memory), local)

    def test_a_notification_reaches_the_owner(self):
        with AgentClient(self.agent.socket, timeout=30) as owner:
            owner.get_notifications()  # what other tests left
            [result] = self.ring.submit([Op("write", self.local, 0, 512, self.handle, 1024)],
                                        timeout=10, notification="ring ready")
            self.assertTrue(result.ok, result)
            with self.client.prepare_transfer(
                    [Op("write", self.local, 0, 8, self.handle)]) as layer:
                tag = self.ring.run_prepared(layer, notification=b"\x00prepared")
                [end] = self.ring.wait(timeout=30)
            self.assertEqual((end.tag, end.code), (tag, grpc.StatusCode.OK))
            got = []
            deadline = time.monotonic() + 30
            while len(got) < 2 and time.monotonic() < deadline:
                got += owner.get_notifications(wait=5).notifications
            self.assertEqual([(n.data, n.buffer_id) for n in got],
                             [(b"ring ready", self.target.id),
                              (b"\x00prepared", self.target.id)])
            expected = bytearray(pattern(2, SIZE))
            expected[1024:1536] = pattern(1, SIZE)[0:512]
            expected[0:8] = pattern(1, SIZE)[0:8]
            self.assertEqual(bytes(self.target.memory), bytes(expected))

    def test_notifications_go_round_the_payload_area(self):
        # 8 entries: a 2048-byte area; 20 payloads of 700 bytes reuse it.
        self.assertEqual(self.ring.max_notification_bytes, 2048)
        with AgentClient(self.agent.socket, timeout=30) as owner:
            owner.get_notifications()
            sent = [pattern(100 + i, 700) for i in range(20)]
            for data in sent:
                [result] = self.ring.submit([Op("write", self.local, 0, 16, self.handle)],
                                            notification=data)
                self.assertTrue(result.ok, result)
            got = []
            deadline = time.monotonic() + 30
            while len(got) < len(sent) and time.monotonic() < deadline:
                got += owner.get_notifications(wait=5).notifications
            self.assertEqual([n.data for n in got], sent)

    def test_pipelined_notifications_keep_their_own_bytes(self):
        with AgentClient(self.agent.socket, timeout=30) as owner:
            owner.get_notifications()
            sent = [pattern(200 + i, 600) for i in range(3)]  # 1800 of 2048 bytes
            tags = [self.ring.post([Op("write", self.local, 0, 16, self.handle, 100 * i)],
                                   notification=data)[0] for i, data in enumerate(sent)]
            ends = []
            while len(ends) < 3:
                ends += self.ring.wait(timeout=30)
            self.assertEqual(sorted((e.tag, e.code) for e in ends),
                             [(tag, grpc.StatusCode.OK) for tag in tags])
            got = []
            deadline = time.monotonic() + 30
            while len(got) < len(sent) and time.monotonic() < deadline:
                got += owner.get_notifications(wait=5).notifications
            self.assertEqual(sorted(n.data for n in got), sorted(sent))

    def test_a_notification_too_large_or_empty_is_refused_here(self):
        ops = [Op("write", self.local, 0, 16, self.handle)]
        for bad in [b"x" * 2049, b"", ""]:
            with self.subTest(size=len(bad)), \
                    self.assertRaises(rdma_agent.InvalidArgumentError) as raised:
                self.ring.post(ops, notification=bad)
            self.assertIn("notification", raised.exception.message)
        with self.assertRaises(rdma_agent.ArgumentTypeError):
            self.ring.post(ops, notification=17)
        self.assertEqual(self.ring.in_flight, 0)
        # A bigger ring: the agent's --max_notification_bytes bounds it.
        with self.client.open_ring(64) as big:
            self.assertEqual(big.max_notification_bytes, 4096)
            with self.assertRaises(rdma_agent.InvalidArgumentError) as raised:
                big.submit(ops, notification=b"x" * 4097)
            self.assertIn("4097", raised.exception.message)
            [result] = big.submit(ops, notification=b"x" * 4096)
            self.assertTrue(result.ok, result)
        with self.client.open_ring(8, max_notification_bytes=100) as small:
            with self.assertRaises(rdma_agent.InvalidArgumentError):
                small.post(ops, notification=b"x" * 101)
        self.client.get_notifications()

    def test_cancel_of_an_unknown_tag_is_false(self):
        [tag] = self.ring.post([Op("write", self.local, 0, 16, self.handle)], tags=[5])
        self.assertFalse(self.ring.cancel(424242))
        # The write's completion is kept for reap(), whatever the order.
        ends = []
        while not ends:
            ends = self.ring.wait(timeout=30)
        self.assertEqual([(e.tag, e.code) for e in ends], [(5, grpc.StatusCode.OK)])
        self.assertFalse(self.ring.cancel(5))  # completed: no longer running
        with self.assertRaises(rdma_agent.InvalidArgumentError):
            self.ring.cancel(-1)
        self.assertEqual(self.ring.in_flight, 0)

    def test_bad_arguments(self):
        with self.assertRaises(rdma_agent.InvalidArgumentError) as raised:
            self.ring.post([Op("write", self.local, 0, 16, self.target)])  # a context
        self.assertIn("op 0: remote", raised.exception.message)
        with self.assertRaises(rdma_agent.InvalidArgumentError):
            self.ring.post([])
        with self.assertRaises(rdma_agent.InvalidArgumentError):
            self.ring.post([Op("write", self.local, 0, 16, self.handle)], tags=[-1])
        with self.assertRaises(rdma_agent.InvalidArgumentError):
            self.client.open_ring(3)
        with self.assertRaises(rdma_agent.InvalidArgumentError) as raised:
            self.client.open_ring(1 << 13)  # past the agent's --max_ring_entries
        self.assertIn("max_ring_entries", raised.exception.message)
        self.assertEqual(self.ring.in_flight, 0)

    def test_a_lying_tail_stops_the_ring_with_its_reason(self):
        # What a hostile client does: a tail far past the agent's head, and
        # the doorbell a client rings after moving its tail (an agent asleep
        # looks at the ring only when rung).
        self.ring._words[64 // 4] = 1000
        self.ring._doorbell()
        with self.assertRaises(rdma_agent.FailedPreconditionError) as raised:
            self.ring.wait(timeout=30)
        self.assertIn("the agent stopped this ring", raised.exception.message)
        self.assertIn("sq_tail 1000", raised.exception.message)
        with self.assertRaises(rdma_agent.FailedPreconditionError):
            self.ring.post([Op("write", self.local, 0, 16, self.handle)])
        self.assertIs(self.ring.ended.code, grpc.StatusCode.FAILED_PRECONDITION)
        # Only that session: a new one works.
        with self.client.open_ring(4) as other:
            [result] = other.submit([Op("write", self.local, 0, 16, self.handle)])
            self.assertTrue(result.ok, result)

    def test_a_closed_ring_refuses_calls(self):
        self.ring.close()
        with self.assertRaises(rdma_agent.FailedPreconditionError):
            self.ring.post([Op("write", self.local, 0, 16, self.handle)])
        self.ring.close()  # twice is fine


class KilledAgentTest(unittest.TestCase):

    def test_a_killed_agent_fails_the_ring_unavailable(self):
        agent = agents.Agent(AGENTD)
        try:
            client = AgentClient(agent.socket, timeout=30)
            buffer = client.attach(SIZE)
            handle = client.import_remote(buffer)
            ring = client.open_ring(4)
            [result] = ring.submit([Op("write", buffer, 0, 16, handle, 100)])
            self.assertTrue(result.ok, result)
            ring.post([Op("write", buffer, 0, 16, handle, 200)])
            agent.process.kill()
            agent.process.wait(timeout=30)
            started = time.monotonic()
            with self.assertRaises(rdma_agent.UnavailableError):
                while True:  # the op may have ended before the kill
                    ring.wait(timeout=30)
            self.assertLess(time.monotonic() - started, 10)
            with self.assertRaises(rdma_agent.UnavailableError):
                ring.submit([Op("write", buffer, 0, 16, handle)])
            ring.close()
        finally:
            agent.stop()


def wait_stopped(pid: int) -> None:
    """Returns once every thread of `pid` is stopped: kill() returns before
    they are, and a thread still running could answer the next op."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir("/proc/%d/task" % pid):
            with open("/proc/%d/task/%s/stat" % (pid, task)) as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.001)
    raise AssertionError("process %d did not stop" % pid)


class HeldPeerTest(unittest.TestCase):
    """CANCEL of a running batch: its remote is on a second agent over tcp,
    held with SIGSTOP (the kernel accepts its connections; nothing answers)."""

    def setUp(self):
        self.a = agents.Agent(AGENTD)
        self.addCleanup(self.a.stop)
        self.b = agents.Agent(AGENTD)
        self.addCleanup(self.b.stop)
        self.held = False
        self.addCleanup(self.resume)
        self.client = AgentClient(self.a.socket, timeout=30)
        self.addCleanup(self.client.close)
        self.peer = AgentClient(self.b.socket, timeout=30)
        self.addCleanup(self.peer.close)

    def resume(self):
        if self.held:
            os.kill(self.b.process.pid, signal.SIGCONT)
            self.held = False

    def test_a_cancel_ends_the_running_batch_holding_its_tag(self):
        local = self.client.attach(SIZE)
        self.addCleanup(local.close)
        local.memory[:] = pattern(1, SIZE)
        remote = self.peer.attach(SIZE)
        self.addCleanup(remote.close)
        remote.memory[:] = pattern(2, SIZE)
        handle = self.client.import_remote(remote.remote_context)
        self.addCleanup(handle.close)
        ring = self.client.open_ring(8)
        self.addCleanup(ring.close)
        [result] = ring.submit([Op("read", local, 0, 16, handle, 0)], timeout=20)
        self.assertEqual((result.code, result.backend), (grpc.StatusCode.OK, "tcp"), result)
        local.memory[:] = pattern(1, SIZE)

        os.kill(self.b.process.pid, signal.SIGSTOP)
        self.held = True
        wait_stopped(self.b.process.pid)
        self.addCleanup(self.resume)  # before the peer's buffer is released
        ring.post([Op("read", local, 0, 1000, handle, 0),
                   Op("read", local, 2000, 1000, handle, 2000)], timeout=30, tags=[5, 6])
        started = time.monotonic()
        self.assertTrue(ring.cancel(6))
        ends = []
        while len(ends) < 2:
            ends += ring.wait(timeout=30)
        self.assertLess(time.monotonic() - started, 20)
        self.assertEqual(sorted((e.tag, e.code) for e in ends),
                         [(5, grpc.StatusCode.CANCELLED), (6, grpc.StatusCode.CANCELLED)])
        self.assertFalse(ring.cancel(6))  # ended: no running batch holds it
        self.resume()
        # Nothing of the cancelled reads lands, even once the peer answers
        # (a read after them, over the same peer, has ended by then).
        [result] = ring.submit([Op("read", local, 40000, 16, handle, 40000)], timeout=20)
        self.assertTrue(result.ok, result)
        expected = bytearray(pattern(1, SIZE))
        expected[40000:40016] = pattern(2, SIZE)[40000:40016]
        self.assertEqual(bytes(local.memory), bytes(expected))


class AutomaticRingTest(unittest.TestCase):
    """AgentClient.submit() through the client's own ring (ring=True, the
    default): the same results as gRPC, and gRPC whenever the ring cannot
    take the batch."""

    @classmethod
    def setUpClass(cls):
        cls.agent = agents.Agent(AGENTD)

    @classmethod
    def tearDownClass(cls):
        cls.agent.stop()

    def setUp(self):
        self.client = AgentClient(self.agent.socket, timeout=30)
        self.addCleanup(self.client.close)
        self.grpc = AgentClient(self.agent.socket, timeout=30, ring=False)
        self.addCleanup(self.grpc.close)
        self.local = self.client.attach(SIZE)
        self.target = self.client.attach(SIZE)
        self.addCleanup(self.local.close)
        self.addCleanup(self.target.close)
        self.local.memory[:] = pattern(1, SIZE)
        self.target.memory[:] = pattern(2, SIZE)

    def test_submit_with_contexts_runs_through_the_ring(self):
        local, target = bytearray(pattern(1, SIZE)), bytearray(pattern(2, SIZE))
        context = self.target.remote_context
        for round in range(3):
            results = self.client.submit([Op("write", self.local, 100, 5000, context, 777),
                                          Op("read", self.local, 9000, 3000, context, 40000)],
                                         timeout=10)
            self.assertEqual([(r.code, r.message, r.backend) for r in results],
                             [(grpc.StatusCode.OK, "", "memory")] * 2)
        target[777:5777] = local[100:5100]
        local[9000:12000] = target[40000:43000]
        self.assertEqual(bytes(self.target.memory), bytes(target))
        self.assertEqual(bytes(self.local.memory), bytes(local))
        # The context's first use went over gRPC; it was imported once at
        # its second: one handle of this user.
        self.assertEqual(self.client.ring_batches, 2)
        self.assertIsNone(self.client.ring_unavailable)
        self.assertEqual(len(self.client.list_remotes()), 1)

    def test_failed_ops_read_as_over_grpc(self):
        context = self.target.remote_context
        ops = [Op("write", self.local, 0, 16, context, SIZE - 8),
               Op("read", self.local, 0, 16, context, 0),
               Op("read", 987654, 0, 16, context, 0)]
        self.client.submit(ops[1:2], timeout=10)  # the context's first use
        through_ring = self.client.submit(ops, timeout=10)
        self.assertEqual(self.client.ring_batches, 1)
        ops[2] = Op("read", 987654, 0, 16, context, 0)
        over_grpc = self.grpc.submit(ops, timeout=10)
        self.assertEqual([(r.code, r.message) for r in through_ring],
                         [(r.code, r.message) for r in over_grpc])
        self.assertEqual([r.code for r in through_ring],
                         [grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.OK,
                          grpc.StatusCode.NOT_FOUND])
        self.assertIn("op 0:", through_ring[0].message)
        self.assertIn("op 2:", through_ring[2].message)

    def test_batches_the_ring_cannot_take_go_over_grpc(self):
        context = self.target.remote_context
        # A context the agent will not import: Submit words the error.
        [bad] = self.client.submit([Op("read", self.local, 0, 16, b"\x01garbage", 0)],
                                   timeout=10)
        self.assertEqual(bad.code, grpc.StatusCode.INVALID_ARGUMENT, bad)
        self.assertIn("op 0:", bad.message)
        # More ops than the ring has slots.
        many = [Op("read", self.local, i, 1, context, i) for i in range(100)]
        results = self.client.submit(many, timeout=10)
        self.assertTrue(all(r.ok for r in results))
        self.assertEqual(bytes(self.local.memory[:100]), pattern(2, SIZE)[:100])
        self.assertEqual(bytes(self.local.memory[100:]), pattern(1, SIZE)[100:])
        self.assertEqual(self.client.ring_batches, 0)
        # The same client then runs a small batch through the ring, at the
        # context's second use (the large batch never reached the cache).
        for _ in range(2):
            [result] = self.client.submit([Op("read", self.local, 0, 1, context, 0)])
            self.assertTrue(result.ok, result)
        self.assertEqual(self.client.ring_batches, 1)

    def test_no_ring_left_for_the_user_goes_over_grpc(self):
        # The agent's --max_ring_sessions_per_user (4) taken by other rings.
        rings = [self.grpc.open_ring(1) for _ in range(4)]
        for ring in rings:
            self.addCleanup(ring.close)
        [result] = self.client.submit(
            [Op("write", self.local, 0, 64, self.target.remote_context, 64)], timeout=10)
        self.assertTrue(result.ok, result)
        self.assertEqual(bytes(self.target.memory[64:128]), pattern(1, SIZE)[:64])
        self.assertEqual(self.client.ring_batches, 0)
        self.assertEqual(self.client.ring_unavailable.code,
                         grpc.StatusCode.RESOURCE_EXHAUSTED)

    def test_threads_submitting_at_once_all_land(self):
        context = self.target.remote_context
        errors = []

        def run(t):
            try:
                for i in range(50):
                    offset = t * 4096 + i * 64
                    [r] = self.client.submit([Op("read", self.local, offset, 64, context,
                                                  offset)], timeout=10)
                    if not r.ok:
                        errors.append(r)
            except Exception as error:  # noqa: BLE001 - reported below
                errors.append(error)

        import threading
        threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(errors, [])
        expected = bytearray(pattern(1, SIZE))
        for t in range(4):
            expected[t * 4096:t * 4096 + 50 * 64] = \
                pattern(2, SIZE)[t * 4096:t * 4096 + 50 * 64]
        self.assertEqual(bytes(self.local.memory), bytes(expected))
        self.assertGreater(self.client.ring_batches, 0)


class AutomaticRingRestartTest(unittest.TestCase):

    def test_a_restarted_agent_gets_a_new_ring_and_a_killed_one_fails_unavailable(self):
        agent = agents.Agent(AGENTD)
        try:
            client = AgentClient(agent.socket, timeout=30, rejoin=False)
            buffer = client.attach(SIZE)
            for _ in range(2):  # imported at the second use
                [result] = client.submit([Op("write", buffer, 0, 16, buffer.remote_context,
                                             100)])
                self.assertTrue(result.ok, result)
            self.assertEqual(client.ring_batches, 1)
            agent.kill()
            agent.restart()
            buffer = client.attach(SIZE)
            buffer.memory[:] = pattern(3, SIZE)
            for _ in range(2):
                [result] = client.submit([Op("write", buffer, 0, 16, buffer.remote_context,
                                             100)], timeout=10)
                self.assertTrue(result.ok, result)
            self.assertEqual(bytes(buffer.memory[100:116]), pattern(3, SIZE)[:16])
            self.assertEqual(client.ring_batches, 2)
            agent.kill()
            started = time.monotonic()
            with self.assertRaises(rdma_agent.UnavailableError):
                client.submit([Op("write", buffer, 0, 16, buffer.remote_context, 200)],
                              timeout=10)
            self.assertLess(time.monotonic() - started, 10)
            client.close()
        finally:
            agent.stop()


# A version 2 header of 4 entries: submissions at 512 (256 bytes),
# completions at 768 (128), messages at 896 (1024), payloads at 1920
# (1024), 2944 bytes in all.
def header(magic=0x474E4952, version=2, entries=4, submissions=512, completions=768,
           messages=896, total=2944, payloads=1920, size=2944):
    memory = mmap.mmap(-1, size)
    struct.pack_into("<III4xQQQQQ", memory, 0, magic, version, entries, submissions,
                     completions, messages, total, payloads)
    return memory


class CraftedMappingTest(unittest.TestCase):
    """On crafted mappings: the checks of the agent's header before anything
    of it is trusted, the stop reason's bounds, and the payload area's use."""

    def geometry(self, memory):
        return ring_module._read_header(memory, len(memory))

    def test_a_good_header(self):
        self.assertEqual(tuple(self.geometry(header())), (4, 512, 768, 896, 1920, 2944))

    def test_other_versions_are_a_failed_precondition(self):
        for version in [1, 3]:
            with self.subTest(version=version), \
                    self.assertRaises(rdma_agent.FailedPreconditionError) as raised:
                self.geometry(header(version=version))
            self.assertIn("version %d; this client speaks 2" % version,
                          raised.exception.message)

    def test_bad_headers_are_internal_errors(self):
        for bad in [dict(magic=0), dict(entries=3), dict(entries=0),
                    dict(total=1920), dict(total=4096, size=4096),  # not 512 + 608 N
                    dict(submissions=256), dict(completions=600),
                    dict(messages=1800), dict(messages=769),
                    # the payload area over the messages, past the ring, unaligned
                    dict(payloads=1800), dict(payloads=2000), dict(payloads=1924),
                    dict(payloads=0), dict(payloads=512)]:
            with self.subTest(bad=bad), self.assertRaises(rdma_agent.InternalError):
                self.geometry(header(**bad))
        with self.assertRaises(rdma_agent.InternalError):
            ring_module._read_header(header(), 100)
        with self.assertRaises(rdma_agent.InternalError):  # the mapping is short
            ring_module._read_header(header(), 2943)

    def test_payloads_are_reused_only_once_their_entries_are_taken(self):
        memory = header()  # 4 entries: a payload area of 1024 bytes at 1920
        ours, theirs = socket.socketpair()
        self.addCleanup(theirs.close)
        ring = ring_module.Ring(None, ours, memory, self.geometry(memory))
        self.addCleanup(ring.close)
        self.assertEqual(ring.max_notification_bytes, 1024)
        ring._sq_tail = 2  # entries 0 and 1 posted; sq_head 0: neither taken
        self.assertEqual(ring._place(b"a" * 600, 0), 0)
        self.assertEqual(ring._place(b"b" * 300, 1), 600)
        with self.assertRaises(rdma_agent.ResourceExhaustedError):
            ring._place(b"c" * 200, 1)  # would wrap onto entry 0's bytes
        self.assertEqual(ring._place(b"d" * 124, 1), 900)  # fits before the end
        self.assertEqual(bytes(memory[1920:2944]), b"a" * 600 + b"b" * 300 + b"d" * 124)
        struct.pack_into("<I", memory, 128, 1)  # sq_head: the agent took entry 0
        ring._sq_tail = 3
        self.assertEqual(ring._place(b"e" * 500, 2), 0)
        with self.assertRaises(rdma_agent.ResourceExhaustedError):
            ring._place(b"f" * 200, 2)  # entry 1's bytes are still in use
        self.assertEqual(bytes(memory[1920:2944]),
                         b"e" * 500 + b"a" * 100 + b"b" * 300 + b"d" * 124)
        # Far past: all taken, the area is whole again.
        struct.pack_into("<I", memory, 128, 1000)
        ring._sq_tail = 1000
        self.assertEqual(ring._place(b"g" * 1024, 1000), 0)

    def test_the_stop_reason_is_at_most_64_bytes(self):
        # No NUL in the 64 bytes, then submission slot 0's bytes; and a
        # short reason.
        for reason, expected in [(b"r" * 64, "r" * 64), (b"short\0" + b"x" * 58, "short")]:
            memory = header()
            memory[448:512] = reason
            memory[512:640] = b"s" * 128
            struct.pack_into("<I", memory, 320, 2)  # agent_flags: STOPPED
            ours, theirs = socket.socketpair()
            self.addCleanup(theirs.close)
            ours.setblocking(False)
            ring = ring_module.Ring(None, ours, memory, self.geometry(memory))
            self.addCleanup(ring.close)
            with self.subTest(expected=expected), \
                    self.assertRaises(rdma_agent.FailedPreconditionError) as raised:
                ring.reap()
            self.assertEqual(raised.exception.message,
                             "the agent stopped this ring: " + expected)

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--agentd", required=True)
    options, rest = parser.parse_known_args()
    AGENTD = options.agentd
    sys.exit(junit.main(argv=sys.argv[:1] + rest))
