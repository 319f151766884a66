"""A shared-memory ring session with the local agent (docs/RING.md), in pure
Python over mmap: ops are posted by writing entries into memory the agent
maps too and moving a tail, and their ends are read back the same way — no
gRPC call, and no syscall while the agent is awake.

    from rdma_agent import AgentClient, Op

    with AgentClient() as agent, agent.open_ring(64) as ring:
        peer = agent.import_remote(peer_context)        # the ring names handles
        [result] = ring.submit([Op("write", mine, 0, 4096, peer)])
        assert result.ok, result

        ring.post([Op("read", mine, 0, 4096, peer)], tags=[7])
        ring.post([Op("read", mine, 4096, 4096, peer)], tags=[8], notification=b"done")
        ends = ring.wait(timeout=5)        # RingCompletion(tag, code, message, backend)

        with agent.prepare_transfer(ops) as layer:
            tag = ring.run_prepared(layer, timeout=5)   # one completion for the run
            ring.cancel(tag)               # True if the agent found it running

Version 2 of the protocol: batches run asynchronously on the agent and may
complete in any order, so completions are matched by tag (submit() and
cancel() keep the others for reap() and wait()). A notification's bytes go
into the ring's payload area, used as a ring of its own: a payload's bytes
are reused only once the agent has taken (copied) the entry that named them.

An op's local side is what an Op takes for submit(); its remote side must
be a RemoteHandle (AgentClient.import_remote). A session ends with close()
(or its `with` block), with this process, or when the agent stops it: then
calls raise FailedPreconditionError with the agent's reason, or
UnavailableError when the agent went away.

Memory ordering. Python has no atomics; this module relies on the
following, and opens a ring only on x86-64 (elsewhere use submit()):
- Each index and flag is one aligned 4-byte word, read and written through
  a memoryview cast to "I": memoryview copies the item with a 4-byte
  memcpy, which the C compiler makes one aligned mov, so no word is ever
  torn. Each access is a separate call of the interpreter into
  memoryview's C code, so the compiler cannot move one across another, and
  the GIL lets no other thread of this process in between.
- RING.md's release stores (entries written, then sq_tail; completions
  read, then cq_head) and acquire loads (cq_tail, then the completions)
  need no instruction on x86-64: TSO never reorders a store with an older
  store or an older load, nor a load with an older load.
- Its sequentially consistent steps are Dekker-style (store sq_tail, then
  load agent_flags; store WAITING, then load cq_tail), and TSO may let a
  load pass an older store still in the store buffer. _full_fence() sits
  between each such pair: acquiring and releasing an uncontended
  threading.Lock runs a locked read-modify-write in glibc (lock cmpxchg),
  which on x86-64 drains the store buffer before any later load.
The agent publishes completions with a release store of cq_tail and then
loads client_flags without a full fence, so a WAITING set at that moment
can be missed; a blocked wait() therefore looks at the ring again every
_LONGEST_SLEEP seconds instead of trusting the doorbell alone.
"""

from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import platform
import select
import socket
import struct
import threading
import time
from collections import OrderedDict, deque, namedtuple
from typing import TYPE_CHECKING, Callable, Sequence

import grpc

from rdma_agent.client import (Op, OpResult, PreparedTransfer, RemoteHandle, _attach_open,
                               _raise_for)
from rdma_agent.errors import AgentError, invalid, status_code, wrong_type
from rdma_agent.proto import attach_pb2

if TYPE_CHECKING:
    from rdma_agent.client import AgentClient

__all__ = ["Ring", "RingCompletion"]

# ---- version 2 of the layout (docs/RING.md): every offset and size here ----

VERSION = 2
_MAGIC = 0x474E4952  # "RING", little-endian
_HEADER_BYTES = 512
# What the agent writes once, from offset 0: magic, version, entries, 4
# unused bytes, then the offsets of the submissions, completions and
# messages, the total bytes and the offset of the payload area.
_HEADER = struct.Struct("<III4xQQQQQ")
# The shared 4-byte words, by byte offset (each on a 64-byte line of its own).
_SQ_TAIL = 64        # client
_SQ_HEAD = 128       # agent
_CQ_TAIL = 192       # agent
_CQ_HEAD = 256       # client
_AGENT_FLAGS = 320   # agent
_CLIENT_FLAGS = 384  # client
_NEEDS_WAKEUP = 1 << 0  # agent_flags
_STOPPED = 1 << 1       # agent_flags
_WAITING = 1 << 0       # client_flags
# The stop reason: 64 bytes of NUL-terminated text, the rest of the header
# (a longer read would run into submission slot 0).
_STOP_REASON = 448
_STOP_REASON_BYTES = 64
# Submission entry: opcode, flags, reserved, timeout_ms, user_tag,
# local_buffer_id, local_offset, length, remote_handle (RUN_PREPARED: the
# prepared id; CANCEL: the tag to cancel), remote_offset, and with NOTIFY
# the payload's offset (low 32 bits) and length (high 32 bits).
_SUBMISSION = struct.Struct("<BBHIQQQQQQQ")
_RUN_PREPARED = 3
_CANCEL = 4
_END_OF_BATCH = 1 << 0
_NOTIFY = 1 << 1
# Completion entry: user_tag, code, backend, message length, reserved.
_COMPLETION = struct.Struct("<QiHH16x")
_MESSAGE_BYTES = 256
_PAYLOAD_BYTES = 256  # of the payload area, per entry
# The agent's --max_notification_bytes unless open_ring() is told otherwise.
DEFAULT_MAX_NOTIFICATION_BYTES = 4096
_BACKENDS = {0: "", 1: "memory", 2: "tcp", 3: "ibverbs"}
_MAX_ENTRIES = 1 << 16

# ---- the client's side -------------------------------------------------------

# How long a blocked wait() sleeps before it looks at the ring again (see
# the module docstring: a doorbell may be missed).
_LONGEST_SLEEP = 0.05
_FENCE = threading.Lock()


def _full_fence() -> None:
    """Orders every earlier store before every later load (x86-64: a locked
    instruction; see the module docstring)."""
    _FENCE.acquire()
    _FENCE.release()


class RingCompletion(namedtuple("RingCompletion", "tag code message backend")):
    """The end of one ring op: its user tag, a grpc.StatusCode, the agent's
    message ("op N: ..." when it failed, N its index in its batch) and the
    backend that ran it ("" if none did)."""

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK


class _Geometry(namedtuple("_Geometry",
                           "entries submissions completions messages payloads total_bytes")):
    """Where a ring's parts are, as its header says."""


def _read_header(memory: mmap.mmap, size: int) -> _Geometry:
    """The header's geometry, checked before any of it is trusted: the magic,
    the version this module speaks, a power-of-two entry count, and every
    region inside the mapping, past the header and apart from the others.
    FailedPreconditionError for another version, InternalError otherwise."""
    if size < _HEADER_BYTES:
        raise AgentError(grpc.StatusCode.INTERNAL,
                         "open ring: the ring of %d bytes is smaller than its header" % size)
    magic, version, entries, submissions, completions, messages, total, payloads = \
        _HEADER.unpack_from(memory, 0)
    if magic != _MAGIC:
        raise AgentError(grpc.StatusCode.INTERNAL,
                         "open ring: the ring's magic is 0x%08x, not 0x%08x" % (magic, _MAGIC))
    if version != VERSION:
        raise AgentError(grpc.StatusCode.FAILED_PRECONDITION,
                         "open ring: the agent speaks ring version %d; this client speaks %d"
                         % (version, VERSION))
    if entries < 1 or entries > _MAX_ENTRIES or entries & (entries - 1):
        raise AgentError(grpc.StatusCode.INTERNAL,
                         "open ring: %d entries is not a power of two up to %d"
                         % (entries, _MAX_ENTRIES))
    expected = _HEADER_BYTES + entries * (_SUBMISSION.size + _COMPLETION.size +
                                          _MESSAGE_BYTES + _PAYLOAD_BYTES)
    if total != expected:
        raise AgentError(grpc.StatusCode.INTERNAL,
                         "open ring: the header claims %d bytes; %d entries take %d"
                         % (total, entries, expected))
    if total > size:
        raise AgentError(grpc.StatusCode.INTERNAL,
                         "open ring: the header claims %d bytes; the mapping has %d"
                         % (total, size))
    regions = sorted([(submissions, entries * _SUBMISSION.size, "submissions"),
                      (completions, entries * _COMPLETION.size, "completions"),
                      (messages, entries * _MESSAGE_BYTES, "messages"),
                      (payloads, entries * _PAYLOAD_BYTES, "payloads")])
    end = _HEADER_BYTES
    for start, length, name in regions:
        if start < end or start + length > total or start % 8:
            raise AgentError(grpc.StatusCode.INTERNAL,
                             "open ring: the %s at %d (%d bytes) overlap another part or "
                             "leave the ring's %d bytes" % (name, start, length, total))
        end = start + length
    return _Geometry(entries, submissions, completions, messages, payloads, total)


def _tag(what: str, tag: object) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < (1 << 64):
        raise invalid("%s %r is not a uint64" % (what, tag))
    return tag


def _timeout_ms(timeout: float | None) -> int:
    """A batch's timeout field: 0 (the agent's default) for None."""
    if timeout is None:
        return 0
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise invalid("ring: timeout must be a positive number of seconds or None, not %r"
                      % (timeout,))
    return min(max(1, int(round(timeout * 1000))), (1 << 32) - 1)


class Ring:
    """A ring session (AgentClient.open_ring). Calls from several threads
    are taken one at a time. A context manager: leaving it closes the
    session."""

    def __init__(self, client: AgentClient, connection: socket.socket, memory: mmap.mmap,
                 geometry: _Geometry,
                 max_notification_bytes: int = DEFAULT_MAX_NOTIFICATION_BYTES) -> None:
        self._client = client
        self._connection = connection
        self._memory = memory
        self._geometry = geometry
        self._mask = geometry.entries - 1
        # The shared words, indexed by byte offset // 4.
        self._words = memoryview(memory).cast("I")
        self._lock = threading.RLock()
        self._sq_tail = 0    # entries posted (free-running, 32 bits)
        self._cq_head = 0    # completions reaped
        self._reaped: list[RingCompletion] = []  # read by submit(), not yet reap()ed
        self._next_tag = 1
        # The payload area, used as a ring: _payload_next is where the next
        # payload goes (a position counting up; its place is modulo the
        # area), _payloads the (entry index, start, end) of payloads whose
        # entry the agent may not have taken yet, oldest first.
        self._payload_area = geometry.entries * _PAYLOAD_BYTES
        self._max_notification = min(self._payload_area, max_notification_bytes)
        self._payload_next = 0
        self._payloads: deque[tuple[int, int, int]] = deque()
        self._ended: AgentError | None = None
        self._closed = False

    @classmethod
    def _open(cls, client: AgentClient, entries: int,
              max_notification_bytes: int = DEFAULT_MAX_NOTIFICATION_BYTES) -> Ring:
        if isinstance(entries, bool) or not isinstance(entries, int):
            raise wrong_type("open_ring: entries", entries, "an int (a power of two)")
        if entries < 1 or entries > _MAX_ENTRIES or entries & (entries - 1):
            raise invalid("open_ring: entries %d is not a power of two from 1 to %d"
                          % (entries, _MAX_ENTRIES))
        if isinstance(max_notification_bytes, bool) or \
                not isinstance(max_notification_bytes, int):
            raise wrong_type("open_ring: max_notification_bytes", max_notification_bytes,
                             "an int")
        if max_notification_bytes < 1:
            raise invalid("open_ring: max_notification_bytes %d must be positive"
                          % max_notification_bytes)
        if platform.machine() not in ("x86_64", "AMD64"):
            raise AgentError(grpc.StatusCode.FAILED_PRECONDITION,
                             "open ring: the Python ring needs x86-64's memory ordering; "
                             "this is %s (use submit())" % platform.machine())
        client._release_gone()
        request = attach_pb2.AttachRequest(open_ring=attach_pb2.OpenRing(entries=entries))
        response, fd, connection = _attach_open(client.attach_socket, request, None,
                                                client.timeout)
        try:
            _raise_for(response)
            if fd is None:
                raise AgentError(grpc.StatusCode.INTERNAL, "open ring: the agent sent no memfd")
            size = os.fstat(fd).st_size
            if size != response.size_bytes:
                raise AgentError(grpc.StatusCode.INTERNAL,
                                 "open ring: the memfd has %d bytes; the agent said %d"
                                 % (size, response.size_bytes))
            memory = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            connection.close()
            raise
        finally:
            if fd is not None:
                os.close(fd)  # the mapping keeps the memory
        try:
            geometry = _read_header(memory, size)
            if geometry.entries != entries:
                raise AgentError(grpc.StatusCode.INTERNAL,
                                 "open ring: asked for %d entries, got %d"
                                 % (entries, geometry.entries))
        except BaseException:
            memory.close()
            connection.close()
            raise
        connection.setblocking(False)
        return cls(client, connection, memory, geometry, max_notification_bytes)

    # -- what callers see ------------------------------------------------

    @property
    def entries(self) -> int:
        """Submission (and completion) slots."""
        return int(self._geometry.entries)

    @property
    def in_flight(self) -> int:
        """Ops posted and not yet reaped (read by reap(), wait() or submit())."""
        return (self._sq_tail - self._cq_head) & 0xFFFFFFFF

    @property
    def ended(self) -> AgentError | None:
        """None while the session runs; else the error its calls raise."""
        return self._ended

    @property
    def max_notification_bytes(self) -> int:
        """The largest notification a batch of this ring may carry: the
        payload area (256 bytes per entry) or the agent's
        --max_notification_bytes (open_ring()), whichever is smaller."""
        return self._max_notification

    def post(self, ops: Sequence[Op], timeout: float | None = None,
             tags: Sequence[int] | None = None,
             notification: bytes | str | None = None) -> list[int]:
        """Posts `ops` as one batch (run together, like one submit();
        `timeout` in seconds bounds it on the agent, None: the agent's
        default) and wakes the agent if it sleeps. `tags` (one uint64 per
        op) come back in the completions; default: numbers this ring hands
        out (counting from 1: tags of your own should not repeat them).
        `notification` (bytes or str, 1 to max_notification_bytes) goes to
        the owner of each remote buffer the batch wrote or read once its
        bytes have landed, as submit_notify()'s. Returns the tags.
        ResourceExhaustedError, posting nothing, when the ring lacks room
        for all of them or for the notification (reap first)."""
        with self._lock:
            self._check_open()
            entries = self._entries(ops, timeout, tags)
            self._post(entries, notification)
            return [entry[4] for entry in entries]

    def reap(self, max_count: int | None = None) -> list[RingCompletion]:
        """The completions ready now, oldest first (at most `max_count`).
        Once the session has ended and every completion posted before has
        been read, raises its error."""
        with self._lock:
            self._check_open()
            ready = self._take(max_count)
            if not ready:
                self._check_ended()
                if self._ended is not None:
                    raise self._ended
            return ready

    def wait(self, timeout: float | None = None, spin: float = 20e-6) -> list[RingCompletion]:
        """Like reap(), but waits for at least one completion: spins for
        `spin` seconds, then blocks on the session's connection (the WAITING
        flag). DeadlineExceededError when none came within `timeout`
        seconds (None: no bound)."""
        with self._lock:
            self._check_open()
            deadline = None if timeout is None else time.monotonic() + timeout
            self._await(lambda: self._ready() > 0, deadline, spin,
                        "no completion within %ss" % timeout)
            return self._take(None)

    def submit(self, ops: Sequence[Op], timeout: float | None = None,
               notification: bytes | str | None = None) -> list[OpResult]:
        """Runs `ops` as one batch and waits for it: one OpResult per op, in
        order, as AgentClient.submit(); `notification` as for post().
        Completions of other batches that arrive meanwhile are kept for
        reap()."""
        with self._lock:
            self._check_open()
            entries = self._entries(ops, timeout, None)
            self._post(entries, notification)
            limit = (timeout if timeout is not None else 0) + self._client.timeout + 5
            ends = self._collect([entry[4] for entry in entries], time.monotonic() + limit,
                                 "the batch did not end within %ss" % limit)
            return [OpResult(end.code, end.message, end.backend) for end in ends]

    def run_prepared(self, prepared: PreparedTransfer | int, timeout: float | None = None,
                     notification: bytes | str | None = None, tag: int | None = None) -> int:
        """Posts one run of a prepared transfer (AgentClient.prepare_transfer,
        or its id) as a batch of its own, with `timeout` and `notification`
        as for post(). Returns its tag (`tag`, or one this ring hands out);
        the run ends in ONE completion (reap(), wait()): OK when every op
        succeeded, else the first failed op's code and message ("op N: ...",
        N its index in the prepared transfer). An unknown or released id
        ends NOT_FOUND. ResourceExhaustedError as for post()."""
        with self._lock:
            self._check_open()
            if isinstance(prepared, PreparedTransfer):
                prepared_id = prepared.id
            elif isinstance(prepared, int) and not isinstance(prepared, bool):
                prepared_id = prepared
            else:
                raise wrong_type("run_prepared: prepared", prepared,
                                 "a PreparedTransfer or its id")
            if not 0 < prepared_id < (1 << 64):
                raise invalid("run_prepared: prepared transfer id %d is not a positive uint64"
                              % prepared_id)
            entry = self._single(_RUN_PREPARED, _timeout_ms(timeout),
                                 None if tag is None else _tag("run_prepared: tag", tag),
                                 prepared_id)
            self._post([entry], notification)
            return entry[4]

    def cancel(self, tag: int) -> bool:
        """Cancels the running batch holding an entry tagged `tag` (a CANCEL
        entry) and waits for the agent's answer: True when it found that
        batch taken and not yet completed (nothing of it touches local
        memory any more; its ops that had not ended end CANCELLED, and its
        completions follow), False when it found none (not yet taken, or
        already completed). Completions of other batches that arrive
        meanwhile are kept for reap()."""
        with self._lock:
            self._check_open()
            entry = self._single(_CANCEL, 0, None, _tag("cancel: tag", tag))
            self._post([entry], None)
            limit = self._client.timeout + 5
            [end] = self._collect([entry[4]], time.monotonic() + limit,
                                  "the cancel was not answered within %ss" % limit)
            if end.code == grpc.StatusCode.OK:
                return True
            if end.code == grpc.StatusCode.NOT_FOUND:
                return False
            raise AgentError(end.code, "cancel: " + end.message)

    def close(self) -> None:
        """Ends the session: entries the agent has not taken never run; a
        batch running ends under its deadline. The mapping goes once no
        view of it is left."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._connection.close()
            self._words.release()
            try:
                self._memory.close()
            except BufferError:
                pass  # exported elsewhere: unmapped with the last view

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return "Ring(%d entries, %d in flight%s)" % (
            self.entries, self.in_flight, ", closed" if self._closed else
            "" if self._ended is None else ", ended")

    # -- posting ---------------------------------------------------------

    def _entries(self, ops: Sequence[Op], timeout: float | None,
                 tags: Sequence[int] | None) -> list[tuple[int, ...]]:
        """Each op as the fields of its submission entry, checked; the batch
        fits the ring now."""
        if self._ended is not None:
            raise self._ended
        ops = list(ops)
        if not ops:
            raise invalid("ring: the op batch is empty")
        if tags is not None:
            tags = list(tags)
            if len(tags) != len(ops):
                raise invalid("ring: %d tags for %d ops" % (len(tags), len(ops)))
        timeout_ms = _timeout_ms(timeout)
        free = self.entries - self.in_flight
        if len(ops) > free:
            raise AgentError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             "ring: %d ops do not fit; %d of %d slots are in flight "
                             "(reap completions)" % (len(ops), self.in_flight, self.entries))
        entries: list[tuple[int, ...]] = []
        for index, op in enumerate(ops):
            if not isinstance(op, Op):
                raise wrong_type("op %d" % index, op, "an rdma_agent.Op")
            fields = self._client._op_message(index, op)
            if "remote_handle" not in fields:
                raise invalid("op %d: remote: the ring names remotes by handle: pass a "
                              "RemoteHandle (AgentClient.import_remote)" % index)
            tag = self._new_tag() if tags is None else _tag("op %d: tag" % index, tags[index])
            if not 0 < fields["length"] < (1 << 64):
                raise invalid("op %d: length %d must be positive" % (index, fields["length"]))
            last = index == len(ops) - 1
            entries.append((fields["type"], _END_OF_BATCH if last else 0, 0,
                            timeout_ms if last else 0, tag, fields["local_buffer_id"],
                            fields["local_offset"], fields["length"], fields["remote_handle"],
                            fields["remote_offset"], 0))
        return entries

    def _single(self, opcode: int, timeout_ms: int, tag: int | None,
                field: int) -> tuple[int, ...]:
        """A RUN_PREPARED or CANCEL entry (a batch of its own; `field` the
        prepared id or the tag to cancel); the ring has a slot for it now."""
        if self._ended is not None:
            raise self._ended
        if self.in_flight >= self.entries:
            raise AgentError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             "ring: no slot is free; %d of %d are in flight (reap completions)"
                             % (self.in_flight, self.entries))
        return (opcode, _END_OF_BATCH, 0, timeout_ms,
                self._new_tag() if tag is None else tag, 0, 0, 0, field, 0, 0)

    def _new_tag(self) -> int:
        tag = self._next_tag
        self._next_tag = (self._next_tag + 1) & 0xFFFFFFFFFFFFFFFF
        return tag

    def _post(self, entries: list[tuple[int, ...]],
              notification: bytes | str | None) -> None:
        """Places the notification (if any) in the payload area, flags the
        batch's last entry with it, and publishes the batch."""
        if notification is not None:
            data = self._payload(notification)
            index = (self._sq_tail + len(entries) - 1) & 0xFFFFFFFF
            offset = self._place(data, index)
            last = list(entries[-1])
            last[1] |= _NOTIFY
            last[10] = offset | (len(data) << 32)
            entries[-1] = tuple(last)
        self._publish(entries)

    def _payload(self, notification: bytes | str) -> bytes:
        if isinstance(notification, str):
            data = notification.encode()
        elif isinstance(notification, (bytes, bytearray, memoryview)):
            data = bytes(notification)
        else:
            raise wrong_type("ring: notification", notification, "bytes or str")
        if not data:
            raise invalid("ring: the notification is empty (pass None for none)")
        if len(data) > self._max_notification:
            raise invalid("ring: the notification of %d bytes is larger than this ring's "
                          "max_notification_bytes, %d (the smaller of its payload area, %d "
                          "bytes, and the agent's --max_notification_bytes)"
                          % (len(data), self._max_notification, self._payload_area))
        return data

    def _place(self, data: bytes, index: int) -> int:
        """Writes `data` where no payload the agent may still copy lies and
        records it for the entry of `index`; returns its offset in the area.
        A payload never wraps: one that would is put at the area's start."""
        # Payloads whose entry the agent has taken (outside [sq_head,
        # sq_tail)) are free.
        head = int(self._words[_SQ_HEAD // 4])
        untaken = (self._sq_tail - head) & 0xFFFFFFFF
        while self._payloads and ((self._payloads[0][0] - head) & 0xFFFFFFFF) >= untaken:
            self._payloads.popleft()
        if not self._payloads:
            self._payload_next = 0
        oldest = self._payloads[0][1] if self._payloads else self._payload_next
        start = self._payload_next
        if start % self._payload_area + len(data) > self._payload_area:
            start += self._payload_area - start % self._payload_area
        if start + len(data) - oldest > self._payload_area:
            raise AgentError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             "ring: no room for a notification of %d bytes until the agent "
                             "takes earlier batches' (wait or reap, then post again)"
                             % len(data))
        offset = start % self._payload_area
        place = self._geometry.payloads + offset
        self._memory[place:place + len(data)] = data
        self._payloads.append((index, start, start + len(data)))
        self._payload_next = start + len(data)
        return offset

    def _publish(self, entries: list[tuple[int, ...]]) -> None:
        """Writes the entries, then moves sq_tail (release: TSO keeps the
        stores in order), then rings if the agent sleeps."""
        base = self._geometry.submissions
        for entry in entries:
            slot = self._sq_tail & self._mask
            _SUBMISSION.pack_into(self._memory, base + slot * _SUBMISSION.size, *entry)
            self._sq_tail = (self._sq_tail + 1) & 0xFFFFFFFF
        self._words[_SQ_TAIL // 4] = self._sq_tail
        _full_fence()
        if self._words[_AGENT_FLAGS // 4] & _NEEDS_WAKEUP:
            self._doorbell()

    def _doorbell(self) -> None:
        try:
            self._connection.send(b"\x01", socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except BlockingIOError:
            pass  # the socket already holds bytes: the agent will wake
        except OSError:
            self._check_ended()

    # -- completions -----------------------------------------------------

    def _cq_tail(self) -> int:
        return int(self._words[_CQ_TAIL // 4])

    def _ready(self) -> int:
        """Completions kept or published and not read."""
        return len(self._reaped) + ((self._cq_tail() - self._cq_head) & 0xFFFFFFFF)

    def _take(self, max_count: int | None) -> list[RingCompletion]:
        kept, self._reaped = self._reaped, []
        if max_count is not None and len(kept) >= max_count:
            self._reaped = kept[max_count:]
            return kept[:max_count]
        published = self._published()
        want = published if max_count is None else min(published, max_count - len(kept))
        return kept + self._read(want)

    def _collect(self, tags: list[int], deadline: float, what: str) -> list[RingCompletion]:
        """Waits for the completions tagged `tags` (one each, returned in
        that order); every other completion read meanwhile is kept for
        reap(). Batches complete in any order."""
        found: dict[int, RingCompletion] = {}
        wanted = set(tags)
        kept = []
        for end in self._reaped:
            if end.tag in wanted and end.tag not in found:
                found[end.tag] = end
            else:
                kept.append(end)
        self._reaped = kept
        while len(found) < len(wanted):
            self._await(lambda: self._published() > 0, deadline, 20e-6, what)
            for end in self._read(self._published()):
                if end.tag in wanted and end.tag not in found:
                    found[end.tag] = end
                else:
                    self._reaped.append(end)
        return [found[tag] for tag in tags]

    def _published(self) -> int:
        """Completions the agent published and this ring has not read."""
        published = (self._cq_tail() - self._cq_head) & 0xFFFFFFFF
        if published > self.entries:  # the agent never does this
            self._end(AgentError(grpc.StatusCode.INTERNAL,
                                 "ring: cq_tail is %d completions past cq_head" % published))
            return 0
        return published

    def _read(self, count: int) -> list[RingCompletion]:
        """Reads `count` published completions (the caller loaded cq_tail
        past them: acquire under TSO), then moves cq_head."""
        if count == 0:
            return []
        ends = []
        base, messages = self._geometry.completions, self._geometry.messages
        for _ in range(count):
            slot = self._cq_head & self._mask
            tag, code, backend, length = _COMPLETION.unpack_from(
                self._memory, base + slot * _COMPLETION.size)
            start = messages + slot * _MESSAGE_BYTES
            text = bytes(self._memory[start:start + min(length, _MESSAGE_BYTES - 1)])
            ends.append(RingCompletion(tag, status_code(code),
                                       text.decode("utf-8", errors="replace"),
                                       _BACKENDS.get(backend, "other")))
            self._cq_head = (self._cq_head + 1) & 0xFFFFFFFF
        self._words[_CQ_HEAD // 4] = self._cq_head
        # An agent asleep with a batch waiting for completion room goes on.
        _full_fence()
        if self._words[_AGENT_FLAGS // 4] & _NEEDS_WAKEUP and \
                self._words[_SQ_HEAD // 4] != self._sq_tail:
            self._doorbell()
        return ends

    # -- waiting and the end of the session ------------------------------

    def _await(self, done: Callable[[], bool], deadline: float | None, spin: float, what: str) -> None:
        """Returns once done() holds: spins for `spin` seconds, then blocks
        on the connection. Raises the session's end, or DeadlineExceeded."""
        spin_until = time.monotonic() + spin
        while not done():
            now = time.monotonic()
            if now < spin_until:
                continue
            self._check_ended()
            if self._ended is not None:
                if done():
                    return
                raise self._ended
            if deadline is not None and now >= deadline:
                raise AgentError(grpc.StatusCode.DEADLINE_EXCEEDED, "ring: " + what)
            # WAITING, then one more look, then sleep until a doorbell.
            self._words[_CLIENT_FLAGS // 4] = _WAITING
            _full_fence()
            if done():
                break
            sleep = _LONGEST_SLEEP if deadline is None else \
                max(0.0, min(_LONGEST_SLEEP, deadline - now))
            select.select([self._connection], [], [], sleep)

    def _check_ended(self) -> None:
        """Records why the session ended, if it has: STOPPED (the agent's
        reason) or the connection closed. Drains doorbell bytes."""
        if self._ended is not None:
            return
        if self._words[_AGENT_FLAGS // 4] & _STOPPED:
            raw = bytes(self._memory[_STOP_REASON:_STOP_REASON + _STOP_REASON_BYTES])
            reason = raw.split(b"\0", 1)[0].decode("utf-8", errors="replace")
            self._end(AgentError(grpc.StatusCode.FAILED_PRECONDITION,
                                 "the agent stopped this ring: " + reason))
            return
        while True:
            try:
                data = self._connection.recv(64)
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError as error:
                data = b""
                if error.errno not in (errno.ECONNRESET, errno.EPIPE):
                    raise
            if not data:
                # A stop may be published just before the close.
                if self._words[_AGENT_FLAGS // 4] & _STOPPED:
                    self._check_ended()
                    return
                self._end(AgentError(grpc.StatusCode.UNAVAILABLE,
                                     "the agent closed this ring's session (it stopped or "
                                     "restarted)"))
                return

    def _end(self, error: AgentError) -> None:
        if self._ended is None:
            self._ended = error

    def _check_open(self) -> None:
        if self._closed:
            raise AgentError(grpc.StatusCode.FAILED_PRECONDITION, "ring: closed")


class _RingPath:
    """The ring AgentClient.submit() runs batches through when it can
    (AgentClient(ring=True)): one ring per client, opened at the first
    batch that may use it, and a bounded cache of the remote contexts its
    ops named, imported (ImportRemote) at their second use so that the ring
    can name them.

    A batch goes over gRPC instead, exactly as before, when the ring cannot
    take it: the platform or the agent offers no ring (the reason is kept in
    `unavailable`; opening is tried again after RETRY_OPEN seconds), an op
    names a published name, a context is used for the first time, an
    import fails (Submit then reports the op's
    error in its own words), the batch has more ops than the ring has slots,
    or another thread's batch holds the ring now. A session that ended
    before the batch was posted (the agent restarted) is dropped and the
    batch goes over gRPC; one that ends while the batch runs fails the call
    UNAVAILABLE, as a Submit cut by the agent's end does."""

    ENTRIES = 64
    # Contexts kept imported per client; the least recently used is
    # released past it (each holds one of the user's
    # --max_remote_handles_per_user on the agent).
    MAX_HANDLES = 256
    # Contexts used once so far, remembered by hash.
    MAX_SEEN = 4096
    RETRY_OPEN = 30.0

    def __init__(self, client: AgentClient) -> None:
        self._client = client
        self._lock = threading.Lock()  # the ring's opening and the cache
        self._ring: Ring | None = None
        self._handles: OrderedDict[bytes, RemoteHandle] = OrderedDict()
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._next_open = 0.0
        self.unavailable: AgentError | None = None
        self.batches = 0  # run through the ring

    def submit(self, ops: list[Op], timeout: float | None) -> list[OpResult] | None:
        """The batch's results through the ring, or None: take it to gRPC
        (which also words what is wrong with a batch that is not all Ops)."""
        if not ops or len(ops) > self.ENTRIES or \
                not all(isinstance(op, Op) for op in ops):
            return None
        for _ in range(2):  # a session found ended is replaced once
            ring = self._ring_now()
            if ring is None:
                return None
            if not ring._lock.acquire(blocking=False):
                return None  # another thread's batch holds it
            try:
                ring._check_ended()
                if ring.ended is None:
                    return self._run(ring, ops, timeout)
            finally:
                ring._lock.release()
            self._drop(ring)
        return None

    def _run(self, ring: Ring, ops: list[Op], timeout: float | None) -> list[OpResult] | None:
        """submit() on a live session whose lock the caller holds."""
        if ring._reaped or ring._published():
            ring._take(None)  # ends of a batch abandoned by a timeout
        if ring.in_flight + len(ops) > ring.entries:
            return None
        named = self._with_handles(ops)
        if named is None:
            return None
        try:
            results = ring.submit(named, timeout)
        except AgentError:
            if ring.ended is not None:
                self._drop(ring)
            raise
        self.batches += 1
        return results

    def close(self) -> None:
        with self._lock:
            ring, self._ring = self._ring, None
            handles = list(self._handles.values())
            self._handles.clear()
        for handle in handles:
            handle.close()
        if ring is not None:
            ring.close()

    def _ring_now(self) -> Ring | None:
        with self._lock:
            if self._ring is not None:
                return self._ring
            if time.monotonic() < self._next_open:
                return None
            try:
                self._ring = Ring._open(self._client, self.ENTRIES)
                self.unavailable = None
            except AgentError as error:
                self.unavailable = error
                self._next_open = time.monotonic() + self.RETRY_OPEN
            return self._ring

    def _drop(self, ring: Ring) -> None:
        """Forgets an ended session and the handles imported for it (an
        agent that restarted has forgotten them too)."""
        with self._lock:
            if self._ring is ring:
                self._ring = None
            handles = list(self._handles.values())
            self._handles.clear()
        ring.close()
        for handle in handles:
            # Never released by id: a restarted agent may have given the
            # same id to another handle of this user.
            handle._released = True

    def _with_handles(self, ops: list[Op]) -> list[Op] | None:
        """`ops` with every remote named by a RemoteHandle, or None."""
        named = []
        for op in ops:
            if op.remote_name:
                return None
            if isinstance(op.remote, RemoteHandle):
                named.append(op)
                continue
            handle = self._handle_for(op.remote_context)
            if handle is None:
                return None
            named.append(dataclasses.replace(op, remote=handle))
        return named

    def _handle_for(self, context: bytes) -> RemoteHandle | None:
        if not context:
            return None
        with self._lock:
            handle = self._handles.get(context)
            if handle is not None:
                self._handles.move_to_end(context)
                return handle
            # Imported at its second use: a context used once costs one
            # Submit, not an import as well (nor, past MAX_HANDLES, a
            # release).
            seen = hash(context)
            if seen not in self._seen:
                self._seen[seen] = None
                if len(self._seen) > self.MAX_SEEN:
                    self._seen.popitem(last=False)
                return None
            del self._seen[seen]
        try:
            handle = self._client.import_remote(context)
        except AgentError:
            return None  # Submit reports what is wrong with it
        with self._lock:
            self._handles[context] = handle
            evicted = []
            while len(self._handles) > self.MAX_HANDLES:
                evicted.append(self._handles.popitem(last=False)[1])
        for old in evicted:
            old.close()
        return handle
