"""librdma_agent_attach from C (attach_library_c.c) against a real
rdma-agentd, the gRPC side done by the rdma_agent package: a token from C
registers the C program's memfd, C maps an agent-allocated registration,
and each error comes back as its gRPC code.

Run by python_venv_test.sh:  python_attach_library_test.py --agentd PATH/rdma-agentd
"""

import argparse
import ctypes
import os
import subprocess
import sys
import unittest

import grpc

import junit
from agents import Agent
from rdma_agent import AgentClient
from rdma_agent.proto import agent_pb2, types_pb2

AGENTD = None
READ_WRITE = types_pb2.ACCESS_READ_WRITE
PROGRAM = os.path.join(os.environ.get("TEST_SRCDIR", ""), "rdma_agentd", "tests", "client",
                       "attach_library_c")


def run_c(*args):
    done = subprocess.run([PROGRAM] + list(args), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    return done.returncode, done.stdout


class AttachLibraryTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.agent = Agent(AGENTD)

    @classmethod
    def tearDownClass(cls):
        assert cls.agent.stop() == 0

    def setUp(self):
        self.client = AgentClient(self.agent.socket, timeout=30)

    def tearDown(self):
        for info in self.client.list_buffers():
            self.client.release(info.buffer_id)
        self.client.close()

    def test_a_token_from_c_registers_its_memfd(self):
        code, out = run_c("attach", self.agent.socket, "10000")
        self.assertEqual(code, 0, out)
        words = out.split()
        self.assertEqual((words[0], words[2], words[3]), ("token", "size", "10000"))
        response = self.client.stub.Register(
            agent_pb2.RegisterRequest(attach_token=words[1], access=READ_WRITE), timeout=30)
        self.assertEqual(response.size_bytes, 10000)
        # The C program is gone; its pages are the registration's.
        self.assertEqual(self.client.read_buffer(response.buffer_id, 0, 10000),
                         bytes(i * 7 % 251 for i in range(10000)))
        # Single use.
        with self.assertRaises(grpc.RpcError) as raised:
            self.client.stub.Register(agent_pb2.RegisterRequest(attach_token=words[1],
                                                                access=READ_WRITE),
                                      timeout=30)
        self.assertNotEqual(raised.exception.code(), grpc.StatusCode.OK)

    def test_c_maps_an_agent_allocated_registration(self):
        response = self.client.register(8192)
        self.client.write_buffer(response.buffer_id, 0, bytes(range(1, 9)))
        code, out = run_c("open", self.agent.socket, str(response.buffer_id))
        self.assertEqual(code, 0, out)
        self.assertEqual(out.split(), ["size", "8192", "head", "0102030405060708"])
        self.assertEqual(self.client.read_buffer(response.buffer_id, 0, 2), b"\xab\x02")

    def test_the_shared_library_loads_from_other_languages(self):
        library = ctypes.CDLL(os.path.join(os.environ["TEST_SRCDIR"], "rdma_agentd", "client",
                                           "c", "librdma_agent_attach.so"))
        self.assertEqual(library.rdma_agent_attach_abi_version(), 1)
        path = ctypes.create_string_buffer(108)
        result = ctypes.create_string_buffer(1024)  # rdma_agent_attach_result fits
        code = library.rdma_agent_attach_socket_path(self.agent.socket.encode(), path, 108,
                                                     result)
        self.assertEqual(code, 0)
        self.assertEqual(path.value.decode(), os.path.join(self.agent.dir, "attach.sock"))

    def test_errors_come_back_as_grpc_codes(self):
        code, out = run_c("errors", self.agent.socket)
        self.assertEqual(code, 0, out)
        codes = dict(line.split()[:2] for line in out.splitlines())
        C = grpc.StatusCode
        self.assertEqual(codes, {
            "abi": "1",
            "path_too_small": str(C.INVALID_ARGUMENT.value[0]),
            "memfd_zero": str(C.INVALID_ARGUMENT.value[0]),
            "missing_socket": str(C.UNAVAILABLE.value[0]),
            "unsealed": str(C.INVALID_ARGUMENT.value[0]),
            "dmabuf_past_end": str(C.INVALID_ARGUMENT.value[0]),
            "dmabuf_host_kind": str(C.INVALID_ARGUMENT.value[0]),
            "open_unknown": str(C.NOT_FOUND.value[0]),
            "null_result": str(C.INVALID_ARGUMENT.value[0]),
        }, out)
        self.assertEqual(self.client.list_buffers(), [])


def main():
    global AGENTD
    parser = argparse.ArgumentParser()
    parser.add_argument("--agentd")
    args, rest = parser.parse_known_args()
    AGENTD = args.agentd
    return junit.main(argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
    sys.exit(main())
