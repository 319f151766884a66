"""The rdma.agent.v1 messages and gRPC stubs, generated into this package
(rdma_agent._proto) so that nothing is installed as a top-level `rdma`."""

from rdma_agent._proto.rdma.agent.v1 import agent_pb2
from rdma_agent._proto.rdma.agent.v1 import agent_pb2_grpc
from rdma_agent._proto.rdma.agent.v1 import attach_pb2
from rdma_agent._proto.rdma.agent.v1 import remote_buffer_pb2
from rdma_agent._proto.rdma.agent.v1 import types_pb2

__all__ = ["agent_pb2", "agent_pb2_grpc", "attach_pb2", "remote_buffer_pb2", "types_pb2"]
