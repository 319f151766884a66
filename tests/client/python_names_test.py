"""Names in the Python client, installed from its wheel, against real
rdma-agentd processes: publish, unpublish, resolve, watch_names,
list_agents and Op(remote_name=...) on one agent (its local directory);
between two agents sharing a real etcd, a peer waiting on a watch moves
bytes to the other's buffer by name; and after the publishing agent is
killed (-9) and restarted, the client's buffers are registered again and
their names published again, so that a peer reaches the same memory by name
on the new epoch; rdma_agent.nixl agents on the two agents exchange metadata
through the directory and find each other again after such a restart.

Run by python_venv_test.sh:
    python_names_test.py --agentd PATH/rdma-agentd
"""

import argparse
import asyncio
import mmap
import random
import sys
import threading
import time
import unittest

import junit
from agents import Agent, Etcd
from rdma_agent import (AgentClient, AgentError, ArgumentTypeError, InvalidArgumentError,
                        NameEvent, NotFoundError, Op)

AGENTD = None


def pattern(seed, size):
    return random.Random(seed).randbytes(size)


def eventually(condition, timeout=20.0):
    """Polls `condition` until it is true (its value) or `timeout` passes
    (None)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    return None


class NamesOnOneAgentTest(unittest.TestCase):
    """One agent, its embedded local directory."""

    def setUp(self):
        self.agent = Agent(AGENTD)
        self.client = AgentClient(self.agent.socket, timeout=30)

    def tearDown(self):
        self.client.close()
        self.assertEqual(self.agent.stop(), 0)

    def test_publish_resolve_unpublish(self):
        buffer = self.client.attach(8192, access="read")
        buffer.publish("kv/a")
        self.client.publish(buffer.id, "kv/b", visibility="any_user")
        self.assertEqual(buffer.names, ["kv/a", "kv/b"])
        record = self.client.resolve("kv/a")
        self.assertEqual(record.name, "kv/a")
        self.assertEqual(record.remote_context, buffer.remote_context)
        self.assertEqual(record.buffer_id, buffer.id)
        self.assertEqual(record.agent_id, self.client.info().agent_id)
        self.assertEqual(record.agent_epoch, buffer.epoch)
        self.assertEqual(record.visibility, "owner")
        self.assertGreater(record.published_at, time.time() - 60)
        self.assertEqual(self.client.resolve("kv/b").visibility, "any_user")

        self.client.unpublish("kv/a")
        self.assertEqual(buffer.names, ["kv/b"])
        with self.assertRaises(NotFoundError) as raised:
            self.client.resolve("kv/a")
        self.assertIn("kv/a", raised.exception.message)
        with self.assertRaises(NotFoundError):
            self.client.unpublish("kv/a")
        # A name stands for one buffer: publishing it again moves it.
        other = self.client.attach(4096)
        other.publish("kv/b")
        self.assertEqual(buffer.names, [])
        self.assertEqual(other.names, ["kv/b"])
        self.assertEqual(self.client.resolve("kv/b").buffer_id, other.id)
        # Names go with their buffer.
        other.close()
        with self.assertRaises(NotFoundError):
            self.client.resolve("kv/b")

    def test_bad_arguments_are_refused_before_sending(self):
        buffer = self.client.attach(4096)
        with self.assertRaises(InvalidArgumentError) as raised:
            buffer.publish("kv/x", visibility="everyone")
        self.assertIn("'owner', 'any_user'", str(raised.exception))
        with self.assertRaises(ArgumentTypeError):
            self.client.publish(buffer, b"kv/x")
        with self.assertRaises(ArgumentTypeError):
            self.client.publish("kv/x", "kv/x")
        with self.assertRaises(InvalidArgumentError):
            self.client.resolve("")
        with self.assertRaises(ArgumentTypeError):
            self.client.watch_names(7)
        with self.assertRaises(InvalidArgumentError) as raised:
            Op("read", buffer, remote=buffer, remote_name="kv/x")
        self.assertIn("both set", str(raised.exception))
        with self.assertRaises(ArgumentTypeError):
            Op("read", buffer, remote_name=3)
        # What the agent refuses comes back with its code.
        with self.assertRaises(InvalidArgumentError) as raised:
            buffer.publish("/absolute")
        self.assertIn("Publish", raised.exception.message)
        with self.assertRaises(NotFoundError):
            self.client.publish(buffer.id + 1000, "kv/x")
        self.assertEqual(buffer.names, [])

    def test_list_agents_shows_this_agent(self):
        agents = self.client.list_agents()
        self.assertEqual(agents.directory, "local")
        self.assertEqual([a.info.agent_id for a in agents.agents],
                         [self.client.info().agent_id])
        self.assertEqual(agents.agents[0].info.epoch, self.client.info().epoch)

    def test_op_names_its_remote_by_name(self):
        source = self.client.attach(4096, access="read")
        sink = self.client.attach(4096)
        source.memory[:] = pattern(1, 4096)
        sink.memory[:] = pattern(2, 4096)
        source.publish("blocks/1")
        [result] = self.client.submit(
            [Op("read", sink, 100, 1000, remote_name="blocks/1", remote_offset=200)], timeout=5)
        self.assertTrue(result.ok, result)
        expected = bytearray(pattern(2, 4096))
        expected[100:1100] = pattern(1, 4096)[200:1200]
        self.assertEqual(bytes(sink.memory), bytes(expected))
        # length None: the rest of the local side.
        [result] = self.client.submit([Op("read", sink, 1024, remote_name="blocks/1")], timeout=5)
        self.assertTrue(result.ok, result)
        self.assertEqual(bytes(sink.memory[1024:]), pattern(1, 4096)[:3072])
        [result] = self.client.submit([Op("read", sink, 0, 16, remote_name="blocks/none")],
                                      timeout=5)
        self.assertEqual(result.code.name, "NOT_FOUND", result)

    def test_watch_names_snapshot_synced_changes(self):
        first = self.client.attach(4096)
        first.publish("kv/first")
        first.publish("other/first")
        events = []
        with self.client.watch_names("kv/") as stream:
            def read():
                for event in stream:
                    events.append(event)
            reader = threading.Thread(target=read)
            reader.start()
            self.assertTrue(eventually(lambda: len(events) >= 2))
            second = self.client.attach(4096)
            second.publish("kv/second")
            second.publish("other/second")
            self.client.unpublish("kv/second")
            first.close()
            self.assertTrue(eventually(lambda: len(events) >= 5), events)
        reader.join(10)
        self.assertFalse(reader.is_alive())  # close() ended the iteration
        self.assertEqual([(e.kind, e.record and e.record.name) for e in events],
                         [("published", "kv/first"), ("synced", None),
                          ("published", "kv/second"), ("withdrawn", "kv/second"),
                          ("withdrawn", "kv/first")])
        self.assertIsInstance(events[0], NameEvent)
        self.assertEqual(events[2].record.remote_context, second.remote_context)
        self.assertEqual(events[3].record.remote_context, b"")

    def test_watch_names_in_asyncio_and_wait_for(self):
        buffer = self.client.attach(4096)

        async def watch():
            kinds = []
            async with self.client.watch_names("a/") as stream:
                async for event in stream:
                    kinds.append(event.kind)
                    if event.kind == "synced":
                        buffer.publish("a/one")
                    elif event.kind == "published":
                        return kinds, event.record

        kinds, record = asyncio.run(asyncio.wait_for(watch(), 20))
        self.assertEqual(kinds, ["synced", "published"])
        self.assertEqual(record.name, "a/one")

        stream = self.client.watch_names("b/")
        timer = threading.Timer(0.2, buffer.publish, ("b/two",))
        timer.start()
        self.assertEqual(stream.wait_for("b/two").buffer_id, buffer.id)
        stream.close()
        timer.join()
        with self.assertRaises(AgentError) as raised:
            stream.wait_for("b/never")
        self.assertEqual(raised.exception.code.name, "CANCELLED")

    def test_watch_ends_when_the_agent_stops(self):
        stream = self.client.watch_names()
        events = iter(stream)
        self.assertEqual(next(events).kind, "synced")
        self.agent.kill()
        with self.assertRaises(AgentError) as raised:
            next(events)
        self.assertEqual(raised.exception.code.name, "UNAVAILABLE")
        self.agent.restart()

    def test_rejoin_without_a_restart_changes_nothing(self):
        buffer = self.client.attach(4096)
        buffer.publish("still/here")
        before = (buffer.id, buffer.remote_context)
        self.assertEqual(self.client.rejoin(), [])
        self.assertEqual((buffer.id, buffer.remote_context), before)


class NamesAcrossAgentsTest(unittest.TestCase):
    """Two agents sharing one real etcd."""

    def setUp(self):
        self.etcd = Etcd()
        self.a = Agent(AGENTD, flags=["--agent_id=agent-a",
                                      "--directory=" + self.etcd.directory])
        self.b = Agent(AGENTD, flags=["--agent_id=agent-b",
                                      "--directory=" + self.etcd.directory])
        self.rejoined = []
        self.on_a = AgentClient(self.a.socket, timeout=30,
                                on_rejoin=lambda buffer, old: self.rejoined.append((buffer, old)))
        self.on_b = AgentClient(self.b.socket, timeout=30)

    def tearDown(self):
        self.on_a.close()
        self.on_b.close()
        self.a.stop()
        self.b.stop()
        self.etcd.stop()

    def test_a_peer_waits_for_a_name_and_writes_by_it(self):
        self.assertEqual([a.info.agent_id for a in self.on_b.list_agents().agents],
                         ["agent-a", "agent-b"])
        self.assertEqual(self.on_b.list_agents().directory, self.etcd.directory)
        size = 1 << 20
        stream = self.on_b.watch_names("decode/")
        tensor = self.on_a.tensor(size + 4096, dtype=__import__("torch").uint8)
        buffer, _ = self.on_a.buffer_of(tensor)
        buffer.memory[:] = pattern(3, size + 4096)
        threading.Timer(0.2, buffer.publish, ("decode/kv",)).start()
        record = stream.wait_for("decode/kv")
        stream.close()
        self.assertEqual(record.agent_id, "agent-a")
        self.assertEqual(self.on_b.resolve("decode/kv").remote_context, buffer.remote_context)

        with self.on_b.attach(size) as mine:
            mine.memory[:] = pattern(4, size)
            [result] = self.on_b.submit(
                [Op("write", mine, remote_name="decode/kv", remote_offset=4096)], timeout=10)
            self.assertTrue(result.ok, result)
            self.assertEqual(result.backend, "tcp")
        expected = pattern(3, 4096) + pattern(4, size)
        self.assertEqual(bytes(tensor.numpy()), expected)

    def test_buffers_come_back_under_their_names_after_the_agent_restarts(self):
        size = 64 << 10
        mine = self.on_a.attach(size)            # attached memfd
        tensor = self.on_a.ndarray(size, "uint8")  # born registered
        born, _ = self.on_a.buffer_of(tensor)
        pinned = self.on_a.attach(4096, lifetime="agent")  # not lifetime-bound
        mine.publish("prefill/blocks")
        born.publish("prefill/array", visibility="any_user")
        pinned.publish("prefill/pinned")
        old_epoch, old_ids = mine.epoch, (mine.id, born.id)
        memory = mine.memory

        self.a.kill()
        self.a.restart()
        self.assertTrue(eventually(lambda: len(self.rejoined) == 2),
                        "not registered again: %r" % (self.on_a.rejoin_error,))
        self.assertNotEqual(born.epoch, old_epoch)
        self.assertEqual(mine.epoch, self.on_a.info().epoch)
        self.assertIs(mine.memory, memory)
        self.assertEqual(sorted((id(b), old) for b, old in self.rejoined),
                         sorted([(id(mine), old_ids[0]), (id(born), old_ids[1])]))
        self.assertEqual(pinned.epoch, old_epoch)  # its owner is the old agent
        self.assertEqual(mine.names, ["prefill/blocks"])
        # The peer's re-resolve finds the new registration under the name.
        record = eventually(lambda: self._resolved_on_b("prefill/blocks", mine.epoch))
        self.assertTrue(record)
        self.assertEqual(record.remote_context, mine.remote_context)
        self.assertEqual(record.buffer_id, mine.id)
        self.assertEqual(self.on_b.resolve("prefill/array").visibility, "any_user")

        # Bytes moved by name land in the very memory the client had.
        with self.on_b.attach(size) as theirs:
            theirs.memory[:] = pattern(5, size)
            results = self.on_b.submit(
                [Op("write", theirs, remote_name="prefill/blocks"),
                 Op("write", theirs, 0, 1024, remote_name="prefill/array", remote_offset=100)],
                timeout=10)
            self.assertTrue(all(result.ok for result in results), results)
        self.assertEqual(bytes(memory), pattern(5, size))
        self.assertTrue(eventually(lambda: bytes(tensor[100:1124]) == pattern(5, size)[:1024]))
        self.assertEqual(bytes(tensor[:100]), bytes(100))
        self.assertEqual(bytes(tensor[1124:]), bytes(size - 1124))
        # An op naming the buffer itself uses its new id.
        [result] = self.on_a.submit([Op("read", mine, 0, 16, remote_name="prefill/array")],
                                    timeout=10)
        self.assertTrue(result.ok, result)

    def _resolved_on_b(self, name, epoch):
        try:
            record = self.on_b.resolve(name)
        except NotFoundError:
            return None
        return record if record.agent_epoch == epoch else None

    def test_a_client_that_does_not_rejoin_keeps_its_stale_buffer(self):
        plain = AgentClient(self.a.socket, timeout=30, rejoin=False)
        try:
            buffer = plain.attach(4096)
            buffer.publish("plain/x")
            epoch = buffer.epoch
            self.a.kill()
            self.a.restart()
            self.assertNotEqual(plain.info().epoch, epoch)
            self.assertEqual(plain.rejoin(), [])
            self.assertEqual(buffer.epoch, epoch)
            # Whatever the directory still holds for the name (the old
            # record until the old lease expires), it reaches nothing.
            with self.on_b.attach(4096) as theirs:
                [result] = self.on_b.submit([Op("write", theirs, 0, 16, remote_name="plain/x")],
                                            timeout=10)
            self.assertFalse(result.ok, result)
            # (the old tcp port is closed: UNAVAILABLE; or the old epoch.)
            self.assertIn(result.code.name, ("NOT_FOUND", "FAILED_PRECONDITION", "UNAVAILABLE"))
        finally:
            plain.close()


class NixlMetadataAcrossAgentsTest(unittest.TestCase):
    """rdma_agent.nixl agents on two agents sharing one real etcd exchange
    metadata by name only, and keep working after the prefill side's agent
    is killed and restarted."""

    def setUp(self):
        self.etcd = Etcd()
        flags = ["--directory=" + self.etcd.directory]
        self.a = Agent(AGENTD, flags=flags + ["--agent_id=agent-a"])
        self.b = Agent(AGENTD, flags=flags + ["--agent_id=agent-b"])

    def tearDown(self):
        self.a.stop()
        self.b.stop()
        self.etcd.stop()

    def test_metadata_by_name_survives_a_restart_of_the_publishers_agent(self):
        import torch
        from rdma_agent.nixl import nixl_agent, nixl_agent_config
        prefill = nixl_agent("prefill", nixl_agent_config(socket=self.a.socket))
        decode = nixl_agent("decode", nixl_agent_config(socket=self.b.socket))
        try:
            # Pages of their own: memory of other clients of this process
            # may still be registered.
            blocks = torch.frombuffer(mmap.mmap(-1, 1 << 16), dtype=torch.uint8)
            blocks[:] = torch.tensor(list(pattern(6, 1 << 16)), dtype=torch.uint8)
            into = torch.frombuffer(mmap.mmap(-1, 1 << 16), dtype=torch.uint8)
            prefill.register_memory(blocks)
            decode.register_memory(into)
            decode.fetch_remote_metadata("prefill")
            prefill.send_local_metadata()
            self.assertTrue(eventually(lambda: decode.check_remote_metadata("prefill",
                                                                            [blocks])))

            def read_all():
                into.zero_()
                try:
                    handle = decode.initialize_xfer("READ", decode.get_xfer_descs(into),
                                                    decode.get_xfer_descs(blocks), "prefill")
                except AgentError:  # its metadata dropped for a moment
                    return False
                state = decode.transfer(handle)
                while state == "PROC":
                    time.sleep(0.001)
                    state = decode.check_xfer_state(handle)
                decode.release_xfer_handle(handle)
                return state == "DONE" and torch.equal(into, blocks)

            self.assertTrue(read_all())
            epoch = prefill._client.info().epoch
            self.a.kill()
            self.a.restart()
            # prefill's registrations come back on the new agent, its
            # metadata is published again with their new contexts, and
            # decode, following the name, fetches it: reads work again.
            self.assertTrue(eventually(read_all, timeout=30))
            self.assertNotEqual(prefill._client.info().epoch, epoch)
        finally:
            decode.close()
            prefill.close()


def main():
    global AGENTD
    parser = argparse.ArgumentParser()
    parser.add_argument("--agentd")
    args, rest = parser.parse_known_args()
    AGENTD = args.agentd
    return junit.main(argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
    sys.exit(main())
