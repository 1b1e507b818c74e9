"""file_descriptor segments: slabs, memfds that hold one or more storages at offsets.

Small storages (up to ``SLAB_ITEM_MAX`` bytes each) are packed into their sending
thread's current slab, across messages, until it is full: one memfd, one mapping,
one descriptor in each deposit that uses it, whatever the number of storages; a
larger storage gets a slab of its own. Each storage is a ``torch.frombuffer`` view
of its slice of the slab's mapping, so the mapping and its descriptor stay while any
storage in the slab lives (or the slab is its thread's current one) and go with the
last. A process maps a slab once (a registry by memfd identity, "dev:ino"), whether
it made it or received it: a receiver fetches a slab's descriptor once, and receives
the messages after it in that slab with no round trip and no new descriptor.

A storage's segment name is "dev:ino/offset". Its memory is written through the
descriptor (``pwrite``), which allocates the pages now: a full memory limit is a
``SharingError`` here rather than a SIGBUS later.

torch cannot tell a ``frombuffer`` view of shared memory from private memory: while
registered, ``patches`` makes ``UntypedStorage.is_shared`` ask the storage cache too.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import weakref
from collections import OrderedDict
from typing import Any

import torch

from shmreduce import _torch, segments
from shmreduce.errors import SharingError

SLAB_ALIGN = 64  # each storage starts on a cache line, as torch's CPU allocator aligns
SLAB_ITEM_MAX = 64 << 10  # storages up to this size share their thread's current slab
SLAB_WINDOW = 1 << 20  # the mapping of a shared slab: pages exist only once written

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_munmap = _libc.munmap
_munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT = mmap.PROT_READ | mmap.PROT_WRITE

# One ctypes array type for every slab's buffer, of a declared length far beyond any
# slab: ctypes keeps an array type per length forever, so a type per slab size would
# pile up. Only the slices torch.frombuffer takes (checked against the mapping) are used.
_Buffer = ctypes.c_char * (1 << 40)
_U8 = torch.uint8
_frombuffer = torch.frombuffer


class Mapping:
    """A slab's descriptor and mapping in this process, freed together with this
    object. Hung on the slab's buffer, which every storage in the slab keeps alive."""

    __slots__ = ("fd", "addr", "size")

    def __init__(self, fd: int, addr: int, size: int) -> None:
        self.fd, self.addr, self.size = fd, addr, size

    # Bound at definition: module globals may be gone at interpreter shutdown.
    def __del__(self, _unmap: Any = _munmap, _close: Any = os.close) -> None:
        _unmap(self.addr, self.size)
        _close(self.fd)


_slabs: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()  # ident -> buffer

# A receiver keeps its latest received shared slabs mapped after their last storage
# dies: its sender goes on filling them, and the next message in one then costs no
# round trip, no descriptor and no mapping. At most KEPT_SLABS of them, least
# recently used first out: SLAB_WINDOW bytes of memory each at most.
KEPT_SLABS = int(os.environ.get("SHMREDUCE_KEPT_SLABS", "8"))
_kept: "OrderedDict[str, Any]" = OrderedDict()


def lookup(ident: str) -> Any | None:
    """This process's mapping (buffer) of the slab *ident*, if it has one."""
    buffer = _slabs.get(ident)
    if buffer is not None and ident in _kept:
        _kept.move_to_end(ident)
    return buffer


def drop_kept() -> None:
    """Let go of the slabs kept mapped for reuse."""
    _kept.clear()


def descriptor(buffer: Any) -> int:
    return int(buffer.mapping.fd)


def _map(fd: int, size: int, ident: str, extent: int) -> Any:
    """Map *size* bytes of *fd*, of which *extent* hold data; the returned buffer owns
    *fd* from now on."""
    addr = _mmap(None, size, _PROT, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    buffer: Any = _Buffer.from_address(addr)
    buffer.mapping = Mapping(fd, addr, size)
    buffer.ident = ident
    buffer.extent = extent  # the bytes a view may cover: never beyond the file's end
    _slabs[ident] = buffer
    return buffer


def _error(exc: OSError, what: str, nbytes: int) -> SharingError:
    if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
        return SharingError(f"out of memory for a {nbytes}-byte shared segment: {exc.strerror}")
    return segments.os_error(exc, what)


def view(buffer: Any, offset: int, nbytes: int) -> torch.UntypedStorage:
    """The storage of *nbytes* at *offset* in a mapped slab."""
    return _frombuffer(buffer, dtype=_U8, count=nbytes, offset=offset).untyped_storage()


class Writer:
    """A new slab being filled by the sender of one message."""

    __slots__ = ("buffer", "fd", "ident", "used", "size")

    def __init__(self, size: int) -> None:
        try:
            fd = os.memfd_create("shmreduce", os.MFD_CLOEXEC)
        except OSError as exc:
            raise _error(exc, "memfd_create", size) from exc
        try:
            # Sized whole up front (no memory until written): a receiver maps all of
            # it, and finds storages the sender adds to it later.
            os.ftruncate(fd, size)
            self.ident, _ = segments.fd_identity(fd)
            self.buffer = _map(fd, size, self.ident, 0)
        except OSError as exc:
            os.close(fd)
            raise _error(exc, "mapping a new memfd", size) from exc
        self.fd, self.used, self.size = fd, 0, size

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.size

    def _put(self, nbytes: int, source: torch.UntypedStorage | None) -> tuple[int, torch.UntypedStorage]:
        """Write *source* (or reserve zeros) at the next free offset; that offset and its view."""
        offset = self.used
        try:
            segments.fill(self.fd, nbytes, source, offset)
        except OSError as exc:
            raise _error(exc, "filling a memfd", nbytes) from exc
        self.used = (offset + nbytes + SLAB_ALIGN - 1) & -SLAB_ALIGN
        self.buffer.extent = offset + nbytes
        return offset, view(self.buffer, offset, nbytes)

    def move(self, storage: torch.UntypedStorage) -> int:
        """Move *storage* into this slab in place; return its offset."""
        offset, shared = self._put(storage.nbytes(), storage)
        _torch.swap_memory(storage, shared)
        return offset

    def new(self, nbytes: int) -> tuple[int, torch.UntypedStorage]:
        """A new zero-filled storage of *nbytes* in this slab, its pages reserved."""
        return self._put(nbytes, None)


def receive(fd: int, ident: str) -> Any:
    """Map a received slab; check it is *ident*. The buffer owns *fd* from now on."""
    got, nbytes = segments.fd_identity(fd)
    if got != ident:
        raise SharingError(
            f"received descriptor does not match its handle (expected {ident}, got {got}): forged or corrupted message"
        )
    try:
        buffer = _map(fd, max(nbytes, 1), ident, nbytes)
    except OSError as exc:
        raise _error(exc, "mapping a received segment", nbytes) from exc
    if nbytes <= SLAB_WINDOW and KEPT_SLABS > 0:
        _kept[ident] = buffer
        while len(_kept) > KEPT_SLABS:
            _kept.popitem(last=False)
    return buffer


def extent(buffer: Any) -> int:
    """The bytes of the slab that hold data (views never go beyond)."""
    return int(buffer.extent)
