"""rdma_agent.nixl on one rdma-agentd: two nixl_agents of one process (one
user), metadata exchanged with get_agent_metadata/add_remote_agent and over
the listener, loopback transfers, notifications, and a clear error for each
bad argument. Needs no root; python_nixl_test covers two hosts.

Run by python_venv_test.sh:  python_nixl_api_test.py --agentd PATH/rdma-agentd
"""

import argparse
import json
import mmap
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np
import torch

import junit
from rdma_agent import AgentClient, AgentError
from rdma_agent.nixl import nixl_agent, nixl_agent_config

AGENTD = None


class NixlApiTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="rana.", dir="/tmp")
        cls.socket = os.path.join(cls.dir, "agent.sock")
        cls.log = open(os.path.join(cls.dir, "log"), "w+")
        cls.agentd = subprocess.Popen(
            [AGENTD, "--runtime_dir=" + cls.dir, "--state_dir=" + cls.dir,
             "--backends=memory", "--peer_listen=127.0.0.1:0"],
            stdout=cls.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(cls.dir, "attach.sock")):
            assert cls.agentd.poll() is None and time.monotonic() < deadline, "no agent"
            time.sleep(0.02)
        time.sleep(0.2)

    @classmethod
    def tearDownClass(cls):
        cls.agentd.terminate()
        code = cls.agentd.wait(timeout=30)
        cls.log.close()
        shutil.rmtree(cls.dir, ignore_errors=True)
        assert code == 0, code

    def setUp(self):
        config = nixl_agent_config(True, True, 0, socket=self.socket)
        self.a = nixl_agent("a", config)
        self.b = nixl_agent("b", nixl_agent_config(socket=self.socket))

    def tearDown(self):
        self.a.close()
        self.b.close()
        with AgentClient(self.socket) as client:
            self.assertEqual(list(client.list_buffers()), [], "registrations left behind")

    def wait_state(self, agent, handle):
        deadline = time.monotonic() + 30
        while (state := agent.check_xfer_state(handle)) == "PROC":
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.001)
        return state

    def test_metadata_by_bytes_then_reads_writes_and_notifications(self):
        # Pages of their own: a and b are agents of one process, and a
        # region sharing pages with another's registration is refused.
        source = torch.frombuffer(mmap.mmap(-1, 16384), dtype=torch.int32)
        source[:] = torch.arange(4096, dtype=torch.int32)
        target = torch.frombuffer(mmap.mmap(-1, 16384), dtype=torch.int32)
        source_regs = self.a.register_memory(source)
        target_regs = self.b.register_memory(target)
        self.assertEqual(self.b.add_remote_agent(self.a.get_agent_metadata()), "a")
        self.assertEqual(self.a.add_remote_agent(self.b.get_agent_metadata()), "b")
        self.assertTrue(self.b.check_remote_metadata("a", [source[100:200]]))
        self.assertFalse(self.b.check_remote_metadata("a", [target[0:10]]))
        self.assertFalse(self.b.check_remote_metadata("c"))

        # b reads elements 100..199 of a into its 1000..1099, then writes its
        # 0..9 into a's 4000..4009, notifying a.
        read = self.b.initialize_xfer("READ", self.b.get_xfer_descs(target[1000:1100]),
                                      self.b.get_xfer_descs(source[100:200]), "a", b"read")
        self.assertEqual(self.b.transfer(read), "PROC")
        self.assertEqual(self.wait_state(self.b, read), "DONE")
        expected = torch.zeros(4096, dtype=torch.int32)
        expected[1000:1100] = torch.arange(100, 200, dtype=torch.int32)
        self.assertTrue(torch.equal(target, expected))
        telemetry = self.b.get_xfer_telemetry(read)
        self.assertEqual((telemetry.totalBytes, telemetry.descCount), (400, 1))
        self.assertEqual(self.b.query_xfer_backend(read), "memory")

        target[:10] = -7
        # From (addr, len, dev) tuples to an Nx3 array, as NIXL takes them.
        local = self.b.get_xfer_descs([(target[0:10].data_ptr(), 40, 0)], "DRAM")
        remote = self.b.get_xfer_descs(
            np.array([[source[4000:4010].data_ptr(), 40, 0]], dtype=np.uint64), "cpu")
        write = self.b.initialize_xfer("WRITE", local, remote, "a", "wrote")
        self.assertEqual(self.b.transfer(write), "PROC")
        self.assertEqual(self.wait_state(self.b, write), "DONE")
        self.assertEqual(source[3999:4011].tolist(), [3999] + [-7] * 10 + [4010])
        deadline = time.monotonic() + 30
        seen = []
        while len(seen) < 2:
            self.assertLess(time.monotonic(), deadline, seen)
            seen += self.a.get_new_notifs().get("b", [])
        self.assertEqual(sorted(seen), [b"read", b"wrote"])
        # b, of the same user on the same agent, saw none of them.
        self.assertEqual(self.b.get_new_notifs(), {})
        self.b.send_notif("a", "hello")
        deadline = time.monotonic() + 30
        while not self.a.check_remote_xfer_done("b", b"hel"):
            self.assertLess(time.monotonic(), deadline)
        self.assertEqual(self.a.notifs.get("b", []), [])

        # Reposting a transfer that ended runs it again.
        target[1000:1100] = 0
        self.assertEqual(self.b.transfer(read), "PROC")
        self.assertEqual(self.wait_state(self.b, read), "DONE")
        self.assertTrue(torch.equal(target[1000:1100], torch.arange(100, 200, dtype=torch.int32)))
        self.b.release_xfer_handle(read)
        self.assertEqual(self.b.transfer(read), "ERR")
        self.b.deregister_memory(target_regs)
        self.a.deregister_memory(source_regs)

    def test_metadata_over_the_listener_and_loopback(self):
        tensor = torch.zeros((8, 64), dtype=torch.uint8)
        regs = self.b.register_memory(tensor)
        self.b.send_local_metadata("127.0.0.1", self.a.listen_port)
        self.b.fetch_remote_metadata("a", "127.0.0.1", self.a.listen_port)
        deadline = time.monotonic() + 30
        while not (self.a.check_remote_metadata("b") and self.b.check_remote_metadata("a")):
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.01)
        self.b.invalidate_local_metadata("127.0.0.1", self.a.listen_port)
        while self.a.check_remote_metadata("b"):
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.01)
        # A bad peer gets its connection closed; the listener serves on.
        with socket.create_connection(("127.0.0.1", self.a.listen_port)) as bad:
            bad.sendall(struct.pack("<I", 1 << 30))
            self.assertEqual(bad.recv(1), b"")
        with socket.create_connection(("127.0.0.1", self.a.listen_port)) as bad:
            body = json.dumps({"op": "send_md", "md": "{}"}).encode()
            bad.sendall(struct.pack("<I", len(body)) + body)
            self.assertEqual(bad.recv(1), b"")

        # A peer that never finishes its message holds the listener at most
        # 10 s; then metadata flows again.
        with socket.create_connection(("127.0.0.1", self.a.listen_port)) as silent:
            silent.sendall(b"\x10")
            started = time.monotonic()
            self.b.send_local_metadata("127.0.0.1", self.a.listen_port)
            while not self.a.check_remote_metadata("b"):
                self.assertLess(time.monotonic() - started, 25, "the listener stayed held")
                time.sleep(0.05)
            self.assertGreater(time.monotonic() - started, 5)  # it did wait for the peer
            self.assertEqual(silent.recv(1), b"")  # and then cut it off

        # Loopback: rows 0..3 into rows 4..7 of the same tensor, by index.
        tensor[:4] = torch.tensor(list(random.Random(3).randbytes(256)),
                                  dtype=torch.uint8).view(4, 64)
        rows = [tensor[i] for i in range(8)]
        local = self.b.prep_xfer_dlist("NIXL_INIT_AGENT", rows)
        loop = self.b.prep_xfer_dlist("b", rows)
        handle = self.b.make_prepped_xfer("WRITE", local, np.arange(4, dtype=np.int64), loop,
                                          np.arange(4, 8, dtype=np.int64), notif_msg=b"loop")
        self.assertEqual(self.b.transfer(handle), "PROC")
        self.assertEqual(self.wait_state(self.b, handle), "DONE")
        self.assertTrue(torch.equal(tensor[4:], tensor[:4]))
        deadline = time.monotonic() + 30
        while not self.b.check_remote_xfer_done("b", b"loop"):
            self.assertLess(time.monotonic(), deadline)
        self.b.deregister_memory(regs)

    def test_metadata_through_the_agents_directory(self):
        # Pages of their own (a and b are agents of one process).
        source = torch.frombuffer(mmap.mmap(-1, 8192), dtype=torch.uint8)
        source[:] = torch.tensor(list(random.Random(5).randbytes(8192)), dtype=torch.uint8)
        target = torch.frombuffer(mmap.mmap(-1, 8192), dtype=torch.uint8)
        self.a.register_memory(source)
        self.b.register_memory(target)
        # b follows a before a has published anything: it arrives when a does.
        self.b.fetch_remote_metadata("a")
        time.sleep(0.2)
        self.assertFalse(self.b.check_remote_metadata("a"))
        self.a.send_local_metadata()
        self.wait_until(lambda: self.b.check_remote_metadata("a", [source[0:8192]]))
        with AgentClient(self.socket) as client:
            record = client.resolve("nixl/agents/a")
            self.assertEqual(record.visibility, "owner")
            size = struct.unpack("<Q", client.read_buffer(record.buffer_id, 0, 8))[0]
            metadata = json.loads(client.read_buffer(record.buffer_id, 8, size))
        self.assertEqual(metadata["name"], "a")
        self.assertEqual(len(metadata["regions"]), 1)

        read = self.b.initialize_xfer("READ", self.b.get_xfer_descs(target[100:1100]),
                                      self.b.get_xfer_descs(source[200:1200]), "a")
        self.assertEqual(self.b.transfer(read), "PROC")
        self.assertEqual(self.wait_state(self.b, read), "DONE")
        self.assertTrue(torch.equal(target[100:1100], source[200:1200]))
        self.assertEqual(int(target[:100].count_nonzero()) + int(target[1100:].count_nonzero()),
                         0)

        # Withdrawn: the follower drops it; sent again: fetched again.
        self.a.invalidate_local_metadata()
        self.wait_until(lambda: not self.b.check_remote_metadata("a"))
        self.a.send_local_metadata()
        self.wait_until(lambda: self.b.check_remote_metadata("a"))
        # A fetch of an agent already published loads it at once.
        self.b.send_local_metadata()
        self.a.fetch_remote_metadata("b")
        self.wait_until(lambda: self.a.check_remote_metadata("b", [target[0:10]]))
        self.b.release_xfer_handle(read)

    def wait_until(self, condition):
        deadline = time.monotonic() + 30
        while not condition():
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.01)

    def test_regions_of_one_call_sharing_pages_share_a_registration(self):
        block = torch.zeros(12000, dtype=torch.uint8)
        page = -(-block.data_ptr() // 4096) * 4096  # both regions touch this page
        regions = [(page + 100, 1000, 0, "x"), (page + 3000, 3000, 0, "y")]
        regs = self.b.register_memory(self.b.get_reg_descs(regions, "DRAM"))
        answers = self.b.query_memory(regs, "UCX")
        self.assertEqual(answers[0]["buffer_id"], answers[1]["buffer_id"])
        self.assertIsNone(self.b.query_memory([(page + 1500, 10, 0, "")], "UCX",
                                              "DRAM")[0])
        # Inside the registration: the same one, released with the last region.
        inside = self.b.register_memory([(page + 1200, 10, 0, "")], "DRAM")
        self.assertEqual(self.b.query_memory(inside, "UCX")[0]["buffer_id"],
                         answers[0]["buffer_id"])
        self.b.deregister_memory(inside)
        self.assertEqual(self.b.query_memory(regs, "UCX"), answers)
        # Straddling its end: refused, nothing moved.
        with self.assertRaises(ValueError) as raised:
            self.b.register_memory([(page + 5000, 8000, 0, "")], "DRAM")
        self.assertIn("shares pages with buffer %s of this client" % answers[0]["buffer_id"],
                      str(raised.exception))
        # Another agent of this process may not take those pages either.
        with self.assertRaises(ValueError) as raised:
            self.a.register_memory([(page + 5000, 8000, 0, "")], "DRAM")
        self.assertIn("another client of this process", str(raised.exception))
        self.b.deregister_memory(regs)
        with AgentClient(self.socket) as client:
            self.assertEqual(len(client.list_buffers()), 2)  # the two mailboxes
        strict = nixl_agent("strict", nixl_agent_config(socket=self.socket,
                                                        share_edge_pages=False))
        try:
            with self.assertRaises(ValueError) as raised:
                strict.register_memory(block)
            self.assertIn("does not fill whole pages", str(raised.exception))
        finally:
            strict.close()

    def test_bad_arguments_name_what_is_wrong(self):
        tensor = torch.zeros(1024, dtype=torch.uint8)
        regs = self.b.register_memory(tensor)
        self.b.add_remote_agent(self.a.get_agent_metadata())
        local = self.b.prep_xfer_dlist("", [tensor[0:16], tensor[16:32]])
        cases = [
            (lambda: self.b.initialize_xfer("PUT", [tensor[0:8]], [tensor[8:16]], "b"),
             ValueError, "operation 'PUT' is not one of 'READ', 'WRITE'"),
            (lambda: self.b.get_xfer_descs([(1, 2, 0)], "VRAM"), ValueError,
             "host memory (DRAM) only"),
            (lambda: self.b.get_xfer_descs([(1, 2, 0)], "HBM"), ValueError,
             "mem_type 'HBM' is not one of"),
            (lambda: self.b.get_xfer_descs([(1, 2)], "DRAM"), ValueError,
             "descriptor 0 must be a 3-tuple"),
            (lambda: self.b.get_xfer_descs(np.zeros((2, 2), np.uint64), "DRAM"), ValueError,
             "must be Nx3"),
            (lambda: self.b.get_xfer_descs("rows"), TypeError, "get_xfer_descs: descs"),
            (lambda: self.b.prep_xfer_dlist("", [torch.zeros(8)]), ValueError,
             "local descriptor 0"),
            (lambda: self.b.prep_xfer_dlist("nobody", [tensor[0:8]]), ValueError,
             "no metadata of remote agent 'nobody'"),
            (lambda: self.b.prep_xfer_dlist("a", [tensor[0:8]]), ValueError,
             "remote descriptor 0"),
            (lambda: self.b.make_prepped_xfer("READ", local, [0, 5], local, [0, 1]),
             ValueError, "make_prepped_xfer: local index 5 of 2"),
            (lambda: self.b.initialize_xfer("READ", [tensor[0:8]], [tensor[8:24]], "b"),
             ValueError, "descriptor pair 0 has 8 local and 16 remote bytes"),
            (lambda: self.b.add_remote_agent(b"not json"), ValueError,
             "add_remote_agent: malformed metadata"),
            (lambda: self.b.deserialize_descs(b"\x80pickle"), ValueError,
             "deserialize_descs: not a serialized descriptor list"),
            (lambda: self.b.deregister_memory(self.b.get_reg_descs([(8, 8, 0, "")], "DRAM")),
             ValueError, "deregister_memory: descriptor 0"),
            (lambda: self.b.fetch_remote_metadata(""), ValueError,
             "remote_agent must be a non-empty str"),
            (lambda: nixl_agent_config(metadata_visibility="all"), ValueError,
             "metadata_visibility"),
            (lambda: self.b.get_xfer_telemetry(self.b.initialize_xfer(
                "READ", [tensor[0:8]], [tensor[8:16]], "b")), AgentError, "has not ended"),
        ]
        for index, (call, kind, words) in enumerate(cases):
            with self.subTest(case=index):
                with self.assertRaises(kind) as raised:
                    call()
                self.assertIsInstance(raised.exception, AgentError)
                self.assertIn(words, str(raised.exception))
        round_trip = self.b.deserialize_descs(self.b.get_serialized_descs(
            self.b.get_xfer_descs([tensor[0:8], tensor[8:16]])))
        self.assertEqual(round_trip, self.b.get_xfer_descs([tensor[0:8], tensor[8:16]]))
        self.b.deregister_memory(regs)


def main():
    global AGENTD
    parser = argparse.ArgumentParser()
    parser.add_argument("--agentd")
    args, rest = parser.parse_known_args()
    AGENTD = args.agentd
    return junit.main(argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
    sys.exit(main())
