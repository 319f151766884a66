"""Checks the rdma-agent wheel as installed by python_venv_test.sh: it is the
installed copy that imports, its stubs live inside the package (no
top-level `rdma`), it is typed, and it asks for Debian 12's grpcio and
protobuf.
"""

import argparse
import importlib.metadata
import importlib.util
import os
import sys
import unittest

import junit


class InstalledPackageTest(unittest.TestCase):

    def test_imports_from_the_venv_not_the_tree(self):
        import rdma_agent
        self.assertTrue(rdma_agent.__file__.startswith(sys.prefix + os.sep),
                        (rdma_agent.__file__, sys.prefix))
        self.assertIn("site-packages", rdma_agent.__file__)
        self.assertNotEqual(sys.prefix, sys.base_prefix, "not running in a venv")

    def test_stubs_are_inside_the_package(self):
        from rdma_agent.proto import agent_pb2, types_pb2
        self.assertTrue(agent_pb2.__name__.startswith("rdma_agent._proto."))
        self.assertEqual(types_pb2.DESCRIPTOR.package, "rdma.agent.v1")
        self.assertIsNone(importlib.util.find_spec("rdma"), "a top-level `rdma` is installed")
        files = [str(f) for f in importlib.metadata.files("rdma-agent")]
        self.assertEqual([f for f in files if f.startswith("rdma/")], [])
        self.assertIn("rdma_agent/_proto/rdma/agent/v1/agent_pb2_grpc.py", files)

    def test_typed(self):
        import rdma_agent
        self.assertTrue(os.path.exists(os.path.join(os.path.dirname(rdma_agent.__file__),
                                                    "py.typed")))

    def test_requires_debians_grpcio_and_protobuf(self):
        requires = importlib.metadata.requires("rdma-agent")
        self.assertIn("grpcio (>=1.51)", requires)
        self.assertIn("protobuf (>=4.21)", requires)
        # Satisfied from Debian's packages through --system-site-packages.
        self.assertGreaterEqual(
            tuple(int(p) for p in importlib.metadata.version("grpcio").split(".")[:2]), (1, 51))
        self.assertEqual(importlib.metadata.version("rdma-agent"), "0.1.0")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--agentd")
    _, rest = parser.parse_known_args()
    return junit.main(argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
    sys.exit(main())
