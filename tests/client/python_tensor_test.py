"""Tensors and arrays with the rdma_agent package (installed from its wheel)
against real rdma-agentd processes: views of registered memory outlive
close(), born-registered tensors and arrays, and memory the caller already
has, moved between two agents.

Run by python_venv_test.sh:  python_tensor_test.py --agentd PATH/rdma-agentd
"""

import argparse
import mmap
import os
import random
import subprocess
import sys
import textwrap
import unittest

import junit
from agents import Agent
from rdma_agent import AgentClient

AGENTD = None


def pattern(seed, size):
    return random.Random(seed).randbytes(size)


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
        cls.agent = Agent(AGENTD)

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


    def test_view_of_memory_registered_in_place_keeps_its_object(self):
        # 8 MiB: numpy's allocator maps it apart and unmaps it when freed.
        code, output = run_python(self.agent.socket, """
            import gc, os, numpy
            from rdma_agent import AgentClient
            with AgentClient(os.environ["SOCKET"]) as agent:
                array = numpy.full(8 << 20, 3, numpy.uint8)
                buffer = agent.register(array, share_edge_pages=True)
                view, start = buffer.memory, buffer.offset
                buffer.close()
                del array, buffer
                gc.collect()
                print("sum", sum(view[start:start + 10]))
        """)
        self.assertEqual(code, 0, output)
        self.assertIn("sum 30", output)


class TensorsBetweenTwoAgentsTest(unittest.TestCase):
    """Two agents (tcp on loopback), one client each: tensors and arrays made
    registered or registered where they are, moved across, every byte
    checked, including those around each op's range."""

    @classmethod
    def setUpClass(cls):
        cls.here_agent, cls.there_agent = Agent(AGENTD), Agent(AGENTD)

    @classmethod
    def tearDownClass(cls):
        codes = [cls.here_agent.stop(), cls.there_agent.stop()]
        assert codes == [0, 0], codes

    def setUp(self):
        import numpy
        import torch
        self.numpy, self.torch = numpy, torch
        self.here = AgentClient(self.here_agent.socket, timeout=30)
        self.there = AgentClient(self.there_agent.socket, timeout=30)

    def tearDown(self):
        for client in (self.here, self.there):
            client.close()
            with AgentClient(client.socket_path, timeout=30) as cleanup:
                for info in cleanup.list_buffers():
                    cleanup.release(info.buffer_id)

    def ids(self, client):
        return {info.buffer_id for info in client.list_buffers()}

    def test_born_registered_tensor_array_and_empty_like(self):
        torch, numpy = self.torch, self.numpy
        source = self.there.tensor((64, 1024), torch.float16)
        self.assertEqual((source.shape, source.dtype), (torch.Size([64, 1024]), torch.float16))
        self.assertEqual(int(source.count_nonzero()), 0)
        source.copy_(torch.arange(64 * 1024, dtype=torch.float16).view(64, 1024))
        target = self.here.empty_like(source)
        self.assertEqual((target.shape, target.dtype), (source.shape, source.dtype))
        buffer, offset = self.there.buffer_of(source)
        self.assertEqual((offset, buffer.size), (0, 64 * 1024 * 2))
        # Rows 10..19 of the remote tensor into rows 30..39 here.
        row = 1024 * 2
        [result] = self.here.submit([rdma_agent_op("read", target[30:40], remote=buffer,
                                                   remote_offset=10 * row)], timeout=30)
        self.assertTrue(result.ok, result)
        self.assertEqual(result.backend, "tcp")
        self.assertTrue(torch.equal(target[30:40], source[10:20]))
        self.assertEqual(int(target[:30].count_nonzero()) + int(target[40:].count_nonzero()), 0)

        array = self.here.ndarray((3, 5), numpy.int32)
        array[:] = numpy.arange(15, dtype=numpy.int32).reshape(3, 5)
        remote_array = self.there.empty_like(array)
        [result] = self.here.submit([rdma_agent_op("write", array[1],
                                                   remote=self.there.buffer_of(remote_array)[0],
                                                   remote_offset=4 * 5)], timeout=30)
        self.assertTrue(result.ok, result)
        self.assertEqual(remote_array.tolist(), [[0] * 5, [5, 6, 7, 8, 9], [0] * 5])

    def test_born_registration_lives_while_a_view_does(self):
        torch = self.torch
        tensor = self.here.tensor(4096, torch.uint8, label="views")
        buffer_id = self.here.buffer_of(tensor)[0].id
        view = tensor[100:200]
        del tensor
        self.here.list_buffers()  # a call: nothing released yet, a view lives
        self.assertIn(buffer_id, self.ids(self.here))
        view[:] = 3  # still mapped
        del view
        # Released at the client's next call once the last view is gone.
        self.here.info()
        self.here.tensor(8, torch.uint8)
        self.assertNotIn(buffer_id, self.ids(self.here))

    def existing_cases(self):
        """(name, object, its bytes as they are, share_edge_pages) of memory
        made the usual way: not page-aligned, so it needs the flag."""
        torch, numpy = self.torch, self.numpy
        tensor = torch.tensor(list(range(3000)), dtype=torch.int32)
        array = numpy.frombuffer(pattern(40, 50000), dtype=numpy.uint8).copy()
        raw = bytearray(pattern(41, 10000))
        return [("torch", tensor), ("numpy", array), ("bytearray", raw)]

    def test_existing_tensor_array_and_bytearray_register_in_place(self):
        torch, numpy = self.torch, self.numpy
        for name, obj in self.existing_cases():
            with self.subTest(name=name):
                view = memoryview(obj) if name == "bytearray" else obj[:]  # made before
                before = bytes(memoryview(obj).cast("B")) if name != "torch" \
                    else obj.numpy().tobytes()
                with self.here.register(obj, share_edge_pages=True, label=name) as buffer:
                    self.assertGreaterEqual(buffer.size, len(before))
                    self.assertEqual(buffer.size % 4096, 0)
                    # The contents are kept, in place.
                    self.assertEqual(bytes(buffer.memory[buffer.offset:buffer.offset +
                                                         len(before)]), before)
                    # A peer writes the middle; the object (and the view made
                    # before registering) sees it without a copy.
                    peer = self.there.attach(len(before))
                    peer.memory[:] = pattern(42, len(before))
                    middle = slice(len(before) // 4, len(before) // 2)
                    [result] = self.here.submit([rdma_agent_op(
                        "read", obj, middle.start, middle.stop - middle.start,
                        peer, middle.start)], timeout=30)
                    self.assertTrue(result.ok, result)
                    expected = bytearray(before)
                    expected[middle] = pattern(42, len(before))[middle]
                    now = bytes(memoryview(obj).cast("B")) if name != "torch" \
                        else obj.numpy().tobytes()
                    self.assertEqual(now, bytes(expected))  # outside the range: unchanged
                    seen = bytes(view) if name == "bytearray" else \
                        (view.numpy().tobytes() if name == "torch" else view.tobytes())
                    self.assertEqual(seen, bytes(expected))
                    # And the other way: the whole object onto the peer.
                    [result] = self.here.submit([rdma_agent_op("write", obj, remote=peer)],
                                                timeout=30)
                    self.assertTrue(result.ok, result)
                    self.assertEqual(bytes(peer.memory), bytes(expected))
                    peer.close()
                # Closed: released, and the object is still good memory.
                self.assertNotIn(buffer.id, self.ids(self.here))
                if name == "torch":
                    self.assertEqual(int(obj.sum()), int(torch.tensor(
                        numpy.frombuffer(bytes(expected), dtype=numpy.int32)).sum()))

    def test_edges_shared_with_other_objects_need_consent_and_overlaps_are_refused(self):
        numpy = self.numpy
        array = numpy.zeros(100000, dtype=numpy.uint8)
        with self.assertRaises(ValueError) as raised:
            self.here.register(array)
        self.assertIn("share_edge_pages=True", str(raised.exception))
        self.assertIn("does not fill whole pages", str(raised.exception))
        # Whole pages need no consent: anonymous pages of an mmap.
        anonymous = mmap.mmap(-1, 3 * 4096)
        pages = numpy.frombuffer(anonymous, dtype=numpy.uint8)
        pages[:] = numpy.frombuffer(pattern(43, 3 * 4096), dtype=numpy.uint8)
        with self.here.register(pages[4096:8192]) as buffer:
            self.assertEqual((buffer.size, buffer.offset), (4096, 0))
            self.assertEqual(bytes(buffer.memory), pattern(43, 3 * 4096)[4096:8192])
            self.assertEqual(self.here.read_buffer(buffer.id, 0, 4096),
                             pattern(43, 3 * 4096)[4096:8192])
        with self.here.register(array, share_edge_pages=True) as buffer:
            with self.assertRaises(ValueError) as raised:
                self.here.register(array[10:20], share_edge_pages=True)
            self.assertIn("shares pages with buffer %d" % buffer.id, str(raised.exception))
        with self.assertRaises(ValueError) as raised:
            self.here.register(self.torch.zeros(4, 4).t())
        self.assertIn("not contiguous", str(raised.exception))
        with self.assertRaises(ValueError) as raised:
            self.here.register(numpy.zeros(4096, numpy.uint8)[::2], share_edge_pages=True)
        self.assertIn("not C-contiguous", str(raised.exception))
        with self.assertRaises(ValueError):
            self.here.register(bytes(100), share_edge_pages=True)  # read-only
        # A registered bytearray cannot be resized (its bytes would move away).
        raw = bytearray(10000)
        with self.here.register(raw, share_edge_pages=True) as buffer:
            with self.assertRaises(BufferError):
                raw.extend(b"more")
            view = buffer.memory
        with self.assertRaises(BufferError):
            raw.extend(b"more")  # a view of the registration still points there
        del view
        raw.extend(b"more")


class BlockPoolTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.agent = Agent(AGENTD)

    @classmethod
    def tearDownClass(cls):
        assert cls.agent.stop() == 0

    def test_blocks_by_id_between_two_pools(self):
        import torch
        from rdma_agent import BlockPool
        with AgentClient(self.agent.socket, timeout=30) as client:
            a = BlockPool(client, 8, (4, 100), torch.int16)
            b = BlockPool(client, 6, (4, 100), torch.int16)
            self.assertEqual((a.block_bytes, a.free_count()), (800, 8))
            ids = a.allocate(3)
            self.assertEqual(ids, [0, 1, 2])
            for block in ids:
                a.blocks[block].fill_(block + 1)
            results = client.submit(a.ops("write", ids, b, remote_blocks=[5, 0, 3]), timeout=30)
            self.assertTrue(all(r.ok for r in results), results)
            self.assertEqual([int(b.blocks[i][0][0]) for i in range(6)], [2, 0, 0, 3, 0, 1])
            self.assertEqual([int(b.blocks[i].count_nonzero()) for i in range(6)],
                             [400, 0, 0, 400, 0, 400])
            with self.assertRaises(ValueError) as raised:
                a.allocate(6)
            self.assertIn("6 blocks asked, 5 of 8 free", str(raised.exception))
            with self.assertRaises(ValueError):
                a.free([7])  # never allocated
            with self.assertRaises(ValueError):
                a.ops("read", [0, 1], b, remote_blocks=[1])
            with self.assertRaises(ValueError):
                a.ops("read", [8], b)
            a.free(ids)
            self.assertEqual(a.free_count(), 8)
            # The pool's registration goes with its tensor.
            buffer_id = a.buffer.id
            del a
            client.info()
            self.assertNotIn(buffer_id, [i.buffer_id for i in client.list_buffers()])


def rdma_agent_op(*args, **kwargs):
    import rdma_agent
    return rdma_agent.Op(*args, **kwargs)


def main():
    global AGENTD
    parser = argparse.ArgumentParser()
    parser.add_argument("--agentd")
    args, rest = parser.parse_known_args()
    AGENTD = args.agentd
    return junit.main(argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
    sys.exit(main())
