"""The program directory: made, locked, removed, and swept when its broker is dead.

stdlib only. A program's directory (``protocol.is_program_dir``) holds its broker's
socket, its lock file, its marker and its segment files. The lock, not the path,
decides who removes a directory: only a process holding the flock of the lock file
at the directory's path (``remove_program_dir``), which is the launcher's, then its
server's and janitor's (``server.py``), or a sweep's (``sweep_stale``). A lock is the
directory's only while its file is the one at the directory's path
(``lock_program_dir``, ``lock_if_free``). So one broker at most serves a program
directory, however launchers, sweeps and a dying janitor interleave.

Used by the broker's launcher, janitor and server (``server.py``), by every
``register()`` (``registry``: the sweep of what dead programs left) and by
``python -m shmreduce doctor``/``cleanup`` (``doctor``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import stat
import time

from shmreduce.broker import protocol as P

STALE_MIN_AGE = 10.0  # seconds; a younger directory may be a broker still starting


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_program_dir(directory: str, lock_fd: int) -> bool:
    """Remove a program directory (segment files, socket, lock, the directory) whose
    lock the caller holds: *lock_fd*, flock'ed. Whether it did.

    The lock, not the path, decides who removes a directory:
    only if the lock file at the directory's path is the very file *lock_fd* is open
    on. Else the directory there is another broker's: ours was removed already (by
    its server, before its janitor came to it; by a sweep) and made anew since. While
    we hold that lock nobody else can take the directory, and nobody makes a new one
    at its path: checked, then renamed away at once. Renamed away first, atomically,
    so that a broker starting meanwhile for the same program makes a fresh directory
    and never loses files to this removal.
    """
    if not _is_lock_of(directory, lock_fd):
        return False
    tomb = f"{directory}.gone-{os.getpid()}"
    try:
        os.rename(directory, tomb)
    except OSError:
        return False  # gone already
    shutil.rmtree(tomb, ignore_errors=True)
    return True


def _is_lock_of(directory: str, lock_fd: int) -> bool:
    """Whether *lock_fd* is open on the lock file at *directory*'s path."""
    try:
        held = os.fstat(lock_fd)
        here = os.stat(os.path.join(directory, P.LOCK_NAME), follow_symlinks=False)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def lock_if_free(directory: str) -> int | None:
    """*directory*'s lock, taken, if no live broker holds it and it is still the
    directory's: its descriptor (the caller closes it, which lets go); else None.

    A directory without a lock file (a launcher between making it and locking it, or
    one killed there) gets one: held here, the launcher's flock fails and its client
    tries again."""
    try:
        fd = os.open(os.path.join(directory, P.LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    if not _is_lock_of(directory, fd):
        os.close(fd)  # removed (and maybe made anew) between our open and our flock
        return None
    return fd


def lock_is_free(directory: str) -> bool:
    """True if no live broker holds this program directory's lock."""
    try:
        fd = os.open(os.path.join(directory, P.LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def stale_dirs(base: str) -> list[str]:
    """This user's program directories under *base* whose broker is dead (when
    looked at: ``sweep_stale`` looks again under the lock).

    Only directories shmreduce made (``protocol.is_program_dir``), at least
    STALE_MIN_AGE old (a younger one may be a launcher's between its making and its
    flock), whose lock no live broker holds.
    """
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return []
    return [
        os.path.join(base, entry)
        for entry in entries
        if _old_program_dir(base, os.path.join(base, entry)) and lock_is_free(os.path.join(base, entry))
    ]


def _old_program_dir(base: str, path: str) -> bool:
    if not P.is_program_dir(path, base):
        return False
    try:
        return time.time() - os.lstat(path).st_mtime >= STALE_MIN_AGE
    except OSError:
        return False


def sweep_stale(base: str, keep: str | None = None) -> list[str]:
    """Remove the ``stale_dirs`` of *base* (but *keep*); return those removed.

    Each is removed holding its lock, looked at again under it: a directory found
    stale may have been removed and made anew by a fresh broker before the removal
    (a sweep that checked the lock, let go of it and removed by path later would
    delete a fresh broker's directory, and a second broker would start)."""
    removed = []
    for path in stale_dirs(base):
        if path == keep:
            continue
        lock_fd = lock_if_free(path)
        if lock_fd is None:
            continue
        try:
            if _old_program_dir(base, path) and remove_program_dir(path, lock_fd):
                removed.append(path)
        finally:
            os.close(lock_fd)
    for path in _leftovers(base):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


_LEFTOVER = re.compile(re.escape(P.DIR_PREFIX) + r"[0-9a-f]+\.(?:gone|new)-([0-9]+)")


def _leftovers(base: str) -> list[str]:
    """What a process killed inside ``remove_program_dir`` (a ``.gone-<pid>`` being
    removed) or ``make_program_dir`` (a ``.new-<pid>`` being made) left: this user's
    private directories of those names whose process is dead, STALE_MIN_AGE old."""
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return []
    found = []
    for entry in entries:
        match = _LEFTOVER.fullmatch(entry)
        if match is None or pid_alive(int(match.group(1))):
            continue
        path = os.path.join(base, entry)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077 and time.time() - st.st_mtime >= STALE_MIN_AGE:
            found.append(path)
    return found


def make_program_dir(directory: str) -> None:
    """Make *directory* with its marker unless it exists; refuse one shmreduce did not make.

    Made as a temporary sibling and renamed into place, so that the directory never
    exists without its marker (two launchers may race: the second rename fails).
    """
    if not os.path.lexists(directory):
        made = f"{directory}.new-{os.getpid()}"
        os.mkdir(made, 0o700)
        os.chmod(made, 0o700)  # whatever the umask
        os.close(os.open(os.path.join(made, P.MARKER_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        try:
            os.rename(made, directory)
        except OSError:
            shutil.rmtree(made, ignore_errors=True)  # another launcher's came first
    if not P.is_program_dir(directory):
        raise SystemExit(f"shmreduce broker: {directory} is not a program directory shmreduce made for this user")


def lock_program_dir(directory: str) -> int | None:
    """Take *directory*'s lock, making the directory if need be: the lock's
    descriptor, or None if a live broker holds it.

    A lock taken on a file that is no longer at the lock's path is not the
    directory's: the janitor of a broker that died removed the directory (and then
    let go of its lock) between our open and our flock, and another launcher may
    have made it anew since. Such a launcher would bind in the new directory beside
    its rightful broker, or later have its own janitor remove a directory another
    broker served: two brokers for one program, senders on one, receivers finding
    no socket. Then: make and lock it again.
    """
    path = os.path.join(directory, P.LOCK_NAME)
    for _attempt in range(20):
        make_program_dir(directory)
        try:
            lock_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            continue  # removed since we made sure of it
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(lock_fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None  # a live broker serves this program (or is removing its directory)
            raise
        held = os.fstat(lock_fd)
        try:
            here = os.stat(path)
            if (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino):
                return lock_fd
        except FileNotFoundError:
            pass
        os.close(lock_fd)
    raise SystemExit(f"shmreduce broker: could not lock {directory}: it was removed and made again 20 times over")
