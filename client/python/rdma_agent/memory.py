"""Where an object's bytes are, and moving memory the caller already has
onto a memfd in place.

The agent reaches client memory only through a memfd it was handed (design
section 4). Memory a program already has (a torch CPU tensor, a numpy
array, a bytearray) lives in anonymous pages of its allocator, so
registering it in place means making those pages memfd pages without moving
them: move_onto_memfd() copies the pages that hold the range into a new
memfd once, then maps the memfd over them with MAP_FIXED. The addresses do
not change, so every view, tensor and pointer to them stays valid and from
then on sees the shared pages (zero copy for every transfer after).

What it costs, and why it is the strategy:
- one copy of the range at registration (the alternative, the agent copying
  through process_vm_readv/writev at every transfer, costs a copy per
  transfer and agent code that reaches into client address spaces);
- whole pages: the memfd holds every page the range touches, so bytes that
  share the first or the last page with the object (other heap objects,
  allocator headers) become reachable by holders of the remote context.
  Callers must say they accept that (`share_edge_pages`) unless the range
  is page-aligned at both ends (as tensor()/ndarray() memory is);
- the pages become MAP_SHARED: a child forked afterwards shares them
  instead of getting copy-on-write copies;
- a write to those pages by another thread while the range is moved can be
  lost: the move holds the GIL (no other Python code runs), but native
  threads (torch's intra-op pool) must not write the range meanwhile.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
from typing import Any

from rdma_agent.errors import invalid, wrong_type

PAGE = mmap.PAGESIZE

# PyDLL keeps the GIL across the calls: no Python thread writes the range
# between the copy and the remap.
_libc = ctypes.PyDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.pwrite.restype = ctypes.c_ssize_t
_libc.pwrite.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
_MAP_FAILED = ctypes.c_void_p(-1).value


def span(obj: Any, what: str = "memory") -> tuple[int, int]:
    """(address, length in bytes) of the contiguous, writable memory of a
    CPU torch.Tensor, a numpy.ndarray, or an object with a writable buffer
    (bytearray, mmap, memoryview). TypeError/ValueError say what is wrong."""
    module = type(obj).__module__
    if module.startswith("torch"):
        if obj.device.type != "cpu":
            raise invalid("%s: a %s tensor is device memory; register it as a dma-buf "
                          "(register_dmabuf)" % (what, obj.device.type))
        if not obj.is_contiguous():
            raise invalid("%s: the tensor is not contiguous (use .contiguous())" % what)
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size())
    if module == "numpy":
        if not obj.flags.c_contiguous:
            raise invalid("%s: the array is not C-contiguous (numpy.ascontiguousarray)" % what)
        if not obj.flags.writeable:
            raise invalid("%s: the array is read-only" % what)
        return int(obj.__array_interface__["data"][0]), int(obj.nbytes)
    try:
        view = memoryview(obj)
    except TypeError:
        raise wrong_type(what, obj, "a torch CPU tensor, a numpy array or a writable "
                         "buffer (bytearray, mmap, memoryview)") from None
    with view:
        if view.readonly:
            raise invalid("%s: the %s is read-only" % (what, type(obj).__name__))
        if not view.c_contiguous:
            raise invalid("%s: the buffer is not contiguous" % what)
        if view.nbytes == 0:
            return 0, 0
        holder = (ctypes.c_char * view.nbytes).from_buffer(view)
        address = ctypes.addressof(holder)
        del holder  # releases its export of the buffer
        return address, view.nbytes


def page_span(address: int, length: int) -> tuple[int, int]:
    """(first page address, bytes) of the whole pages [address, address+length) touches."""
    first = address - address % PAGE
    end = -(-(address + length) // PAGE) * PAGE
    return first, end - first


def move_onto_memfd(address: int, length: int, label: str) -> tuple[int, int, int]:
    """Makes the pages holding [address, address+length) pages of a new memfd
    (sealed against shrinking), in place. Returns (memfd, first page
    address, bytes); the caller owns the fd."""
    first, size = page_span(address, length)
    fd = os.memfd_create(label or "rdma-agent-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        done = 0
        while done < size:
            wrote = _libc.pwrite(fd, first + done, size - done, done)
            if wrote <= 0:
                error = ctypes.get_errno()
                raise OSError(error, "copying memory onto a memfd: " + os.strerror(error))
            done += wrote
        mapped = _libc.mmap(first, size, mmap.PROT_READ | mmap.PROT_WRITE,
                            mmap.MAP_SHARED | 0x10,  # MAP_FIXED
                            fd, 0)
        if mapped == _MAP_FAILED or mapped != first:
            error = ctypes.get_errno()
            raise OSError(error, "mapping the memfd over the memory: " + os.strerror(error))
    except BaseException:
        os.close(fd)
        raise
    return fd, first, size


def address_of(memory: mmap.mmap) -> int:
    """The address an mmap is mapped at."""
    holder = ctypes.c_char.from_buffer(memory)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder
