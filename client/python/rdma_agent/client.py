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

Asynchronous transfers return a Transfer at once; its end comes from one
watch-stream thread per client, as a concurrent.futures.Future (so also
`await transfer` in asyncio):

    transfer = agent.submit_async([Op("read", mine.id, 0, 5, peer_context, 0)])
    end = transfer.wait(timeout=10)        # TransferResult: state, results
    end = await transfer                   # the same, from a coroutine
    transfer.cancel()                      # nothing of it touches memory after

Errors of RPCs are raised as AgentError, whose `code` is a grpc.StatusCode
(NOT_FOUND, OUT_OF_RANGE, PERMISSION_DENIED, ...). Submit reports each op's
own outcome in its OpResult instead, and a transfer in its TransferResult.
"""

import asyncio
import concurrent.futures
import errno
import fcntl
import mmap
import os
import socket
import struct
import threading
import time
import weakref
from collections import namedtuple

import grpc
from google.protobuf import duration_pb2

from rdma_agent.proto import agent_pb2
from rdma_agent.proto import agent_pb2_grpc
from rdma_agent.proto import attach_pb2
from rdma_agent.proto import remote_buffer_pb2
from rdma_agent.proto import types_pb2

__all__ = [
    "ACCESS", "CANCELLED", "DEFAULT_SOCKET", "DONE", "FAILED", "LIFETIME", "MEMORY_KIND",
    "OP_TYPE", "PENDING", "SOCKET_ENV", "AgentClient", "AgentError", "Buffer",
    "Notification", "NotificationBatch", "NotificationResult", "NotificationStream", "Op",
    "OpResult", "SubmitResult", "Transfer", "TransferResult", "decode_context", "status_code",
]

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
# Device memory kinds for register_dmabuf (types.proto MemoryKind).
MEMORY_KIND = {
    "cuda": types_pb2.MEMORY_KIND_CUDA,
    "rocm": types_pb2.MEMORY_KIND_ROCM,
    "other": types_pb2.MEMORY_KIND_OTHER,
}
LIFETIME = {
    "agent": types_pb2.LIFETIME_AGENT,
    "process": types_pb2.LIFETIME_CLIENT_PROCESS,
    "connection": types_pb2.LIFETIME_CLIENT_CONNECTION,
}

# Where an asynchronous transfer is (types.proto TransferState). PENDING is
# the only state that changes.
PENDING = "pending"      # queued or running: its ops may still touch memory
DONE = "done"            # ended, every op OK
FAILED = "failed"        # ended, some op failed (its OpResult says why)
CANCELLED = "cancelled"  # ended because cancel() stopped it
_STATE = {
    types_pb2.TRANSFER_STATE_UNSPECIFIED: PENDING,
    types_pb2.TRANSFER_STATE_PENDING: PENDING,
    types_pb2.TRANSFER_STATE_DONE: DONE,
    types_pb2.TRANSFER_STATE_FAILED: FAILED,
    types_pb2.TRANSFER_STATE_CANCELLED: CANCELLED,
}
# Longest GetTransfers long poll asked for at once (the agent cuts it to its
# --max_transfer_wait; wait() asks again).
_LONGEST_POLL = 600.0

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


class NotificationResult(namedtuple("NotificationResult",
                                    "agent_id buffer_id code message backend")):
    """What became of a batch's notification to one remote buffer: `code` OK
    when the target agent queued it for the buffer's owner, ABORTED when an
    op on that agent did not succeed (not sent), anything else when sending
    failed (never resent)."""

    @property
    def ok(self):
        return self.code == grpc.StatusCode.OK


class SubmitResult(namedtuple("SubmitResult", "results notifications")):
    """submit_notify(): one OpResult per op and one NotificationResult per
    distinct remote buffer."""


class Notification(namedtuple("Notification",
                              "from_agent_id buffer_id data receive_time sequence")):
    """Bytes a client of `from_agent_id` sent to the owner of this user's
    buffer `buffer_id` after its ops there succeeded (their bytes are in the
    buffer). `receive_time` in Unix seconds; `sequence` numbers this user's
    notifications from 1 (a gap is where some were dropped)."""


class NotificationBatch(namedtuple("NotificationBatch", "notifications dropped")):
    """get_notifications(): the notifications, oldest first, and how many
    were dropped (queue full) since the last answer that said so."""


def _notification_results(messages):
    return [NotificationResult(n.agent_id, n.buffer_id, status_code(n.code), n.message,
                               n.backend) for n in messages]


def _notification(message):
    return Notification(message.from_agent_id, message.buffer_id, message.data,
                        _seconds(message, "receive_time"), message.sequence)


class TransferResult(namedtuple(
        "TransferResult",
        "transfer_id state results create_time start_time end_time notifications")):
    """A transfer as the client last learnt it.

    `state` is PENDING, DONE, FAILED or CANCELLED; `results` one OpResult per
    op, in order, once ended (empty while pending); the times are Unix
    seconds (float), None when unset: `start_time` for a transfer that never
    ran (cancelled while queued), `end_time` while pending; `notifications`
    one NotificationResult per distinct remote buffer when the transfer
    carried a notification, once ended.
    """

    @property
    def ended(self):
        return self.state != PENDING

    @property
    def ok(self):
        return self.state == DONE


def _seconds(message, field):
    return getattr(message, field).ToNanoseconds() / 1e9 if message.HasField(field) else None


def _transfer_result(message):
    return TransferResult(
        message.transfer_id, _STATE.get(message.state, FAILED),
        [OpResult(status_code(r.code), r.message, r.backend) for r in message.results],
        _seconds(message, "create_time"), _seconds(message, "start_time"),
        _seconds(message, "end_time"), _notification_results(message.notifications))


def _duration(seconds):
    return duration_pb2.Duration(seconds=int(seconds),
                                 nanos=int(round((seconds - int(seconds)) * 1e9)))


class _Record:
    """What one client knows about one transfer; its handles share it. The
    client's lock guards `end` and `confirmed`."""

    __slots__ = ("transfer_id", "end", "confirmed", "future", "__weakref__")

    def __init__(self, transfer_id):
        self.transfer_id = transfer_id
        self.end = None           # the TransferResult once ended; never changes
        self.confirmed = False    # the agent has answered for this id
        self.future = concurrent.futures.Future()


class Transfer:
    """A handle on one asynchronous transfer (AgentClient.submit_async).

    Dropping it does not cancel the transfer: the agent owns it, and pins the
    registrations it uses. Once the client learns the end (from its watch
    thread, or from wait(), poll() or cancel()) it keeps it, and every path
    agrees on it. Thread-safe.

    The end also resolves `future` (a concurrent.futures.Future of the
    TransferResult); `await transfer` waits for it in asyncio. With the
    client's watch (the default), the future resolves when the agent pushes
    the end; it fails with AgentError if the watch stops first (close(), or
    the agent went away); without the watch, only wait(), poll() and cancel()
    resolve it. Callbacks added to the future run on the watch thread: keep
    them short, and do not wait() there for another transfer (asyncio's
    wrap_future only schedules onto its loop, which is fine).
    """

    def __init__(self, client, record):
        self._client = client
        self._record = record
        self.transfer_id = record.transfer_id

    @property
    def future(self):
        return self._record.future

    def done(self):
        """True once the client knows the end."""
        return self._record.end is not None

    def wait(self, timeout=None):
        """The final TransferResult, once ended (whatever its state: check
        `.ok`); AgentError DEADLINE_EXCEEDED if it did not end within
        `timeout` seconds (None: no bound; 0: look once). With the watch it
        waits for the pushed end (no RPC); otherwise each call holds one
        GetTransfers long poll on the agent (no agent thread; one of the
        user's --max_waiting_rpcs_per_user). NOT_FOUND when the agent does
        not know the id (not this user's, or its end was already read by a
        GetTransfers of another client, or expired)."""
        return self._client._wait(self._record, timeout)

    def result(self, timeout=None):
        """As wait(), with concurrent.futures' manners: TimeoutError instead
        of AgentError DEADLINE_EXCEEDED."""
        try:
            return self.wait(timeout)
        except AgentError as error:
            if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(error.message) from None
            raise

    def poll(self):
        """The TransferResult now: the end once known, else the agent's answer
        (PENDING with no results while it runs)."""
        return self._client._poll(self._record)

    def cancel(self):
        """Stops the transfer (CancelTransfer): ops not started never start,
        ops in flight stop, and once this returns nothing of the transfer
        reads or writes local memory. Returns the final TransferResult:
        CANCELLED, or the state it had already ended in."""
        return self._client._cancel(self._record)

    def __await__(self):
        return asyncio.wrap_future(self._record.future).__await__()

    def __repr__(self):
        end = self._record.end
        return "Transfer(%d, %s)" % (self.transfer_id, end.state if end else PENDING)


def _access(access):
    return ACCESS[access] if isinstance(access, str) else access


def _lifetime(lifetime):
    return LIFETIME[lifetime] if isinstance(lifetime, str) else lifetime


def _memory_kind(kind):
    return MEMORY_KIND[kind] if isinstance(kind, str) else kind


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

    `watch` (default True): the first submit_async() (or transfer()) starts
    one thread that reads the agent's WatchTransfers stream and resolves the
    transfers' futures; close() stops it. The stream carries every end of
    this user's transfers on the agent and takes none away: every watching
    client of the user gets every end, and an end stays readable by other
    clients' wait() and poll() until one of them reads it. With
    watch=False, no thread: wait() long-polls the agent (no agent thread
    either) and futures resolve only through wait(), poll() and cancel().
    """

    def __init__(self, socket_path=None, attach_socket=None,
                 timeout=30.0, chunk_bytes=1 << 20, watch=True):
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
        # Asynchronous transfers: records by id (weakly: handles on one id
        # share one), those the watch must still resolve (strongly, until
        # ended), and ends the watch delivered for a submit_async() still in
        # progress, kept until every such call has claimed its own.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._records = weakref.WeakValueDictionary()
        self._pending = {}
        self._last_ticket = 0
        self._submitting = set()
        self._unclaimed = {}
        self._watch_enabled = watch
        self._watching = False
        self._watch_call = None
        self._watch_thread = None
        self._closing = False

    def close(self):
        """Stops the watch (pending futures fail with AgentError CANCELLED)
        and closes the channel."""
        with self._lock:
            self._closing = True
            call, thread = self._watch_call, self._watch_thread
        if call is not None:
            call.cancel()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
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

    def register_dmabuf(self, fd, offset, length, kind="cuda", device=0,
                        access="read_write", label="", lifetime="process",
                        pci_bus_id=None):
        """Registers device memory (a GPU's) that this process exported as a
        dma-buf `fd` (e.g. cuda-python's cuMemGetHandleForAddressRange with
        CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD): the bytes [offset, offset +
        length) of it. `kind` is "cuda", "rocm" or "other", `device` the
        device's index. `pci_bus_id` (optional) is the device's PCI address
        as nvidia-smi or cuDeviceGetPCIBusId print it ("0000:3b:00.0"): NIC
        backends then use the NICs nearest the device; a malformed one raises
        INVALID_ARGUMENT. Only NIC backends register device memory; the agent
        answers FAILED_PRECONDITION when it has none. Nothing is mapped
        here and `fd` stays this process's (the agent keeps its own copy):
        returns the RegisterResponse (buffer_id, remote_context, backends);
        release it with release(buffer_id) or, by default, by exiting."""
        request = attach_pb2.AttachRequest(
            attach_device_memory=attach_pb2.AttachDeviceMemory(
                offset=offset, length=length, kind=_memory_kind(kind),
                device_index=device, pci_bus_id=pci_bus_id or ""))
        reply, extra = _attach_exchange(self.attach_socket, request, fd, self.timeout)
        if extra is not None:
            os.close(extra)
        _raise_for(reply)
        return _rpc(self.stub.Register,
                    agent_pb2.RegisterRequest(attach_token=reply.attach_token,
                                              access=_access(access), label=label,
                                              lifetime=_lifetime(lifetime)),
                    self.timeout)

    @staticmethod
    def _submit_request(ops, timeout, notification=None):
        request = agent_pb2.SubmitRequest(notification=_as_bytes(notification))
        for op in ops:
            request.ops.add(type=OP_TYPE[op.type] if isinstance(op.type, str) else op.type,
                            local_buffer_id=op.local_buffer_id,
                            local_offset=op.local_offset, length=op.length,
                            remote_context=op.remote_context,
                            remote_offset=op.remote_offset)
        if timeout is not None:
            request.timeout.CopyFrom(_duration(timeout))
        return request

    def submit(self, ops, timeout=None):
        """Runs `ops` (Op tuples) as one batch: one OpResult per op. `timeout`
        (seconds) bounds the batch on the agent; None = the agent's default."""
        request = self._submit_request(ops, timeout)
        deadline = (timeout if timeout is not None else self.timeout) + 5
        response = _rpc(self.stub.Submit, request, deadline)
        return [OpResult(status_code(r.code), r.message, r.backend) for r in response.results]

    def submit_notify(self, ops, notification, timeout=None):
        """submit() that also sends `notification` (bytes or str, at most the
        agent's --max_notification_bytes) to the owner of each remote buffer
        the batch targets, once every op on its agent has succeeded. Returns
        a SubmitResult."""
        request = self._submit_request(ops, timeout, notification)
        deadline = (timeout if timeout is not None else self.timeout) + 5
        response = _rpc(self.stub.Submit, request, deadline)
        return SubmitResult(
            [OpResult(status_code(r.code), r.message, r.backend) for r in response.results],
            _notification_results(response.notifications))

    def get_notifications(self, wait=0, max_count=0):
        """Takes this user's queued notifications (at most `max_count`; 0 =
        the agent's most), waiting up to `wait` seconds for the first one.
        Returns a NotificationBatch; each notification is returned once."""
        request = agent_pb2.GetNotificationsRequest(wait=_duration(wait), max_count=max_count)
        response = _rpc(self.stub.GetNotifications, request, wait + self.timeout)
        return NotificationBatch([_notification(n) for n in response.notifications],
                                 response.dropped)

    def watch_notifications(self):
        """A NotificationStream: iterate it for (Notification or None, dropped)
        pairs as notifications arrive (first those queued), until close()."""
        return NotificationStream(
            self.stub.WatchNotifications(agent_pb2.WatchNotificationsRequest()))

    def submit_async(self, ops, timeout=None, notification=None):
        """Starts `ops` as one asynchronous transfer and returns its Transfer
        once the agent has accepted it. A bad batch raises AgentError with
        submit()'s codes (RESOURCE_EXHAUSTED beyond the agent's transfers in
        flight per user); a bad op is reported in the transfer's results.
        `timeout` (seconds) bounds the transfer on the agent from now, time
        queued included; None = the agent's default. `notification` as for
        submit_notify(); the TransferResult's `notifications` say what became
        of it."""
        request = self._submit_request(ops, timeout, notification)
        self._ensure_watch()
        # Taken before the request leaves: the watch may deliver the end
        # before the answer arrives.
        with self._lock:
            self._last_ticket += 1
            ticket = self._last_ticket
            self._submitting.add(ticket)
        transfer_id = None
        try:
            transfer_id = _rpc(self.stub.SubmitAsync, request, self.timeout).transfer_id
        finally:
            with self._lock:
                self._submitting.discard(ticket)
                record = None
                if transfer_id is not None:
                    record = self._record_locked(transfer_id)
                    record.confirmed = True
                self._prune_unclaimed_locked()
            if record is not None and record.end is not None:
                self._settle(record.future, record.end)
        return Transfer(self, record)

    def transfer(self, transfer_id):
        """A Transfer for an id of this user submitted elsewhere (another
        process, rdma-agentctl submit --async); no RPC: an id the agent does
        not know raises NOT_FOUND from wait(), poll() and cancel()."""
        self._ensure_watch()
        with self._lock:
            record = self._record_locked(transfer_id)
        return Transfer(self, record)

    # -- asynchronous transfers: the client's side ------------------------

    def _record_locked(self, transfer_id):
        record = self._records.get(transfer_id)
        if record is None:
            record = _Record(transfer_id)
            self._records[transfer_id] = record
        if record.end is None:
            early = self._unclaimed.pop(transfer_id, None)
            if early is not None:
                record.end = early[0]  # its future is settled by the caller
            elif self._watch_enabled:
                self._pending[transfer_id] = record
        return record

    def _prune_unclaimed_locked(self):
        # A submit_async() can claim an end only if it was in progress when
        # the end arrived: its ticket is at most the end's horizon.
        oldest = min(self._submitting) if self._submitting else self._last_ticket + 1
        for transfer_id in [i for i, (_, horizon) in self._unclaimed.items()
                            if horizon < oldest]:
            del self._unclaimed[transfer_id]

    @staticmethod
    def _settle(future, end=None, error=None):
        """Resolves a future once; a future its user cancelled stays so."""
        try:
            if error is None:
                future.set_result(end)
            else:
                future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass

    def _resolve(self, record, end):
        """Records `end` unless an end is known; returns the end in force."""
        with self._lock:
            if record.end is not None:
                return record.end
            record.end = end
            self._pending.pop(record.transfer_id, None)
            self._changed.notify_all()
        self._settle(record.future, end)
        return end

    def _ensure_watch(self):
        if not self._watch_enabled:
            return
        with self._lock:
            if self._watching or self._closing:
                return
            self._watching = True
            # Started here, read there; close() cancels it.
            self._watch_call = self.stub.WatchTransfers(agent_pb2.WatchTransfersRequest())
            self._watch_thread = threading.Thread(
                target=self._watch_loop, args=(self._watch_call,),
                name="rdma-xfer-watch", daemon=True)
            self._watch_thread.start()

    def _watch_loop(self, call):
        why = AgentError(grpc.StatusCode.UNAVAILABLE, "the agent ended the WatchTransfers stream")
        try:
            for event in call:
                end = _transfer_result(event.transfer)
                if end.ended:
                    self._delivered(end)
        except grpc.RpcError as error:
            why = AgentError(error.code(), error.details())
        with self._lock:
            if self._closing:
                why = AgentError(grpc.StatusCode.CANCELLED, "the client was closed")
            self._watching = False
            self._watch_call = None
            waiting = [r for r in self._pending.values() if not r.future.done()]
            self._changed.notify_all()
        # The records stay pending: a watch started later may still bring
        # their ends (the futures, though, have failed).
        for record in waiting:
            self._settle(record.future, error=AgentError(
                why.code, "transfer %d: the watch ended before its end arrived: %s"
                % (record.transfer_id, why.message)))

    def _delivered(self, end):
        with self._lock:
            record = self._pending.get(end.transfer_id)
            if record is None:
                if self._submitting:  # maybe one of theirs
                    self._unclaimed[end.transfer_id] = (end, self._last_ticket)
                return
            if record.end is not None:
                return
            record.end = end
            del self._pending[end.transfer_id]
            self._changed.notify_all()
        self._settle(record.future, end)

    def _on_watch_thread(self):
        return threading.current_thread() is self._watch_thread

    def _await_end(self, record, deadline):
        """Waits without an RPC for the watch to bring the end: "ended",
        "timeout" (a watch still runs) or "nowatch"."""
        with self._lock:
            while record.end is None and self._watching and \
                    record.transfer_id in self._pending:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return "timeout"
                self._changed.wait(remaining)
            if record.end is not None:
                return "ended"
            return "nowatch"

    def _watch_serves(self, record):
        with self._lock:
            return self._watching and record.transfer_id in self._pending and \
                not self._on_watch_thread()

    def _get_transfer(self, transfer_id, wait):
        wait = max(0.0, min(wait, _LONGEST_POLL))
        request = agent_pb2.GetTransfersRequest(transfer_ids=[transfer_id])
        if wait > 0:
            request.wait.CopyFrom(_duration(wait))
        return _rpc(self.stub.GetTransfers, request, wait + self.timeout).transfers[0]

    def _wait(self, record, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        asked = False
        while True:
            if record.end is not None:
                return record.end
            if self._on_watch_thread() and self._watch_enabled:
                raise AgentError(grpc.StatusCode.FAILED_PRECONDITION,
                                 "wait() for transfer %d on the watch thread (in a future's "
                                 "callback) would wait for itself" % record.transfer_id)
            if record.confirmed and self._watch_serves(record):
                outcome = self._await_end(record, deadline)
                if outcome == "ended":
                    return record.end
                if outcome == "timeout":
                    break
                continue  # the watch stopped: ask the agent
            remaining = None if deadline is None else deadline - time.monotonic()
            if asked and remaining is not None and remaining <= 0:
                break
            # With the watch, only to learn that the agent knows the id.
            wait = 0.0 if self._watch_serves(record) else \
                (_LONGEST_POLL if remaining is None else remaining)
            result = self._ask(record, wait)
            asked = True
            if result.ended:
                return result
        raise AgentError(grpc.StatusCode.DEADLINE_EXCEEDED,
                         "transfer %d did not end within %ss" % (record.transfer_id, timeout))

    def _poll(self, record):
        if record.end is not None:
            return record.end
        return self._ask(record, 0.0)

    def _ask(self, record, wait):
        """GetTransfers for `record`, long-polling up to `wait` s: its end
        (kept), or its PENDING state (the agent is then known to have it).
        NOT_FOUND means what it says: the agent's watch streams never take
        an end away, so this client's watch cannot have one in transit."""
        message = self._get_transfer(record.transfer_id, wait)
        result = _transfer_result(message)
        if result.ended:
            return self._resolve(record, result)
        with self._lock:
            record.confirmed = True
        return result

    def _cancel(self, record):
        if record.end is not None:  # ended: nothing to stop
            return record.end
        response = _rpc(self.stub.CancelTransfer,
                        agent_pb2.CancelTransferRequest(transfer_id=record.transfer_id),
                        self.timeout)
        return self._resolve(record, _transfer_result(response.transfer))

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


def _as_bytes(data):
    if data is None:
        return b""
    return data.encode() if isinstance(data, str) else bytes(data)


class NotificationStream:
    """One WatchNotifications stream. Iterating yields (notification, dropped)
    pairs: a Notification (or None when the event only reports drops) and the
    notifications this stream lost to a full queue since the previous event.
    Iteration ends after close(), or raises AgentError when the agent ends
    the stream. A context manager; in asyncio, `async for` over it (one
    reader thread feeds the event loop) and `async with`."""

    def __init__(self, call):
        self._call = call
        self._reader = None

    def __aiter__(self):
        loop = asyncio.get_running_loop()
        queue = asyncio.Queue()
        end = object()

        def read():
            try:
                for item in self:
                    loop.call_soon_threadsafe(queue.put_nowait, item)
                loop.call_soon_threadsafe(queue.put_nowait, end)
            except AgentError as error:
                loop.call_soon_threadsafe(queue.put_nowait, error)

        self._reader = threading.Thread(target=read, name="rdma-notify-watch", daemon=True)
        self._reader.start()

        async def events():
            while True:
                item = await queue.get()
                if item is end:
                    return
                if isinstance(item, AgentError):
                    raise item
                yield item

        return events()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()

    def __iter__(self):
        try:
            for event in self._call:
                notification = (_notification(event.notification)
                                if event.HasField("notification") else None)
                yield notification, event.dropped
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED:
                return
            raise AgentError(error.code(), error.details()) from None

    def close(self):
        """Cancels the stream; an iteration in progress ends."""
        self._call.cancel()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def decode_context(remote_context):
    """The RemoteBuffer message inside a serialized remote context."""
    message = remote_buffer_pb2.RemoteBuffer()
    message.ParseFromString(remote_context)
    return message
