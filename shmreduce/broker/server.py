"""The broker process: holds descriptors and segment names between processes.

stdlib only, never imports torch. Started by ``client.start_broker`` as
``python -m shmreduce.broker.server DIR ROOT_PID`` with its *status socket* on
descriptor 3 (``STATUS_FD``). The protocol and the lifetimes it guarantees are
documented in ``protocol.py``.

Launch handshake (issue 19, item 3). A fork of the starter may happen at any
moment of a launch (a DataLoader worker, a Pool) and its child inherits every
descriptor the launch has open, close-on-exec or not: so no step waits for an end
of file, and every wait has a deadline. The starter sends the authkey as one
SOCK_SEQPACKET record on the status socket; the launcher reads that one record
(bounded by START_WAIT) and answers with one record, ``ok`` once a broker listens
on DIR (its own or one that runs already), or ``error: why``. Nothing else of the
launch is a pipe.

Process layout: the launcher takes the program directory's lock (making the
directory if need be), binds and listens, then double-forks and exits (so the
caller is never left with a zombie and knows the socket is listening when it
returns). The grandchild is the *janitor*: it forks the *server*, waits for it, and
removes the program directory whatever way the server ended, SIGKILL included,
before it lets go of the lock: a lock is the directory's only while its file is the
one at the directory's path (``_lock_program_dir``), and the lock, not the path,
decides who removes a directory: only a process holding the flock of the lock file
at the directory's path (``remove_program_dir``: the server at its exit, then its
janitor, which finds it gone or another's; a sweep, ``sweep_stale``). So one broker
at most serves a program directory, however launchers, sweeps and a dying janitor
interleave (issue 19, item 4; issue 27, finding B). The launcher's stdout is the starter's stderr: the server logs there (or
to ``$SHMREDUCE_BROKER_LOG``).

Also owns the one sweep of stale program directories (``sweep_stale``), used by
every launcher and by ``python -m shmreduce cleanup``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import resource
import select
import shutil
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from shmreduce import _native
from shmreduce._platform import make_undumpable, map_shared, peer_pid, peer_uid, raise_nofile_limit, unmap
from shmreduce.broker import protocol as P

STALE_MIN_AGE = 10.0  # seconds; a younger directory may be a broker still starting
GRACE = float(os.environ.get("SHMREDUCE_BROKER_GRACE", "1.0"))
ORPHAN_TTL = float(os.environ.get("SHMREDUCE_ORPHAN_TTL", "60"))  # see Lifetimes in protocol.py
ACCEPT_PAUSE = 1.0  # seconds the broker stops accepting at its descriptor limit
_T = TypeVar("_T")
SPARE_DESCRIPTORS = 8  # kept for connections and pidfds: two processes' worth, at the limit
DRAIN_EVERY = 0.1  # seconds between two looks at the draining segments' headers
LEDGER_SCAN_EVERY = 1.0  # seconds between two reads of every ledger (a held RETIRED generation's holders)
HELD_LOOK_EVERY = 1.0  # seconds between two looks at a draining segment kept only because it is held
# Draining memfds kept only because a process holds their generation, every ref sent
# in them loaded, whose descriptors the broker keeps (a holder may forward from them,
# or load a blob of them again): past that, the oldest one's descriptor is closed. Its
# record and header stay, and its memory while its holders map it; a fetch of it is
# answered unknown (a forwarder shares the storage anew, in its own pool). So the
# broker holds a bounded number of descriptors however much receivers keep (SPEC 12).
FORWARDABLE = 4

log = logging.getLogger("shmreduce.broker")


class _Client:
    """One client process, across its connections: the segments it deposited, the
    files it holds, its ledger (the generations it holds as a receiver).

    Known from its first connection until it is counted out (``Broker._count_out``):
    once its process is dead and its connections are closed and read, or at its last
    close if it said K (or if its death cannot be watched: no pidfd). A live process
    whose connections all closed (the broker dropped them: one bad record, an I/O
    error) stays known, and its new connections (same token, same pid) join it."""

    __slots__ = ("token", "pid", "holds", "segs", "sent", "ledger", "ledger_key", "conns", "keeps", "watched", "dead")

    def __init__(self, token: bytes, pid: int) -> None:
        self.token = token
        self.pid = pid  # its first connection's peer: every later connection's must be the same
        self.holds: set[str] = set()  # segment files it holds (their owner)
        self.segs: set[int] = set()  # memfds it deposited, by inode
        self.sent: set[_Segment] = set()  # segments it sends refs in (deposited, forwarded or held), let go of or not
        self.ledger = -1  # its ledger's memfd (protocol.py, "Ledger"), read once it is gone
        self.ledger_key = 0  # that memfd's identity (protocol.identity)
        self.conns = 0
        self.keeps = False  # it said it closes and lives on: its holds are its own to let go of
        self.watched = False  # its process's death is watched (a pidfd in Broker.pidfds)
        self.dead = False  # its process died (its pidfd was readable)

    def holds_nothing(self) -> bool:
        return self.ledger < 0 and not self.segs and not self.holds


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


class _Segment:
    """A segment the broker keeps for the program: a memfd (its descriptor, by inode)
    or a file of the program directory (by name). Kept while a client uses it (its
    maker: a memfd's depositor, a file's holder), then while anything can reach it
    (``Broker._reach``): a process holds its generation, or refs sent in it wait to
    be loaded while one of their senders lives, or ORPHAN_TTL after the last died."""

    __slots__ = ("key", "fd", "header", "users", "senders", "until", "map", "addr", "look", "forwarded")

    def __init__(self, key: int | str, fd: int, header: bool) -> None:
        self.key = key
        self.fd = fd  # a memfd's; -1 for a file
        self.header = header  # pooled: the first HEADER bytes are the generation and its counters
        self.users = 0
        self.senders: set[_Client] = set()  # live clients that sent refs in it (its makers and forwarders)
        self.until = 0.0  # once only refs of dead senders reach it: when it goes, loaded or not; 0: not timed
        self.addr = 0  # its header, once read (mapped without a descriptor: map_shared)
        self.look = 0.0  # draining: not looked at again before then (only held: HELD_LOOK_EVERY)
        self.forwarded = False  # a memfd a process that did not make it sent from: its descriptor stays


class _AtLimit(OSError):
    """A segment's header could not be read for a limit of this process (descriptors,
    memory): not that it has none. Whatever asked keeps the segment, and asks again."""


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
        self.memfds: dict[int, _Segment] = {}  # inode -> deposited memfd
        self.files: dict[str, _Segment] = {}  # name -> held file
        self.draining: set[_Segment] = set()  # no user left, still reachable (``_reach``)
        self.forwardable: dict[int, _Segment] = {}  # draining memfds only held, by inode, oldest first (FORWARDABLE)
        self.drained_at = float("-inf")
        self.ledgers_read_at = float("-inf")
        self.ledger_holds: set[tuple[int | str, int]] = set()  # _held_in_ledgers
        # pid -> pidfd of every client process known here, and back (issue 27: a
        # process is counted out once the kernel says it died, never because a
        # connection of it closed).
        self.pidfds: dict[int, int] = {}
        self.pids: dict[int, int] = {}
        self.departed: list[_Client] = []  # gone holding generations: counted out once every post connection is read
        # Ledger entries of dead processes in segments the broker knows no descriptor or
        # file of (yet), by segment: counted out when one comes (_count_out_unreached).
        self.unreached: dict[int | str, list[tuple[int, int]]] = {}
        self.retry: set[_Segment] = set()  # known segments with unreached entries: their header was unreadable
        # Descriptors kept for connections (dups of the wake pipe): a deposit may not
        # take the last SPARE_DESCRIPTORS, so a broker full of segments still accepts
        # the processes that would load and let them go (_keep_spares, _room).
        self.spares: list[int] = []
        self.records: dict[str, int] = {}  # records read, by op: how often clients need the broker
        self.ledger_bytes_read = 0  # what it read of ledgers (at deaths; a full ping): a plain ping reads none
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
            self.root_alive = _pid_alive(root_pid)
        self.idle_since: float | None = time.monotonic()
        self.stopping = False
        self.buf = bytearray(P.MAX_RECORD)  # every record is received into it (recv_record)
        # The loop blocks in poll() while nothing is timed (a handshake, a draining
        # segment, no client): a signal (SIGTERM: stop) wakes it through this pipe.
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.poller.register(self.wake_r, select.EPOLLIN)
        self._keep_spares()

    # -- segments --------------------------------------------------------------

    def _deposit(self, client: _Client, fd: int, header: bool, forward: bool = False) -> None:
        """*client* sends refs to the memfd *fd* (taken over here): kept by inode.
        *forward*: a pooled segment it received and sends on (it did not make it):
        it is one of the segment's senders, not a user (issue 36, item 10: a relay's
        deposit kept every memfd it forwarded for the relay's life)."""
        try:
            ino = P.identity(os.fstat(fd))
        except OSError:
            os.close(fd)
            return
        seg = self.memfds.get(ino)
        if seg is None:
            seg = self.memfds[ino] = _Segment(ino, fd, header)
            if forward:
                self.draining.add(seg)  # nobody uses it: kept while something reaches it
        elif seg.fd < 0:
            seg.fd = fd  # its descriptor was let go of (FORWARDABLE): this one serves from now on
        else:
            os.close(fd)  # the one kept already serves
        if forward:
            # Refs of it go out from now on, perhaps before the header counts them
            # sent: its descriptor is never let go of while it is kept.
            seg.forwarded = True
            self.forwardable.pop(ino, None)
        self._sends(client, seg)
        if not forward and ino not in client.segs:
            client.segs.add(ino)
            self._use(seg)
        self._count_out_unreached(seg)

    def _sends(self, client: _Client, seg: _Segment) -> None:
        """*client* sends refs in *seg*: while it lives, they keep *seg* (see ``_reach``)."""
        if client not in seg.senders:
            seg.senders.add(client)
            client.sent.add(seg)

    def _hold(self, client: _Client, names, fd: int = -1) -> None:
        """*client* made these files and holds them. *fd*: one file's descriptor, its
        file gone (its directory went with a broker that died): its header is read
        through it, and nothing is unlinked at its close (issue 36, item 6)."""
        for name in names:
            if name in client.holds or not P.is_segment_name(name):
                continue
            seg = self.files.get(name)
            if seg is None:
                seg = self.files[name] = _Segment(name, -1, True)
            if fd >= 0 and seg.fd < 0:
                _unmap_header(seg)
                seg.fd, fd, seg.header = fd, -1, True
            client.holds.add(name)
            self._sends(client, seg)
            self._use(seg)
            self._count_out_unreached(seg)
        if fd >= 0:
            os.close(fd)

    def _count_out_unreached(self, seg: _Segment) -> None:
        """Count out of *seg* what the ledgers of dead processes said they held in it
        while the broker could not reach it (it knew no descriptor or file of it: a
        broker restarted, and its owner had not come back yet): exactly as at their
        deaths (``_let_go_gens``)."""
        pending = self.unreached.pop(seg.key, None)
        if pending:
            self._count_out_entries(seg, pending)

    def _use(self, seg: _Segment) -> None:
        seg.users += 1
        self.draining.discard(seg)
        if isinstance(seg.key, int):
            self.forwardable.pop(seg.key, None)

    def _unuse(self, seg: _Segment, died: bool) -> None:
        """One user less; with none left, *seg* goes once nothing reaches it
        (``_reach``). A segment without a header (a storage torch shared) is kept for
        ORPHAN_TTL once its depositor *died* with it or let go of it (its storage
        died there): no header counts its refs in flight, and a receiver may still
        load what was sent in it. A file never made (a name held for later) goes."""
        seg.users -= 1
        if seg.users > 0:
            return
        if isinstance(seg.key, int) and not seg.header:
            seg.until = time.monotonic() + ORPHAN_TTL
            self.draining.add(seg)
            return
        self.draining.add(seg)
        self._settle(seg, time.monotonic())

    # What keeps a segment nobody uses (``_reach``): the rule a timer follows (SPEC 15:
    # a timer frees only what no message or holder can reach any more).
    _HELD, _SENT, _ORPHANED, _UNREACHED = 0, 1, 2, 3

    def _reach(self, seg: _Segment) -> int:
        """What can still reach *seg*, whose users all let go of it:

        _HELD       a process holds its generation (the header's holders: exact, each
                    counted out at its death from its ledger): it may forward it, so
                    the segment stays (issue 36, item 9: a file unlinked once sent ==
                    loaded, under the DataLoader batches the main process forwarded).
                    In a RETIRED generation the count may be one too many (a process
                    killed mid-take or mid-let-go): there, a live process's ledger
                    naming it decides (``_held_in_ledgers``), or a phantom hold would
                    keep the segment for the program's life;
        _SENT       refs sent in its generation are not all loaded (a ref loaded again
                    counts once: its ticket; a generation whose tickets ran past the
                    bitmap, UNCOUNTED, cannot tell) and one of their senders lives: they
                    wait for it, however long (issue 36, item 8: a retired slab's
                    messages were dropped at ORPHAN_TTL while their sender lived);
        _ORPHANED   such refs, every sender dead: kept ORPHAN_TTL from then;
        _UNREACHED  nothing: it goes now."""
        try:
            header = self._header(seg)
        except _AtLimit:
            return self._SENT  # unknown for now: kept, and settled again
        if header is None:
            return self._UNREACHED
        try:
            if header[3] > 0:
                if not _native.hdr_flags(seg.addr) & _native.RETIRED or (seg.key, header[0]) in self._held_in_ledgers():
                    return self._HELD
            if self._loaded(seg, header):
                return self._UNREACHED
        except OSError:
            self._truncated(seg)
            return self._UNREACHED
        return self._SENT if seg.senders else self._ORPHANED

    def _held_in_ledgers(self) -> set[tuple[int | str, int]]:
        """(segment, generation) of every entry of every known client's ledger, read
        at most every LEDGER_SCAN_EVERY seconds (only a held RETIRED generation asks)."""
        now = time.monotonic()
        if now - self.ledgers_read_at >= LEDGER_SCAN_EVERY:
            self.ledgers_read_at = now
            self.ledger_holds = {(key, gen) for c in self.clients.values() for key, gen, _state in self._ledger_holds(c.ledger)}
        return self.ledger_holds

    def _settle(self, seg: _Segment, now: float) -> None:
        """*seg*, draining (no user), closed if nothing reaches it; timed while only
        refs of dead senders do. One only held is looked at every HELD_LOOK_EVERY
        (only its holders' let-go, which posts nothing, frees it): a drain costs
        the same however much receivers keep."""
        reach = self._reach(seg)
        if reach == self._UNREACHED:
            self._close(seg)
        elif reach == self._ORPHANED:
            if not seg.until:
                seg.until = now + ORPHAN_TTL
            elif now >= seg.until:
                log.debug("let go of segment %s: refs sent in it not loaded within %.0f s (SHMREDUCE_ORPHAN_TTL)", seg.key, ORPHAN_TTL)
                self._close(seg)
        else:
            seg.until = 0.0
            if reach == self._HELD:
                seg.look = now + HELD_LOOK_EVERY
                if isinstance(seg.key, int) and seg.fd >= 0 and not seg.forwarded and self._all_loaded(seg):
                    self._forwardable(seg)

    @staticmethod
    def _loaded(seg: _Segment, header: tuple[int, int, int, int]) -> bool:
        """Whether every ref sent in the generation of *seg*'s *header* was loaded: as
        many loaded as sent, each counted (not UNCOUNTED). OSError: truncated under it."""
        return header[1] <= header[2] and not _native.hdr_flags(seg.addr) & _native.UNCOUNTED

    def _all_loaded(self, seg: _Segment) -> bool:
        """Whether every ref sent in *seg*'s generation was loaded (its header says)."""
        try:
            header = self._header(seg)
            return header is not None and self._loaded(seg, header)
        except OSError:
            return False

    def _forwardable(self, seg: _Segment) -> None:
        """*seg*, a memfd only held, keeps its descriptor if it is one of the newest
        FORWARDABLE such; the oldest one's is closed (see FORWARDABLE)."""
        assert isinstance(seg.key, int)
        self.forwardable.setdefault(seg.key, seg)
        while len(self.forwardable) > FORWARDABLE:
            oldest = self.forwardable.pop(next(iter(self.forwardable)))
            if oldest.fd >= 0:
                os.close(oldest.fd)
                oldest.fd = -1

    def _header(self, seg: _Segment) -> tuple[int, int, int, int] | None:
        """(generation, sent, loaded, holders) of *seg*, or None if it has none."""
        if not seg.header:
            return None
        if not seg.addr:
            fd = seg.fd
            if fd < 0 and isinstance(seg.key, int):
                return None  # a memfd whose descriptor was let go of keeps its header mapped
            try:
                if fd < 0:
                    fd = self._room(lambda: os.open(os.path.join(self.dir, str(seg.key)), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC))
                try:
                    if os.fstat(fd).st_size < _native.HEADER_BYTES:
                        raise ValueError("smaller than a header")
                    seg.addr = map_shared(fd, _native.HEADER_BYTES)
                finally:
                    if fd != seg.fd:
                        os.close(fd)
            except (OSError, ValueError) as exc:
                if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                    raise _AtLimit(exc.errno, exc.strerror) from exc  # still a pooled segment: read it later
                seg.header = False  # gone, or too small to be a pooled segment
                return None
        try:
            return _native.hdr_read(seg.addr)
        except OSError:  # truncated under its header (_native.guard_faults)
            self._truncated(seg)
            return None

    def _truncated(self, seg: _Segment) -> None:
        """*seg*'s file was truncated by a process of the user: its header is gone, and
        so are the bytes of what was sent in it (their loads fail, stale); the broker
        goes on, and treats it as a segment without a header."""
        log.warning("segment %s was truncated under its header by another process: what was sent in it is lost", seg.key)
        seg.header = False
        _unmap_header(seg)

    def _close(self, seg: _Segment) -> None:
        self.draining.discard(seg)
        for sender in seg.senders:
            sender.sent.discard(seg)
        seg.senders.clear()
        _unmap_header(seg)
        if isinstance(seg.key, int):
            self.memfds.pop(seg.key, None)
            self.forwardable.pop(seg.key, None)
            if seg.fd >= 0:
                os.close(seg.fd)
            seg.fd = -1
        elif seg.fd >= 0:  # a file gone with a broker that died: its descriptor
            self.files.pop(seg.key, None)
            os.close(seg.fd)
            seg.fd = -1
        else:
            self.files.pop(seg.key, None)
            try:
                os.unlink(os.path.join(self.dir, seg.key))
            except FileNotFoundError:
                pass

    def _drop_deposits(self, client: _Client, inos, died: bool) -> None:
        for ino in inos:
            if ino in client.segs:
                client.segs.discard(ino)
                self._unuse(self.memfds[ino], died)

    def _release(self, client: _Client, names, died: bool) -> None:
        for name in names:
            if name in client.holds:
                client.holds.discard(name)
                self._unuse(self.files[name], died)

    def _let_go_gens(self, client: _Client) -> None:
        """A receiver died: count it out of the holders of every generation its
        ledger says it holds. An entry of a segment the broker keeps no descriptor or
        file of waits in ``unreached`` until one comes (its owner, back after a broker
        restart, deposits what it keeps: issue 36, item 6), and is counted out then,
        as here; a segment nobody brings again was let go of by its owner (closed, or
        dead: nobody reuses it)."""
        found: dict[int | str, list[tuple[int, int]]] = {}
        for key, gen, state in self._ledger_holds(client.ledger):
            found.setdefault(key, []).append((gen, state))
        for key, entries in found.items():
            seg = self.memfds.get(key) if isinstance(key, int) else self.files.get(key)
            if seg is None:
                self.unreached.setdefault(key, []).extend(entries)
            else:
                self._count_out_entries(seg, entries)
        _close_ledger(client)

    def _count_out_entries(self, seg: _Segment, entries: list[tuple[int, int]]) -> None:
        """Count a dead process out of *seg*: its ledger's (generation, state) entries of it."""
        try:
            if self._header(seg) is None:
                return
        except _AtLimit:
            # Its header unreadable for now (at a limit): counted out by the next
            # drain that can read it (a hold counted too long, never too short).
            self.unreached.setdefault(seg.key, []).extend(entries)
            self.retry.add(seg)
            return
        try:
            for gen, state in entries:
                if state == P.HELD:
                    _native.hdr_unhold(seg.addr, gen)
                elif state == P.TAKING:
                    # Killed around its hdr_hold: counted or not, in whatever generation
                    # the header held then (a stale load's), found by the lifetime model.
                    _native.hdr_retire_any(seg.addr)
                else:  # DROPPING: counted out of its own generation, or not yet
                    _native.hdr_retire(seg.addr, gen)
        except OSError:
            self._truncated(seg)

    def _ledger_holds(self, fd: int) -> list[tuple[int | str, int, int]]:
        """(segment, generation, state) of what the ledger *fd* says its client holds;
        the bytes read are counted (``ledger_bytes_read``)."""
        if fd < 0:
            return []
        try:
            blob = os.pread(fd, min(os.fstat(fd).st_size, P.LEDGER_MAX), 0)
        except OSError:
            return []
        self.ledger_bytes_read += len(blob)
        return P.ledger_holds(blob)

    def _drain(self, now: float) -> None:
        """Close the segments nobody uses that nothing reaches any more, or whose time
        is up (``_reach``); at most every DRAIN_EVERY seconds (a header read each)."""
        if now - self.drained_at < DRAIN_EVERY:
            return
        self.drained_at = now
        for seg in list(self.retry):
            self.retry.discard(seg)
            known = self.memfds.get(seg.key) if isinstance(seg.key, int) else self.files.get(seg.key)
            if known is seg:
                self._count_out_unreached(seg)
        for seg in list(self.draining):
            if seg.header:
                if now >= seg.look:
                    self._settle(seg, now)
            elif now >= seg.until:  # a storage torch shared, its depositor dead
                self._close(seg)

    def counters(self, full: bool = False) -> dict:
        """What a ping answers: counts the broker keeps as it goes, whatever the size of
        what it holds (issue 29, item 6: a ping that parsed every ledger took 668 ms
        with one 64 MiB ledger). *full* (a diagnostic, ``ping(full=True)``) adds what
        costs a read of every ledger, of ``/proc/self`` or a look at every memfd: the
        generations held, the broker's descriptors (others of the user cannot list them:
        it is not dumpable), the memfds whose descriptors it let go of (FORWARDABLE) and
        whether libtorch is mapped in it."""
        counters = {
            "pid": os.getpid(),
            "clients": sum(1 for c in self.clients.values() if c.conns),
            "clients_away": sum(1 for c in self.clients.values() if not c.conns),  # alive, no connection
            "connections": len(self.conns),
            "segments": len(self.memfds),
            "segment_files": len(self.files),
            "draining": len(self.draining),
            # of those, kept because a live process holds their generation (it may
            # forward them), not for refs in flight
            "draining_held": sum(1 for seg in self.draining if self._reach(seg) == self._HELD),
            "handshakes": len(self.handshakes),
            "root_alive": self.root_alive,
            "records": dict(self.records),
        }
        if full:
            counters["generations_held"] = sum(len(self._ledger_holds(c.ledger)) for c in self.clients.values())
            counters["memfds_let_go"] = sum(1 for seg in self.memfds.values() if seg.fd < 0)  # only held: FORWARDABLE
            counters.update(_own_descriptors())
            counters["libtorch_mapped"] = _maps_libtorch()
        counters["ledger_bytes_read"] = self.ledger_bytes_read
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
        and the log says so once a minute (issue 29, item 2: 100% CPU and 28,000
        WARNING lines a second)."""
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
                # dies (issue 27: counted out alive, its tensors were overwritten).
                log.debug("pid %d closed its connections and lives: known until it reconnects or dies", client.pid)
        if not self.conns:
            self.idle_since = time.monotonic()
            if self.draining and self.root_alive and log.isEnabledFor(logging.DEBUG):
                # Normal: a sender that exited before its receiver loaded what it put,
                # or refs nobody will load (a DataLoader stopped early). They go with
                # the program's root, or after ORPHAN_TTL.
                log.debug("no client left, staying for what is still in flight: %s", self.holdings())

    def _count_out(self, client: _Client) -> None:
        """*client* is gone (dead, its connections closed and read; or it said K): what
        it held goes, what it sent stays while in flight."""
        if self.clients.get(client.token) is not client:
            return  # counted out already (meanwhile, by a read this one started)
        if client.keeps and client.watched and not client.dead and (client.sent or client.ledger >= 0):
            # K: its process lives on without these connections (``unregister()``).
            # What it used here goes now (it posts no drop any more); what it sent
            # stays while in flight, and what it holds is counted out from its ledger
            # at its death: it stays known until then (issue 36, item 7: its messages
            # were dropped ORPHAN_TTL after, its holds pinned their segments for good).
            log.debug("pid %d lives on without connections: known until it dies", client.pid)
            self._drop_deposits(client, list(client.segs), died=True)
            self._release(client, list(client.holds), died=True)
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
            _close_ledger(client)  # it counts itself out (K), or holds nothing
        for seg in client.sent:
            seg.senders.discard(client)  # its refs still in flight keep their segments ORPHAN_TTL from now
        client.sent.clear()
        self._drop_deposits(client, list(client.segs), died=True)
        self._release(client, list(client.holds), died=True)
        if client.watched and not any(c.pid == client.pid for c in self.clients.values()):
            self._unwatch(client.pid)

    def _adopt_ledger(self, client: _Client, fd: int) -> None:
        """*client* posted its ledger *fd*: it replaces the one kept for it. A ledger
        is one process's record of what it holds here: known to one identity of that
        process at a time. Another identity of the same process that has it lets go of
        it (one whose K was lost: its process closed its connections while the broker
        was stopped and its buffer full, and went on with a new identity); else the
        process's death would count its holds out twice (issue 29, item 6)."""
        try:
            key = P.identity(os.fstat(fd))
        except OSError:
            os.close(fd)
            raise
        _close_ledger(client)
        client.ledger, client.ledger_key = fd, key
        for other in [c for c in self.clients.values() if c.pid == client.pid and c is not client]:
            if other.ledger >= 0 and other.ledger_key == client.ledger_key:
                log.debug("pid %d posted its ledger again under a new identity: the old one lets go of it", client.pid)
                _close_ledger(other)
                if not other.conns and other.holds_nothing():
                    self._count_out(other)  # away, and nothing left to count out at its death

    def _watch(self, pid: int) -> bool:
        """Watch process *pid*'s death (one pidfd per process, in the epoll); False if
        it cannot be (no pidfd_open: kernel before 5.3; or it died already): its
        clients are then counted out at their last close, as before issue 27."""
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

    def holdings(self, limit: int = 20) -> str:
        """What keeps this broker alive without clients, for its log: each segment
        with refs in flight, and its header."""
        parts = []
        for seg in list(self.draining)[:limit]:
            until = f"until {seg.until - time.monotonic():.0f} s from now" if seg.until else "while held or while a sender lives"
            try:
                header = self._header(seg)
            except _AtLimit:
                header = None
            parts.append(f"segment {seg.key} (header {header}, {until})")
        if len(self.draining) > limit:
            parts.append(f"... {len(self.draining) - limit} more segment(s)")
        return "; ".join(parts) or "nothing"

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
            self._let_go_gens(self.departed.pop())

    def _handle(self, conn: _Conn, op: bytes, key: bytes, body: bytes, fds: list[int], lost: bool = False) -> bool:
        """One record; False if the connection was dropped.

        Whatever goes wrong with one record drops its connection only: the broker
        keeps every other process's segments. Descriptors a record brought and did
        not leave here are closed.
        """
        client = conn.client
        name = op.decode("ascii", "replace")
        self.records[name] = self.records.get(name, 0) + 1
        try:
            if op == P.SEGMENT:
                if conn.post:
                    raise P.ProtocolError("a segment record comes on the request connection: it is answered")
                if fds and not lost and not self._keep_spares():
                    # It took a descriptor kept for connections: the broker is full.
                    os.close(fds.pop())
                    self._keep_spares()
                    lost = True
                    self._log_full(conn.pid)
                if lost:
                    status = P.STATUS_LOST  # its sender fails, before any ref to it is sent
                elif len(fds) != 1 or not (body in (P.SEG_MADE, P.SEG_TORCH, P.SEG_FORWARDED) or body.startswith(P.SEG_FILE)):
                    raise P.ProtocolError("a segment record carries one descriptor and its kind")
                elif body.startswith(P.SEG_FILE):
                    names = P.decode_names(body[len(P.SEG_FILE) :])
                    if len(names) != 1:
                        raise P.ProtocolError("a file's segment record names one file")
                    self._hold(client, names, fds.pop())
                else:
                    self._deposit(client, fds.pop(), body != P.SEG_TORCH, forward=body == P.SEG_FORWARDED)
                    status = P.STATUS_OK
                P.send_record(conn.sock, P.DEPOSITED, P.NO_KEY, bytes([status]))
            elif op == P.DROP:
                self._drop_deposits(client, P.decode_inos(body), died=False)
            elif op == P.FETCH:
                inos = P.decode_inos(body)
                if len(inos) != 1:
                    raise P.ProtocolError(f"a fetch names one memfd, not {len(inos)}")
                seg = self.memfds.get(inos[0])  # deposits are answered: none is still queued
                if seg is None or seg.fd < 0:
                    P.send_record(conn.sock, P.FETCHED, P.NO_KEY, P.encode_fetched(P.STATUS_UNKNOWN, 0))
                else:
                    P.send_record(conn.sock, P.FETCHED, P.NO_KEY, P.encode_fetched(P.STATUS_OK, 1), [seg.fd])
            elif op == P.HOLD:
                self._hold(client, P.decode_names(body))
            elif op == P.RELEASE:
                self._release(client, P.decode_names(body), died=False)
            elif op == P.LEDGER:
                if lost:
                    pass  # not counted out if it dies: its holds keep their segments from reuse
                elif len(fds) != 1 or body or not stat.S_ISREG(os.fstat(fds[0]).st_mode):
                    raise P.ProtocolError("a ledger record carries one memfd and no body")
                else:
                    self._adopt_ledger(client, fds.pop())
            elif op == P.KEEP:
                if body:
                    raise P.ProtocolError("a keep record has no body")
                client.keeps = True  # it closes and lives on: it counts itself out
            elif op == P.PING:
                if body not in (b"", P.PING_FULL):
                    raise P.ProtocolError(f"a ping's body is empty or {P.PING_FULL!r}")
                self._read_posts()
                P.send_record(conn.sock, P.PONG, P.NO_KEY, json.dumps(self.counters(full=body == P.PING_FULL)).encode())
            else:
                raise P.ProtocolError(f"unknown op {op!r}")
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

    def _expire(self, now: float) -> None:
        for fd in [fd for fd, shake in self.handshakes.items() if shake.deadline <= now]:
            shake = self.handshakes.pop(fd)
            log.warning("closed a connection of pid %d: no handshake within %.0f s", shake.pid, P.HANDSHAKE_TIMEOUT)
            self.poller.unregister(fd)
            shake.sock.close()
        if self.draining or self.retry:
            self._drain(now)

    # -- main loop -------------------------------------------------------------

    def _should_exit(self, now: float) -> bool:
        if self.stopping:
            return True
        # Only authenticated clients keep a broker; a connection still in its handshake
        # does while the program's root lives (a client racing an idle exit is served),
        # never after: a process of the user connecting every few seconds without the
        # key no longer keeps a dead program's broker and directory (issue 29, item 3).
        if self.conns or (self.handshakes and self.root_alive) or self.idle_since is None:
            return False
        if self.draining and self.root_alive:
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
            elif self.draining or self.retry or not conns:
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
            if self.handshakes or self.draining or self.retry:
                self._expire(now)
            if len(self.spares) < SPARE_DESCRIPTORS:
                self._keep_spares()
            self._resume_accepting(now)

    def shutdown(self) -> None:
        for seg in list(self.memfds.values()) + list(self.files.values()):
            _unmap_header(seg)
            if seg.fd >= 0:
                os.close(seg.fd)
        self.memfds.clear()
        self.files.clear()
        for client in self.clients.values():
            _close_ledger(client)
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


def _close_ledger(client: _Client) -> None:
    if client.ledger >= 0:
        os.close(client.ledger)
        client.ledger, client.ledger_key = -1, 0


def _drain_pipe(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _unmap_header(seg: _Segment) -> None:
    """Unmap the header the broker read of *seg*, if it did."""
    if seg.addr:
        unmap(seg.addr, _native.HEADER_BYTES)
        seg.addr = 0


def _level(exc: BaseException) -> int:
    """The level of a line about a connection dropped for *exc*: DEBUG where its
    process merely went away (exited or killed with a request unanswered: the normal
    end of a DataLoader worker it shut down), WARNING for the rest (a protocol error,
    another I/O failure), which a user must look into."""
    return logging.DEBUG if isinstance(exc, (BrokenPipeError, ConnectionResetError)) else logging.WARNING


def _pid_alive(pid: int) -> bool:
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

    The lock, not the path, decides who removes a directory (issue 27, finding B):
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


def _lock_if_free(directory: str) -> int | None:
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
    (issue 27, finding B: a sweep that checked the lock, let go of it and removed by
    path later deleted a fresh broker's directory, and a second broker started)."""
    removed = []
    for path in stale_dirs(base):
        if path == keep:
            continue
        lock_fd = _lock_if_free(path)
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
    removed) or ``_make_program_dir`` (a ``.new-<pid>`` being made) left: this user's
    private directories of those names whose process is dead, STALE_MIN_AGE old
    (issue 29, item 4)."""
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return []
    found = []
    for entry in entries:
        match = _LEFTOVER.fullmatch(entry)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        path = os.path.join(base, entry)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077 and time.time() - st.st_mtime >= STALE_MIN_AGE:
            found.append(path)
    return found


def _make_program_dir(directory: str) -> None:
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


def _lock_program_dir(directory: str) -> int | None:
    """Take *directory*'s lock, making the directory if need be: the lock's
    descriptor, or None if a live broker holds it.

    A lock taken on a file that is no longer at the lock's path is not the
    directory's: the janitor of a broker that died removed the directory (and then
    let go of its lock) between our open and our flock, and another launcher may
    have made it anew since. Before this check such a launcher went on to bind in
    the new directory beside its rightful broker, or later had its own janitor
    remove a directory another broker served: two brokers for one program, senders
    on one, receivers finding no socket (issue 19, item 4). Then: make and lock it
    again.
    """
    path = os.path.join(directory, P.LOCK_NAME)
    for _attempt in range(20):
        _make_program_dir(directory)
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


def launch(directory: str, root_pid: int, authkey: bytes, status: socket.socket | None = None) -> int:
    """Start a broker for *directory* unless one runs; return the exit status.

    *status*: the starter's status socket, closed in the broker's processes (it is
    the launcher's alone, and a launcher answers only once it has returned)."""
    base = os.path.dirname(directory)
    lock_fd = _lock_program_dir(directory)
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
        # could open the memfds it keeps, read-write, through /proc/<broker>/fd (issue
        # 29, item 5). It reads its own counts for them (ping(full=True)).
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


STATUS_FD = 3  # the launcher's end of the starter's status socket (see the module docstring)
START_WAIT = 30.0  # seconds the launcher waits for the authkey: it is sent before the launcher starts


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m shmreduce.broker.server DIR ROOT_PID  (status socket on descriptor 3)", file=sys.stderr)
        return 2
    # posix_spawn closes nothing: descriptors the starter had open without
    # close-on-exec (descriptors received over sockets, a user's) are not ours to keep
    # alive for the broker's whole life.
    os.closerange(STATUS_FD + 1, os.sysconf("SC_OPEN_MAX"))
    try:
        status = socket.socket(fileno=STATUS_FD)
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
