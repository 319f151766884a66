"""A thin Python client of rdma-agentd.

Works with Debian's /usr/bin/python3 (python3-grpcio, python3-protobuf). The
rdma.agent.v1 stubs come from protoc + grpc_python_plugin: `bazel build
//client/python:stubs`, or `client/python/generate_stubs.sh OUT_DIR`; put the
directory holding `rdma/` on sys.path.

    from rdma_agent_client import AgentClient, Op

    with AgentClient() as agent:                       # /run/rdma-agentd/agent.sock
        with agent.attach(1 << 20) as mine:            # memfd passed to the agent
            mine.memory[0:5] = b"hello"                # the agent's bytes, no copy
            peer_context = ...                         # from the other side
            results = agent.submit([Op("write", mine.id, 0, 5, peer_context, 0)])
            assert results[0].ok, results[0]

Errors of RPCs are raised as AgentError, whose `code` is a grpc.StatusCode
(NOT_FOUND, OUT_OF_RANGE, PERMISSION_DENIED, ...). Submit reports each op's
own outcome in its OpResult instead.
"""

import errno
import fcntl
import mmap
import os
import socket
import struct
from collections import namedtuple

import grpc
from google.protobuf import duration_pb2

from rdma.agent.v1 import agent_pb2
from rdma.agent.v1 import agent_pb2_grpc
from rdma.agent.v1 import attach_pb2
from rdma.agent.v1 import remote_buffer_pb2
from rdma.agent.v1 import types_pb2

DEFAULT_SOCKET = "/run/rdma-agentd/agent.sock"
# Names the agent's socket (a path or a "unix:" target) when none is given.
SOCKET_ENV = "RDMA_AGENT_SOCKET"

ACCESS = {
    "read": types_pb2.ACCESS_READ,
    "write": types_pb2.ACCESS_WRITE,
    "read_write": types_pb2.ACCESS_READ_WRITE,
}
OP_TYPE = {
    "read": types_pb2.OP_TYPE_READ_INTO_LOCAL,
    "write": types_pb2.OP_TYPE_WRITE_FROM_LOCAL,
}
# How long a registration lives if nobody releases it (types.proto Lifetime):
# until Release ("agent"), or until this process exits ("process") or its
# connection closes ("connection"), whichever comes first.
LIFETIME = {
    "agent": types_pb2.LIFETIME_AGENT,
    "process": types_pb2.LIFETIME_CLIENT_PROCESS,
    "connection": types_pb2.LIFETIME_CLIENT_CONNECTION,
}

_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
# Matches the agent's attach framing (common/fd_message.h).
_MAX_ATTACH_MESSAGE = 64 * 1024


def status_code(number):
    """The grpc.StatusCode of a status number (UNKNOWN if it is not one)."""
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


class AgentError(Exception):
    """An RPC or attach-socket request the agent (or the transport) refused."""

    def __init__(self, code, message):
        super().__init__("%s: %s" % (code.name, message))
        self.code = code
        self.message = message


# One op of a Submit. `type` is "read" (READ_INTO_LOCAL: remote -> local) or
# "write" (WRITE_FROM_LOCAL: local -> remote); `remote_context` is the
# serialized RemoteBuffer (bytes) of the other side.
Op = namedtuple("Op", "type local_buffer_id local_offset length remote_context remote_offset")


class OpResult(namedtuple("OpResult", "code message backend")):
    """What happened to one op: a grpc.StatusCode, its message, the backend."""

    @property
    def ok(self):
        return self.code == grpc.StatusCode.OK


def _access(access):
    return ACCESS[access] if isinstance(access, str) else access


def _lifetime(lifetime):
    return LIFETIME[lifetime] if isinstance(lifetime, str) else lifetime


def _rpc(call, request, timeout):
    try:
        return call(request, timeout=timeout)
    except grpc.RpcError as error:
        raise AgentError(error.code(), error.details()) from None


def _recv_exact(sock, size, fds):
    """Receives exactly `size` bytes; fds that come along are appended."""
    data = b""
    while len(data) < size:
        chunk, received, _, _ = socket.recv_fds(sock, size - len(data), 4)
        fds.extend(received)
        if not chunk:
            raise AgentError(grpc.StatusCode.UNAVAILABLE,
                             "attach socket closed by the agent")
        data += chunk
    return data


def _attach_exchange(path, request, fd, timeout):
    """One request/response on the attach socket (attach.proto framing).

    Returns (AttachResponse, fd or None). The caller owns the returned fd.
    """
    body = request.SerializeToString()
    frame = struct.pack("<I", len(body)) + body
    fds = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            # The fd rides on the first byte of the length prefix.
            sent = socket.send_fds(sock, [frame], [fd] if fd is not None else [])
            if sent < len(frame):
                sock.sendall(frame[sent:])
            (size,) = struct.unpack("<I", _recv_exact(sock, 4, fds))
            if size > _MAX_ATTACH_MESSAGE:
                raise AgentError(grpc.StatusCode.INTERNAL,
                                 "attach response of %d bytes is too large" % size)
            response = attach_pb2.AttachResponse()
            response.ParseFromString(_recv_exact(sock, size, fds))
    except socket.timeout:
        for extra in fds:
            os.close(extra)
        raise AgentError(grpc.StatusCode.DEADLINE_EXCEEDED,
                         "no answer from the attach socket %s in time" % path) from None
    except (FileNotFoundError, ConnectionError) as error:
        for extra in fds:
            os.close(extra)
        raise AgentError(grpc.StatusCode.UNAVAILABLE,
                         "attach socket %s: %s" % (path, error)) from None
    except BaseException:
        for extra in fds:
            os.close(extra)
        raise
    # Keep the first fd; a well-behaved agent sends at most one.
    for extra in fds[1:]:
        os.close(extra)
    return response, (fds[0] if fds else None)


def _check_range(what, buffer_id, offset, length):
    # uint64 on the wire: an overflowing range cannot even be sent.
    if offset < 0 or length < 0 or offset + length > (1 << 64) - 1:
        raise AgentError(grpc.StatusCode.OUT_OF_RANGE,
                         "%s of buffer %d: offset %d + length %d overflows"
                         % (what, buffer_id, offset, length))


def _raise_for(response):
    if response.code != 0:
        raise AgentError(status_code(response.code), response.message)


class Buffer:
    """A registration mapped into this process (`memory`, an mmap).

    Closing it (or leaving its `with` block) releases the registration, best
    effort, unless release() was called, then unmaps the memory. `lifetime`
    is the Lifetime the agent keeps it with: by default it is released also
    when this process dies without closing it.
    """

    def __init__(self, client, buffer_id, memory, remote_context, backends,
                 lifetime=types_pb2.LIFETIME_AGENT):
        self._client = client
        self.id = buffer_id
        self.size = len(memory)
        self.memory = memory
        self.remote_context = remote_context
        self.backends = list(backends)
        self.lifetime = lifetime
        self._released = False

    def release(self):
        """Releases the registration now (AgentError if the agent refuses).

        The mapping stays until close(); close() will not release again.
        """
        if self._released:
            raise AgentError(grpc.StatusCode.FAILED_PRECONDITION,
                             "Release: buffer %d was already released" % self.id)
        self._released = True
        self._client.release(self.id)

    def close(self):
        if not self._released:
            self._released = True
            try:
                self._client.release(self.id)
            except AgentError:
                pass  # best effort, as documented
        if self.memory is not None:
            self.memory.close()
            self.memory = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # Only unmaps: the channel may already be gone at interpreter exit.
        if getattr(self, "memory", None) is not None:
            try:
                self.memory.close()
            except (BufferError, ValueError):
                pass


def _probe_socket(path):
    """Fails at once, naming the errno, when `path` cannot be connected to."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError as error:
        code = (grpc.StatusCode.PERMISSION_DENIED
                if error.errno in (errno.EACCES, errno.EPERM)
                else grpc.StatusCode.UNAVAILABLE)
        raise AgentError(code, "cannot reach rdma-agentd at unix:%s: %s"
                         % (path, os.strerror(error.errno))) from None
    finally:
        probe.close()


class AgentClient:
    """Connection to rdma-agentd over its Unix socket.

    `socket_path` is the agent socket (a path, or a "unix:" target); None
    means $RDMA_AGENT_SOCKET, else /run/rdma-agentd/agent.sock.
    `attach_socket` defaults to attach.sock next to it. `timeout` (seconds)
    bounds each RPC and attach exchange, and the wait for the agent. A socket
    that is missing or forbidden fails at once with the errno.
    """

    def __init__(self, socket_path=None, attach_socket=None,
                 timeout=30.0, chunk_bytes=1 << 20):
        path = socket_path or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
        for prefix in ("unix://", "unix:"):
            if path.startswith(prefix):
                path = path[len(prefix):]
                break
        self.socket_path = path
        self.attach_socket = attach_socket or os.path.join(
            os.path.dirname(path), "attach.sock")
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        _probe_socket(path)
        self._channel = grpc.insecure_channel(
            "unix:" + path,
            options=[("grpc.max_receive_message_length", max(4 << 20, chunk_bytes + (64 << 10))),
                     # Never idle out: where the agent cannot watch this
                     # process, its buffers end with the connection.
                     ("grpc.client_idle_timeout_ms", (1 << 31) - 1)])
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise AgentError(grpc.StatusCode.UNAVAILABLE,
                             "cannot reach rdma-agentd at unix:%s within %ss"
                             % (path, timeout)) from None
        self.stub = agent_pb2_grpc.RdmaAgentStub(self._channel)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def info(self):
        """The agent's AgentInfo (id, epoch, version, backends)."""
        return _rpc(self.stub.GetInfo, agent_pb2.GetInfoRequest(), self.timeout)

    def register(self, size, access="read_write", label="", lifetime="agent"):
        """Agent-allocated registration, not mapped here and, by default, never
        released automatically, not even when this process exits: the
        RegisterResponse (buffer_id, remote_context, lifetime, ...)."""
        return _rpc(self.stub.Register,
                    agent_pb2.RegisterRequest(allocate_bytes=size, access=_access(access),
                                              label=label, lifetime=_lifetime(lifetime)),
                    self.timeout)

    def allocate(self, size, access="read_write", label="", lifetime="process"):
        """Agent allocates; the memory is mapped here through the fd the
        attach socket returns (OpenBuffer). Returns a Buffer. `lifetime`: by
        default the agent releases it if this process dies without closing
        it; "agent" keeps it until released."""
        response = self.register(size, access, label, lifetime)
        try:
            reply, fd = _attach_exchange(
                self.attach_socket,
                attach_pb2.AttachRequest(open=attach_pb2.OpenBuffer(buffer_id=response.buffer_id)),
                None, self.timeout)
            _raise_for(reply)
            if fd is None:
                raise AgentError(grpc.StatusCode.INTERNAL,
                                 "OpenBuffer %d: the agent sent no fd" % response.buffer_id)
            try:
                memory = mmap.mmap(fd, response.size_bytes, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)  # the mapping keeps the memory
        except BaseException:
            try:
                self.release(response.buffer_id)
            except AgentError:
                pass
            raise
        return Buffer(self, response.buffer_id, memory, response.remote_context,
                      response.backends, response.lifetime)

    def attach(self, size, access="read_write", label="", lifetime="process"):
        """This process creates a memfd (sealed against shrinking), maps it,
        hands it to the agent on the attach socket and registers it.
        `lifetime` as for allocate()."""
        if size <= 0:
            raise AgentError(grpc.StatusCode.INVALID_ARGUMENT, "size must be positive")
        fd = os.memfd_create(label or "rdma-agent-client",
                             os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            memory = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            reply, extra = _attach_exchange(
                self.attach_socket, attach_pb2.AttachRequest(attach=attach_pb2.AttachMemory()),
                fd, self.timeout)
        finally:
            os.close(fd)  # the agent has its own reference; ours is the mapping
        if extra is not None:
            os.close(extra)
        try:
            _raise_for(reply)
            response = _rpc(self.stub.Register,
                            agent_pb2.RegisterRequest(attach_token=reply.attach_token,
                                                      access=_access(access), label=label,
                                                      lifetime=_lifetime(lifetime)),
                            self.timeout)
        except BaseException:
            memory.close()
            raise
        return Buffer(self, response.buffer_id, memory, response.remote_context,
                      response.backends, response.lifetime)

    def submit(self, ops, timeout=None):
        """Runs `ops` (Op tuples) as one batch: one OpResult per op. `timeout`
        (seconds) bounds the batch on the agent; None = the agent's default."""
        request = agent_pb2.SubmitRequest()
        for op in ops:
            request.ops.add(type=OP_TYPE[op.type] if isinstance(op.type, str) else op.type,
                            local_buffer_id=op.local_buffer_id,
                            local_offset=op.local_offset, length=op.length,
                            remote_context=op.remote_context,
                            remote_offset=op.remote_offset)
        if timeout is not None:
            request.timeout.CopyFrom(duration_pb2.Duration(
                seconds=int(timeout), nanos=int(round((timeout - int(timeout)) * 1e9))))
        deadline = (timeout if timeout is not None else self.timeout) + 5
        response = _rpc(self.stub.Submit, request, deadline)
        return [OpResult(status_code(r.code), r.message, r.backend) for r in response.results]

    def release(self, buffer_id):
        _rpc(self.stub.Release, agent_pb2.ReleaseRequest(buffer_id=buffer_id), self.timeout)

    def list_buffers(self, all_users=False):
        """This user's registrations (BufferInfo messages); with `all_users`,
        every user's (root only: AgentError PERMISSION_DENIED otherwise)."""
        return list(_rpc(self.stub.ListBuffers,
                         agent_pb2.ListBuffersRequest(all_users=all_users),
                         self.timeout).buffers)

    def read_buffer(self, buffer_id, offset, length):
        """Bytes [offset, offset+length) of a registration, over gRPC."""
        _check_range("ReadBuffer", buffer_id, offset, length)
        parts = []
        done = 0
        while True:  # one RPC even for length 0: the agent judges it
            n = min(self.chunk_bytes, length - done)
            response = _rpc(self.stub.ReadBuffer,
                            agent_pb2.ReadBufferRequest(buffer_id=buffer_id,
                                                        offset=offset + done, length=n),
                            self.timeout)
            parts.append(response.data)
            done += n
            if done >= length:
                return b"".join(parts)

    def write_buffer(self, buffer_id, offset, data):
        """Writes `data` into a registration at `offset`, over gRPC."""
        view = memoryview(data)
        _check_range("WriteBuffer", buffer_id, offset, len(view))
        done = 0
        while True:
            n = min(self.chunk_bytes, len(view) - done)
            _rpc(self.stub.WriteBuffer,
                 agent_pb2.WriteBufferRequest(buffer_id=buffer_id, offset=offset + done,
                                              data=bytes(view[done:done + n])),
                 self.timeout)
            done += n
            if done >= len(view):
                return


def decode_context(remote_context):
    """The RemoteBuffer message inside a serialized remote context."""
    message = remote_buffer_pb2.RemoteBuffer()
    message.ParseFromString(remote_context)
    return message
