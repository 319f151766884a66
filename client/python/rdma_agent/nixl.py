"""NIXL's Python API over rdma-agentd.

Code written against NIXL (`from nixl._api import nixl_agent,
nixl_agent_config`) runs with its import changed to `from rdma_agent.nixl
import nixl_agent, nixl_agent_config`: the methods take NIXL's arguments and
return what NIXL's return, and move the bytes through the host's
rdma-agentd ($RDMA_AGENT_SOCKET) instead of an in-process UCX.

How each part maps onto the agent:
- register_memory(): every region (a tensor, a list of tensors, (addr, len,
  dev, meta) tuples, an Nx3 array) is registered in place
  (AgentClient.register_range: its pages move onto a memfd the agent shares,
  once; then zero copy) unless it already lies in a registration of this
  agent's client, e.g. memory made by AgentClient.tensor().
- Metadata (get_agent_metadata, add_remote_agent, the listener and
  send_local_metadata/fetch_remote_metadata) carries the name and the remote
  contexts of the registrations: JSON, never pickle.
- Without an ip_addr, send_local_metadata/fetch_remote_metadata/
  invalidate_local_metadata use the agent's directory instead, as NIXL
  uses etcd when NIXL_ETCD_ENDPOINTS is set: the metadata goes into a small
  read-only registration published under the name
  `<metadata_prefix><agent name>` (nixl_agent_config; "nixl/agents/" by
  default, for the publishing user only unless metadata_visibility is
  "any_user"); a fetch resolves the name and reads the metadata with one
  READ; invalidation withdraws the name. Like NIXL's etcd watchers, one
  WatchNames stream per nixl_agent (thread "nixl-metadata") follows the
  names it fetched: a peer's new metadata (sent again, or after its agent
  restarted) is fetched again, and withdrawn metadata is dropped. The
  directory is the agents' --directory (etcd across hosts; the local one
  reaches the agents of one host), so nothing but the agent is configured
  here. After this process's agent restarts, its registrations come back
  (AgentClient rejoin) and metadata it had sent is sent again.
- Transfers are asynchronous transfers of the agent (SubmitAsync, their ends
  pushed by WatchTransfers); check_xfer_state reads the end.
- Notifications are the agent's: each agent registers a small mailbox
  buffer; send_notif and a transfer's notif_msg are one 1-byte WRITE into the
  peer's mailbox with the message as the batch's notification, sent after
  the transfer's data landed, so the message is visible only after the data.
  They arrive on one WatchNotifications stream per agent (thread
  "nixl-notify"); get_new_notifs() takes them without a call to the agent.

What differs from NIXL:
- DRAM only: VRAM ("cuda") regions raise ValueError (register GPU memory as
  a dma-buf through AgentClient.register_dmabuf); FILE/BLOCK/OBJ do not exist.
- Backends are the agent's (it routes each op to memory, ibverbs or tcp);
  `backends` arguments and nixl_agent_config(backends=...) are accepted and
  ignored, and get_plugin_list() answers ["RDMA_AGENT"].
- A region that does not fill whole pages is registered with the pages it
  touches (nixl_agent_config(share_edge_pages=True), the default): holders of
  this agent's metadata can reach the bytes sharing its first and last page
  (and, for regions of one register_memory call that share pages, the bytes
  between them). Pass share_edge_pages=False to refuse such regions. A
  region sharing pages with a registration of an earlier call is refused.
- Notifications go to the user's streams on the agent: every nixl_agent of
  the user on that host receives each one and keeps those for its own
  mailbox. The agent also queues a copy for GetNotifications, which these
  agents never read; that queue stays within the user's notification
  budget by losing its oldest (docs/SECURITY.md, Notifications).
- Errors are rdma_agent.AgentError subclasses (ValueError/TypeError for
  bad arguments) instead of nixlBind errors; nothing is logged and returned
  as None: it is raised.
- Partial metadata, estimate_xfer_cost, memory views and make_connection
  are not offered; the metadata's directory is the agent's, not one of
  this process's own (NIXL_ETCD_ENDPOINTS and NIXL_ETCD_NAMESPACE are not
  read).
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import json
import queue
import socket
import struct
import threading
import time
from typing import Any, Iterable, Sequence

import grpc

from rdma_agent.client import (DONE, VISIBILITY, AgentClient, Buffer, NameRecord, NameStream,
                               Op, TransferResult, decode_context)
from rdma_agent.errors import AgentError, NotFoundError, invalid, one_of, wrong_type
from rdma_agent.memory import page_span

__all__ = [
    "DEFAULT_COMM_PORT", "DEFAULT_METADATA_PREFIX", "NIXL_INIT_AGENT", "nixl_agent", "nixl_agent_config",
    "nixl_prepped_dlist_handle", "nixl_xfer_handle", "nixlRegDList", "nixlXferDList",
    "nixlXferTelemetry",
]

DEFAULT_COMM_PORT = 8888
# Where nixl_agents publish their metadata in the agent's directory.
DEFAULT_METADATA_PREFIX = "nixl/agents/"
NIXL_INIT_AGENT = "NIXL_INIT_AGENT"
_MEM_TYPES = {"DRAM": "DRAM", "cpu": "DRAM", "VRAM": "VRAM", "cuda": "VRAM"}
_OPERATIONS = {"READ": "read", "WRITE": "write"}
_METADATA_VERSION = 1
# Metadata messages on the listener are bounded, and so are the remote agents
# a listener keeps: anyone who reaches the port can send them.
_MAX_MESSAGE_BYTES = 16 << 20
_MAX_REMOTE_AGENTS = 4096
# A peer of the listener has this long to send its whole message: a slow
# one cannot hold the (single) listener thread longer.
_MESSAGE_SECONDS = 10.0
_NOTIFY_MAGIC = b"NIXL"
# Notifications kept for get_new_notifs() (each at most the agent's
# --max_notification_bytes); more are counted in notifs_dropped.
_MAX_INBOX = 16384


def _mem_type(mem_type: str | None, default: str = "DRAM") -> str:
    name = default if mem_type is None else mem_type
    if name not in _MEM_TYPES:
        raise one_of("mem_type", name, _MEM_TYPES)
    if _MEM_TYPES[name] != "DRAM":
        raise invalid("mem_type %r: rdma_agent.nixl moves host memory (DRAM) only; register "
                      "GPU memory as a dma-buf (AgentClient.register_dmabuf)" % name)
    return "DRAM"


def _is_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _tensor_desc(tensor: Any) -> tuple[int, int, int]:
    if tensor.device.type != "cpu":
        raise invalid("a %s tensor: rdma_agent.nixl moves host memory (DRAM) only"
                      % tensor.device.type)
    if not tensor.is_contiguous():
        raise invalid("the tensor is not contiguous (NIXL needs contiguous tensors)")
    return int(tensor.data_ptr()), int(tensor.numel() * tensor.element_size()), 0


class _DList:
    """A descriptor list: (addr, len, dev) rows of one memory type."""

    def __init__(self, mem_type: str, descs: Iterable[Sequence[Any]]) -> None:
        self.mem_type = mem_type
        self.descs: list[tuple[Any, ...]] = [tuple(d) for d in descs]

    def __len__(self) -> int:
        return len(self.descs)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        return self.descs[index]

    def __iter__(self) -> Any:
        return iter(self.descs)

    def __bool__(self) -> bool:
        return True  # an empty list is still a list (NIXL's are truthy objects)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and \
            (self.mem_type, self.descs) == (other.mem_type, other.descs)  # type: ignore

    def __repr__(self) -> str:
        return "%s(%r, %r)" % (type(self).__name__, self.mem_type, self.descs)

    def getType(self) -> str:  # noqa: N802 (NIXL's name)
        return self.mem_type

    def descCount(self) -> int:  # noqa: N802 (NIXL's name)
        return len(self.descs)


class nixlXferDList(_DList):  # noqa: N801 (NIXL's name)
    """Transfer descriptors: (address, length, device id) rows."""


class nixlRegDList(_DList):  # noqa: N801 (NIXL's name)
    """Registration descriptors: (address, length, device id, meta) rows."""


class nixlXferTelemetry:  # noqa: N801 (NIXL's name)
    """A finished transfer's telemetry, with nixl._bindings' field names:
    times in microseconds (startTime since the epoch), totalBytes moved,
    descCount descriptors."""

    def __init__(self, startTime: int, postDuration: int, xferDuration: int,  # noqa: N803
                 totalBytes: int, descCount: int) -> None:  # noqa: N803
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self) -> str:
        return ("nixlXferTelemetry(startTime=%d, postDuration=%d, xferDuration=%d, "
                "totalBytes=%d, descCount=%d)" % (self.startTime, self.postDuration,
                                                  self.xferDuration, self.totalBytes,
                                                  self.descCount))


class nixl_agent_config:  # noqa: N801 (NIXL's name)
    """nixl_agent's configuration, NIXL's arguments in NIXL's order.

    `enable_listen_thread` with `listen_port` (0: any free port) starts the
    metadata listener; `enable_prog_thread` lets a thread send transfer
    notifications as transfers end (otherwise check_xfer_state sends them).
    capture_telemetry, num_threads, backends and sync_mode are accepted for
    compatibility; telemetry is always kept. Added: `socket` (the agent's
    socket; default $RDMA_AGENT_SOCKET), `timeout` (seconds a transfer may
    take; None: the agent's default), `share_edge_pages` (see the module
    docstring), and for metadata through the agent's directory
    `metadata_prefix` (names are the prefix and the agent's name) and
    `metadata_visibility` ("owner": the same user finds it; "any_user")."""

    def __init__(self, enable_prog_thread: bool = True, enable_listen_thread: bool = False,
                 listen_port: int = DEFAULT_COMM_PORT, capture_telemetry: bool = False,
                 num_threads: int = 0, backends: Sequence[str] = ("UCX",),
                 sync_mode: object = None, socket: str | None = None,
                 timeout: float | None = None, share_edge_pages: bool = True,
                 metadata_prefix: str = DEFAULT_METADATA_PREFIX,
                 metadata_visibility: str = "owner") -> None:
        if not isinstance(metadata_prefix, str):
            raise wrong_type("nixl_agent_config: metadata_prefix", metadata_prefix, "a str")
        if metadata_visibility not in VISIBILITY:
            raise one_of("nixl_agent_config: metadata_visibility", metadata_visibility,
                         VISIBILITY)
        self.metadata_prefix = metadata_prefix
        self.metadata_visibility = metadata_visibility
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.backends = list(backends)
        self.sync_mode = sync_mode
        self.socket = socket
        self.timeout = timeout
        self.share_edge_pages = share_edge_pages


class nixl_prepped_dlist_handle:  # noqa: N801 (NIXL's name)
    """A descriptor list resolved once (prep_xfer_dlist) to (buffer or
    remote context, offset, length) per descriptor."""

    def __init__(self, agent_name: str, sides: list[tuple[Any, int, int]]) -> None:
        self.agent_name = agent_name
        self.sides = sides
        self._released = False

    def release(self) -> None:
        self._released = True
        self.sides = []

    def __repr__(self) -> str:
        return "nixl_prepped_dlist_handle(%r, %d descs, released=%s)" % (
            self.agent_name, len(self.sides), self._released)


class nixl_xfer_handle:  # noqa: N801 (NIXL's name)
    """A transfer request: its ops, to be posted (again) with transfer()."""

    def __init__(self, agent: nixl_agent, operation: str, remote_agent: str,
                 ops: list[Op], notif_msg: bytes) -> None:
        self._agent = agent
        self.operation = operation
        self.remote_agent = remote_agent
        self.ops = ops
        self.notif_msg = notif_msg
        self.total_bytes = sum(op.length or 0 for op in ops)
        self._lock = threading.Lock()
        self._transfer: Any = None
        self._end: TransferResult | None = None
        self._notified: concurrent.futures.Future[bool] | None = None
        self._posted = 0.0
        self._post_duration = 0.0
        self._released = False

    def release(self) -> None:
        """Cancels the transfer if it runs; then the handle is unusable."""
        if self._released:
            return
        self._released = True
        transfer = self._transfer
        if transfer is not None and not transfer.done():
            transfer.cancel()

    def __repr__(self) -> str:
        return "nixl_xfer_handle(%s to %r, %d ops, released=%s)" % (
            self.operation, self.remote_agent, len(self.ops), self._released)


class _Region:
    """A local registered region: [address, address+length) in `buffer` at
    `offset`; `owned` when this agent made the registration for it."""

    def __init__(self, address: int, length: int, buffer: Buffer, offset: int,
                 owned: bool) -> None:
        self.address = address
        self.length = length
        self.buffer = buffer
        self.offset = offset
        self.owned = owned


class _RemoteAgent:
    """What a peer's metadata says: its regions and its mailbox."""

    def __init__(self, name: str, regions: list[tuple[int, int, bytes, int]],
                 mailbox: bytes) -> None:
        self.name = name
        self.regions = regions  # (address, length, remote context, offset)
        self.mailbox = mailbox


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


def _send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    sock.sendall(struct.pack("<I", len(body)) + body)


def _recv_exactly(sock: socket.socket, size: int, deadline: float) -> bytes:
    data = bytearray()
    while len(data) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the peer was too slow")
        sock.settimeout(remaining)
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


def _recv_message(sock: socket.socket, seconds: float = _MESSAGE_SECONDS) -> dict[str, Any]:
    """One length-prefixed JSON message, whole within `seconds`."""
    deadline = time.monotonic() + seconds
    (size,) = struct.unpack("<I", _recv_exactly(sock, 4, deadline))
    if size > _MAX_MESSAGE_BYTES:
        raise ValueError("a metadata message of %d bytes (at most %d)"
                         % (size, _MAX_MESSAGE_BYTES))
    message = json.loads(_recv_exactly(sock, size, deadline))
    if not isinstance(message, dict):
        raise ValueError("a metadata message that is not an object")
    return message


class nixl_agent:  # noqa: N801 (NIXL's name)
    """A NIXL agent named `agent_name`, backed by this host's rdma-agentd."""

    def __init__(self, agent_name: str, nixl_conf: nixl_agent_config | None = None,
                 instantiate_all: bool = False) -> None:
        if not isinstance(agent_name, str) or not agent_name:
            raise invalid("nixl_agent: agent_name must be a non-empty str")
        self.name = agent_name
        self.config = nixl_conf or nixl_agent_config()
        self.notifs: dict[str, list[bytes]] = {}
        self.backends: dict[str, str] = {b: b for b in self.config.backends}
        self._client = AgentClient(self.config.socket, timeout=30.0,
                                   on_rejoin=self._on_rejoin)
        self._lock = threading.Lock()
        self._regions: list[_Region] = []
        self._remotes: dict[str, _RemoteAgent] = {}
        # Metadata through the agent's directory: the registration published
        # under this agent's name, the peers whose metadata was fetched from
        # the directory (refetched when they publish again, dropped when
        # they withdraw), and the stream that follows them.
        self._published: Buffer | None = None
        self._wanted: set[str] = set()
        self._names_stream: NameStream | None = None
        self._names_thread: threading.Thread | None = None
        self._mailbox = self._client.attach(64, label="nixl-mailbox:" + agent_name[:40])
        self._closed = False
        # Sends of metadata, fetches and transfer notifications run here, in
        # order: NIXL's calls return at once and these complete later.
        self._work: queue.Queue[Any] = queue.Queue()
        self._worker = threading.Thread(target=self._work_loop, name="nixl-work", daemon=True)
        self._worker.start()
        # Notifications come on one WatchNotifications stream, read by one
        # thread into `_inbox` (bounded by the agent's queue: the stream
        # delivers what the agent kept); get_new_notifs() takes from it
        # without an RPC, so polling loops cost no agent calls.
        self._inbox: collections.deque[tuple[str, bytes]] = collections.deque()
        self.notifs_dropped = 0
        self._stream = self._client.watch_notifications()
        self._notify_thread = threading.Thread(target=self._notify_loop, name="nixl-notify",
                                               daemon=True)
        self._notify_thread.start()
        self._listener: socket.socket | None = None
        self._listen_thread: threading.Thread | None = None
        self.listen_port = 0
        if self.config.enable_listen:
            self._listen(self.config.port)

    # -- lifetime ---------------------------------------------------------

    def close(self) -> None:
        """Stops the listener and the worker, deregisters what this agent
        registered and closes its client. Also done at garbage collection."""
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        self._work.put(None)
        self._worker.join(timeout=30)
        self._stream.close()
        self._notify_thread.join(timeout=30)
        with self._lock:
            names_stream, names_thread = self._names_stream, self._names_thread
        if names_stream is not None:
            names_stream.close()
        if names_thread is not None:
            names_thread.join(timeout=30)
        if self._published is not None:
            self._published.close()  # its name goes with it
            self._published = None
        for region in list(self._regions):
            if region.owned:
                region.buffer.close()
        self._regions = []
        self._mailbox.close()
        self._client.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter exit: the agent drops it with the process
            pass

    def __enter__(self) -> nixl_agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- backends (the agent's) ---------------------------------------------

    def get_plugin_list(self) -> list[str]:
        return ["RDMA_AGENT"]

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        return ["DRAM"]

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        return {}

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return ["DRAM"]

    def get_backend_params(self, backend: str) -> dict[str, str]:
        return {}

    def create_backend(self, backend: str, initParams: dict[str, str] | None = None  # noqa: N803
                       ) -> None:
        """Accepted for compatibility: the agent routes every op itself."""
        self.backends[backend] = backend

    # -- descriptors --------------------------------------------------------

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> nixlXferDList:
        """nixlXferDList from a tensor, a list of tensors, (addr, len, dev)
        tuples with `mem_type`, an Nx3 numpy array with `mem_type`, or an
        nixlXferDList (returned as is)."""
        if isinstance(descs, nixlXferDList):
            return descs
        if isinstance(descs, nixlRegDList):
            raise wrong_type("get_xfer_descs: descs", descs, "transfer descriptors")
        rows = self._rows("get_xfer_descs", descs, mem_type, 3)
        return nixlXferDList("DRAM", [row[:3] for row in rows])

    def get_reg_descs(self, descs: Any, mem_type: str | None = None) -> nixlRegDList:
        """nixlRegDList from a tensor, a list of tensors, (addr, len, dev,
        meta) tuples with `mem_type`, an Nx3 numpy array with `mem_type`, or
        an nixlRegDList (returned as is)."""
        if isinstance(descs, nixlRegDList):
            return descs
        if isinstance(descs, nixlXferDList):
            raise wrong_type("get_reg_descs: descs", descs, "registration descriptors")
        rows = self._rows("get_reg_descs", descs, mem_type, 4)
        return nixlRegDList("DRAM", [tuple(row[:3]) + (row[3] if len(row) > 3 else "",)
                                     for row in rows])

    def _rows(self, call: str, descs: Any, mem_type: str | None,
              tuple_size: int) -> list[tuple[Any, ...]]:
        if _is_tensor(descs):
            return [_tensor_desc(descs)]
        if type(descs).__module__ == "numpy":
            if descs.ndim != 2 or descs.shape[1] != 3:
                raise invalid("%s: a numpy array of descriptors must be Nx3 "
                              "(address, length, device id)" % call)
            _mem_type(mem_type, default="")
            return [tuple(int(v) for v in row) for row in descs.tolist()]
        if not isinstance(descs, (list, tuple)) or not descs:
            raise wrong_type("%s: descs" % call, descs,
                             "a tensor, a non-empty list of tensors or tuples, or an Nx3 array")
        if all(_is_tensor(d) for d in descs):
            return [_tensor_desc(d) for d in descs]
        _mem_type(mem_type, default="")
        rows = []
        for index, row in enumerate(descs):
            if not isinstance(row, (tuple, list)) or len(row) != tuple_size:
                raise invalid("%s: descriptor %d must be a %d-tuple %s" % (
                    call, index, tuple_size,
                    "(address, length, device id, meta)" if tuple_size == 4
                    else "(address, length, device id)"))
            rows.append((int(row[0]), int(row[1]), int(row[2])) + tuple(row[3:]))
        return rows

    def get_serialized_descs(self, descs: _DList) -> bytes:
        """The list as bytes (JSON, not pickle: deserializing a peer's bytes
        runs no code)."""
        if not isinstance(descs, _DList):
            raise wrong_type("get_serialized_descs: descs", descs, "a descriptor list")
        return json.dumps({"kind": type(descs).__name__, "mem_type": descs.mem_type,
                           "descs": [list(d) for d in descs.descs]}).encode()

    def deserialize_descs(self, serialized_descs: bytes) -> _DList:
        try:
            message = json.loads(serialized_descs)
            kind = {"nixlXferDList": nixlXferDList,
                    "nixlRegDList": nixlRegDList}[message["kind"]]
            return kind(_mem_type(message["mem_type"]), [
                tuple(int(v) for v in d[:3]) + tuple(str(v) for v in d[3:4])
                for d in message["descs"]])
        except (ValueError, KeyError, TypeError) as error:
            raise invalid("deserialize_descs: not a serialized descriptor list (%s)"
                          % error) from None

    # -- memory ---------------------------------------------------------------

    def register_memory(self, reg_list: Any, mem_type: str | None = None,
                        backends: Sequence[str] = ()) -> nixlRegDList:
        """Registers the regions with the agent (see the module docstring);
        returns the nixlRegDList to deregister_memory later. Regions of one
        call that share pages (caches the allocator placed side by side)
        share one registration."""
        descs = self.get_reg_descs(reg_list, mem_type)
        wanted: list[tuple[int, int, int, str]] = []
        for index, (address, length, _, meta) in enumerate(descs.descs):
            if length <= 0:
                raise invalid("register_memory: descriptor %d has length %d" % (index, length))
            first, size = page_span(address, length)
            if not self.config.share_edge_pages and (first, size) != (address, length):
                raise invalid("register_memory: descriptor %d (0x%x, %d bytes) does not fill "
                              "whole pages (nixl_agent_config(share_edge_pages=False))"
                              % (index, address, length))
            wanted.append((address, length, index, str(meta)))
        made: list[_Region] = []
        try:
            for group in self._page_groups(wanted):
                made.extend(self._register_group(group))
        except BaseException:
            for region in made:
                self._drop_region(region)
            raise
        return descs

    def _page_groups(self, wanted: list[tuple[int, int, int, str]]
                     ) -> list[list[tuple[int, int, int, str]]]:
        """The regions in groups whose pages overlap, by address."""
        groups: list[list[tuple[int, int, int, str]]] = []
        group_end = -1
        for region in sorted(wanted):
            first, size = page_span(region[0], region[1])
            if groups and first < group_end:
                groups[-1].append(region)
                group_end = max(group_end, first + size)
            else:
                groups.append([region])
                group_end = first + size
        return groups

    def _register_group(self, group: list[tuple[int, int, int, str]]) -> list[_Region]:
        start = min(address for address, _, _, _ in group)
        end = max(address + length for address, length, _, _ in group)
        found = self._client.find_range(start, end - start)
        if found is not None:
            buffer, owned = found[0], False
        else:
            indices = ",".join(str(index) for _, _, index, _ in group)
            buffer = self._client.register_range(
                start, end - start, label=("nixl:%s:%s" % (self.name, group[0][3]))[:100],
                share_edge_pages=self.config.share_edge_pages,
                what="region %s" % indices)
            owned = True
        regions = [_Region(address, length, buffer, address - buffer.address, owned)
                   for address, length, _, _ in group]
        with self._lock:
            self._regions.extend(regions)
        return regions

    def _drop_region(self, region: _Region) -> None:
        with self._lock:
            if region in self._regions:
                self._regions.remove(region)
            still_used = any(r.buffer is region.buffer for r in self._regions)
        if region.owned and not still_used:
            region.buffer.close()

    def deregister_memory(self, dereg_list: nixlRegDList, backends: Sequence[str] = ()) -> None:
        """Releases the registrations made for these regions."""
        descs = self.get_reg_descs(dereg_list)
        for index, (address, length, _, _) in enumerate(descs.descs):
            with self._lock:
                region = next((r for r in self._regions
                               if (r.address, r.length) == (address, length)), None)
            if region is None:
                raise invalid("deregister_memory: descriptor %d (0x%x, %d bytes) is not "
                              "registered" % (index, address, length))
            self._drop_region(region)

    def query_memory(self, reg_list: Any, backend: str,
                     mem_type: str | None = None) -> list[dict[str, str] | None]:
        """For each region: None if no registration of this agent holds it,
        else what the agent registered it as."""
        answers: list[dict[str, str] | None] = []
        for address, length, _, _ in self.get_reg_descs(reg_list, mem_type).descs:
            region = self._local_region(address, length)
            if region is None:
                answers.append(None)
                continue
            answers.append({"buffer_id": str(region.buffer.id),
                            "backends": ",".join(region.buffer.backends),
                            "registered_bytes": str(region.buffer.size)})
        return answers

    def _local_region(self, address: int, length: int) -> _Region | None:
        with self._lock:
            for region in self._regions:
                if region.address <= address and \
                        address + length <= region.address + region.length:
                    return region
        return None

    # -- metadata -------------------------------------------------------------

    def get_agent_metadata(self) -> bytes:
        """This agent's name, mailbox and registered regions with their
        remote contexts."""
        with self._lock:
            regions = [[r.address, r.length, _b64(r.buffer.remote_context), r.offset]
                       for r in self._regions]
        return json.dumps({"nixl_rdma_agent": _METADATA_VERSION, "name": self.name,
                           "mailbox": _b64(self._mailbox.remote_context),
                           "regions": regions}).encode()

    def add_remote_agent(self, metadata: bytes) -> str:
        """Loads a peer's metadata; returns its name."""
        try:
            message = json.loads(metadata)
            if message.get("nixl_rdma_agent") != _METADATA_VERSION:
                raise ValueError("not rdma_agent.nixl metadata of version %d"
                                 % _METADATA_VERSION)
            name = message["name"]
            if not isinstance(name, str) or not name:
                raise ValueError("no agent name")
            regions = [(int(a), int(n), _unb64(c), int(o)) for a, n, c, o in message["regions"]]
            for _, _, context, _ in regions:
                decode_context(context)
            mailbox = _unb64(message["mailbox"])
        except (ValueError, KeyError, TypeError) as error:
            raise invalid("add_remote_agent: malformed metadata (%s)" % error) from None
        with self._lock:
            if name not in self._remotes and len(self._remotes) >= _MAX_REMOTE_AGENTS:
                raise AgentError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 "add_remote_agent: already %d remote agents"
                                 % _MAX_REMOTE_AGENTS)
            self._remotes[name] = _RemoteAgent(name, regions, mailbox)
        return name

    def remove_remote_agent(self, agent: str) -> None:
        with self._lock:
            self._wanted.discard(agent)
            if self._remotes.pop(agent, None) is None:
                raise invalid("remove_remote_agent: no remote agent %r" % agent)

    def check_remote_metadata(self, agent: str, descs: Any = None) -> bool:
        """True once `agent`'s metadata is loaded (and, with `descs`, covers
        every descriptor)."""
        with self._lock:
            remote = self._remotes.get(agent)
        if remote is None:
            return False
        if descs is None:
            return True
        try:
            self._remote_sides(remote, self.get_xfer_descs(descs))
        except AgentError:
            return False
        return True

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Sends this agent's metadata to the listener at ip_addr:port, in the
        background (retried for 30 s while the peer is not listening yet);
        without ip_addr, publishes it in the agent's directory (again, with
        what is registered now, at each call)."""
        if not ip_addr:
            self._work.put(self._publish_metadata)
            return
        self._work.put(lambda: self._exchange(ip_addr, port, {
            "op": "send_md", "md": self.get_agent_metadata().decode()}))

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "",
                              port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        """Asks the listener at ip_addr:port for `remote_agent`'s metadata, in
        the background; check_remote_metadata() says when it arrived.
        Without ip_addr, fetches it from the agent's directory, now or as
        soon as `remote_agent` publishes it, and again whenever it publishes
        new metadata (until remove_remote_agent)."""
        if not isinstance(remote_agent, str) or not remote_agent:
            raise invalid("fetch_remote_metadata: remote_agent must be a non-empty str")
        if not ip_addr:
            self._follow(remote_agent)
            return

        def fetch() -> None:
            answer = self._exchange(ip_addr, port, {"op": "fetch_md", "name": remote_agent})
            if answer is not None and "md" in answer:
                self.add_remote_agent(answer["md"].encode())

        self._work.put(fetch)

    def invalidate_local_metadata(self, ip_addr: str = "",
                                  port: int = DEFAULT_COMM_PORT) -> None:
        """Tells the listener at ip_addr:port to forget this agent; without
        ip_addr, withdraws its metadata from the agent's directory (its
        followers drop it)."""
        if not ip_addr:
            self._work.put(self._withdraw_metadata)
            return
        self._work.put(lambda: self._exchange(ip_addr, port,
                                              {"op": "invalidate", "name": self.name}))

    # -- metadata through the agent's directory -------------------------------

    def _metadata_name(self, agent: str) -> str:
        return self.config.metadata_prefix + agent

    def _publish_metadata(self) -> None:
        """Puts the metadata into a new read-only registration (8-byte
        little-endian length, then the JSON), publishes it under this
        agent's name, and releases the one published before."""
        blob = self.get_agent_metadata()
        payload = struct.pack("<Q", len(blob)) + blob
        buffer = self._client.attach(len(payload), access="read",
                                     label="nixl-metadata:" + self.name[:40])
        try:
            buffer.memory[:] = payload
            buffer.publish(self._metadata_name(self.name), self.config.metadata_visibility)
        except BaseException:
            buffer.close()
            raise
        old, self._published = self._published, buffer
        if old is not None:
            old.close()

    def _withdraw_metadata(self) -> None:
        old, self._published = self._published, None
        if old is not None:
            old.close()  # Release withdraws its name

    def _on_rejoin(self, buffer: Buffer, old_id: int) -> None:
        # Regions, mailbox and metadata have new contexts on the restarted
        # agent: metadata sent before is sent again, with them.
        if self._published is not None and not self._closed:
            self._work.put(self._republish_after_rejoin)

    def _republish_after_rejoin(self) -> None:
        if self._published is not None:
            self._publish_metadata()

    def _follow(self, remote_agent: str) -> None:
        """Fetches `remote_agent`'s metadata from the directory now and each
        time it is published, through this agent's names stream."""
        with self._lock:
            self._wanted.add(remote_agent)
            start = self._names_thread is None
            if start:
                self._names_thread = threading.Thread(target=self._follow_loop,
                                                      name="nixl-metadata", daemon=True)
        if start:
            assert self._names_thread is not None
            self._names_thread.start()
        else:
            self._work.put(lambda: self._fetch_by_name(remote_agent))

    def _follow_loop(self) -> None:
        prefix = self.config.metadata_prefix
        while not self._closed:
            try:
                stream = self._client.watch_names(prefix)
                with self._lock:
                    if self._closed:
                        stream.close()
                        return
                    self._names_stream = stream
                for event in stream:
                    if event.record is None or not event.record.name.startswith(prefix):
                        continue
                    agent = event.record.name[len(prefix):]
                    with self._lock:
                        wanted = agent in self._wanted and agent != self.name
                    if not wanted:
                        continue
                    if event.kind == "published":
                        self._work.put(lambda agent=agent, record=event.record:
                                       self._load(agent, record))
                    elif event.kind == "withdrawn":
                        with self._lock:
                            self._remotes.pop(agent, None)
                return  # closed
            except AgentError:
                time.sleep(0.5)  # the agent restarted: watch again (a new snapshot)

    def _fetch_by_name(self, agent: str) -> None:
        try:
            record = self._client.resolve(self._metadata_name(agent))
        except NotFoundError:
            return  # the stream fetches it once it is published
        self._load(agent, record)

    def _load(self, agent: str, record: NameRecord) -> None:
        """Reads the metadata a record points at and loads it if it is
        `agent`'s."""
        size = decode_context(record.remote_context).size_bytes
        if not 8 <= size <= _MAX_MESSAGE_BYTES:
            return
        with self._client.attach(size, access="write", label="nixl-metadata-read") as into:
            [result] = self._client.submit([Op("read", into, 0, size,
                                               remote=record.remote_context)],
                                           timeout=self.config.timeout or 30)
            if not result.ok:
                return  # withdrawn meanwhile, or its agent restarted: a new event follows
            data = bytes(into.memory)
        (length,) = struct.unpack_from("<Q", data)
        if length > size - 8:
            return
        blob = data[8:8 + length]
        try:
            if json.loads(blob).get("name") != agent:
                return
        except (ValueError, AttributeError):
            return
        with self._lock:
            if agent not in self._wanted:
                return  # removed meanwhile
        self.add_remote_agent(blob)

    def _exchange(self, ip_addr: str, port: int,
                  message: dict[str, Any]) -> dict[str, Any] | None:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection((ip_addr, port), timeout=10) as sock:
                    _send_message(sock, message)
                    return _recv_message(sock)
            except (OSError, ValueError):
                if time.monotonic() >= deadline or self._closed:
                    return None
                time.sleep(0.05)

    def _listen(self, port: int) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("", port))
        listener.listen(64)
        self._listener = listener
        self.listen_port = listener.getsockname()[1]
        self._listen_thread = threading.Thread(target=self._listen_loop, name="nixl-listen",
                                               daemon=True)
        self._listen_thread.start()

    def _listen_loop(self) -> None:
        assert self._listener is not None
        while not self._closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            with connection:
                connection.settimeout(10)
                try:
                    self._answer(connection, _recv_message(connection))
                except (OSError, ValueError, AgentError):
                    continue  # a bad peer loses its connection, nothing else

    def _answer(self, connection: socket.socket, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "send_md":
            self.add_remote_agent(str(message.get("md", "")).encode())
            _send_message(connection, {"ok": True})
        elif op == "fetch_md":
            if message.get("name") not in (None, self.name):
                _send_message(connection, {"error": "this agent is %s" % self.name})
            else:
                _send_message(connection, {"md": self.get_agent_metadata().decode()})
        elif op == "invalidate":
            with self._lock:
                self._remotes.pop(str(message.get("name")), None)
            _send_message(connection, {"ok": True})
        else:
            _send_message(connection, {"error": "unknown op"})

    def _work_loop(self) -> None:
        while True:
            job = self._work.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a failed background step shows in its state
                pass

    # -- transfers ----------------------------------------------------------

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: str | None = None,
                        backends: Sequence[str] = ()) -> nixl_prepped_dlist_handle:
        """Resolves descriptors once: local ones (agent_name NIXL_INIT_AGENT
        or "") to this agent's registrations, remote ones (a remote agent's
        name, or this agent's for loopback) to the remote contexts of its
        metadata."""
        descs = self.get_xfer_descs(xfer_list, mem_type)
        if agent_name in (NIXL_INIT_AGENT, ""):
            return nixl_prepped_dlist_handle(NIXL_INIT_AGENT, self._local_sides(descs))
        return nixl_prepped_dlist_handle(agent_name,
                                         self._remote_sides(self._remote(agent_name), descs))

    def _remote(self, name: str) -> _RemoteAgent:
        if name == self.name:
            return _RemoteAgent(name, [], b"")  # loopback: resolved from local regions
        with self._lock:
            remote = self._remotes.get(name)
        if remote is None:
            raise invalid("no metadata of remote agent %r (add_remote_agent or "
                          "fetch_remote_metadata first)" % name)
        return remote

    def _local_sides(self, descs: nixlXferDList) -> list[tuple[Any, int, int]]:
        sides: list[tuple[Any, int, int]] = []
        for index, (address, length, _) in enumerate(descs.descs):
            region = self._local_region(address, length)
            if region is None:
                raise invalid("local descriptor %d (0x%x, %d bytes) is not in memory "
                              "registered with register_memory" % (index, address, length))
            sides.append((region.buffer, region.offset + address - region.address, length))
        return sides

    def _remote_sides(self, remote: _RemoteAgent,
                      descs: nixlXferDList) -> list[tuple[Any, int, int]]:
        if remote.name == self.name:
            return [(buffer.remote_context, offset, length)
                    for buffer, offset, length in self._local_sides(descs)]
        sides: list[tuple[Any, int, int]] = []
        for index, (address, length, _) in enumerate(descs.descs):
            for start, size, context, offset in remote.regions:
                if start <= address and address + length <= start + size:
                    sides.append((context, offset + address - start, length))
                    break
            else:
                raise invalid("remote descriptor %d (0x%x, %d bytes) is not in memory "
                              "%r registered" % (index, address, length, remote.name))
        return sides

    def _ops(self, operation: str, local: list[tuple[Any, int, int]],
             remote: list[tuple[Any, int, int]]) -> list[Op]:
        if operation not in _OPERATIONS:
            raise one_of("operation", operation, _OPERATIONS)
        if len(local) != len(remote):
            raise invalid("%s: %d local descriptors for %d remote ones"
                          % (operation, len(local), len(remote)))
        ops = []
        for index, ((buffer, local_offset, local_length),
                    (context, remote_offset, remote_length)) in enumerate(zip(local, remote)):
            if local_length != remote_length:
                raise invalid("%s: descriptor pair %d has %d local and %d remote bytes"
                              % (operation, index, local_length, remote_length))
            ops.append(Op(_OPERATIONS[operation], buffer.id, local_offset, local_length,
                          context, remote_offset))
        return ops

    def make_prepped_xfer(self, operation: str, local_xfer_side: nixl_prepped_dlist_handle,
                          local_indices: Any, remote_xfer_side: nixl_prepped_dlist_handle,
                          remote_indices: Any, notif_msg: bytes | str = b"",
                          backends: Sequence[str] = (),
                          skip_desc_merge: bool = False) -> nixl_xfer_handle:
        """A transfer of the prepared descriptors at these indices (lists or
        numpy integer arrays), pairwise."""
        if local_xfer_side.agent_name != NIXL_INIT_AGENT:
            raise invalid("make_prepped_xfer: the local side must be prepared with "
                          "NIXL_INIT_AGENT")
        local = self._pick("local", local_xfer_side, local_indices)
        remote = self._pick("remote", remote_xfer_side, remote_indices)
        return nixl_xfer_handle(self, operation, remote_xfer_side.agent_name,
                                self._ops(operation, local, remote), _bytes(notif_msg))

    @staticmethod
    def _pick(what: str, side: nixl_prepped_dlist_handle,
              indices: Any) -> list[tuple[Any, int, int]]:
        if side._released:
            raise invalid("make_prepped_xfer: the %s side was released" % what)
        picked = []
        for index in (indices.tolist() if hasattr(indices, "tolist") else indices):
            if not 0 <= int(index) < len(side.sides):
                raise invalid("make_prepped_xfer: %s index %d of %d descriptors"
                              % (what, int(index), len(side.sides)))
            picked.append(side.sides[int(index)])
        return picked

    def initialize_xfer(self, operation: str, local_descs: Any, remote_descs: Any,
                        remote_agent: str, notif_msg: bytes | str = b"",
                        backends: Sequence[str] = ()) -> nixl_xfer_handle:
        """A transfer between two descriptor lists, pairwise."""
        local = self._local_sides(self.get_xfer_descs(local_descs))
        remote = self._remote_sides(self._remote(remote_agent), self.get_xfer_descs(remote_descs))
        return nixl_xfer_handle(self, operation, remote_agent,
                                self._ops(operation, local, remote), _bytes(notif_msg))

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes | str = b"") -> str:
        """Posts the transfer (again, once ended): "PROC", or "ERR" if the
        agent refused it or it still runs."""
        with handle._lock:
            if handle._released:
                return "ERR"
            if handle._transfer is not None and self._state_locked(handle) == "PROC":
                return "ERR"
            if notif_msg:
                handle.notif_msg = _bytes(notif_msg)
            handle._end = None
            handle._notified = None
            handle._posted = time.time()
            started = time.monotonic()
            try:
                handle._transfer = self._client.submit_async(handle.ops, self.config.timeout)
            except AgentError:
                handle._transfer = None
                return "ERR"
            handle._post_duration = time.monotonic() - started
            if self.config.enable_pthread:
                handle._transfer.future.add_done_callback(
                    lambda _: self._work.put(lambda: self._finish(handle)))
        return "PROC"

    def _finish(self, handle: nixl_xfer_handle) -> None:
        with handle._lock:
            self._state_locked(handle)

    def _state_locked(self, handle: nixl_xfer_handle) -> str:
        """PROC until the transfer ended and its notification went out."""
        transfer = handle._transfer
        if transfer is None:
            return "ERR"
        end = handle._end
        if end is None:
            if not transfer.done():
                return "PROC"
            end = handle._end = transfer.wait(0)
        if end.state != DONE:
            return "ERR"
        if handle.notif_msg and handle._notified is None:
            handle._notified = concurrent.futures.Future()
            try:
                self._notify(handle.remote_agent, handle.notif_msg)
                handle._notified.set_result(True)
            except AgentError as error:
                handle._notified.set_exception(error)
        if handle._notified is not None and handle._notified.exception() is not None:
            return "ERR"
        return "DONE"

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """"DONE" once the transfer's bytes landed (and its notification was
        sent), "PROC" while it runs, "ERR" if an op (or the notification)
        failed."""
        with handle._lock:
            if handle._released:
                return "ERR"
            return self._state_locked(handle)

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry:
        """Telemetry of an ended transfer (times from the agent's record)."""
        end = handle._end
        if end is None:
            raise AgentError(grpc.StatusCode.FAILED_PRECONDITION,
                             "get_xfer_telemetry: the transfer has not ended")
        start = end.start_time or end.create_time or handle._posted
        finish = end.end_time or start
        return nixlXferTelemetry(int(handle._posted * 1e6), int(handle._post_duration * 1e6),
                                 int(max(0.0, finish - start) * 1e6), handle.total_bytes,
                                 len(handle.ops))

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        """The backend the agent used for the first op of the ended transfer."""
        end = handle._end
        if end is None or not end.results:
            raise AgentError(grpc.StatusCode.FAILED_PRECONDITION,
                             "query_xfer_backend: the transfer has not ended")
        return end.results[0].backend

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    # -- notifications --------------------------------------------------------

    def _notify(self, remote_agent: str, message: bytes) -> None:
        remote = self._remote(remote_agent)
        mailbox = remote.mailbox if remote.name != self.name else \
            self._mailbox.remote_context
        name = self.name.encode()
        payload = _NOTIFY_MAGIC + struct.pack("<H", len(name)) + name + message
        sent = self._client.submit_notify(
            [Op("write", self._mailbox, 0, 1, mailbox, 0)], payload, self.config.timeout)
        failed = [r for r in sent.results if not r.ok] + \
            [n for n in sent.notifications if not n.ok]
        if failed or not sent.notifications:
            raise AgentError(failed[0].code if failed else grpc.StatusCode.UNAVAILABLE,
                             "notification to %r: %s" % (remote_agent, failed or "not sent"))

    def send_notif(self, remote_agent_name: str, notif_msg: bytes | str,
                   backend: str | None = None) -> None:
        """Sends `notif_msg` to the remote agent (through its mailbox)."""
        self._notify(remote_agent_name, _bytes(notif_msg))

    def _notify_loop(self) -> None:
        try:
            for notification, dropped in self._stream:
                self.notifs_dropped += dropped
                if notification is None or notification.buffer_id != self._mailbox.id:
                    continue
                data = notification.data
                if not data.startswith(_NOTIFY_MAGIC) or len(data) < 6:
                    continue
                (size,) = struct.unpack("<H", data[4:6])
                try:
                    sender = data[6:6 + size].decode()
                except UnicodeDecodeError:
                    continue
                if len(self._inbox) >= _MAX_INBOX:
                    self.notifs_dropped += 1  # nobody reads them
                    continue
                self._inbox.append((sender, data[6 + size:]))
        except AgentError:
            pass  # the agent went away: no more notifications

    def _take_notifs(self, into: dict[str, list[bytes]]) -> dict[str, list[bytes]]:
        while self._inbox:
            sender, message = self._inbox.popleft()
            into.setdefault(sender, []).append(message)
        return into

    def get_new_notifs(self, backends: Sequence[str] = ()) -> dict[str, list[bytes]]:
        """The notifications that arrived since the last call, by sender."""
        return self._take_notifs({})

    def update_notifs(self, backends: Sequence[str] = ()) -> dict[str, list[bytes]]:
        """Adds new notifications to self.notifs and returns it."""
        return self._take_notifs(self.notifs)

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: bytes,
                               backends: Sequence[str] = (), tag_is_prefix: bool = True) -> bool:
        """True (and the notification taken off self.notifs) once a
        notification from the remote agent starts with (or, without
        tag_is_prefix, contains) lookup_tag."""
        self._take_notifs(self.notifs)
        messages = self.notifs.get(remote_agent_name, [])
        for message in messages:
            if (message.startswith(lookup_tag) if tag_is_prefix else lookup_tag in message):
                messages.remove(message)
                return True
        return False


def _bytes(message: bytes | str) -> bytes:
    return message.encode() if isinstance(message, str) else bytes(message)
