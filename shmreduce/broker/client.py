"""The persistent connection from this process to a program's broker.

One ``BrokerClient`` per (process, program directory), created on first use and
reset in forked children (a child opens its own connection; it never writes on the
parent's); every connection is closed at exit. The broker is started lazily by
the first client of a process of that program that shares and finds none; a
receiver only ever connects. Every socket operation has a timeout: a dead or stuck
broker is a ``SharingError`` within seconds, never a hang. Lost connections,
protocol errors and broker restarts are logged to ``logging.getLogger("shmreduce")``.
Wire format: ``protocol.py``.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import mmap
import multiprocessing
import multiprocessing.util
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from shmreduce import _faults, forking
from shmreduce.broker import protocol as P
from shmreduce.errors import SharingError, broker_gone, deposit_lost, stale_message, too_many_files

IO_TIMEOUT = float(os.environ.get("SHMREDUCE_IO_TIMEOUT", "10"))
START_TIMEOUT = 30.0
# The post connection was closed by the broker (it died or exited), whatever is still
# buffered to read on it.
_HANGUP = select.POLLHUP | select.POLLRDHUP | select.POLLERR
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

log = logging.getLogger("shmreduce")

# Called with (client) after every (re)connection; the storage cache uses it to hold
# again the segment names this process still maps.
on_connect: list[Callable[[BrokerClient], None]] = []
on_close: list[Callable[[BrokerClient], None]] = []  # before a client's connections close


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))


def _kernel_timeouts(sock: socket.socket) -> None:
    # Blocking socket with SO_RCVTIMEO/SO_SNDTIMEO, set once: the kernel bounds every
    # call (it fails with EAGAIN), and CPython skips the poll() it runs before each
    # call on a socket with a Python-level timeout (~40 us per record, measured by
    # make bench).
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(IO_TIMEOUT))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(IO_TIMEOUT))


def _authkey() -> bytes:
    return bytes(multiprocessing.current_process().authkey)


# The descriptors of the launches in progress in this process. A child forked during
# a launch closes them at once (after_in_child): it must neither hold the launcher's
# status socket nor reply on ours; the launch itself never waits for an end of file,
# so a child that forked before the hook ran changes nothing either.
# Registered and let go of under _launch_lock, which a fork waits for (a few
# system calls at most): no descriptor of a launch is ever unregistered in a child.
#
# Lock order: _launch_lock is the innermost lock of this module (taken under a
# client's lock, never the other way), and a fork's before-hook takes it. A fork
# can come from the very thread inside the section: a collection set off by an
# allocation there (``socket.socketpair``) runs gc callbacks and finalizers, which may
# fork (taking the lock, it would wait for ever for its own thread to let go of it). So
# the section records its thread (``_launch_owner``), and a fork from that thread
# takes nothing: what the lock keeps whole is only ever changed by this thread, which
# is stopped in the fork, so the child sees it as it was before or after one whole
# step. The child then closes every launch socket registered by then; one made in
# that very step and not registered yet stays open in it, which costs nothing (no
# step of a launch waits for an end of file, and every one is close-on-exec).
_launch_socks: set[socket.socket] = set()
_launch_lock = threading.Lock()
_launch_owner = 0  # the thread (threading.get_ident) inside a section under _launch_lock, else 0
_fork_hold = threading.local()  # .taken: this thread's pending fork took _launch_lock


@contextmanager
def _launch_section() -> Iterator[None]:
    """Hold _launch_lock, recording this thread as its holder (see above)."""
    global _launch_owner
    with _launch_lock:
        _launch_owner = threading.get_ident()
        try:
            yield
        finally:
            _launch_owner = 0


def start_broker(directory: str, root_pid: int) -> None:
    """Run the launcher; return once a broker listens on *directory*.

    No pipe, no end of file awaited, every wait bounded by START_TIMEOUT (see
    Launch handshake in ``server.py``). Not ``subprocess.run`` with the authkey on
    the launcher's stdin: a child forked meanwhile (a DataLoader worker, a Pool; the
    feeder thread makes the first share while the main thread forks) would keep the
    pipe's write end open, so the launcher would wait for an end of the authkey that
    never comes, or ``Popen`` for ever on its error pipe, holding the client's lock.
    """
    deadline = time.monotonic() + START_TIMEOUT
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
    with _launch_section():
        ours, pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Its end for the launcher, away from 0-3, whatever this process has open there.
        theirs = socket.socket(fileno=fcntl.fcntl(pair.fileno(), fcntl.F_DUPFD_CLOEXEC, 10))
        pair.close()
        _launch_socks.update((ours, theirs))
    pid = 0
    try:
        ours.send(_authkey())  # one record, waiting in the socket for the launcher
        try:
            # The launcher's stdout is our stderr: the broker logs there (see Failures in
            # protocol.py). posix_spawn runs no Python in a child and opens no pipe.
            os.fstat(2)
            out: tuple = (os.POSIX_SPAWN_DUP2, 2, 1)
        except OSError:
            out = (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)
        actions = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            out,
            (os.POSIX_SPAWN_DUP2, 1, 2),
            (os.POSIX_SPAWN_DUP2, theirs.fileno(), P.STATUS_FD),
        ]
        # -S: no site hooks (sitecustomize, .pth files), which may register() and so
        # import torch: the broker runs the stdlib and this package only (PYTHONPATH).
        argv = [sys.executable, "-S", "-m", "shmreduce.broker.server", directory, str(root_pid)]
        pid = os.posix_spawn(sys.executable, argv, env, file_actions=actions)
        _let_go_of_launch_socket(theirs)
        _faults.pause("broker.launch")
        answer = _launch_answer(ours, pid, deadline)
    except OSError as exc:
        raise SharingError(f"could not start the shmreduce broker: {exc}") from exc
    finally:
        for sock in (ours, theirs):
            _let_go_of_launch_socket(sock)
        if pid:
            _reap(pid, deadline)
    if answer != b"ok":
        why = answer.decode(errors="replace").removeprefix("error: ") if answer else "it exited without an answer"
        raise SharingError(f"could not start the shmreduce broker in {directory}: {why}")


def _let_go_of_launch_socket(sock: socket.socket) -> None:
    with _launch_section():
        _launch_socks.discard(sock)
        sock.close()


def _launch_answer(sock: socket.socket, pid: int, deadline: float) -> bytes | None:
    """The launcher's one record: its answer, or None if it exited without one. Never
    waits for an end of file (a forked child may hold the launcher's end): the
    launcher's exit is looked at between short waits."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the launcher gave no answer within {START_TIMEOUT:.0f} s")
        sock.settimeout(min(0.05, remaining))
        try:
            answer = sock.recv(P.MAX_RECORD)
            if answer:
                return answer
        except TimeoutError:
            pass
        try:
            exited = os.waitpid(pid, os.WNOHANG)[0] == pid
        except ChildProcessError:
            exited = True  # reaped by someone else's SIGCHLD handler
        if exited:
            sock.setblocking(False)
            try:
                return sock.recv(P.MAX_RECORD) or None  # what it sent before it exited
            except BlockingIOError:
                return None


def _reap(pid: int, deadline: float) -> None:
    """Wait for the launcher to exit (it does at once after its answer), boundedly:
    past *deadline* it is killed."""
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            return
        time.sleep(0.002)


class BrokerClient:
    """This process's connections to one broker; reconnects (and restarts it) on demand.

    Two connections, one identity: *post* carries the fire-and-forget records
    (drop, hold, release, this process's ledger), a few per segment, never one per
    message; *request* carries deposit (segment), fetch and ping, which the broker
    answers at once.

    *root_pid* is the root of the program that owns the directory, known only to the
    processes of that program (see ``client_for``): only then may a sending
    operation start the broker, which records it. Receiving operations (fetch, a
    hold's connection, releases) only connect: no broker there is a SharingError.
    """

    def __init__(self, directory: str, root_pid: int | None, ledger: Ledger | None = None) -> None:
        self.directory = directory
        self.ledger = ledger  # the ledger it posts (tests: one each); None: this process's for its directory
        self.root_pid = root_pid
        self.lock = threading.RLock()
        self.sock: socket.socket | None = None  # request connection
        self.post: socket.socket | None = None  # post connection
        self.token = os.urandom(P.TOKEN_LEN)
        self.broker_pid = 0
        self.round_trips = 0
        self.retired = False  # closed for good (see retire)

    # -- connection ------------------------------------------------------------

    def _open(self, role: bytes, start: bool) -> socket.socket:
        """A new connection of *role*; with *start*, start the broker if none listens
        (only if this client knows its program's root)."""
        if self.retired:
            raise broker_gone("this process closed its connections to it (close_all)")
        path = os.path.join(self.directory, P.SOCKET_NAME)
        if len(path.encode()) >= 108:
            raise SharingError(f"socket path too long for AF_UNIX: {path}; set SHMREDUCE_SHM_DIR to a shorter directory")
        last: Exception | None = None
        deadline = time.monotonic() + START_TIMEOUT
        for attempt in range(100):
            if attempt >= 2:
                # A broker that is exiting still holds the directory's lock, so the
                # launcher leaves it be: wait for it to go, briefly.
                if time.monotonic() > deadline:
                    break
                time.sleep(min(0.2, 0.005 * 2**attempt))
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    raise too_many_files("opening a connection to the broker") from exc
                raise broker_gone(str(exc)) from exc
            _kernel_timeouts(sock)
            try:
                sock.connect(path)
                pid = P.client_handshake(sock, _authkey(), role, self.token)
            except (FileNotFoundError, ConnectionRefusedError, P.ProtocolError, ConnectionResetError) as exc:
                sock.close()
                # Without its traceback: kept past the except block, the traceback's
                # frames (up to the caller's pickler, memo and tensors) would form a
                # cycle with this frame and wait for the cyclic GC to be freed.
                last = exc.with_traceback(None)
                if (isinstance(exc, P.ProtocolError) and attempt) or not start or self.root_pid is None:
                    break
                start_broker(self.directory, self.root_pid)
                continue
            except OSError as exc:
                sock.close()
                raise broker_gone(str(exc)) from exc
            if self.broker_pid and pid != self.broker_pid:
                log.warning(
                    "the shmreduce broker of %s restarted (pid %d, now %d): messages deposited with the old one are lost",
                    self.directory,
                    self.broker_pid,
                    pid,
                )
            self.broker_pid = pid
            return sock
        if isinstance(last, P.ProtocolError):
            raise SharingError(
                f"the shmreduce broker in {self.directory} refused this process ({last}); "
                "only processes of the same program (same multiprocessing authkey) and user may connect"
            )
        raise broker_gone(str(last))

    def _socket(self, start: bool) -> socket.socket:
        if self.sock is None:
            self.sock = self._open(P.ROLE_REQUEST, start)
        return self.sock

    def _post_socket(self, start: bool) -> socket.socket:
        if self.post is None:
            post = self._open(P.ROLE_POST, start)
            try:
                # What this process holds as a receiver, read by the broker once it is gone.
                if self.ledger is not None:
                    if not self.ledger.post(post):
                        raise OSError(errno.EBADF, "this client's ledger is closed")
                else:
                    while not _ledger_for(self.directory).post(post):
                        pass  # closed meanwhile, as its directory let go of its last hold
            except OSError as exc:
                post.close()
                raise self._broken(exc) from exc
            self.post = post
            for hook in on_connect:
                hook(self)
        return self.post

    def connect(self) -> None:
        """Make sure the broker behind the post connection lives, e.g. before its
        directory is used: connect if not connected (starting the broker if none
        runs); if the broker closed the connection (killed, or exited), connect afresh,
        which starts a new one. One non-blocking poll when connected. Under the lock:
        threads making their first share at once connect once, never closing each
        other's fresh connection.

        The poll asks for the hang-up itself, not for something to read: a peek that
        took buffered data for a sign of life let a sender pack the next message into
        files the dead broker's janitor was removing."""
        with self.lock:
            if self.post is not None and not self._post_hung_up():
                return  # no hang-up: the broker is there
            self._post_socket(start=True)

    def _post_hung_up(self) -> bool:
        """Whether the broker closed its end of the post connection (then closed here:
        the next post connects afresh). It died (a sender's new connection starts a
        new one), or it dropped this connection alone (the new one joins
        this process's identity there, its ledger posted again)."""
        post = self.post
        if post is None:
            return False
        poller = select.poll()
        poller.register(post, _HANGUP)
        if not poller.poll(0):
            return False
        self._close_post()
        return True

    def close(self, keep: bool = False) -> None:
        """Close both connections. *keep*: this process lives on, and counts itself out
        of the generations it holds when their storages die (the broker, told so first,
        does not count it out at the close; a broker that does not hear it is dead, and
        counts nobody out); the next connections are a new identity.

        Without a K posted the identity stays: the broker counts a process out once it
        is dead, and a live one's next connections join what it holds there
        (a new identity would post the same ledger twice: counted out twice at death)."""
        with self.lock:
            kept = False
            if keep and self.post is not None:
                try:
                    P.send_record(self.post, P.KEEP, P.NO_KEY)
                    kept = True
                except OSError as exc:
                    # Not posted within IO_TIMEOUT (the broker stopped, its buffer full;
                    # or gone). The broker keeps this identity while the process lives,
                    # and lets go of its ledger when the next identity posts it: a process
                    # is never counted out twice, or early.
                    log.debug("could not tell the shmreduce broker of %s that this process lives on: %s", self.directory, exc)
            self._close_post()
            self._close_request()
            if kept:
                self.token = os.urandom(P.TOKEN_LEN)  # a new identity for the next connections

    def _close_post(self, detach: bool = False) -> None:
        if self.post is not None:
            for hook in on_close:
                hook(self)
            if detach:
                self.post.detach()  # the descriptor stays open until the process ends
            else:
                self.post.close()
            self.post = None

    def _close_request(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def retire(self, exiting: bool = False) -> None:
        """Close for good: this client is no longer this process's client of its
        directory (``close_all``), so it never connects again; a send through it is a
        SharingError (which a release lets pass).

        A client outlives its place in ``_clients`` wherever it was kept (a thread may
        have taken it just before ``close_all``). Reconnected, such a client held a
        connection nothing would close: the broker saw a live client and never
        exited. *exiting*: at interpreter exit, the
        broker counts this process out of what it holds (else it keeps them)."""
        with self.lock:
            self.retired = True
            if not exiting:
                self.close(keep=True)
                return
            # At interpreter exit the connections are left to the kernel, which closes
            # them as the process ends: the broker counts a process out once it is dead,
            # and a close seen long before that (the interpreter's teardown)
            # left it with no client and nothing draining yet: it exited under the
            # messages this process had just sent.
            self._close_post(detach=True)
            if self.sock is not None:
                self.sock.detach()
                self.sock = None

    def connected(self) -> bool:
        return self.sock is not None or self.post is not None

    def sockets(self) -> list[socket.socket]:
        return [s for s in (self.sock, self.post) if s is not None]

    def _broken(self, exc: BaseException) -> SharingError:
        log.warning("lost the connection to the shmreduce broker of %s: %s: %s", self.directory, type(exc).__name__, exc)
        self.close(keep=True)
        return broker_gone(f"{type(exc).__name__}: {exc}")

    # -- fire-and-forget -------------------------------------------------------

    def _send(self, op: bytes, key: bytes, body: bytes, fds: list[int] | tuple = (), start: bool = False) -> None:
        """Post one record; *start*: as a sender (see the class). A post connection the
        broker closed since the last record is replaced, once: the broker died (a
        fresh one serves the retry; a receiver's finds none: SharingError), or it
        dropped that connection alone and lives (the new one joins this process's
        identity there, its ledger posted again)."""
        with self.lock:
            for attempt in (0, 1):
                sock = self._post_socket(start)
                try:
                    P.send_record(sock, op, key, body, fds)
                    return
                except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError) as exc:
                    log.debug("the post connection to the shmreduce broker of %s was closed: %s", self.directory, exc)
                    self._close_post()
                    if attempt:
                        raise broker_gone(str(exc)) from exc
                except OSError as exc:
                    raise self._broken(exc) from exc

    def segment(self, fd: int, header: str, forward: bool = False) -> None:
        """This process sends refs to the memfd *fd* (*header*: where its header lies,
        "lead" for a pooled segment, "trail" past a storage torch moved for shmreduce,
        "" for none; *forward*: one it received and sends on, not one it made): the broker keeps
        its descriptor, by inode, for the receivers to fetch, while its maker uses it
        and then while anything can reach it (protocol.py, "Lifetimes")."""
        self.deposit([(fd, header, forward)])

    def deposit(self, memfds: list[tuple[int, str, bool]]) -> None:
        """``segment`` for each (fd, header, forward) of *memfds*, in one record (up to
        P.MAX_FDS a record): a receiver that fetches one of them gets those after it
        with it (the storages torch moved for one message, which its receiver loads
        together).

        A round trip, once per segment this process sends from: a deposit the broker
        could not keep (at its descriptor limit, the kernel dropped the descriptor) is
        a SharingError here, before any ref to it is sent, not a message whose
        receiver finds it stale."""
        with self.lock:
            self._post_socket(start=True)  # this identity's ledger at the broker first, as for any record
            for i in range(0, len(memfds), P.MAX_FDS):
                batch = memfds[i : i + P.MAX_FDS]
                kinds = b"".join(P.SEG_KINDS[header, forward] for _fd, header, forward in batch)
                _op, body, fds = self._round_trip(P.SEGMENT, kinds, P.DEPOSITED, start=True, fds=[fd for fd, _h, _f in batch])
                for extra in fds:
                    os.close(extra)
                if body == bytes([P.STATUS_LOST]):
                    raise deposit_lost()
                if body != bytes([P.STATUS_OK]):
                    raise self._broken(P.ProtocolError(f"bad deposit reply {body[:16]!r}"))

    def segment_file(self, fd: int, name: str) -> None:
        """This process holds the file *name* it made, which went with a broker that
        died (its directory removed): the new broker gets its descriptor *fd* (still
        the caller's), to read its header when a process that holds its generation
        dies. Let go of as a hold (``release``)."""
        with self.lock:
            self._post_socket(start=True)
            _op, body, fds = self._round_trip(P.SEGMENT, P.SEG_FILE + P.encode_names([name]), P.DEPOSITED, start=True, fds=[fd])
            for extra in fds:
                os.close(extra)
            if body != bytes([P.STATUS_OK]):
                raise self._broken(P.ProtocolError(f"bad deposit reply {body[:16]!r}"))

    def drop(self, inos: list[int]) -> None:
        """This process no longer sends refs to these memfds (closed: out of its pool)."""
        for i in range(0, len(inos), P.INOS_PER_RECORD):
            self._send(P.DROP, P.NO_KEY, P.encode_inos(inos[i : i + P.INOS_PER_RECORD]))

    def hold(self, names: Iterable[str]) -> None:
        """Hold segment files (this process made them): unlinked once nobody holds them
        and nothing sent in them is in flight."""
        self._send_names(P.HOLD, list(names), start=True)

    def release(self, names: Iterable[str]) -> None:
        self._send_names(P.RELEASE, list(names), start=False)

    def _send_names(self, op: bytes, names: list[str], start: bool) -> None:
        for i in range(0, len(names), P.NAMES_PER_RECORD):
            self._send(op, P.NO_KEY, P.encode_names(names[i : i + P.NAMES_PER_RECORD]), start=start)

    # -- round trips -----------------------------------------------------------

    def fetch(self, ino: int) -> int | None:
        """The descriptor of the memfd *ino* deposited at the broker (the caller owns
        it), or None if the broker keeps no such segment (any more)."""
        found = self._fetch(ino, 1)
        return found[0][1] if found else None

    def fetch_with_batch(self, ino: int) -> list[tuple[int, int]]:
        """(inode, descriptor) of the memfd *ino*, then of those deposited after it with
        it (``deposit``) that the broker keeps, up to P.FETCHED_FDS in one round trip;
        empty if it keeps no such segment (any more). The caller owns the descriptors.
        A process too near its descriptor limit to take them all at once takes the one
        it needs alone."""
        try:
            return self._fetch(ino, P.FETCHED_FDS)
        except SharingError as exc:
            if not isinstance(exc.__cause__, P.DescriptorsDropped):
                raise
        return self._fetch(ino, 1)

    def _fetch(self, ino: int, most: int) -> list[tuple[int, int]]:
        with self.lock:
            _op, body, fds = self._round_trip(P.FETCH, P.encode_inos([ino, most]), P.FETCHED, start=False)
            try:
                status, total, others = P.decode_fetched(body)
                if status != P.STATUS_OK:
                    return []
                if total != len(fds) or total > most:
                    raise P.ProtocolError(f"a fetch reply of {total} descriptors with {len(fds)}, of {most} at most")
                found, fds = list(zip([ino, *others], fds, strict=True)), []
                return found
            except P.ProtocolError as exc:
                raise self._broken(exc) from exc
            finally:
                for fd in fds:
                    os.close(fd)

    def ping(self, full: bool = False) -> dict:
        """The broker's counters; also a barrier for this connection's earlier sends.
        *full*: with those that cost the broker a read of every ledger and of its own
        ``/proc/self`` (``generations_held``, ``descriptors``: a diagnostic)."""
        with self.lock:
            _op, body, fds = self._round_trip(P.PING, P.PING_FULL if full else b"", P.PONG, start=True)
            for fd in fds:
                os.close(fd)
            return json.loads(body)

    def _round_trip(self, op: bytes, body: bytes, reply: bytes, start: bool, fds: list[int] | tuple = ()) -> tuple[bytes, bytes, list[int]]:
        """Send a request (with *fds* attached, still the caller's), return its reply
        (op, body, descriptors: the caller's).

        A request connection the broker closed (a send refused, or no reply but the
        end of the stream) is replaced once, and the request asked again: the broker
        died (its successor may know what was asked; *start*: start one), or it
        dropped that connection alone and lives. Each receive is bounded by
        IO_TIMEOUT: a broker that does not answer is a SharingError."""
        retried = False
        while True:
            sock = self._socket(start)
            try:
                try:
                    P.send_record(sock, op, P.NO_KEY, body, fds)
                    self.round_trips += 1
                    record = P.recv_record(sock)
                except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError) as exc:
                    record, closed = None, exc
                else:
                    closed = ConnectionResetError("broker closed the connection")
                if record is None:
                    log.debug("the request connection to the shmreduce broker of %s was closed: %s", self.directory, closed)
                    self._close_request()
                    self._post_hung_up()  # the broker died: its successor must get this process's ledger
                    if retried:
                        raise broker_gone(f"{type(closed).__name__}: {closed}")
                    retried = True
                    continue
                if record[0] != reply:
                    for fd in record[3]:
                        os.close(fd)
                    raise P.ProtocolError(f"unexpected reply {record[0]!r}")
                return record[0], record[2], record[3]
            except P.DescriptorsDropped as exc:
                # The reply came whole (a SEQPACKET record) without the descriptors the
                # kernel could not install here: the connection goes on.
                raise too_many_files("receiving a segment") from exc
            except OSError as exc:
                raise self._broken(exc) from exc
            except P.ProtocolError as exc:
                raise self._broken(exc) from exc


# -- one client per program directory, per process ---------------------------------

_clients: dict[str, BrokerClient] = {}
_clients_lock = threading.Lock()


def client_for(directory: str, root_pid: int | None = None) -> BrokerClient:
    """This process's client of the broker of *directory*.

    *root_pid*: the root of the program that owns *directory*, given only by a
    process of that program about to share into it (then its client may start
    the broker). Receivers, and senders re-sending another program's files, give
    none: they only connect.
    """
    client = _clients.get(directory)
    if client is None:
        with _clients_lock:
            client = _clients.get(directory)
            if client is None:
                if not _clients:
                    atexit.register(_close_all_at_exit)  # no "unclosed socket" at exit
                client = _clients[directory] = BrokerClient(directory, root_pid)
    if client.root_pid is None and root_pid is not None:
        client.root_pid = root_pid
    return client


def connected_client(directory: str) -> BrokerClient | None:
    """This process's client of the broker of *directory*, if it is connected."""
    client = _clients.get(directory)
    return client if client is not None and client.connected() else None


def existing_clients() -> list[BrokerClient]:
    return list(_clients.values())


# Below the priority of a queue's feeder join (-5), which multiprocessing's exit runs
# first, highest first.
_AFTER_FEEDERS = -100


def close_all(exiting: bool = False) -> None:
    """Close every connection of this process (the clients are dropped). Unless
    *exiting*, this process keeps what it holds (see ``BrokerClient.close``)."""
    atexit.unregister(_close_all_at_exit)
    for client in list(_clients.values()):
        client.retire(exiting)
    _clients.clear()
    with _ledgers_lock:
        for directory, ledger in list(_ledgers.items()):
            if not exiting and ledger.close(unless_held=True):
                del _ledgers[directory]  # it held nothing: the next connection posts a new one


def _close_all_at_exit() -> None:
    global exiting
    if not multiprocessing.util.is_exiting():
        # Registered at the first client, after multiprocessing's exit function (at
        # this module's import of multiprocessing.util), this runs before it; but
        # that function joins the queues' feeder threads, still pickling what was put
        # (a loaded machine runs them late), through these connections: close after
        # them, as its last finalizer. Were they closed first, each such message
        # failed, and the failure was written on stderr.
        multiprocessing.util.Finalize(None, _close_all_at_exit, exitpriority=_AFTER_FEEDERS)
        return
    exiting = True
    for ledger in list(_ledgers.values()):
        ledger.freeze()  # what it holds now, its brokers count out
    close_all(exiting=True)


# -- the ledger ----------------------------------------------------------------------


class Ledger:
    """The generations this process holds as a receiver in one program, in a memfd
    that program's broker keeps and reads once this process is gone (protocol.py,
    "Ledger"): holding one is an entry written, letting go one cleared, with no
    record. Grows by doubling (the broker reads the memfd's size then)."""

    def __init__(self, directory: str = "") -> None:
        self.directory = directory
        self.fd = os.memfd_create("shmreduce-ledger", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        # Never shrunk (it grows by doubling): written through a mapping here, it
        # would be a SIGBUS for this process if another one of the user cut it.
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        self.size = 0
        self.map: mmap.mmap | None = None
        self.free: list[int] = []  # entries let go of, reused first
        self.used = 0  # entries ever handed out
        self.frozen = False  # at exit: its brokers count out what it holds
        self.closed = False
        self.lock = threading.Lock()

    def hold(self, key: int | str, gen: int) -> int:
        """Write a TAKING entry for generation *gen* of segment *key*: its index; -1 if
        this ledger was closed meanwhile (``close_all``: take the next one)."""
        with self.lock:
            if self.closed:
                return -1
            if self.free:
                index = self.free.pop()
            else:
                index, self.used = self.used, self.used + 1
                if self.used * P.LEDGER_ENTRY.size > self.size:
                    size = max(P.LEDGER_MIN, 2 * self.size)
                    os.ftruncate(self.fd, size)
                    self.map, self.size = mmap.mmap(self.fd, size), size
            assert self.map is not None
            at = index * P.LEDGER_ENTRY.size
            P.LEDGER_ENTRY.pack_into(self.map, at, *P.ledger_entry(key, gen, P.FREE))
            P.LEDGER_STATE.pack_into(self.map, at + P.LEDGER_STATE_AT, P.TAKING)
            return index

    def mark(self, index: int, state: int) -> bool:
        """Set entry *index*'s state alone (one aligned store); False once frozen
        (the brokers count it out: the caller must not count itself out too)."""
        with self.lock:
            if self.frozen:
                return False
            assert self.map is not None
            P.LEDGER_STATE.pack_into(self.map, index * P.LEDGER_ENTRY.size + P.LEDGER_STATE_AT, state)
            if state == P.FREE:
                self.free.append(index)
            return True

    def post(self, sock: socket.socket) -> bool:
        """Post it on the new connection *sock*; False if it was closed meanwhile."""
        with self.lock:
            if self.closed:
                return False
            P.send_record(sock, P.LEDGER, P.NO_KEY, b"", [self.fd])
            return True

    def empty(self) -> bool:
        return len(self.free) == self.used

    def freeze(self) -> None:
        with self.lock:
            self.frozen = True

    def close(self, unless_held: bool = False) -> bool:
        """Close it (*unless_held*: only if it holds nothing); whether it did."""
        with self.lock:
            if unless_held and not self.empty():
                return False
            if not self.closed:
                self.closed = True
                os.close(self.fd)
                if self.map is not None:
                    self.map.close()
            return True


# One ledger per program directory (its broker reads only the holds taken through
# it): it outlives the clients of its directory while it holds anything, so that a
# client made after ``close_all`` (``register()`` again) posts what is still held.
_ledgers: dict[str, Ledger] = {}
_ledgers_lock = threading.Lock()


def _ledger_for(directory: str) -> Ledger:
    ledger = _ledgers.get(directory)
    if ledger is None:
        with _ledgers_lock:
            ledger = _ledgers.get(directory)
            if ledger is None:
                ledger = _ledgers[directory] = Ledger(directory)
    return ledger


def hold(directory: str, key: int | str, gen: int) -> tuple[Ledger, int]:
    """This process is about to hold generation *gen* of segment *key* of the program
    of *directory*: its ledger entry, TAKING (``held`` once the header counted it),
    which that broker reads if this process dies. Connects to that broker (never
    starts it) if not yet: a broker that does not know this process's ledger would
    count nobody out. Without a broker, nobody could: the entry is written all the
    same."""
    ledger = _ledger_for(directory)
    while (index := ledger.hold(key, gen)) < 0:
        ledger = _ledger_for(directory)  # that one was closed meanwhile: the next one
    client = client_for(directory)
    try:
        with client.lock:
            client._post_hung_up()  # the broker that knew our ledger died, or dropped the connection
            client._post_socket(start=False)
    except SharingError:
        pass
    return ledger, index


def held(entry: tuple[Ledger, int]) -> None:
    """The header counted the hold of *entry*."""
    ledger, index = entry
    ledger.mark(index, P.HELD)


def dropping(entry: tuple[Ledger, int]) -> bool:
    """About to count this process out of *entry*'s header; False at exit, once
    frozen: the brokers count it out then."""
    ledger, index = entry
    return ledger.mark(index, P.DROPPING)


def let_go(entry: tuple[Ledger, int]) -> bool:
    """Clear a ledger *entry* once the header counted this process out (or never
    counted it in: a stale load's); False at exit, once frozen. A ledger left empty
    with no client of its directory (after ``close_all``) is closed."""
    ledger, index = entry
    if not ledger.mark(index, P.FREE):
        return False
    if ledger.empty() and ledger.directory not in _clients:
        with _ledgers_lock:
            if _ledgers.get(ledger.directory) is ledger and ledger.directory not in _clients and ledger.close(unless_held=True):
                del _ledgers[ledger.directory]
    return True


# Set at interpreter exit, once every connection closed without a keep: the brokers
# count this process out of what it holds, and it must not count itself out too.
exiting = False


def _after_fork_in_child() -> None:
    # The inherited sockets are the parent's connections: never write on them.
    global _clients_lock, _launch_lock, _launch_owner, _ledgers_lock
    for ledger in _ledgers.values():
        os.close(ledger.fd)  # the parent's: the child writes its own (its tokens' holds)
    _ledgers.clear()
    _ledgers_lock = threading.Lock()
    for client in _clients.values():
        client.retired = True  # the parent's (its lock may be held by a parent's thread)
        _close_inherited(client.sockets())
    _clients.clear()
    _clients_lock = threading.Lock()
    # A launch in progress in the parent is the parent's: its descriptors go.
    _close_inherited(list(_launch_socks))
    _launch_socks.clear()
    _launch_lock = threading.Lock()
    _launch_owner = 0
    _fork_hold.taken = False


def _close_inherited(socks: list[socket.socket]) -> None:
    """Close a fork child's copies of the parent's sockets, detached first: a socket
    object still referenced elsewhere then never closes a descriptor number this
    process has reused since."""
    for sock in socks:
        try:
            os.close(sock.detach())
        except OSError:
            pass


def _before_fork() -> None:
    # A fork from inside a launch section, on its own thread (a gc callback, a
    # finalizer), takes nothing: it would wait for itself (see _launch_lock).
    taken = _launch_owner != threading.get_ident()
    if taken:
        _launch_lock.acquire()
    _fork_hold.taken = taken


def _after_fork_in_parent() -> None:
    if getattr(_fork_hold, "taken", False):
        _fork_hold.taken = False
        _launch_lock.release()


forking.part("broker.client", before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)

__all__ = [
    "BrokerClient",
    "client_for",
    "close_all",
    "connected_client",
    "existing_clients",
    "on_close",
    "on_connect",
    "start_broker",
    "stale_message",
]
