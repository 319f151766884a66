"""The client of rdma-agentd: registrations, batches, transfers, notifications.

    import rdma_agent
    from rdma_agent import AgentClient, Op

    with AgentClient() as agent:                       # $RDMA_AGENT_SOCKET
        with agent.attach(1 << 20) as mine:            # memfd passed to the agent
            mine.memory[0:5] = b"hello"                # the agent's bytes, no copy
            peer_context = ...                         # from the other side
            [result] = agent.submit([Op("write", mine, length=5, remote=peer_context)])
            assert result.ok, result

Tensors and arrays are born registered (tensor(), empty_like(), ndarray())
or registered where they are (register(tensor_or_array)); an Op takes them
as its local side directly.

Asynchronous transfers return a Transfer at once; its end comes from one
watch-stream thread per client, as a concurrent.futures.Future (so also
`await transfer` in asyncio):

    transfer = agent.submit_async([Op("read", mine, remote=peer_context)])
    end = transfer.wait(timeout=10)        # TransferResult: state, results
    end = await transfer                   # the same, from a coroutine
    transfer.cancel()                      # nothing of it touches memory after

Buffers are found by name through the agent's directory (--directory):
publish() (or Buffer.publish) puts a buffer's remote context under a name,
resolve() answers it, watch_names() streams names appearing and going, and
an Op may name its remote side by `remote_name`. A buffer this process owns
(attach(), tensor(), register()) and registered with the process's or the
connection's lifetime comes back by itself when the agent restarts:
registered again, with its names published again (see AgentClient).

Refusals are raised as AgentError (rdma_agent.errors), whose `code` is a
grpc.StatusCode (NOT_FOUND, OUT_OF_RANGE, ...) and whose subclass names it
(NotFoundError, ...); bad arguments are InvalidArgumentError (a ValueError)
or ArgumentTypeError (a TypeError) before anything is sent. Submit reports
each op's own outcome in its OpResult instead, and a transfer in its
TransferResult.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import dataclasses
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
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterable, Iterator, Mapping, Sequence, TypeVar, Union

import grpc
from google.protobuf import duration_pb2

from rdma_agent import memory as _memory
from rdma_agent.errors import (AgentError, ArgumentTypeError, InvalidArgumentError,
                               invalid, one_of, status_code, wrong_type)

from rdma_agent.proto import agent_pb2
from rdma_agent.proto import agent_pb2_grpc
from rdma_agent.proto import attach_pb2
from rdma_agent.proto import remote_buffer_pb2
from rdma_agent.proto import types_pb2

if TYPE_CHECKING:
    from rdma_agent.ring import Ring

__all__ = [
    "ACCESS", "CANCELLED", "DEFAULT_SOCKET", "DONE", "FAILED", "LIFETIME", "MEMORY_KIND",
    "OP_TYPE", "PENDING", "SOCKET_ENV", "VISIBILITY", "AgentClient", "AgentError",
    "ArgumentTypeError", "Buffer", "InvalidArgumentError", "NameEvent", "NameRecord",
    "NameStream", "Notification", "NotificationBatch", "NotificationResult",
    "NotificationStream", "Op", "OpResult", "PreparedTransfer", "RemoteHandle", "SubmitResult",
    "Transfer", "TransferResult", "decode_context", "status_code",
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
# Who may resolve a published name (agent.proto Visibility): the publishing
# user only ("owner", on any agent of the directory) or every user.
VISIBILITY = {
    "owner": agent_pb2.VISIBILITY_OWNER,
    "any_user": agent_pb2.VISIBILITY_ANY_USER,
}
_VISIBILITY_NAME = {number: name for name, number in VISIBILITY.items()}
# What a NameEvent says happened (agent.proto NameEvent.Kind).
_NAME_EVENT_KIND = {
    agent_pb2.NameEvent.PUBLISHED: "published",
    agent_pb2.NameEvent.WITHDRAWN: "withdrawn",
    agent_pb2.NameEvent.SYNCED: "synced",
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

# Matches the agent's attach framing (common/fd_message.h).
_MAX_ATTACH_MESSAGE = 64 * 1024


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(what: str, value: object, positive: bool = False) -> int:
    """`value` as a byte count or offset: an int >= 0 (> 0 if `positive`)."""
    if not _is_int(value):
        raise wrong_type(what, value, "an int (bytes)")
    assert isinstance(value, int)
    if value < (1 if positive else 0) or value > (1 << 64) - 1:
        raise invalid("%s %d must be %s and below 2**64" % (
            what, value, "a positive number of bytes" if positive else ">= 0"))
    return value


def _shape(call: str, shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(shape, int):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise wrong_type("%s: shape" % call, shape, "an int or a sequence of ints") from None
    return tuple(_check_count("%s: shape" % call, extent) for extent in dims)


# What an Op's local side may be: a buffer id, a Buffer, or a tensor, array
# or buffer-protocol object inside a registration of the same client.
Local = Any
# What an Op's remote side may be: a remote context (bytes), a Buffer (its
# remote_context) or a RemoteHandle (import_remote(): the context parsed once
# by the agent, named by its handle).
Remote = Union[bytes, "Buffer", "RemoteHandle"]


@dataclasses.dataclass(frozen=True)
class Op:
    """One op of a batch.

    `type`: "read" (READ_INTO_LOCAL: remote -> local) or "write"
    (WRITE_FROM_LOCAL: local -> remote). `local`: a buffer id, a Buffer, or
    a tensor/array/bytearray inside a registration made by the submitting
    client (then offsets count from the object's first byte). `remote`: the
    other side's remote context (bytes), a Buffer, or a RemoteHandle from
    import_remote() (the op then carries 8 bytes instead of the context); or,
    instead, `remote_name`: a name published in the agent's directory, which
    the agent resolves once per batch (NOT_FOUND in the op's result when
    nobody publishes it). `length` None: the rest of the local side from
    `local_offset` (a whole tensor or array), cut to the rest of the remote
    buffer from `remote_offset` when the remote is a context or a handle.
    """

    type: str | int
    local: Local
    local_offset: int = 0
    length: int | None = None
    remote: Remote = b""
    remote_offset: int = 0
    remote_name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.type, str):
            if self.type not in OP_TYPE:
                raise one_of("Op: type", self.type, OP_TYPE)
        elif self.type not in OP_TYPE.values():
            raise one_of("Op: type", self.type, OP_TYPE)
        if _is_int(self.local):
            _check_count("Op: local buffer id", self.local)
        _check_count("Op: local_offset", self.local_offset)
        _check_count("Op: remote_offset", self.remote_offset)
        if self.length is not None:
            _check_count("Op: length", self.length)
        if not isinstance(self.remote_name, str):
            raise wrong_type("Op: remote_name", self.remote_name, "a str")
        if self.remote_name:
            if isinstance(self.remote, (Buffer, RemoteHandle)) or len(self.remote) != 0:
                raise invalid("Op: remote and remote_name are both set: name the other "
                              "side one way")
            return
        if isinstance(self.remote, (Buffer, RemoteHandle)):
            return
        if not isinstance(self.remote, (bytes, bytearray, memoryview)):
            raise wrong_type("Op: remote", self.remote,
                             "a remote context (bytes), a Buffer or a RemoteHandle")
        if len(self.remote) == 0:
            raise invalid("Op: remote is empty: pass the other side's remote context "
                          "(or its published name as remote_name)")

    @property
    def remote_context(self) -> bytes:
        """The remote context; empty when `remote` is a RemoteHandle."""
        if isinstance(self.remote, Buffer):
            return self.remote.remote_context
        if isinstance(self.remote, RemoteHandle):
            return b""
        return bytes(self.remote)


class OpResult(namedtuple("OpResult", "code message backend")):
    """What happened to one op: a grpc.StatusCode, its message, the backend."""

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK


class NotificationResult(namedtuple("NotificationResult",
                                    "agent_id buffer_id code message backend")):
    """What became of a batch's notification to one remote buffer: `code` OK
    when the target agent queued it for the buffer's owner, ABORTED when an
    op on that agent did not succeed (not sent), anything else when sending
    failed (never resent)."""

    @property
    def ok(self) -> bool:
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


class NameRecord(namedtuple("NameRecord",
                            "name remote_context agent_id agent_epoch owner_uid buffer_id "
                            "published_at visibility")):
    """A published name: the remote context it stands for (bytes; empty in a
    "withdrawn" event), the owner (the publishing agent, its epoch then, the
    local uid there, the buffer id there), when it was published (Unix
    seconds, None if unknown) and who may resolve it ("owner" or
    "any_user")."""


class NameEvent(namedtuple("NameEvent", "kind record")):
    """One event of watch_names(): `kind` "published" (the name appeared, or
    now stands for another buffer), "withdrawn" (`record` without its
    context) or "synced" (record None: every name published when the watch
    started came before it)."""


def _name_record(message: Any) -> NameRecord:
    return NameRecord(message.name, message.remote_context, message.agent_id,
                      message.agent_epoch, message.owner_uid, message.buffer_id,
                      _seconds(message, "published_at"),
                      _VISIBILITY_NAME.get(message.visibility, "owner"))


def _check_name(call: str, name: object) -> str:
    if not isinstance(name, str):
        raise wrong_type("%s: name" % call, name, "a str")
    if not name:
        raise invalid("%s: the name is empty" % call)
    return name


def _notification_results(messages: Iterable[Any]) -> list[NotificationResult]:
    return [NotificationResult(n.agent_id, n.buffer_id, status_code(n.code), n.message,
                               n.backend) for n in messages]


def _notification(message: Any) -> Notification:
    return Notification(message.from_agent_id, message.buffer_id, message.data,
                        _seconds(message, "receive_time"), message.sequence)


class TransferResult(namedtuple(
        "TransferResult",
        "transfer_id state results create_time start_time end_time notifications "
        "bytes_total bytes_done", defaults=(0, 0))):
    """A transfer as the client last learnt it.

    `state` is PENDING, DONE, FAILED or CANCELLED; `results` one OpResult per
    op, in order, once ended (empty while pending); the times are Unix
    seconds (float), None when unset: `start_time` for a transfer that never
    ran (cancelled while queued), `end_time` while pending; `notifications`
    one NotificationResult per distinct remote buffer when the transfer
    carried a notification, once ended; `bytes_total` the bytes its valid ops
    move and `bytes_done` how many have landed (an estimate while pending,
    the bytes of the ops that succeeded once ended).
    """

    @property
    def ended(self) -> bool:
        return self.state != PENDING

    @property
    def ok(self) -> bool:
        return self.state == DONE


def _seconds(message: Any, field: str) -> float | None:
    return getattr(message, field).ToNanoseconds() / 1e9 if message.HasField(field) else None


def _transfer_result(message: Any) -> TransferResult:
    return TransferResult(
        message.transfer_id, _STATE.get(message.state, FAILED),
        [OpResult(status_code(r.code), r.message, r.backend) for r in message.results],
        _seconds(message, "create_time"), _seconds(message, "start_time"),
        _seconds(message, "end_time"), _notification_results(message.notifications),
        message.bytes_total, message.bytes_done)


def _duration(seconds: float) -> Any:
    return duration_pb2.Duration(seconds=int(seconds),
                                 nanos=int(round((seconds - int(seconds)) * 1e9)))


class _Record:
    """What one client knows about one transfer; its handles share it. The
    client's lock guards `end` and `confirmed`."""

    __slots__ = ("transfer_id", "end", "confirmed", "future", "__weakref__")

    def __init__(self, transfer_id: int) -> None:
        self.transfer_id = transfer_id
        self.end: TransferResult | None = None  # the TransferResult once ended; never changes
        self.confirmed = False    # the agent has answered for this id
        self.future: concurrent.futures.Future[TransferResult] = concurrent.futures.Future()


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

    def __init__(self, client: AgentClient, record: _Record) -> None:
        self._client = client
        self._record = record
        self.transfer_id = record.transfer_id

    @property
    def future(self) -> concurrent.futures.Future[TransferResult]:
        return self._record.future

    def done(self) -> bool:
        """True once the client knows the end."""
        return self._record.end is not None

    def wait(self, timeout: float | None = None) -> TransferResult:
        """The final TransferResult, once ended (whatever its state: check
        `.ok`); AgentError DEADLINE_EXCEEDED if it did not end within
        `timeout` seconds (None: no bound; 0: look once). With the watch it
        waits for the pushed end (no RPC); otherwise each call holds one
        GetTransfers long poll on the agent (no agent thread; one of the
        user's --max_waiting_rpcs_per_user). NOT_FOUND when the agent does
        not know the id (not this user's, or its end was already read by a
        GetTransfers of another client, or expired)."""
        return self._client._wait(self._record, timeout)

    def result(self, timeout: float | None = None) -> TransferResult:
        """As wait(), with concurrent.futures' manners: TimeoutError instead
        of AgentError DEADLINE_EXCEEDED."""
        try:
            return self.wait(timeout)
        except AgentError as error:
            if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(error.message) from None
            raise

    def poll(self) -> TransferResult:
        """The TransferResult now: the end once known, else the agent's answer
        (PENDING with no results while it runs)."""
        return self._client._poll(self._record)

    def cancel(self) -> TransferResult:
        """Stops the transfer (CancelTransfer): ops not started never start,
        ops in flight stop, and once this returns nothing of the transfer
        reads or writes local memory. Returns the final TransferResult:
        CANCELLED, or the state it had already ended in."""
        return self._client._cancel(self._record)

    def __await__(self) -> Generator[Any, None, TransferResult]:
        return asyncio.wrap_future(self._record.future).__await__()

    def __repr__(self) -> str:
        end = self._record.end
        return "Transfer(%d, %s)" % (self.transfer_id, end.state if end else PENDING)


def _named(what: str, table: Mapping[str, int], value: str | int) -> int:
    """The enum number of `value`, a name in `table` or one of its numbers."""
    if isinstance(value, str):
        if value not in table:
            raise one_of(what, value, table)
        return table[value]
    if not _is_int(value):
        raise wrong_type(what, value, "one of " + ", ".join(repr(k) for k in table))
    if value not in table.values():
        raise one_of(what, value, table)
    return value


def _access(access: str | int, call: str = "register") -> int:
    return _named("%s: access" % call, ACCESS, access)


def _lifetime(lifetime: str | int, call: str = "register") -> int:
    return _named("%s: lifetime" % call, LIFETIME, lifetime)


def _memory_kind(kind: str | int) -> int:
    return _named("register_dmabuf: kind", MEMORY_KIND, kind)


def _rpc(call: Any, request: Any, timeout: float | None) -> Any:
    try:
        return call(request, timeout=timeout)
    except grpc.RpcError as error:
        raise AgentError(error.code(), error.details()) from None


def _recv_exact(sock: socket.socket, size: int, fds: list[int]) -> bytes:
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


def _attach_exchange(path: str, request: Any, fd: int | None,
                     timeout: float | None) -> tuple[Any, int | None]:
    """One request/response on the attach socket (attach.proto framing).

    Returns (AttachResponse, fd or None). The caller owns the returned fd.
    """
    response, received, sock = _attach_open(path, request, fd, timeout)
    sock.close()
    return response, received


def _attach_open(path: str, request: Any, fd: int | None,
                 timeout: float | None) -> tuple[Any, int | None, socket.socket]:
    """_attach_exchange() that keeps the connection (a ring session lives on
    it): returns (AttachResponse, fd or None, the connected socket), all the
    caller's."""
    body = request.SerializeToString()
    frame = struct.pack("<I", len(body)) + body
    fds: list[int] = []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
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
        sock.close()
        for extra in fds:
            os.close(extra)
        raise AgentError(grpc.StatusCode.DEADLINE_EXCEEDED,
                         "no answer from the attach socket %s in time" % path) from None
    except (FileNotFoundError, ConnectionError) as error:
        sock.close()
        for extra in fds:
            os.close(extra)
        raise AgentError(grpc.StatusCode.UNAVAILABLE,
                         "attach socket %s: %s" % (path, error)) from None
    except BaseException:
        sock.close()
        for extra in fds:
            os.close(extra)
        raise
    # Keep the first fd; a well-behaved agent sends at most one.
    for extra in fds[1:]:
        os.close(extra)
    return response, (fds[0] if fds else None), sock


def _check_range(what: str, buffer_id: int, offset: int, length: int) -> None:
    # uint64 on the wire: an overflowing range cannot even be sent.
    if offset < 0 or length < 0 or offset + length > (1 << 64) - 1:
        raise AgentError(grpc.StatusCode.OUT_OF_RANGE,
                         "%s of buffer %d: offset %d + length %d overflows"
                         % (what, buffer_id, offset, length))


def _raise_for(response: Any) -> None:
    if response.code != 0:
        raise AgentError(status_code(response.code), response.message)


class Buffer:
    """A registration of this process's memory.

    `memory` is the registered memory as this process sees it: an mmap for
    allocate() and attach(), a memoryview of the pages for register() of an
    existing object, None once closed (or, for tensor()/ndarray() memory,
    once the tensor and its views are gone). `size` is the registration's
    size in bytes; `offset` where the object a registration was made for
    starts in it (0 but for register() of an existing object).

    close() (or leaving its `with` block) releases the registration, best
    effort, unless release() was called. It never unmaps memory: this
    Buffer drops its reference, and the mapping goes when the last view of
    it does (a torch.frombuffer or numpy view made of `memory` stays valid
    memory of this process, no longer shared with the agent). `lifetime`
    is the Lifetime the agent keeps it with: by default it is released also
    when this process dies without closing it.

    publish(name) puts the buffer under a name in the agent's directory;
    `names` lists the names this client published for it. When the agent
    restarts, a buffer of memory this process owns (attach(), tensor(),
    ndarray(), register() of an object) with the "process" or "connection"
    lifetime is registered again on the new agent and its names published
    again: `id`, `remote_context` and `backends` then change in place (the
    memory stays the same), so name it in ops by the Buffer (or the object
    inside it), not by a saved id. See AgentClient's `rejoin`.
    """

    def __init__(self, client: AgentClient, buffer_id: int, memory: Any,
                 remote_context: bytes, backends: Iterable[str],
                 lifetime: int = types_pb2.LIFETIME_AGENT, size: int | None = None,
                 address: int = 0, offset: int = 0, owner: object = None,
                 memfd: int | None = None, access: int = types_pb2.ACCESS_READ_WRITE,
                 label: str = "") -> None:
        self._client = client
        self.id = buffer_id
        self.size = len(memory) if size is None else size
        self._memory = memory
        self._memory_ref: weakref.ref[Any] | None = None
        self.address = address
        self.offset = offset
        self.remote_context = remote_context
        self.backends = list(backends)
        self.lifetime = lifetime
        self._owner = owner  # what keeps adopted memory allocated
        self._released = False
        # What registering it again after an agent restart takes: the memfd
        # (closed with the Buffer, or when it is collected), access, label.
        self._memfd = memfd
        self._memfd_closer = (weakref.finalize(self, os.close, memfd)
                              if memfd is not None else None)
        self._access = access
        self._label = label
        # Names this client published for it, with their visibility numbers.
        self._names: dict[str, int] = {}

    @property
    def names(self) -> list[str]:
        """The names this client published for this buffer (and has not
        withdrawn), sorted."""
        return sorted(self._names)

    @property
    def epoch(self) -> int:
        """The epoch of the agent that issued `remote_context`."""
        return decode_context(self.remote_context).agent_epoch

    def publish(self, name: str, visibility: str | int = "owner") -> None:
        """AgentClient.publish(self, name, visibility)."""
        self._client.publish(self, name, visibility)

    def _drop_memfd(self) -> None:
        if self._memfd_closer is not None:
            self._memfd_closer()
        self._memfd = None

    @property
    def memory(self) -> Any:
        if self._memory is not None:
            return self._memory
        return self._memory_ref() if self._memory_ref is not None else None

    @property
    def released(self) -> bool:
        return self._released

    def _hold_weakly(self) -> None:
        """Keeps only a weak reference to `memory`: its views keep it."""
        self._memory_ref = weakref.ref(self._memory)
        self._memory = None

    def release(self) -> None:
        """Releases the registration now (AgentError if the agent refuses).

        The memory stays mapped; close() will not release again.
        """
        if self._released:
            raise AgentError(grpc.StatusCode.FAILED_PRECONDITION,
                             "Release: buffer %d was already released" % self.id)
        self._released = True
        self._client._forget(self.id)
        self._names.clear()
        self._drop_memfd()
        self._client.release(self.id)

    def close(self) -> None:
        """Releases (best effort) and drops this Buffer's hold on the memory;
        live views keep theirs."""
        if not self._released:
            self._released = True
            self._client._forget(self.id)
            self._names.clear()
            try:
                self._client.release(self.id)
            except AgentError:
                pass  # best effort, as documented
        self._drop_memfd()
        self._memory = None
        self._memory_ref = None
        self._owner = None

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return "Buffer(id=%d, size=%d%s)" % (self.id, self.size,
                                             ", released" if self._released else "")


_Kept = TypeVar("_Kept", bound="_KeptOnAgent")


class _KeptOnAgent:
    """What the agent keeps under an id for this client until release():
    released at most once, close() best effort, a context manager."""

    # "RPC: what %d was already released", for a second release().
    _ALREADY_RELEASED = ""

    def __init__(self, client: AgentClient, id_: int) -> None:
        self._client = client
        self.id: int = id_
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def _release_call(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        """Drops it on the agent. NotFoundError when the agent does not know
        it; FailedPreconditionError when this object released it already."""
        if self._released:
            raise AgentError(grpc.StatusCode.FAILED_PRECONDITION,
                             self._ALREADY_RELEASED % self.id)
        self._released = True
        self._release_call()

    def close(self) -> None:
        """release(), best effort, unless released already."""
        if not self._released:
            try:
                self.release()
            except AgentError:
                pass

    def __enter__(self: _Kept) -> _Kept:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteHandle(_KeptOnAgent):
    """A remote context the agent has parsed, checked and routed once
    (AgentClient.import_remote): an Op whose `remote` is this handle sends
    its 8-byte id instead of the context.

    The handle is this user's (another user's ops naming it get NOT_FOUND)
    and lives on the agent until release() or close() (leaving its `with`
    block), or until the agent stops. It says nothing about the buffer
    still existing: ops naming it are checked by the serving agent as ops
    carrying the context are. `agent_id`, `buffer_id`, `size_bytes`,
    `access` and `backends` are what the context says (the backends: the
    agent's that reach it, best first). Ops already running with it when it
    is released finish.
    """

    _ALREADY_RELEASED = "ReleaseRemote: handle %d was already released"

    def __init__(self, client: AgentClient, info: Any) -> None:
        super().__init__(client, info.remote_handle)
        self.agent_id: str = info.agent_id
        self.buffer_id: int = info.buffer_id
        self.size_bytes: int = info.size_bytes
        self.access: int = info.access
        self.backends: list[str] = list(info.backends)

    def _release_call(self) -> None:
        _rpc(self._client.stub.ReleaseRemote,
             agent_pb2.ReleaseRemoteRequest(remote_handle=self.id), self._client.timeout)

    def __repr__(self) -> str:
        return "RemoteHandle(%d, buffer %d of %s%s)" % (
            self.id, self.buffer_id, self.agent_id, ", released" if self._released else "")


class PreparedTransfer(_KeptOnAgent):
    """A batch the agent validated once and keeps under an id
    (AgentClient.prepare_transfer): submit() and submit_async() run its ops
    again without sending them, each run exactly as a Submit of those ops
    (results one per op, in order). The ops are fixed when prepared: a
    handle they name may be released afterwards. Lives on the agent until
    release() or close() (leaving its `with` block); runs already started
    finish.
    """

    _ALREADY_RELEASED = "ReleasePrepared: transfer %d was already released"

    def __init__(self, client: AgentClient, prepared_id: int, op_count: int) -> None:
        super().__init__(client, prepared_id)
        self.op_count = op_count

    def submit(self, timeout: float | None = None) -> list[OpResult]:
        """Runs the ops once and waits: one OpResult per op. `timeout`
        (seconds) bounds the run on the agent; None = the agent's default.
        NotFoundError once released."""
        return self._client._submit_prepared(self.id, timeout)

    def submit_async(self, timeout: float | None = None) -> Transfer:
        """Starts one run as an asynchronous transfer (AgentClient.
        submit_async); the TransferResult also says what became of the
        notification given to prepare_transfer()."""
        return self._client._submit_async_request(
            self._client._prepared_request(self.id, timeout))

    def _release_call(self) -> None:
        _rpc(self._client.stub.ReleasePrepared,
             agent_pb2.ReleasePreparedRequest(prepared_id=self.id), self._client.timeout)

    def __repr__(self) -> str:
        return "PreparedTransfer(%d, %d ops%s)" % (self.id, self.op_count,
                                                    ", released" if self._released else "")


# Every Buffer of every client of this process with memory mapped here, for
# register_memory()'s overlap check.
_MAPPED: weakref.WeakSet[Buffer] = weakref.WeakSet()
_MAPPED_LOCK = threading.Lock()


def _probe_socket(path: str) -> None:
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

    `rejoin` (default True): when the agent restarts (a new epoch), every
    Buffer of this client over memory this process owns (attach(),
    tensor(), ndarray(), register() of an object) that lives with the
    process or the connection is registered again on the new agent from the
    memfd the Buffer keeps, and every name this client published for it is
    published again (with its visibility), so a peer's next resolve finds
    it. The Buffer updates itself (`id`, `remote_context`, `backends`;
    `memory` is the same); then `on_rejoin(buffer, old_id)` is called, if
    given, on the client's "rdma-rejoin" thread. That thread starts with the
    first such Buffer and wakes when the channel reconnects; rejoin() does
    the same check on demand. Each such Buffer holds one fd of this process.
    Agent-allocated buffers (allocate(), register(size)) and "agent"
    lifetime ones are not registered again: their memory or their owner is
    the old agent's. What went wrong last is in `rejoin_error`.

    `ring` (default True): submit() runs a batch through a shared-memory
    ring session of this client (docs/RING.md; opened at the first batch,
    64 slots, charged to this user's registered bytes and
    --max_ring_sessions_per_user) instead of a gRPC call, importing each
    remote context its ops name once (import_remote(); the 256 most
    recently used are kept). The batch goes over gRPC when the ring cannot
    take it: no ring here or on the agent (why: `ring_unavailable`), an op
    named by remote_name, a context the agent will not import, more than 64
    ops, or another thread's batch on the ring at that moment. A ring whose
    agent restarted is dropped and the next one opened. `ring_batches`
    counts the batches that went through it. submit_notify(),
    submit_async() and prepared transfers go over gRPC; open_ring() gives
    the ring itself.
    """

    def __init__(self, socket_path: str | None = None, attach_socket: str | None = None,
                 timeout: float = 30.0, chunk_bytes: int = 1 << 20, watch: bool = True,
                 rejoin: bool = True,
                 on_rejoin: Callable[[Buffer, int], None] | None = None,
                 ring: bool = True) -> None:
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
                     ("grpc.client_idle_timeout_ms", (1 << 31) - 1),
                     # A restarted agent is found at once (a local socket
                     # is cheap to retry; gRPC's default backoff starts at
                     # a second and grows to two minutes).
                     ("grpc.initial_reconnect_backoff_ms", 100),
                     ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 2000)])
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
        self._records: weakref.WeakValueDictionary[int, _Record] = \
            weakref.WeakValueDictionary()
        self._pending: dict[int, _Record] = {}
        self._last_ticket = 0
        self._submitting: set[int] = set()
        self._unclaimed: dict[int, tuple[TransferResult, int]] = {}
        self._watch_enabled = watch
        self._watching = False
        self._watch_call: Any = None
        self._watch_thread: threading.Thread | None = None
        self._closing = False
        # This client's registrations of local memory, for ops that name a
        # tensor or array and for sizes: mapped ones weakly (their owner
        # closes them), born and adopted ones strongly (born ones until
        # their memory is gone, adopted ones until closed).
        self._regions: weakref.WeakValueDictionary[int, Buffer] = weakref.WeakValueDictionary()
        self._kept: dict[int, Buffer] = {}
        # Born registrations whose memory went away (appended by a
        # finalizer, on any thread): released at the next call.
        self._gone: collections.deque[Buffer] = collections.deque()
        # Registering again after an agent restart (see the class docstring).
        self._rejoin_enabled = rejoin
        self._on_rejoin = on_rejoin
        self._rejoin_lock = threading.Lock()
        self._rejoin_wake = threading.Event()
        self._rejoin_thread: threading.Thread | None = None
        self._connection_lost = False
        self.rejoin_error: AgentError | None = None
        # submit()'s shared-memory lane (see the class docstring).
        self._ring_path: Any = None
        if ring:
            from rdma_agent.ring import _RingPath
            self._ring_path = _RingPath(self)

    def close(self) -> None:
        """Releases born registrations whose memory is gone, stops the watch
        (pending futures fail with AgentError CANCELLED) and closes the
        channel."""
        self._release_gone()
        if self._ring_path is not None:
            self._ring_path.close()
        with self._lock:
            self._closing = True
            call, thread = self._watch_call, self._watch_thread
        if call is not None:
            call.cancel()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        rejoiner = self._rejoin_thread
        if rejoiner is not None:
            self._channel.unsubscribe(self._on_connectivity)
            self._rejoin_wake.set()
            if rejoiner is not threading.current_thread():
                rejoiner.join()
            # gRPC's connectivity poller notices the unsubscription within
            # 0.2 s; a channel closed before then makes it fail loudly.
            poller = getattr(self._channel, "_connectivity_state", None)
            deadline = time.monotonic() + 1
            while getattr(poller, "polling", False) and time.monotonic() < deadline:
                time.sleep(0.01)
        self._channel.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def ring_batches(self) -> int:
        """Batches submit() ran through its ring (ring=True)."""
        return 0 if self._ring_path is None else self._ring_path.batches

    @property
    def ring_unavailable(self) -> AgentError | None:
        """Why submit() could not open its ring when it last tried (then
        it goes over gRPC, trying again after 30 s); None otherwise."""
        return None if self._ring_path is None else self._ring_path.unavailable

    def info(self) -> agent_pb2.AgentInfo:
        """The agent's AgentInfo (id, epoch, version, backends)."""
        self._release_gone()
        return _rpc(self.stub.GetInfo, agent_pb2.GetInfoRequest(), self.timeout)

    def register(self, what: int | Any, access: str | int = "read_write", label: str = "",
                 lifetime: str | int = "process", share_edge_pages: bool = False) -> Any:
        """Registers memory with the agent.

        `what` an int: the agent allocates that many bytes, not mapped here
        (see allocate() for mapped memory); returns the RegisterResponse
        (buffer_id, remote_context, lifetime, ...). Anything else: memory
        this process already has, registered in place (register_memory());
        returns a Buffer. `access`: "read", "write" or "read_write";
        `lifetime`: "process" (default: released when this process exits or
        dies), "connection" (when this client's connection closes) or
        "agent" (only by release())."""
        if not _is_int(what):
            return self.register_memory(what, access, label, lifetime, share_edge_pages)
        size = _check_count("register: size", what, positive=True)
        self._release_gone()
        return _rpc(self.stub.Register,
                    agent_pb2.RegisterRequest(allocate_bytes=size,
                                              access=_access(access, "register"),
                                              label=label,
                                              lifetime=_lifetime(lifetime, "register")),
                    self.timeout)

    def allocate(self, size: int, access: str | int = "read_write", label: str = "",
                 lifetime: str | int = "process") -> Buffer:
        """Agent allocates; the memory is mapped here through the fd the
        attach socket returns (OpenBuffer). Returns a Buffer. `lifetime`: by
        default the agent releases it if this process dies without closing
        it; "agent" keeps it until released."""
        size = _check_count("allocate: size", size, positive=True)
        response = self.register(size, _access(access, "allocate"), label,
                                 _lifetime(lifetime, "allocate"))
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
        return self._track(Buffer(self, response.buffer_id, memory, response.remote_context,
                                  response.backends, response.lifetime,
                                  address=_memory.address_of(memory)))

    def attach(self, size: int, access: str | int = "read_write", label: str = "",
               lifetime: str | int = "process") -> Buffer:
        """This process creates a memfd (sealed against shrinking), maps it,
        hands it to the agent on the attach socket and registers it.
        `lifetime` as for allocate()."""
        size = _check_count("attach: size", size, positive=True)
        access_number = _access(access, "attach")
        lifetime_number = _lifetime(lifetime, "attach")
        self._release_gone()
        fd = os.memfd_create(label or "rdma-agent-client",
                             os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            memory = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            response = self._register_fd(fd, access_number, label, lifetime_number)
        except BaseException:
            os.close(fd)
            raise
        # The agent has its own reference and ours is the mapping; the fd is
        # kept only to register the memory again after an agent restart.
        return self._track(Buffer(self, response.buffer_id, memory, response.remote_context,
                                  response.backends, response.lifetime,
                                  address=_memory.address_of(memory),
                                  memfd=self._kept_memfd(fd, response.lifetime),
                                  access=access_number, label=label))

    def _kept_memfd(self, fd: int, lifetime: int) -> int | None:
        """`fd` when a Buffer keeps it for rejoin; otherwise closes it."""
        if self._rejoin_enabled and lifetime != types_pb2.LIFETIME_AGENT:
            return fd
        os.close(fd)
        return None

    def _register_fd(self, fd: int, access: int, label: str,
                     lifetime: int) -> agent_pb2.RegisterResponse:
        """Hands a memfd to the agent (attach socket) and registers it."""
        reply, extra = _attach_exchange(
            self.attach_socket, attach_pb2.AttachRequest(attach=attach_pb2.AttachMemory()),
            fd, self.timeout)
        if extra is not None:
            os.close(extra)
        _raise_for(reply)
        return _rpc(self.stub.Register,
                    agent_pb2.RegisterRequest(attach_token=reply.attach_token, access=access,
                                              label=label, lifetime=lifetime),
                    self.timeout)

    # -- tensors, arrays and memory the caller already has -----------------

    def _track(self, buffer: Buffer, keep: bool = False) -> Buffer:
        with _MAPPED_LOCK:
            _MAPPED.add(buffer)
        with self._lock:
            self._regions[buffer.id] = buffer
            if keep:
                self._kept[buffer.id] = buffer
        if buffer._memfd is not None:
            self._start_rejoin()
        return buffer

    def _forget(self, buffer_id: int) -> None:
        with self._lock:
            self._regions.pop(buffer_id, None)
            self._kept.pop(buffer_id, None)

    def _release_gone(self) -> None:
        while self._gone:
            buffer = self._gone.popleft()
            if not buffer.released:
                buffer.close()

    def _born(self, nbytes: int, call: str, access: str | int, label: str,
              lifetime: str | int) -> tuple[Buffer, mmap.mmap]:
        """An attached registration whose mapping is kept alive only by the
        views made of it; released once they are all gone."""
        if nbytes <= 0:
            raise invalid("%s: the shape holds no elements (a registration needs bytes)"
                          % call)
        buffer = self.attach(nbytes, access, label, lifetime)
        memory = buffer.memory
        buffer._hold_weakly()
        # The Buffer, not its id: rejoin may give it another id.
        weakref.finalize(memory, self._gone.append, buffer)
        self._track(buffer, keep=True)
        return buffer, memory

    def tensor(self, shape: int | Sequence[int], dtype: Any = None,
               access: str | int = "read_write", label: str = "",
               lifetime: str | int = "process") -> Any:
        """A torch CPU tensor (zeros, default dtype torch.float32) born
        registered: its memory is a memfd the agent shares. The registration
        lives while the tensor or any view of it does (then it is released
        at this client's next call or close()); buffer_of() finds it and an
        Op takes the tensor as its local side."""
        import torch
        dtype = torch.float32 if dtype is None else dtype
        dims = _shape("tensor", shape)
        count = 1
        for extent in dims:
            count *= extent
        element = torch.empty((), dtype=dtype).element_size()
        _, memory = self._born(count * element, "tensor", access, label, lifetime)
        return torch.frombuffer(memory, dtype=dtype, count=count).view(dims)

    def ndarray(self, shape: int | Sequence[int], dtype: Any = None,
                access: str | int = "read_write", label: str = "",
                lifetime: str | int = "process") -> Any:
        """A numpy array (zeros, default dtype float32) born registered, as
        tensor()."""
        import numpy
        dtype = numpy.dtype(numpy.float32 if dtype is None else dtype)
        dims = _shape("ndarray", shape)
        count = 1
        for extent in dims:
            count *= extent
        _, memory = self._born(count * dtype.itemsize, "ndarray", access, label, lifetime)
        return numpy.frombuffer(memory, dtype=dtype, count=count).reshape(dims)

    def empty_like(self, like: Any, access: str | int = "read_write", label: str = "",
                   lifetime: str | int = "process") -> Any:
        """A born-registered tensor or array of the shape and dtype of `like`
        (a torch tensor or a numpy array), zero-filled."""
        if type(like).__module__.startswith("torch"):
            return self.tensor(tuple(like.shape), like.dtype, access, label, lifetime)
        if type(like).__module__ == "numpy":
            return self.ndarray(like.shape, like.dtype, access, label, lifetime)
        raise wrong_type("empty_like: like", like, "a torch tensor or a numpy array")

    def register_memory(self, obj: Any, access: str | int = "read_write", label: str = "",
                        lifetime: str | int = "process",
                        share_edge_pages: bool = False) -> Buffer:
        """Registers memory this process already has — a contiguous torch CPU
        tensor, a numpy array, a bytearray or another writable buffer — in
        place: its pages become pages of a memfd the agent shares, at the
        same addresses (rdma_agent.memory: one copy now, zero copy for every
        transfer after; existing views stay valid). Returns a Buffer whose
        `offset` is where `obj` starts in it; the Buffer keeps `obj` alive
        until close().

        The registration holds the whole pages `obj` touches. When `obj`
        does not start and end on page boundaries, bytes of other objects in
        its first and last page become reachable by holders of the remote
        context: pass share_edge_pages=True to accept that, or allocate
        with tensor()/ndarray() instead. Memory already inside a
        registration of this client is refused (moving it again would cut
        the first registration off from it)."""
        address, length = _memory.span(obj, "register_memory")
        if length == 0:
            raise invalid("register_memory: the %s holds no bytes" % type(obj).__name__)
        # A buffer export, where the object has one, also keeps it from being
        # resized (moved) while the registration or a view of it lives.
        owner = obj if type(obj).__module__.startswith("torch") else memoryview(obj)
        return self.register_range(address, length, access, label, lifetime, share_edge_pages,
                                   owner=owner, what=type(obj).__name__)

    def register_range(self, address: int, length: int, access: str | int = "read_write",
                       label: str = "", lifetime: str | int = "process",
                       share_edge_pages: bool = False, owner: object = None,
                       what: str = "memory") -> Buffer:
        """register_memory() of the `length` bytes at `address` of this
        process (e.g. a tensor's data_ptr()), which the caller keeps mapped
        and allocated until the Buffer is closed (`owner`, if given, is kept
        alive until then)."""
        address = _check_count("register_range: address", address, positive=True)
        length = _check_count("register_range: length", length, positive=True)
        obj_name = what
        access_number = _access(access, "register_memory")
        lifetime_number = _lifetime(lifetime, "register_memory")
        first, size = _memory.page_span(address, length)
        if not share_edge_pages and (first != address or size != length):
            raise invalid(
                "register_memory: the %s at 0x%x (%d bytes) does not fill whole pages of "
                "%d bytes, so its registration would expose the bytes sharing its first and "
                "last page; pass share_edge_pages=True to accept that, or allocate it "
                "registered with tensor()/ndarray()"
                % (obj_name, address, length, _memory.PAGE))
        self._release_gone()
        with _MAPPED_LOCK:
            # Any client of this process: moving pages that a registration
            # (or a live mapping) already holds would cut them off from it.
            for other in list(_MAPPED):
                if other.memory is not None and \
                        other.address < first + size and first < other.address + other.size:
                    raise invalid("register_memory: the %s at 0x%x shares pages with "
                                  "buffer %d of %s" % (obj_name, address, other.id,
                                                       "this client" if other._client is self
                                                       else "another client of this process"))
            fd, first, size = _memory.move_onto_memfd(address, length, label)
        try:
            response = self._register_fd(fd, access_number, label, lifetime_number)
        except BaseException:
            os.close(fd)
            raise
        memfd = self._kept_memfd(fd, response.lifetime)
        pages = (ctypes.c_char * size).from_address(first)
        # Views of `memory` keep the pages' object allocated, as views of an
        # mmap keep the mapping.
        pages._owner = owner  # type: ignore[attr-defined]
        return self._track(Buffer(self, response.buffer_id, memoryview(pages).cast("B"),
                                  response.remote_context, response.backends,
                                  response.lifetime, size=size, address=first,
                                  offset=address - first, owner=owner, memfd=memfd,
                                  access=access_number, label=label), keep=True)

    def buffer_of(self, obj: Any) -> tuple[Buffer, int]:
        """The registration of this client that holds `obj` (a tensor, an
        array or a buffer), and the offset of `obj` in it. InvalidArgumentError
        when none does."""
        if isinstance(obj, Buffer):
            return obj, 0
        address, length = _memory.span(obj, "buffer_of")
        found = self.find_range(address, length)
        if found is not None:
            return found
        raise invalid("the %s at 0x%x (%d bytes) is not inside a registration of this client "
                      "(register it, or make it with tensor()/ndarray())"
                      % (type(obj).__name__, address, length))

    def find_range(self, address: int, length: int) -> tuple[Buffer, int] | None:
        """The registration of this client holding the `length` bytes at
        `address`, and their offset in it; None if none does."""
        with self._lock:
            for buffer in list(self._regions.values()):
                if buffer.released:
                    continue
                if buffer.address <= address and address + length <= buffer.address + buffer.size:
                    return buffer, address - buffer.address
        return None

    def register_dmabuf(self, fd: int, offset: int, length: int, kind: str | int = "cuda",
                        device: int = 0, access: str | int = "read_write", label: str = "",
                        lifetime: str | int = "process",
                        pci_bus_id: str | None = None) -> agent_pb2.RegisterResponse:
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

    def _resolve_local(self, index: int, op: Op) -> tuple[int, int, int | None]:
        """(buffer id, offset of the op's local side in it, bytes of the local
        side from there or None if unknown)."""
        if _is_int(op.local):
            buffer = self._regions.get(op.local)
            return op.local, 0, None if buffer is None else buffer.size
        try:
            buffer, start = self.buffer_of(op.local)
        except (InvalidArgumentError, ArgumentTypeError) as error:
            raise type(error)(error.code, "op %d: local: %s" % (index, error.message)) from None
        if isinstance(op.local, Buffer):
            return buffer.id, 0, buffer.size
        return buffer.id, start, _memory.span(op.local)[1]

    def _op_message(self, index: int, op: Op) -> dict[str, Any]:
        buffer_id, start, local_size = self._resolve_local(index, op)
        if local_size is not None and op.local_offset > local_size:
            raise invalid("op %d: local_offset %d is past the %d bytes of its local side"
                          % (index, op.local_offset, local_size))
        remote_context = b"" if op.remote_name else op.remote_context
        handle = op.remote if isinstance(op.remote, RemoteHandle) else None
        length = op.length
        if length is None:
            rests = []
            if local_size is not None:
                rests.append(local_size - op.local_offset)
            if handle is not None:
                remote_size = handle.size_bytes
            else:
                try:
                    remote_size = decode_context(remote_context).size_bytes
                except Exception:  # malformed: the agent says so
                    remote_size = 0
            if remote_size:
                rests.append(max(0, remote_size - op.remote_offset))
            if not rests:
                raise invalid("op %d: length is needed (the local buffer %d is not this "
                              "client's and the remote context has no size)"
                              % (index, buffer_id))
            length = min(rests)
        fields: dict[str, Any] = dict(
            type=OP_TYPE[op.type] if isinstance(op.type, str) else op.type,
            local_buffer_id=buffer_id, local_offset=start + op.local_offset, length=length,
            remote_offset=op.remote_offset)
        if op.remote_name:
            fields["remote_name"] = op.remote_name
        elif handle is not None:
            fields["remote_handle"] = handle.id
        else:
            fields["remote_context"] = remote_context
        return fields

    def open_ring(self, entries: int = 64, max_notification_bytes: int = 4096) -> Ring:
        """Opens a shared-memory ring session with the agent (docs/RING.md,
        version 2): returns an rdma_agent.ring.Ring of `entries` slots (a
        power of two, at most the agent's --max_ring_entries), whose ops name
        local buffers and RemoteHandles and run without a gRPC call.
        `max_notification_bytes` is the agent's --max_notification_bytes (the
        agent does not say it): larger notifications are refused here. The
        ring's memory is charged to this user's registered-bytes quota until
        close()."""
        from rdma_agent.ring import Ring
        return Ring._open(self, entries, max_notification_bytes)

    def _op_messages(self, ops: Iterable[Op], container: Any) -> None:
        """Adds one Op message per Op to the repeated field `container`."""
        for index, op in enumerate(ops):
            if not isinstance(op, Op):
                raise wrong_type("op %d" % index, op, "an rdma_agent.Op")
            container.add(**self._op_message(index, op))

    def _submit_request(self, ops: Iterable[Op], timeout: float | None,
                        notification: bytes | str | None = None) -> agent_pb2.SubmitRequest:
        self._release_gone()
        request = agent_pb2.SubmitRequest(notification=_as_bytes(notification))
        self._op_messages(ops, request.ops)
        if timeout is not None:
            request.timeout.CopyFrom(_duration(timeout))
        return request

    # -- imported remotes and prepared transfers ---------------------------

    def import_remote(self, remote: bytes | Buffer) -> RemoteHandle:
        """Has the agent parse, check and route a remote context once
        (ImportRemote); returns the RemoteHandle that ops then name instead
        of the context (a Buffer: its remote_context). InvalidArgumentError
        for a malformed context, UnavailableError when no backend of the
        agent reaches it, ResourceExhaustedError beyond the agent's
        --max_remote_handles_per_user (or its bytes)."""
        if isinstance(remote, Buffer):
            context = remote.remote_context
        elif isinstance(remote, (bytes, bytearray, memoryview)):
            context = bytes(remote)
        else:
            raise wrong_type("import_remote: remote", remote, "a remote context (bytes) or a "
                             "Buffer")
        if not context:
            raise invalid("import_remote: the remote context is empty")
        self._release_gone()
        response = _rpc(self.stub.ImportRemote,
                        agent_pb2.ImportRemoteRequest(remote_context=context), self.timeout)
        return RemoteHandle(self, response.remote)

    def list_remotes(self) -> list[RemoteHandle]:
        """This user's imported remotes on the agent (ListRemotes), whoever
        imported them; each a RemoteHandle (release() drops it)."""
        response = _rpc(self.stub.ListRemotes, agent_pb2.ListRemotesRequest(), self.timeout)
        return [RemoteHandle(self, info) for info in response.remotes]

    def prepare_transfer(self, ops: Iterable[Op],
                         notification: bytes | str | None = None) -> PreparedTransfer:
        """Has the agent validate `ops` once and keep them (PrepareTransfer):
        returns the PreparedTransfer to run them by id. A bad batch or a bad
        op fails the call with the code Submit would give it, naming the op
        ("op N: ..."); ResourceExhaustedError beyond the agent's
        --max_prepared_transfers_per_user (or its bytes). `notification`
        (bytes or str) is sent at every run, as for submit_notify()."""
        self._release_gone()
        request = agent_pb2.PrepareTransferRequest(notification=_as_bytes(notification))
        self._op_messages(ops, request.ops)
        response = _rpc(self.stub.PrepareTransfer, request, self.timeout)
        return PreparedTransfer(self, response.prepared_id, len(request.ops))

    def _prepared_request(self, prepared_id: int,
                          timeout: float | None) -> agent_pb2.SubmitRequest:
        request = agent_pb2.SubmitRequest(prepared_id=prepared_id)
        if timeout is not None:
            request.timeout.CopyFrom(_duration(timeout))
        return request

    def _submit_prepared(self, prepared_id: int, timeout: float | None) -> list[OpResult]:
        request = self._prepared_request(prepared_id, timeout)
        deadline = (timeout if timeout is not None else self.timeout) + 5
        response = _rpc(self.stub.Submit, request, deadline)
        return [OpResult(status_code(r.code), r.message, r.backend) for r in response.results]

    def submit(self, ops: Iterable[Op], timeout: float | None = None) -> list[OpResult]:
        """Runs `ops` (Op tuples) as one batch: one OpResult per op. `timeout`
        (seconds) bounds the batch on the agent; None = the agent's default.
        With ring=True (the default) the batch goes through this client's
        shared-memory ring when it can, else over gRPC; the results are the
        same either way (see the class docstring)."""
        if self._ring_path is not None:
            ops = list(ops)
            self._release_gone()
            results = self._ring_path.submit(ops, timeout)
            if results is not None:
                return results
        request = self._submit_request(ops, timeout)
        deadline = (timeout if timeout is not None else self.timeout) + 5
        response = _rpc(self.stub.Submit, request, deadline)
        return [OpResult(status_code(r.code), r.message, r.backend) for r in response.results]

    def submit_notify(self, ops: Iterable[Op], notification: bytes | str,
                      timeout: float | None = None) -> SubmitResult:
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

    def get_notifications(self, wait: float = 0, max_count: int = 0) -> NotificationBatch:
        """Takes this user's queued notifications (at most `max_count`; 0 =
        the agent's most), waiting up to `wait` seconds for the first one.
        Returns a NotificationBatch; each notification is returned once."""
        self._release_gone()
        request = agent_pb2.GetNotificationsRequest(wait=_duration(wait), max_count=max_count)
        response = _rpc(self.stub.GetNotifications, request, wait + self.timeout)
        return NotificationBatch([_notification(n) for n in response.notifications],
                                 response.dropped)

    def watch_notifications(self) -> NotificationStream:
        """A NotificationStream: iterate it for (Notification or None, dropped)
        pairs as notifications arrive (first those queued), until close()."""
        return NotificationStream(
            self.stub.WatchNotifications(agent_pb2.WatchNotificationsRequest()))

    def submit_async(self, ops: Iterable[Op], timeout: float | None = None,
                     notification: bytes | str | None = None) -> Transfer:
        """Starts `ops` as one asynchronous transfer and returns its Transfer
        once the agent has accepted it. A bad batch raises AgentError with
        submit()'s codes (RESOURCE_EXHAUSTED beyond the agent's transfers in
        flight per user); a bad op is reported in the transfer's results.
        `timeout` (seconds) bounds the transfer on the agent from now, time
        queued included; None = the agent's default. `notification` as for
        submit_notify(); the TransferResult's `notifications` say what became
        of it."""
        return self._submit_async_request(self._submit_request(ops, timeout, notification))

    def _submit_async_request(self, request: agent_pb2.SubmitRequest) -> Transfer:
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
        assert record is not None  # the RPC raised otherwise
        return Transfer(self, record)

    def transfer(self, transfer_id: int) -> Transfer:
        """A Transfer for an id of this user submitted elsewhere (another
        process, rdma-agentctl submit --async); no RPC: an id the agent does
        not know raises NOT_FOUND from wait(), poll() and cancel()."""
        self._ensure_watch()
        with self._lock:
            record = self._record_locked(transfer_id)
        return Transfer(self, record)

    # -- asynchronous transfers: the client's side ------------------------

    def _record_locked(self, transfer_id: int) -> _Record:
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

    def _prune_unclaimed_locked(self) -> None:
        # A submit_async() can claim an end only if it was in progress when
        # the end arrived: its ticket is at most the end's horizon.
        oldest = min(self._submitting) if self._submitting else self._last_ticket + 1
        for transfer_id in [i for i, (_, horizon) in self._unclaimed.items()
                            if horizon < oldest]:
            del self._unclaimed[transfer_id]

    @staticmethod
    def _settle(future: concurrent.futures.Future[TransferResult],
                end: TransferResult | None = None, error: BaseException | None = None) -> None:
        """Resolves a future once; a future its user cancelled stays so."""
        try:
            if error is not None:
                future.set_exception(error)
            elif end is not None:
                future.set_result(end)
        except concurrent.futures.InvalidStateError:
            pass

    def _resolve(self, record: _Record, end: TransferResult) -> TransferResult:
        """Records `end` unless an end is known; returns the end in force."""
        with self._lock:
            if record.end is not None:
                return record.end
            record.end = end
            self._pending.pop(record.transfer_id, None)
            self._changed.notify_all()
        self._settle(record.future, end)
        return end

    def _ensure_watch(self) -> None:
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

    def _watch_loop(self, call: Any) -> None:
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

    def _delivered(self, end: TransferResult) -> None:
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

    def _on_watch_thread(self) -> bool:
        return threading.current_thread() is self._watch_thread

    def _await_end(self, record: _Record, deadline: float | None) -> str:
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

    def _watch_serves(self, record: _Record) -> bool:
        with self._lock:
            return self._watching and record.transfer_id in self._pending and \
                not self._on_watch_thread()

    def _get_transfer(self, transfer_id: int, wait: float) -> Any:
        wait = max(0.0, min(wait, _LONGEST_POLL))
        request = agent_pb2.GetTransfersRequest(transfer_ids=[transfer_id])
        if wait > 0:
            request.wait.CopyFrom(_duration(wait))
        return _rpc(self.stub.GetTransfers, request, wait + self.timeout).transfers[0]

    def _wait(self, record: _Record, timeout: float | None) -> TransferResult:
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
                if outcome == "ended" and record.end is not None:
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

    def _poll(self, record: _Record) -> TransferResult:
        if record.end is not None:
            return record.end
        return self._ask(record, 0.0)

    def _ask(self, record: _Record, wait: float) -> TransferResult:
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

    def _cancel(self, record: _Record) -> TransferResult:
        if record.end is not None:  # ended: nothing to stop
            return record.end
        response = _rpc(self.stub.CancelTransfer,
                        agent_pb2.CancelTransferRequest(transfer_id=record.transfer_id),
                        self.timeout)
        return self._resolve(record, _transfer_result(response.transfer))

    # -- names (the agent's directory) -------------------------------------

    def list_agents(self) -> agent_pb2.ListAgentsResponse:
        """Every agent the agent's directory knows, this one included, by id
        (ListAgentsResponse: `agents`, AgentRecord messages; `directory`,
        "local" or "etcd://..."; `unreadable`; `truncated`)."""
        self._release_gone()
        return _rpc(self.stub.ListAgents, agent_pb2.ListAgentsRequest(), self.timeout)

    def publish(self, buffer: Buffer | int, name: str, visibility: str | int = "owner") -> None:
        """Publishes one of this user's buffers (a Buffer, or a buffer id)
        under `name` in the agent's directory: whoever resolves the name gets
        its remote context. `visibility` "owner" (default: this user, on any
        agent) or "any_user". A name held by another user or agent raises
        AgentError ALREADY_EXISTS; publishing it
        again moves it to this buffer. A Buffer of this client keeps its
        names (Buffer.names) and publishes them again after an agent
        restart."""
        name = _check_name("publish", name)
        number = _named("publish: visibility", VISIBILITY, visibility)
        if isinstance(buffer, Buffer):
            target: Buffer | None = buffer
            buffer_id = buffer.id
        elif _is_int(buffer):
            buffer_id = _check_count("publish: buffer id", buffer)
            target = self._regions.get(buffer_id)
        else:
            raise wrong_type("publish: buffer", buffer, "a Buffer or a buffer id")
        self._release_gone()
        _rpc(self.stub.Publish,
             agent_pb2.PublishRequest(buffer_id=buffer_id, name=name,
                                      visibility=agent_pb2.Visibility.Name(number)),
             self.timeout)
        with self._lock:
            for other in list(self._regions.values()):
                other._names.pop(name, None)  # a name stands for one buffer
            if target is not None:
                target._names[name] = number

    def unpublish(self, name: str) -> None:
        """Withdraws one of this user's names (NotFoundError when this user
        holds no such name on this agent)."""
        name = _check_name("unpublish", name)
        self._release_gone()
        _rpc(self.stub.Unpublish, agent_pb2.UnpublishRequest(name=name), self.timeout)
        with self._lock:
            for buffer in list(self._regions.values()):
                buffer._names.pop(name, None)

    def resolve(self, name: str) -> NameRecord:
        """The NameRecord `name` stands for (its remote_context goes into an
        Op's `remote`); NotFoundError when nobody this user may see holds
        it."""
        name = _check_name("resolve", name)
        self._release_gone()
        response = _rpc(self.stub.Resolve, agent_pb2.ResolveRequest(name=name), self.timeout)
        return _name_record(response.record)

    def watch_names(self, prefix: str = "") -> NameStream:
        """A NameStream of the names under `prefix` (empty: every name) this
        user may see: iterate it for NameEvents, first one "published" per
        name published now, then "synced", then each change as it happens,
        until close(). The stream ends (AgentError UNAVAILABLE) when the
        agent stops; watch again for a fresh snapshot."""
        if not isinstance(prefix, str):
            raise wrong_type("watch_names: prefix", prefix, "a str")
        self._release_gone()
        return NameStream(self.stub.WatchNames(agent_pb2.WatchNamesRequest(prefix=prefix)))

    # -- registering again after an agent restart --------------------------

    def _start_rejoin(self) -> None:
        with self._lock:
            if self._rejoin_thread is not None or self._closing:
                return
            self._rejoin_thread = threading.Thread(target=self._rejoin_loop,
                                                   name="rdma-rejoin", daemon=True)
        self._channel.subscribe(self._on_connectivity, try_to_connect=True)
        self._rejoin_thread.start()

    def _on_connectivity(self, state: grpc.ChannelConnectivity) -> None:
        # On gRPC's thread: only note it. Back to READY after a loss is
        # when the agent may have restarted.
        if state == grpc.ChannelConnectivity.READY:
            if self._connection_lost:
                self._connection_lost = False
                self._rejoin_wake.set()
        else:
            self._connection_lost = True

    def _rejoin_loop(self) -> None:
        attempts = 0
        while True:
            self._rejoin_wake.wait()
            self._rejoin_wake.clear()
            if self._closing:
                return
            try:
                self.rejoin()
                attempts = 0
            except AgentError as error:
                self.rejoin_error = error
                attempts += 1
                if attempts < 20:  # the agent may not serve yet: try again
                    time.sleep(0.25 * attempts)
                    self._rejoin_wake.set()

    def rejoin(self) -> list[Buffer]:
        """Registers again, on the agent as it is now, every Buffer this
        client would rejoin (see the class docstring) whose registration is
        from an earlier epoch, and publishes its names again. Returns those
        Buffers (empty when the agent has not restarted). A name another
        owner took meanwhile stays theirs: that failure is kept in
        `rejoin_error` and the name dropped from Buffer.names. Called by the
        "rdma-rejoin" thread when the channel reconnects; safe to call from
        any thread."""
        with self._rejoin_lock:
            epoch = _rpc(self.stub.GetInfo, agent_pb2.GetInfoRequest(), self.timeout).epoch
            with self._lock:
                stale = [b for b in self._regions.values()
                         if b._memfd is not None and not b.released and b.epoch != epoch]
            for buffer in stale:
                self._register_again(buffer)
            return stale

    def _register_again(self, buffer: Buffer) -> None:
        assert buffer._memfd is not None
        old_id = buffer.id
        response = self._register_fd(buffer._memfd, buffer._access, buffer._label,
                                     buffer.lifetime)
        with self._lock:
            if self._regions.get(old_id) is buffer:
                del self._regions[old_id]
            kept = self._kept.pop(old_id, None)
            buffer.id = response.buffer_id
            buffer.remote_context = response.remote_context
            buffer.backends = list(response.backends)
            buffer.lifetime = response.lifetime
            self._regions[buffer.id] = buffer
            if kept is not None:
                self._kept[buffer.id] = buffer
            names = dict(buffer._names)
        for name, visibility in names.items():
            try:
                _rpc(self.stub.Publish,
                     agent_pb2.PublishRequest(buffer_id=buffer.id, name=name,
                                              visibility=agent_pb2.Visibility.Name(visibility)),
                     self.timeout)
            except AgentError as error:
                self.rejoin_error = AgentError(
                    error.code, "publishing %r again for buffer %d: %s"
                    % (name, buffer.id, error.message))
                buffer._names.pop(name, None)
        if self._on_rejoin is not None:
            self._on_rejoin(buffer, old_id)

    def release(self, buffer_id: int) -> None:
        _rpc(self.stub.Release, agent_pb2.ReleaseRequest(buffer_id=buffer_id), self.timeout)

    def list_buffers(self, all_users: bool = False) -> list[agent_pb2.BufferInfo]:
        """This user's registrations (BufferInfo messages); with `all_users`,
        every user's (root only: AgentError PERMISSION_DENIED otherwise)."""
        self._release_gone()
        return list(_rpc(self.stub.ListBuffers,
                         agent_pb2.ListBuffersRequest(all_users=all_users),
                         self.timeout).buffers)

    def read_buffer(self, buffer_id: int, offset: int, length: int) -> bytes:
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

    def write_buffer(self, buffer_id: int, offset: int,
                     data: bytes | bytearray | memoryview) -> None:
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


def _as_bytes(data: bytes | bytearray | memoryview | str | None) -> bytes:
    if data is None:
        return b""
    return data.encode() if isinstance(data, str) else bytes(data)


class _EventStream:
    """One server stream read by iteration (or `async for`, through one
    reader thread that feeds the event loop); close() cancels it."""

    _thread_name = "rdma-stream"

    def __init__(self, call: Any) -> None:
        self._call = call
        self._reader: threading.Thread | None = None

    def _events(self) -> Iterator[Any]:
        raise NotImplementedError

    def __aiter__(self) -> Any:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        end = object()

        def put(item: Any) -> bool:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
                return True
            except RuntimeError:  # the event loop is closed: nobody reads on
                self._call.cancel()
                return False

        def read() -> None:
            try:
                for item in self._events():
                    if not put(item):
                        return
                put(end)
            except AgentError as error:
                put(error)

        self._reader = threading.Thread(target=read, name=self._thread_name, daemon=True)
        self._reader.start()

        async def events() -> Any:
            while True:
                item = await queue.get()
                if item is end:
                    return
                if isinstance(item, AgentError):
                    raise item
                yield item

        return events()

    def _messages(self) -> Iterator[Any]:
        try:
            yield from self._call
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED:
                return
            raise AgentError(error.code(), error.details()) from None

    def close(self) -> None:
        """Cancels the stream; an iteration in progress ends."""
        self._call.cancel()


class NotificationStream(_EventStream):
    """One WatchNotifications stream. Iterating yields (notification, dropped)
    pairs: a Notification (or None when the event only reports drops) and the
    notifications this stream lost to a full queue since the previous event.
    Iteration ends after close(), or raises AgentError when the agent ends
    the stream. A context manager; in asyncio, `async for` over it (one
    reader thread feeds the event loop) and `async with`."""

    _thread_name = "rdma-notify-watch"

    def _events(self) -> Iterator[tuple[Notification | None, int]]:
        for event in self._messages():
            notification = (_notification(event.notification)
                            if event.HasField("notification") else None)
            yield notification, event.dropped

    def __iter__(self) -> Iterator[tuple[Notification | None, int]]:
        return self._events()

    async def __aenter__(self) -> NotificationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __enter__(self) -> NotificationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NameStream(_EventStream):
    """One WatchNames stream (watch_names()). Iterating yields NameEvents:
    one "published" per name published when the stream started, "synced",
    then each "published" or "withdrawn" as it happens. Iteration ends after
    close(), or raises AgentError when the agent ends the stream
    (UNAVAILABLE when it stops; RESOURCE_EXHAUSTED when this reader fell too
    far behind, or the user holds too many watches). A context manager;
    `async for` and `async with` in asyncio.

    wait_for(name) reads on until `name` is published and returns its
    NameRecord: what a peer waiting for another's buffer does."""

    _thread_name = "rdma-name-watch"

    def _events(self) -> Iterator[NameEvent]:
        for event in self._messages():
            kind = _NAME_EVENT_KIND.get(event.kind)
            if kind is None:
                continue  # a kind newer than this client
            yield NameEvent(kind, _name_record(event.record) if kind != "synced" else None)

    def __iter__(self) -> Iterator[NameEvent]:
        return self._events()

    def wait_for(self, name: str) -> NameRecord:
        """Reads events until `name` is published; its record. AgentError
        when the stream ends first (CANCELLED after close())."""
        for event in self._events():
            if event.kind == "published" and event.record.name == name:
                return event.record
        raise AgentError(grpc.StatusCode.CANCELLED,
                         "watch_names: the stream was closed before %r was published" % name)

    async def __aenter__(self) -> NameStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __enter__(self) -> NameStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def decode_context(remote_context: bytes) -> remote_buffer_pb2.RemoteBuffer:
    """The RemoteBuffer message inside a serialized remote context."""
    message = remote_buffer_pb2.RemoteBuffer()
    message.ParseFromString(remote_context)
    return message
