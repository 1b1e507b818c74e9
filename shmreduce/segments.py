"""Descriptor-level helpers for shared segments (``pool`` owns the segments):
file names, creating and opening file_system files, writing bytes through a
descriptor (``fill``), identities, and the errors they raise.

A file_system segment is a named file, mode 0600, in the program directory; a
file_descriptor segment is a memfd. Bytes go in through the descriptor, never a
fresh mapping: every page is allocated by that write, so a full mount is a
``SharingError`` now rather than a SIGBUS later.
"""

from __future__ import annotations

import errno
import itertools
import os

import torch

from shmreduce import _native
from shmreduce.broker.protocol import DIR_PREFIX, SEG_PREFIX, identity, is_segment_name
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


def fd_identity(fd: int) -> tuple[int, int]:
    """The identity (device and inode: ``protocol.identity``) of the file *fd* is
    open on, and its size."""
    st = os.fstat(fd)
    return identity(st), st.st_size


def os_error(exc: OSError, what: str) -> SharingError:
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return too_many_files(what)
    return SharingError(f"{what} failed: {exc}")


def fill(fd: int, nbytes: int, source: torch.UntypedStorage | None, offset: int = 0, mapping: int = 0) -> None:
    """Write *source*'s bytes into a new segment at *offset*, or reserve *nbytes* of
    zeros there if None. *mapping*: where the segment is mapped here (0: nowhere).

    Through the descriptor, not through a fresh mapping: the kernel copies into the
    new pages directly, sparing one page fault per page (half the cost of a small
    storage here), and a full memory limit is an error now rather than a SIGBUS. A
    large write on the several threads this process may use allocates each part's
    pages in one call and copies through *mapping* instead (``_native.write``: writes
    to one file run one at a time).
    """
    if source is None:
        os.posix_fallocate(fd, offset, nbytes)
        return
    _native.write(fd, source.data_ptr(), nbytes, offset, mapping)


def create_file(directory: str, name: str, size: int) -> int:
    """A new file *name* of *directory*, mode 0600, *size* bytes long (no memory
    until written), its first page allocated; its descriptor."""
    path = f"{directory}/{name}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except FileNotFoundError:
        raise ProgramDirectoryGone(f"program directory {directory} is gone (its broker died)") from None
    except OSError as exc:
        raise os_error(exc, f"creating {path}") from exc
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, min(size, _native.HEADER_BYTES))  # the header's page
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        if exc.errno in (errno.ENOSPC, errno.EFBIG):
            raise out_of_shm(directory, size, exc.strerror or str(exc)) from exc
        raise os_error(exc, f"sizing {path}") from exc
    return fd


def open_file(directory: str, name: str) -> int:
    """A descriptor of the existing segment file *name* of *directory* (its handle's
    tag already checked: transfer.fs_tag), checked to be this user's.

    Opened, never created: a file unlinked a moment ago is a SharingError, not
    fresh zeros."""
    if not is_segment_name(name):
        raise SharingError(f"refusing segment name {name!r}: not a shmreduce segment (forged message?)")
    path = f"{directory}/{name}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SharingError(f"shared-memory file {path} is gone: its program exited or the message is stale; send it again") from None
    except OSError as exc:
        raise os_error(exc, f"opening {path}") from exc
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise os_error(exc, f"opening {path}") from exc
    if st.st_uid != os.getuid() or st.st_size <= 0:
        os.close(fd)
        raise SharingError(f"shared-memory file {path} does not match its handle (owner or size): forged message?")
    return fd


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
