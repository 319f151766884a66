"""The Python shared-memory ring (rdma_agent.ring), installed from its wheel,
against a real rdma-agentd: bytes moved and checked around each op, failed
ops and their messages, pipelined batches, a ring the agent stops for a
lying tail, and an agent killed under a ring. The header checks run on
crafted mappings.

Run by python_venv_test.sh:
    python_ring_test.py --agentd PATH/rdma-agentd
"""

import argparse
import mmap
import random
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
        second = self.ring.post([Op("read", self.local, 20000, 4096, self.handle, 0)],
                                timeout=10)
        self.assertEqual(first, [11, 12])
        self.assertEqual(self.ring.in_flight, 3)
        ends = []
        deadline = time.monotonic() + 30
        while len(ends) < 3 and time.monotonic() < deadline:
            ends += self.ring.wait(timeout=30)
        self.assertEqual([e.tag for e in ends], [11, 12] + second)
        self.assertTrue(all(e.ok for e in ends), ends)
        local = pattern(1, SIZE)
        # The read ran after both writes: it sees the first one's bytes.
        self.assertEqual(bytes(self.local.memory[20000:24096]), local[0:4096])
        self.assertEqual(bytes(self.target.memory[8192:12288]), local[4096:8192])
        self.assertEqual(bytes(self.target.memory[4096:8192]), pattern(2, SIZE)[4096:8192])

    def test_submit_keeps_earlier_completions_for_reap(self):
        [tag] = self.ring.post([Op("write", self.local, 0, 16, self.handle)])
        [result] = self.ring.submit([Op("read", 987654321, 0, 16, self.handle)])
        self.assertEqual(result.code, grpc.StatusCode.NOT_FOUND)
        [end] = self.ring.reap()
        self.assertEqual((end.tag, end.code), (tag, grpc.StatusCode.OK))
        self.assertEqual(self.ring.reap(), [])

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
        # What a hostile client does: a tail far past the agent's head.
        self.ring._words[64 // 4] = 1000
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


def header(magic=0x474E4952, version=1, entries=4, submissions=512, completions=768,
           messages=896, total=1920):
    memory = mmap.mmap(-1, 1920)
    struct.pack_into("<III4xQQQQ", memory, 0, magic, version, entries, submissions,
                     completions, messages, total)
    return memory


class HeaderTest(unittest.TestCase):
    """The checks of the agent's header, before anything of it is trusted."""

    def geometry(self, memory):
        return ring_module._read_header(memory, len(memory))

    def test_a_good_header(self):
        self.assertEqual(tuple(self.geometry(header())), (4, 512, 768, 896, 1920))

    def test_another_version_is_a_failed_precondition(self):
        with self.assertRaises(rdma_agent.FailedPreconditionError) as raised:
            self.geometry(header(version=2))
        self.assertIn("version 2", raised.exception.message)

    def test_bad_headers_are_internal_errors(self):
        for bad in [dict(magic=0), dict(entries=3), dict(entries=0), dict(total=4096),
                    dict(submissions=256), dict(completions=600),
                    dict(messages=1800), dict(messages=769)]:
            with self.subTest(bad=bad), self.assertRaises(rdma_agent.InternalError):
                self.geometry(header(**bad))
        with self.assertRaises(rdma_agent.InternalError):
            ring_module._read_header(header(), 100)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--agentd", required=True)
    options, rest = parser.parse_known_args()
    AGENTD = options.agentd
    sys.exit(junit.main(argv=sys.argv[:1] + rest))
