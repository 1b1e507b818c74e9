"""Linux-specific capabilities, computed once at import.

Owns the small amount of platform code shmreduce needs: memfd, SO_PEERCRED,
the descriptor limit. Nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import socket
import struct
import sys

IS_LINUX = sys.platform.startswith("linux")
HAVE_MEMFD = hasattr(os, "memfd_create")
HAVE_SEQPACKET = hasattr(socket, "SOCK_SEQPACKET") and IS_LINUX

_UCRED = struct.Struct("3i")


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of an AF_UNIX socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    _pid, uid, _gid = _UCRED.unpack(creds)
    return uid


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of an AF_UNIX socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(creds)[0]


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return (old_soft, new_soft).

    Servers commonly do this (systemd's default hard limit is 512k); the soft limit of
    1024 is what makes torch's fd strategy fail with 'Too many open files' (#973).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft >= hard:
        return soft, soft
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, target


PR_SET_DUMPABLE = 4  # <linux/prctl.h>


def make_undumpable() -> bool:
    """``prctl(PR_SET_DUMPABLE, 0)``: this process's ``/proc/<pid>`` files (``fd``,
    ``maps``, ``mem``, ``environ``, ``io``) become root's, closed to every other
    non-root process of the user, and it is not ptraced or core-dumped by them, as
    ssh-agent and gpg-agent do. Whether it could (ctypes and prctl are Linux's; its
    own ``/proc/self`` stays open to it)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0


_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc_mm() -> tuple[object, object, object]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.restype = ctypes.c_int
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.mmap, libc.munmap, libc.madvise


_mmap, _munmap, _madvise = _libc_mm() if IS_LINUX else (None, None, None)
MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14
# Whether populate() may use MADV_POPULATE_WRITE: cleared once the kernel refuses it
# (EINVAL: older than 5.14), and by tests of the other path.
populating = IS_LINUX


def map_shared(fd: int, size: int, offset: int = 0) -> int:
    """Map *size* bytes of *fd* from *offset* (a page boundary) read-write and shared;
    return the address.

    Unlike ``mmap.mmap`` (which keeps a ``dup()`` of *fd* for as long as the map
    lives) the map holds no descriptor: a broker that reads the header of every
    segment it keeps holds one descriptor per memfd, and none per file."""
    addr = _mmap(None, size, 0x1 | 0x2, 0x01, fd, offset)  # type: ignore[operator]  # PROT_READ|PROT_WRITE, MAP_SHARED
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(addr)


def unmap(addr: int, size: int) -> None:
    _munmap(addr, size)  # type: ignore[operator]


def populate(addr: int, size: int) -> bool:
    """Allocate the pages of a shared mapping's *size* bytes at *addr* (page-aligned)
    and map them writable here, in one call (``MADV_POPULATE_WRITE``): what a
    ``posix_fallocate`` then one write fault per page would do. A full mount or memory
    limit is an ``OSError`` (ENOSPC, ENOMEM), never a SIGBUS. False if the kernel
    cannot (older than 5.14): the caller allocates another way."""
    global populating
    if not populating:
        return False
    if _madvise(addr, size, MADV_POPULATE_WRITE) == 0:  # type: ignore[operator]
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL:
        populating = False
        return False
    if err == errno.EFAULT:  # the page could not be allocated: a SIGBUS on a write
        err = errno.ENOSPC
    raise OSError(err, os.strerror(err))


MADV_REMOVE = 9  # <linux/mman.h>


def release(addr: int, size: int) -> None:
    """Give back to the mount (or the memory limit) the pages of a shared mapping's
    *size* bytes at *addr*, page-aligned, as a hole: what ``populate`` allocated of a
    range before it failed (``posix_fallocate`` leaves nothing behind when it fails)."""
    if size > 0:
        _madvise(addr, size, MADV_REMOVE)  # type: ignore[operator]


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def boot_id() -> str:
    """This boot of the running kernel (random at each boot, the same in every container on
    it); "" where the kernel does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
