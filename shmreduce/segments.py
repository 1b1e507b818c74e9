"""file_system segments (create them, move a storage into one in place, map them),
the adoption of storages torch already shared by descriptor, and the
descriptor-level helpers both kinds use (``fill``, ``fd_identity``, ``os_error``).

A file_system segment is a named file, mode 0600, in the program directory (the
file_descriptor kind, memfd slabs, is ``slabs``). A storage moves in by writing its
bytes through the new file's descriptor, then swapping its memory for a mapping of
the file: every page is allocated by that write, so a full mount is a
``SharingError`` now rather than a SIGBUS later. Descriptors opened here are closed
here; torch's storages keep their own.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os

import torch

from shmreduce import _torch
from shmreduce._platform import HAVE_PROC_FD
from shmreduce.broker.protocol import DIR_PREFIX, SEG_PREFIX, is_segment_name
from shmreduce.cache import Segment
from shmreduce.errors import SharingError, out_of_shm, too_many_files


class ProgramDirectoryGone(SharingError):
    """The program directory a new file was to go to is gone (its broker died)."""


# File names: a random per-process prefix and a counter (as transfer's message keys),
# unique without a getrandom() call per file; O_EXCL refuses any clash. The prefix is
# drawn again in a forked child.
_name_prefix = os.urandom(6).hex()
_name_count = itertools.count()


def new_name() -> str:
    """A name for a new file, unique in this program."""
    return f"{SEG_PREFIX}{_name_prefix}{next(_name_count) & 0xFFFFFFFFFFFF:012x}"


def _after_fork_in_child() -> None:
    global _name_prefix
    _name_prefix = os.urandom(6).hex()


os.register_at_fork(after_in_child=_after_fork_in_child)


def fd_identity(fd: int) -> tuple[str, int]:
    """The "dev:ino" identity of the file *fd* is open on, and its size."""
    st = os.fstat(fd)
    return f"{st.st_dev}:{st.st_ino}", st.st_size


def os_error(exc: OSError, what: str) -> SharingError:
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return too_many_files(what)
    return SharingError(f"{what} failed: {exc}")


_CHAR = ctypes.c_char


def fill(fd: int, nbytes: int, source: torch.UntypedStorage | None, offset: int = 0) -> None:
    """Write *source*'s bytes into a new segment at *offset*, or reserve *nbytes* of
    zeros there if None.

    Through the descriptor, not through a fresh mapping: the kernel copies into the
    new pages directly, sparing one page fault per page (half the cost of a small
    storage here), and a full memory limit is an error now rather than a SIGBUS.
    """
    if source is None:
        os.posix_fallocate(fd, offset, nbytes)
        return
    data = (_CHAR * nbytes).from_address(source.data_ptr())
    done = os.pwrite(fd, data, offset)
    if done < nbytes:  # a single write stops at 2 GiB
        view = memoryview(data).cast("B")
        while done < nbytes:
            done += os.pwrite(fd, view[done:], offset + done)


def _file(program: str, name: str, nbytes: int, source: torch.UntypedStorage | None) -> tuple[Segment, torch.UntypedStorage]:
    """A new file *name* of *program*, mode 0600, holding *source*'s bytes (or zeros), and its mapping."""
    path = f"{program}/{name}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except FileNotFoundError:
        raise ProgramDirectoryGone(f"program directory {program} is gone (its broker died)") from None
    except OSError as exc:
        raise os_error(exc, f"creating {path}") from exc
    try:
        fill(fd, nbytes, source)
    except OSError as exc:
        os.unlink(path)
        if exc.errno in (errno.ENOSPC, errno.EFBIG):
            raise out_of_shm(program, nbytes, exc.strerror or str(exc)) from exc
        raise os_error(exc, f"filling {path}") from exc
    finally:
        os.close(fd)
    try:
        return Segment("fs", program, name, nbytes), _torch.map_file(path, nbytes)
    except RuntimeError as exc:
        os.unlink(path)
        raise SharingError(f"mapping {path} failed: {exc}") from exc


def move_to_file(storage: torch.UntypedStorage, program: str, name: str) -> Segment:
    """Move *storage* into a new file *name* of *program* in place."""
    segment, shared = _file(program, name, storage.nbytes(), storage)
    _torch.swap_memory(storage, shared)
    return segment


def new_file(nbytes: int, program: str, name: str) -> tuple[Segment, torch.UntypedStorage]:
    """A new zero-filled storage of *nbytes* in a file *name* of *program*, its space reserved."""
    return _file(program, name, nbytes, None)


def adopt_fd(storage: torch.UntypedStorage) -> Segment | None:
    """The segment of a storage torch already put in fd-backed shared memory, if any."""
    try:
        fd = _torch.storage_fd(storage)
    except RuntimeError:
        return None
    if fd < 0:
        return None
    name, _ = fd_identity(fd)
    return Segment("fd", "", f"{name}/0", storage.nbytes())


def refuse_foreign_file(storage: torch.UntypedStorage) -> None:
    """Refuse a storage mapped from a file shmreduce did not make
    (``from_file(shared=True)``): moving it into a segment would silently stop it
    writing to its file. Mappings of shmreduce's own files (made in a program
    directory, or received through /proc/self/fd) pass."""
    filename = storage.filename
    if filename is None or filename.startswith("/proc/self/fd/"):
        return
    if os.path.basename(os.path.dirname(filename)).startswith(DIR_PREFIX):
        return
    raise SharingError(
        f"cannot share a storage mapped from the file {filename!r} (from_file(shared=True)): "
        "sharing moves a storage into shmreduce's shared memory, which would detach it "
        "from its file. Send a copy (tensor.clone()), or map the file in the receiver too"
    )


def map_file(segment: Segment) -> torch.UntypedStorage:
    """Map a file_system segment (its handle's tag already checked: transfer.fs_tag).

    The file is opened here and torch maps it through /proc/self/fd: torch's
    from_file *creates* a missing path, so mapping by name could turn a file unlinked
    a moment ago into fresh zeros; the descriptor pins the file that was checked.
    """
    if not is_segment_name(segment.name):
        raise SharingError(f"refusing segment name {segment.name!r}: not a shmreduce segment (forged message?)")
    path = f"{segment.program}/{segment.name}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SharingError(
            f"shared-memory file {path} is gone: its program exited or the message is stale; send it again"
        ) from None
    except OSError as exc:
        raise os_error(exc, f"opening {path}") from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_size < segment.nbytes:
            raise SharingError(f"shared-memory file {path} does not match its handle (owner or size): forged message?")
        return _torch.map_file(f"/proc/self/fd/{fd}" if HAVE_PROC_FD else path, segment.nbytes)
    except RuntimeError as exc:
        raise SharingError(f"mapping {path} failed: {exc}") from exc
    finally:
        os.close(fd)
