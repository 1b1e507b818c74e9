"""The broker process: holds descriptors and segment names between processes.

stdlib only, never imports torch. Started by ``client.start_broker`` as
``python -m shmreduce.broker.server DIR ROOT_PID`` with its *status socket* on
descriptor 3 (``protocol.STATUS_FD``). The protocol and the lifetimes it guarantees
are documented in ``protocol.py``. Owns the processes (launcher, janitor, server),
the connections (accept, handshake, the spare descriptors, clients and their
pidfds), the op table and the loop; what the broker keeps of the segments is
``keeper.py``'s, the program directory's locking and sweeping ``programdir.py``'s.

Launch handshake. A fork of the starter may happen at any moment of a launch (a
DataLoader worker, a Pool) and its child inherits every descriptor the launch has
open, close-on-exec or not: so no step waits for an end of file, and every wait has
a deadline. The starter sends the authkey as one SOCK_SEQPACKET record on the status
socket; the launcher reads that one record (bounded by START_WAIT) and answers with
one record, ``ok`` once a broker listens on DIR (its own or one that runs already),
or ``error: why``. Nothing else of the launch is a pipe.

Process layout: the launcher takes the program directory's lock (making the
directory if need be: ``programdir.lock_program_dir``), sweeps the stale ones,
binds and listens, then double-forks and exits (so the caller is never left with a
zombie and knows the socket is listening when it returns). The grandchild is the
*janitor*: it forks the *server*, waits for it, and removes the program directory
whatever way the server ended, SIGKILL included, before it lets go of the lock
(``programdir.remove_program_dir``: only while the directory is still the one its
lock is of). The launcher's stdout is the starter's stderr: the server logs there
(or to ``$SHMREDUCE_BROKER_LOG``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import select
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from shmreduce import _native
from shmreduce._platform import make_undumpable, peer_pid, peer_uid, raise_nofile_limit
from shmreduce.broker import protocol as P
from shmreduce.broker.keeper import HELD, Account, Keeper, close_ledger
from shmreduce.broker.programdir import lock_program_dir, pid_alive, remove_program_dir, sweep_stale

GRACE = float(os.environ.get("SHMREDUCE_BROKER_GRACE", "1.0"))
ACCEPT_PAUSE = 1.0  # seconds the broker stops accepting at its descriptor limit
_T = TypeVar("_T")
_Reply = tuple[bytes, bytes, list[int]]  # a record's answer: its op, body and descriptors (kept here)
SPARE_DESCRIPTORS = 8  # kept for connections and pidfds: two processes' worth, at the limit

log = logging.getLogger("shmreduce.broker")


class _Client(Account):
    """One client process, across its connections: what the keeper has of it (the
    segments it deposited, the files it holds, its ledger: ``keeper.Account``).

    Known from its first connection until it is counted out (``Broker._count_out``):
    once its process is dead and its connections are closed and read, or at its last
    close if it said K (or if its death cannot be watched: no pidfd). A live process
    whose connections all closed (the broker dropped them: one bad record, an I/O
    error) stays known, and its new connections (same token, same pid) join it."""

    __slots__ = ("token", "pid", "conns", "keeps", "watched", "dead")

    def __init__(self, token: bytes, pid: int) -> None:
        super().__init__()
        self.token = token
        self.pid = pid  # its first connection's peer: every later connection's must be the same
        self.conns = 0
        self.keeps = False  # it said it closes and lives on: its holds are its own to let go of
        self.watched = False  # its process's death is watched (a pidfd in Broker.pidfds)
        self.dead = False  # its process died (its pidfd was readable)


class _Conn:
    __slots__ = ("sock", "fd", "client", "post", "pid")

    def __init__(self, sock: socket.socket, client: _Client, post: bool, pid: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.client = client
        self.post = post
        self.pid = pid  # the peer's, for log lines


class _Handshake:
    """A connection accepted but not yet authenticated (see Handshake in protocol.py)."""

    __slots__ = ("sock", "nonce", "deadline", "pid")

    def __init__(self, sock: socket.socket, nonce: bytes, deadline: float, pid: int) -> None:
        self.sock = sock
        self.nonce = nonce
        self.deadline = deadline
        self.pid = pid


class Broker:
    def __init__(self, directory: str, listener: socket.socket, authkey: bytes, root_pid: int, lock_fd: int) -> None:
        self.dir = directory
        self.accept_paused_until = 0.0  # out of descriptors: the listener is out of the poll until then
        self.limit_logged = float("-inf")
        _native.guard_faults()  # a header read of a file truncated by another process: an error, not a SIGBUS
        self.lock_fd = lock_fd  # the directory's lock, flock'ed by the launcher (shared with the janitor)
        self.listener = listener
        self.authkey = authkey
        self.uid = os.getuid()
        self.conns: dict[int, _Conn] = {}
        self.handshakes: dict[int, _Handshake] = {}
        self.clients: dict[bytes, _Client] = {}
        # The segments: a header's file opened in a spare's place at the limit; a held
        # RETIRED generation's holders read from every known client's ledger.
        self.keeper = Keeper(directory, self._room, lambda: [c.ledger for c in self.clients.values()])
        # pid -> pidfd of every client process known here, and back: a process is
        # counted out once the kernel says it died, never because a connection of it
        # closed (a live process's tensors would be overwritten).
        self.pidfds: dict[int, int] = {}
        self.pids: dict[int, int] = {}
        self.departed: list[_Client] = []  # gone holding generations: counted out once every post connection is read
        # Descriptors kept for connections (dups of the wake pipe): a deposit may not
        # take the last SPARE_DESCRIPTORS, so a broker full of segments still accepts
        # the processes that would load and let them go (_keep_spares, _room).
        self.spares: list[int] = []
        self.records: dict[str, int] = {}  # records read, by op: how often clients need the broker
        # Each op's handler: its own checks, its own reply (None: a posted record).
        self.ops: dict[bytes, Callable[[_Conn, bytes, list[int], bool], _Reply | None]] = {
            P.SEGMENT: self._on_segment,
            P.DROP: self._on_drop,
            P.FETCH: self._on_fetch,
            P.HOLD: self._on_hold,
            P.RELEASE: self._on_release,
            P.LEDGER: self._on_ledger,
            P.KEEP: self._on_keep,
            P.PING: self._on_ping,
        }
        self.reading = False
        self.poller = select.epoll()
        listener.setblocking(False)
        self.poller.register(listener.fileno(), select.EPOLLIN)
        self.root_alive = True
        self.root_fd = -1
        try:
            self.root_fd = os.pidfd_open(root_pid)
            self.poller.register(self.root_fd, select.EPOLLIN)
        except (OSError, AttributeError):
            self.root_alive = pid_alive(root_pid)
        self.idle_since: float | None = time.monotonic()
        self.stopping = False
        self.buf = bytearray(P.MAX_RECORD)  # every record is received into it (recv_record)
        # The loop blocks in poll() while nothing is timed (a handshake, a draining
        # segment, no client): a signal (SIGTERM: stop) wakes it through this pipe.
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.poller.register(self.wake_r, select.EPOLLIN)
        self._keep_spares()

    def counters(self, full: bool = False) -> dict:
        """What a ping answers: counts the broker keeps as it goes, whatever the size of
        what it holds (a ping that parsed every ledger would take as long as reading
        them all: most of a second for one 64 MiB ledger). *full* (a diagnostic, ``ping(full=True)``) adds what
        costs a read of every ledger, of ``/proc/self`` or a look at every memfd: the
        generations held, the broker's descriptors (others of the user cannot list them:
        it is not dumpable), the memfds whose descriptors it let go of (FORWARDABLE) and
        whether libtorch is mapped in it."""
        counters = {
            "pid": os.getpid(),
            "clients": sum(1 for c in self.clients.values() if c.conns),
            "clients_away": sum(1 for c in self.clients.values() if not c.conns),  # alive, no connection
            "connections": len(self.conns),
            "segments": len(self.keeper.memfds),
            "segment_files": len(self.keeper.files),
            "draining": len(self.keeper.draining),
            # of those, kept because a live process holds their generation (it may
            # forward them), not for refs in flight
            "draining_held": sum(1 for seg in self.keeper.draining if self.keeper.reach(seg) == HELD),
            "handshakes": len(self.handshakes),
            "root_alive": self.root_alive,
            "records": dict(self.records),
        }
        if full:
            counters["generations_held"] = sum(len(self.keeper.read_ledger(c.ledger)) for c in self.clients.values())
            counters["memfds_let_go"] = sum(1 for seg in self.keeper.memfds.values() if seg.fd < 0)  # only held: FORWARDABLE
            counters.update(_own_descriptors())
            counters["libtorch_mapped"] = _maps_libtorch()
        counters["ledger_bytes_read"] = self.keeper.ledger_bytes_read
        return counters

    # -- connections -----------------------------------------------------------

    def _accept(self) -> None:
        """Start a connection's handshake; its answer is read by the loop (_answer).

        Two records, each small enough to fit a fresh socket's buffer: the broker
        never blocks on a client, so a connection that says nothing stalls no one.
        """
        try:
            sock, _ = self._room(self.listener.accept)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self._at_descriptor_limit()
            else:
                log.warning("cannot accept a connection: %s", exc)
            return
        try:
            # Non-blocking always: the loop drains whatever a client has queued, and
            # a client that stops reading its replies is dropped, never waited on.
            sock.setblocking(False)
            pid = peer_pid(sock)
            if peer_uid(sock) != self.uid:
                raise P.ProtocolError("peer runs as another user")
            nonce, hello = P.handshake_hello()
            sock.send(hello)
        except (OSError, P.ProtocolError) as exc:
            log.log(_level(exc), "refused a connection: %s", exc)
            sock.close()
            return
        fd = sock.fileno()
        self.handshakes[fd] = _Handshake(sock, nonce, time.monotonic() + P.HANDSHAKE_TIMEOUT, pid)
        self.poller.register(fd, select.EPOLLIN)

    def _log_full(self, pid: int) -> None:
        """A segment of *pid* refused (its sender hears it): said once a minute."""
        now = time.monotonic()
        if now - self.limit_logged >= 60.0:
            self.limit_logged = now
            log.warning(
                "out of file descriptors (its limit: %d): refusing new segments (pid %d's first); "
                "raise the limit (ulimit -n) of the process that starts the broker",
                resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                pid,
            )

    def _keep_spares(self) -> bool:
        """Top the spare descriptors up; False if this process is at its descriptor
        limit with fewer than SPARE_DESCRIPTORS of them."""
        while len(self.spares) < SPARE_DESCRIPTORS:
            try:
                self.spares.append(os.dup(self.wake_w))
            except OSError:
                return False
        return True

    def _room(self, make: Callable[[], _T]) -> _T:
        """``make()``, which opens one descriptor for a connection (its socket, its
        process's pidfd, a header's file); at the limit, again in a spare's place."""
        try:
            return make()
        except OSError as exc:
            if exc.errno != errno.EMFILE or not self.spares:
                raise
            os.close(self.spares.pop())
            return make()

    def _at_descriptor_limit(self) -> None:
        """Out of descriptors: the listener stays readable (level-triggered), so it
        leaves the poll for ACCEPT_PAUSE seconds instead of spinning, the newest
        connection still in its handshake is shed (a descriptor for the next client),
        and the log says so once a minute (a spinning loop would take a whole CPU and
        log thousands of WARNING lines a second)."""
        now = time.monotonic()
        if self.accept_paused_until == 0.0:
            self.poller.unregister(self.listener.fileno())
        self.accept_paused_until = now + ACCEPT_PAUSE
        if self.handshakes:
            fd = max(self.handshakes, key=lambda f: self.handshakes[f].deadline)
            shake = self.handshakes.pop(fd)
            self.poller.unregister(fd)
            shake.sock.close()
        if now - self.limit_logged >= 60.0:
            self.limit_logged = now
            log.warning(
                "out of file descriptors (its limit: %d): not accepting connections for %.0f s at a time, shedding the "
                "newest unauthenticated ones; raise the limit (ulimit -n) of the process that starts the broker",
                resource.getrlimit(resource.RLIMIT_NOFILE)[0],  # listing /proc/self/fd would need a descriptor
                ACCEPT_PAUSE,
            )

    def _resume_accepting(self, now: float) -> None:
        if self.accept_paused_until and now >= self.accept_paused_until:
            self.accept_paused_until = 0.0
            self.poller.register(self.listener.fileno(), select.EPOLLIN)

    def _answer(self, shake: _Handshake) -> None:
        """The client's answer to the hello: authenticate it and make it a connection."""
        fd = shake.sock.fileno()
        try:
            answer = shake.sock.recv(P.HANDSHAKE_ANSWER_LEN + 1)
        except BlockingIOError:
            return
        except OSError as exc:
            answer = b""
            log.debug("handshake with pid %d failed: %s", shake.pid, exc)  # it went away
        del self.handshakes[fd]
        try:
            role, token, reply = P.handshake_reply(self.authkey, shake.nonce, answer)
            known = self.clients.get(token)
            if known is not None and known.pid != shake.pid:
                # A token is one process's: another process presenting it would join
                # (and one day count out) a ledger that is not its own.
                raise P.ProtocolError(f"its token is pid {known.pid}'s")
            shake.sock.send(reply)
        except (OSError, P.ProtocolError) as exc:
            if answer:
                log.log(_level(exc), "handshake with pid %d failed: %s", shake.pid, exc)
            self.poller.unregister(fd)
            shake.sock.close()
            return
        client = self.clients.get(token)
        if client is None:
            client = self.clients[token] = _Client(token, shake.pid)
            client.watched = self._watch(shake.pid)
        elif not client.conns:
            log.debug("pid %d reconnected", client.pid)
        client.conns += 1
        conn = _Conn(shake.sock, client, role == P.ROLE_POST, shake.pid)
        self.conns[fd] = conn
        self.idle_since = None

    def _drop(self, conn: _Conn, reason: str = "", level: int = logging.WARNING) -> None:
        """Close *conn*; with a *reason* (it broke the protocol, or its I/O failed), log
        it at *level*: DEBUG where its process merely went away (see ``_level``).
        A client whose connections have all closed has exited (or was killed): what
        it held goes, what it sent stays while in flight."""
        if self.conns.pop(conn.fd, None) is None:
            return
        if reason:
            log.log(level, "dropped the connection of pid %d: %s", conn.pid, reason)
        self.poller.unregister(conn.fd)
        conn.sock.close()
        client = conn.client
        client.conns -= 1
        if not client.conns:
            if client.keeps or client.dead or not client.watched or client.holds_nothing():
                self._count_out(client)
            else:
                # Its process lives (the broker dropped its connections, or it closed
                # them without K): what it holds stays counted until it reconnects or
                # dies (counted out alive, its tensors would be overwritten).
                log.debug("pid %d closed its connections and lives: known until it reconnects or dies", client.pid)
        if not self.conns:
            self.idle_since = time.monotonic()
            if self.keeper.draining and self.root_alive and log.isEnabledFor(logging.DEBUG):
                # Normal: a sender that exited before its receiver loaded what it put,
                # or refs nobody will load (a DataLoader stopped early). They go with
                # the program's root, or after ORPHAN_TTL.
                log.debug("no client left, staying for what is still in flight: %s", self.keeper.holdings())

    def _count_out(self, client: _Client) -> None:
        """*client* is gone (dead, its connections closed and read; or it said K): what
        it held goes, what it sent stays while in flight."""
        if self.clients.get(client.token) is not client:
            return  # counted out already (meanwhile, by a read this one started)
        if client.keeps and client.watched and not client.dead and (client.sent or client.ledger >= 0):
            # K: its process lives on without these connections (``unregister()``).
            # What it used here goes now (it posts no drop any more); what it sent
            # stays while in flight, and what it holds is counted out from its ledger
            # at its death: it stays known until then (counted out now, its messages
            # would be dropped ORPHAN_TTL after, its holds pin their segments for good).
            log.debug("pid %d lives on without connections: known until it dies", client.pid)
            self.keeper.let_go(client)
            client.keeps = False  # counted out at its death, as any process
            return
        log.debug("pid %d disconnected", client.pid)
        del self.clients[client.token]
        if client.ledger >= 0 and not client.keeps:
            # A segment it held may be known here only from a record still queued
            # on its owner's post connection (the H the owner posted before
            # any ref to it): counted out once every post connection is read.
            self.departed.append(client)
            self._read_posts()
        else:
            close_ledger(client)  # it counts itself out (K), or holds nothing
        self.keeper.forget(client)
        if client.watched and not any(c.pid == client.pid for c in self.clients.values()):
            self._unwatch(client.pid)

    def _adopt_ledger(self, client: _Client, fd: int) -> None:
        """*client* posted its ledger *fd*: it replaces the one kept for it. A ledger
        is one process's record of what it holds here: known to one identity of that
        process at a time. Another identity of the same process that has it lets go of
        it (one whose K was lost: its process closed its connections while the broker
        was stopped and its buffer full, and went on with a new identity); else the
        process's death would count its holds out twice."""
        try:
            key = P.identity(os.fstat(fd))
        except OSError:
            os.close(fd)
            raise
        close_ledger(client)
        client.ledger, client.ledger_key = fd, key
        for other in [c for c in self.clients.values() if c.pid == client.pid and c is not client]:
            if other.ledger >= 0 and other.ledger_key == client.ledger_key:
                log.debug("pid %d posted its ledger again under a new identity: the old one lets go of it", client.pid)
                close_ledger(other)
                if not other.conns and other.holds_nothing():
                    self._count_out(other)  # away, and nothing left to count out at its death

    def _watch(self, pid: int) -> bool:
        """Watch process *pid*'s death (one pidfd per process, in the epoll); False if
        it cannot be (no pidfd_open: kernel before 5.3; or it died already): its
        clients are then counted out at their last close."""
        if pid in self.pidfds:
            return True
        if pid <= 0:
            return False
        try:
            pidfd = self._room(lambda: os.pidfd_open(pid))
        except (AttributeError, OSError) as exc:
            log.debug("cannot watch pid %d (%s): counted out at its last close", pid, exc)
            return False
        self.pidfds[pid] = pidfd
        self.pids[pidfd] = pid
        self.poller.register(pidfd, select.EPOLLIN)
        return True

    def _unwatch(self, pid: int) -> None:
        pidfd = self.pidfds.pop(pid, -1)
        if pidfd >= 0:
            del self.pids[pidfd]
            self.poller.unregister(pidfd)
            os.close(pidfd)

    def _died(self, pid: int) -> None:
        """Process *pid* died (its pidfd is readable): each of its clients is counted
        out once its connections are closed and read (now, or at its last close)."""
        self._unwatch(pid)
        for client in [c for c in self.clients.values() if c.pid == pid]:
            client.dead = True
            if not client.conns:
                self._count_out(client)

    def _serve(self, conn: _Conn) -> int:
        """Handle every record *conn* has queued; return how many (-1: conn dropped).

        A request connection has at most one record queued (its client waits for each
        reply), so it is read once: level-triggered epoll reports anything more.
        """
        count = 0
        reset = False
        while not count or conn.post:
            lost = False
            try:
                record = P.recv_record(conn.sock, 0, self.buf)
            except BlockingIOError:
                return count
            except P.DescriptorsDropped as exc:
                # At the descriptor limit: the record is whole, its descriptors are
                # not. Keep the connection (the stream is in step).
                record, lost = exc.record, True
                self._log_full(conn.pid)
            except ConnectionResetError:
                # Its process closed the connection with records of ours unread: Linux
                # reports ECONNRESET once, *before* the records that process sent us
                # and that are still queued. They count: read on to the end of stream.
                # A request connection's records want replies nobody will read.
                if reset or not conn.post:
                    self._drop(conn)
                    return -1
                reset = True
                continue
            except (OSError, P.ProtocolError) as exc:
                self._drop(conn, str(exc) or type(exc).__name__, _level(exc))
                return -1
            if record is None:
                self._drop(conn)
                return -1
            if not self._handle(conn, *record, lost=lost):
                return -1
            count += 1
        return count

    def _read_posts(self) -> None:
        """Read every post connection now: a barrier for what clients sent before (a
        fetch may come on a request connection before the deposit it needs, posted
        earlier by another process, is read)."""
        if self.reading:
            return  # the read in progress counts out whoever departs meanwhile
        self.reading = True
        try:
            for conn in [c for c in self.conns.values() if c.post]:
                self._serve(conn)
        finally:
            self.reading = False
        while self.departed:
            self.keeper.count_out(self.departed.pop())

    def _handle(self, conn: _Conn, op: bytes, key: bytes, body: bytes, fds: list[int], lost: bool = False) -> bool:
        """One record, by its op's handler (``ops``); False if the connection was dropped.

        Whatever goes wrong with one record drops its connection only: the broker
        keeps every other process's segments. Descriptors a record brought and did
        not leave here are closed.
        """
        name = op.decode("ascii", "replace")
        self.records[name] = self.records.get(name, 0) + 1
        try:
            handler = self.ops.get(op)
            if handler is None:
                raise P.ProtocolError(f"unknown op {op!r}")
            reply = handler(conn, body, fds, lost)
            if reply is not None:
                P.send_record(conn.sock, reply[0], P.NO_KEY, reply[1], reply[2])
            return True
        except (OSError, P.ProtocolError) as exc:
            self._drop(conn, f"{op!r} record: {exc}", _level(exc))
            return False
        except Exception:  # noqa: BLE001  a bug one record hit must not end the broker
            log.exception("unexpected error on a %r record of pid %d", op, conn.pid)
            self._drop(conn, "unexpected error (above)")
            return False
        finally:
            for fd in fds:
                os.close(fd)

    # -- one handler per op (protocol.py): (conn, body, fds, lost) -> its reply --
    # A handler takes the descriptors it keeps out of *fds* (``_handle`` closes the
    # rest); *lost*: the kernel dropped the record's descriptors (at the limit).

    def _on_segment(self, conn: _Conn, body: bytes, fds: list[int], lost: bool) -> _Reply:
        """S: memfds this client sends refs in, a kind byte each (``P.SEG_KINDS``), or a
        file of its pool gone with a dead broker (SEG_FILE): answered with whether
        the broker keeps them (all, or none: its sender fails, before any ref to one
        is sent)."""
        if conn.post:
            raise P.ProtocolError("a segment record comes on the request connection: it is answered")
        if fds and not lost and not self._keep_spares():
            # It took a descriptor kept for connections: the broker is full.
            os.close(fds.pop())
            self._keep_spares()
            lost = True
            self._log_full(conn.pid)
        if lost:
            return P.DEPOSITED, bytes([P.STATUS_LOST]), []
        if body.startswith(P.SEG_FILE):
            names = P.decode_names(body[len(P.SEG_FILE) :])
            if len(names) != 1 or len(fds) != 1:
                raise P.ProtocolError("a file's segment record names one file and carries its descriptor")
            self.keeper.hold(conn.client, names, fds.pop())
            return P.DEPOSITED, bytes([P.STATUS_OK]), []
        kinds = [P.SEG_KIND_OF.get(body[i : i + 1]) for i in range(len(body))]
        if not fds or len(kinds) != len(fds) or None in kinds:
            raise P.ProtocolError("a segment record carries descriptors and a kind for each")
        inos = []
        for kind in kinds:
            assert kind is not None
            ino = self.keeper.deposit(conn.client, fds.pop(0), kind[0], forward=kind[1])  # taken, or closed
            if ino is not None:
                inos.append(ino)
        if len(inos) > 1:
            self.keeper.batch(inos)
        return P.DEPOSITED, bytes([P.STATUS_OK]), []

    def _on_drop(self, conn: _Conn, body: bytes, fds: list[int], lost: bool) -> None:
        """X: memfds this client no longer sends refs in."""
        self.keeper.drop(conn.client, P.decode_inos(body))

    def _on_fetch(self, conn: _Conn, body: bytes, fds: list[int], lost: bool) -> _Reply:
        """F: the descriptor of one deposited memfd and of those deposited after it with
        it, as many as the client takes (their inodes listed after the first's), or
        unknown."""
        fields = P.decode_inos(body)
        if len(fields) != 2 or not 1 <= fields[1] <= P.FETCHED_FDS:
            raise P.ProtocolError(f"a fetch names one memfd and how many descriptors it takes, not {fields[:4]}")
        found = self.keeper.fetch(*fields)  # deposits are answered: none is still queued
        if not found:
            return P.FETCHED, P.encode_fetched(P.STATUS_UNKNOWN, []), []
        return P.FETCHED, P.encode_fetched(P.STATUS_OK, [ino for ino, _fd in found[1:]]), [fd for _ino, fd in found]

    def _on_hold(self, conn: _Conn, body: bytes, fds: list[int], lost: bool) -> None:
        """H: files this client made and holds."""
        self.keeper.hold(conn.client, P.decode_names(body))

    def _on_release(self, conn: _Conn, body: bytes, fds: list[int], lost: bool) -> None:
        """R: files this client let go of."""
        self.keeper.release(conn.client, P.decode_names(body))

    def _on_ledger(self, conn: _Conn, body: bytes, fds: list[int], lost: bool) -> None:
        """L: this client's ledger, read at its death."""
        if lost:
            return  # not counted out if it dies: its holds keep their segments from reuse
        if len(fds) != 1 or body or not stat.S_ISREG(os.fstat(fds[0]).st_mode):
            raise P.ProtocolError("a ledger record carries one memfd and no body")
        self._adopt_ledger(conn.client, fds.pop())

    def _on_keep(self, conn: _Conn, body: bytes, fds: list[int], lost: bool) -> None:
        """K: this client closes and lives on."""
        if body:
            raise P.ProtocolError("a keep record has no body")
        conn.client.keeps = True  # it counts itself out

    def _on_ping(self, conn: _Conn, body: bytes, fds: list[int], lost: bool) -> _Reply:
        """P: the counters, once every post connection is read (a barrier)."""
        if body not in (b"", P.PING_FULL):
            raise P.ProtocolError(f"a ping's body is empty or {P.PING_FULL!r}")
        self._read_posts()
        return P.PONG, json.dumps(self.counters(full=body == P.PING_FULL)).encode(), []

    def _expire(self, now: float) -> None:
        for fd in [fd for fd, shake in self.handshakes.items() if shake.deadline <= now]:
            shake = self.handshakes.pop(fd)
            log.warning("closed a connection of pid %d: no handshake within %.0f s", shake.pid, P.HANDSHAKE_TIMEOUT)
            self.poller.unregister(fd)
            shake.sock.close()
        if self.keeper.draining or self.keeper.retry:
            self.keeper.drain(now)

    # -- main loop -------------------------------------------------------------

    def _should_exit(self, now: float) -> bool:
        if self.stopping:
            return True
        # Only authenticated clients keep a broker; a connection still in its handshake
        # does while the program's root lives (a client racing an idle exit is served),
        # never after: a process of the user connecting every few seconds without the
        # key no longer keeps a dead program's broker and directory.
        if self.conns or (self.handshakes and self.root_alive) or self.idle_since is None:
            return False
        if self.keeper.draining and self.root_alive:
            return False
        return now - self.idle_since >= GRACE

    def run(self) -> None:
        listener, conns = self.listener.fileno(), self.conns
        while True:
            now = time.monotonic()
            if self._should_exit(now):
                break
            # Woken by records, connections, the root's exit or a signal; by time
            # only for what is timed: a handshake's deadline, a draining segment, the
            # GRACE before exiting without clients.
            timeout = -1.0
            if self.handshakes:
                timeout = max(0.0, min(h.deadline for h in self.handshakes.values()) - now)
            elif self.keeper.draining or self.keeper.retry or not conns:
                timeout = 0.25
            if self.accept_paused_until:
                pause = max(0.0, self.accept_paused_until - now)
                timeout = pause if timeout < 0 else min(timeout, pause)
            for fd, _events in self.poller.poll(timeout):
                conn = conns.get(fd)
                if conn is not None:
                    self._serve(conn)
                elif fd == self.wake_r:
                    while _drain_pipe(fd):
                        pass
                elif fd in self.handshakes:
                    self._answer(self.handshakes[fd])
                elif fd == listener:
                    self._accept()
                elif fd in self.pids:
                    self._died(self.pids[fd])
                elif fd == self.root_fd:
                    self.root_alive = False
                    self.poller.unregister(self.root_fd)
                    os.close(self.root_fd)
                    self.root_fd = -1
                    if not conns:
                        self.idle_since = time.monotonic()
            now = time.monotonic()
            if self.handshakes or self.keeper.draining or self.keeper.retry:
                self._expire(now)
            if len(self.spares) < SPARE_DESCRIPTORS:
                self._keep_spares()
            self._resume_accepting(now)

    def shutdown(self) -> None:
        self.keeper.close_all()
        for client in self.clients.values():
            close_ledger(client)
        for pidfd in self.pids:
            os.close(pidfd)
        for conn in list(self.conns.values()):
            conn.sock.close()
        for shake in self.handshakes.values():
            shake.sock.close()
        self.listener.close()
        self.poller.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        for fd in self.spares:
            os.close(fd)
        self.spares.clear()
        remove_program_dir(self.dir, self.lock_fd)


def _own_descriptors() -> dict[str, int]:
    """This process's open descriptors and the lowest free one (the number a new
    descriptor would get); -1 each at its descriptor limit."""
    try:
        fd = os.dup(0)
    except OSError:
        return {"descriptors": -1, "lowest_free_descriptor": -1}
    try:
        return {"descriptors": len(os.listdir("/proc/self/fd")) - 2, "lowest_free_descriptor": fd}  # less the dup and the listing's
    except OSError:
        return {"descriptors": -1, "lowest_free_descriptor": fd}
    finally:
        os.close(fd)


def _maps_libtorch() -> bool:
    """Whether libtorch is mapped in this process (the broker must never import torch)."""
    try:
        with open("/proc/self/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return False


def _drain_pipe(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _level(exc: BaseException) -> int:
    """The level of a line about a connection dropped for *exc*: DEBUG where its
    process merely went away (exited or killed with a request unanswered: the normal
    end of a DataLoader worker it shut down), WARNING for the rest (a protocol error,
    another I/O failure), which a user must look into."""
    return logging.DEBUG if isinstance(exc, (BrokenPipeError, ConnectionResetError)) else logging.WARNING


def launch(directory: str, root_pid: int, authkey: bytes, status: socket.socket | None = None) -> int:
    """Start a broker for *directory* unless one runs; return the exit status.

    *status*: the starter's status socket, closed in the broker's processes (it is
    the launcher's alone, and a launcher answers only once it has returned)."""
    base = os.path.dirname(directory)
    lock_fd = lock_program_dir(directory)
    if lock_fd is None:
        return 0  # a live broker already serves this program
    sweep_stale(base, keep=directory)
    path = os.path.join(directory, P.SOCKET_NAME)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(128)

    if os.fork() != 0:
        return 0  # launcher: the socket listens; the caller may connect now
    if status is not None:
        status.close()
    os.setsid()
    if os.fork() != 0:
        os._exit(0)
    _janitor(directory, listener, authkey, root_pid, lock_fd)
    os._exit(0)


def _log_to_stderr(directory: str) -> None:
    """The server's log: one line per event on its stderr (see Failures in protocol.py),
    at ``$SHMREDUCE_LOG_LEVEL`` (default WARNING: only what a user must act on)."""
    handler = logging.StreamHandler(sys.stderr)
    name = os.path.basename(directory)
    handler.setFormatter(logging.Formatter(f"%(asctime)s shmreduce broker %(process)d ({name}) %(levelname)s: %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(log_level(os.environ.get("SHMREDUCE_LOG_LEVEL", "")))


def log_level(value: str) -> int:
    """The level ``$SHMREDUCE_LOG_LEVEL`` names: a name (``DEBUG``, ``warning``) or a
    number; WARNING if unset or not a level."""
    value = value.strip()
    if value.isdigit():
        return int(value)
    level = logging.getLevelName(value.upper())
    return level if isinstance(level, int) else logging.WARNING


def _janitor(directory: str, listener: socket.socket, authkey: bytes, root_pid: int, lock_fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    path = os.environ.get("SHMREDUCE_BROKER_LOG")
    # stdout is the starter's stderr (client.start_broker), unless a log file is named.
    errfd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if path else os.dup(1)
    for fd, target in ((0, devnull), (1, devnull), (2, errfd)):
        os.dup2(target, fd)
    for fd in {devnull, errfd}:
        os.close(fd)
    server = os.fork()
    if server == 0:
        signal.signal(signal.SIGTERM, lambda *_: setattr(broker, "stopping", True))
        _log_to_stderr(directory)
        # Before it holds any descriptor of the program's: other processes of the user
        # could open the memfds it keeps, read-write, through /proc/<broker>/fd. It reads its own counts for them (ping(full=True)).
        if not make_undumpable():
            log.debug("cannot make the broker not dumpable: its /proc/<pid>/fd stays open to the user's processes")
        raise_nofile_limit()
        broker = Broker(directory, listener, authkey, root_pid, lock_fd)
        signal.set_wakeup_fd(broker.wake_w, warn_on_full_buffer=False)
        try:
            broker.run()
        finally:
            broker.shutdown()
        os._exit(0)
    listener.close()
    signal.signal(signal.SIGTERM, lambda *_: os.kill(server, signal.SIGTERM))
    while True:
        try:
            os.waitpid(server, 0)
            break
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    # Only if the directory is still ours (its server removed it already, at its
    # exit: a fresh broker may serve a new one at that path now).
    remove_program_dir(directory, lock_fd)
    os.close(lock_fd)


START_WAIT = 30.0  # seconds the launcher waits for the authkey: it is sent before the launcher starts


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m shmreduce.broker.server DIR ROOT_PID  (status socket on descriptor 3)", file=sys.stderr)
        return 2
    # posix_spawn closes nothing: descriptors the starter had open without
    # close-on-exec (descriptors received over sockets, a user's) are not ours to keep
    # alive for the broker's whole life.
    os.closerange(P.STATUS_FD + 1, os.sysconf("SC_OPEN_MAX"))
    try:
        status = socket.socket(fileno=P.STATUS_FD)
    except OSError:
        print("shmreduce broker: no status socket on descriptor 3", file=sys.stderr)
        return 2
    status.settimeout(START_WAIT)
    try:
        authkey = status.recv(P.MAX_RECORD)
        if not authkey:
            raise SystemExit("shmreduce broker: no authkey on the status socket")
        code = launch(os.path.abspath(argv[0]), int(argv[1]), authkey, status)
        status.send(b"ok")
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - told to the starter, which raises SharingError
        try:
            status.send(f"error: {type(exc).__name__}: {exc}".encode(errors="replace")[: P.MAX_RECORD])
        except OSError:
            pass
        return 1
    finally:
        status.close()
    return code


if __name__ == "__main__":
    _code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)  # no interpreter teardown: the starter waits for this exit
