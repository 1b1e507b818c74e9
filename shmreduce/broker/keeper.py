"""What the broker keeps: the segments' lifetimes at the broker.

stdlib only, never imports torch; no sockets, no epoll, no clock of its own: the
server (``server.py``) hands it what its records say (``deposit``, ``hold``,
``drop``, ``release``), the deaths of processes (``forget``, ``count_out``) and
the time (``settle``, ``drain``), and the keeper answers from the segments'
headers (``_native``'s header functions) and the clients' ledgers. The rules it
follows are written once, in ``protocol.py`` ("Lifetimes").

A segment is kept while a client uses it (``use``: a memfd's depositor, a file's
holder), then *drains* while anything can still reach it (``reach``): a process
holds its generation, refs sent in it wait to be loaded, or ORPHAN_TTL after their
last sender died (a storage torch moved for shmreduce has its header past it:
``Segment.at``). A memfd without a header (a storage torch shared for the user) has
nothing that counts its refs: it drains ORPHAN_TTL from its last user's death. What
it keeps:

- ``memfds``: deposited memfds, by inode, each with its descriptor (fetched by
  receivers) and its header, mapped;
- ``files``: the program directory's segment files clients hold, by name;
- ``draining``: the segments nobody uses that are still reachable, looked at by
  ``drain``;
- ``forwardable``: of those, the memfds only held whose descriptors it keeps
  (FORWARDABLE at most);
- ``unreached``: ledger entries of dead processes in segments it knows no
  descriptor or file of yet, counted out when one comes;
- ``retry``: segments whose header was unreadable at a limit of this process,
  counted out at the next ``drain``.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Iterable

from shmreduce import _native
from shmreduce._platform import map_shared, unmap
from shmreduce.broker import protocol as P

ORPHAN_TTL = float(os.environ.get("SHMREDUCE_ORPHAN_TTL", "60"))  # see Lifetimes in protocol.py
DRAIN_EVERY = 0.1  # seconds between two looks at the draining segments' headers
LEDGER_SCAN_EVERY = 1.0  # seconds between two reads of every ledger (a held RETIRED generation's holders)
HELD_LOOK_EVERY = 1.0  # seconds between two looks at a draining segment kept only because it is held
# Draining memfds kept only because a process holds their generation, every ref sent
# in them loaded, whose descriptors the broker keeps (a holder may forward from them,
# or load a blob of them again): past that, the oldest one's descriptor is closed. Its
# record and header stay, and its memory while its holders map it; a fetch of it is
# answered unknown (a forwarder shares the storage anew, in its own pool). So the
# broker holds a bounded number of descriptors however much receivers keep.
FORWARDABLE = 4

# What keeps a segment nobody uses (``Keeper.reach``): the rule a timer follows (a
# timer frees only what no message or holder can reach any more).
HELD, SENT, ORPHANED, UNREACHED = 0, 1, 2, 3

log = logging.getLogger("shmreduce.broker")


class Account:
    """What one client process has at the keeper: the segments it deposited, the
    files it holds, the segments it sends refs in, its ledger (the generations it
    holds as a receiver). The server's client (``server._Client``) is one."""

    __slots__ = ("holds", "segs", "sent", "ledger", "ledger_key")

    def __init__(self) -> None:
        self.holds: set[str] = set()  # segment files it holds (their owner)
        self.segs: set[int] = set()  # memfds it deposited, by inode
        self.sent: set[Segment] = set()  # segments it sends refs in (deposited, forwarded or held), let go of or not
        self.ledger = -1  # its ledger's memfd (protocol.py, "Ledger"), read once it is gone
        self.ledger_key = 0  # that memfd's identity (protocol.identity)

    def holds_nothing(self) -> bool:
        return self.ledger < 0 and not self.segs and not self.holds


class Segment:
    """A segment the broker keeps for the program: a memfd (its descriptor, by inode)
    or a file of the program directory (by name). Kept while a client uses it (its
    maker: a memfd's depositor, a file's holder), then while anything can reach it
    (``Keeper.reach``): a process holds its generation, or refs sent in it wait to
    be loaded while one of their senders lives, or ORPHAN_TTL after the last died."""

    __slots__ = ("key", "fd", "header", "at", "users", "senders", "until", "map", "addr", "look", "forwarded", "batch")

    def __init__(self, key: int | str, fd: int, header: bool, at: int = 0) -> None:
        self.key = key
        self.fd = fd  # a memfd's; -1 for a file
        self.header = header  # the generation and its counters: a pooled segment's first HEADER bytes, ...
        self.at = at  # ... or those from here (a storage torch moved for shmreduce: it trails it)
        self.users = 0
        self.senders: set[Account] = set()  # live clients that sent refs in it (its makers and forwarders)
        self.until = 0.0  # once only refs of dead senders reach it: when it goes, loaded or not; 0: not timed
        self.addr = 0  # its header, once read (mapped without a descriptor: map_shared)
        self.look = 0.0  # draining: not looked at again before then (only held: HELD_LOOK_EVERY)
        self.forwarded = False  # a memfd a process that did not make it sent from: its descriptor stays
        self.batch: tuple[int, ...] = ()  # the memfds deposited with it (one message's storages torch moved)


class _AtLimit(OSError):
    """A segment's header could not be read for a limit of this process (descriptors,
    memory): not that it has none. Whatever asked keeps the segment, and asks again."""


class Keeper:
    """The segments the broker keeps for one program directory (*directory*: where
    its segment files are). *room*: calls its argument, which opens one descriptor
    (a header's file), making room at the descriptor limit if it can (the server's
    spares); *ledgers*: the ledgers' memfds of every client known (a held RETIRED
    generation asks them who holds it)."""

    def __init__(
        self,
        directory: str,
        room: Callable[[Callable[[], int]], int] = lambda make: make(),
        ledgers: Callable[[], Iterable[int]] = tuple,
    ) -> None:
        self.dir = directory
        self.room = room
        self.ledgers = ledgers
        self.memfds: dict[int, Segment] = {}  # inode -> deposited memfd
        self.files: dict[str, Segment] = {}  # name -> held file
        self.draining: set[Segment] = set()  # no user left, still reachable (``reach``)
        self.forwardable: dict[int, Segment] = {}  # draining memfds only held, by inode, oldest first (FORWARDABLE)
        self.drained_at = float("-inf")
        self.ledgers_read_at = float("-inf")
        self.ledger_holds: set[tuple[int | str, int]] = set()  # _held_in_ledgers
        # Ledger entries of dead processes in segments the broker knows no descriptor or
        # file of (yet), by segment: counted out when one comes (_count_out_unreached).
        self.unreached: dict[int | str, list[tuple[int, int]]] = {}
        self.retry: set[Segment] = set()  # known segments with unreached entries: their header was unreadable
        self.ledger_bytes_read = 0  # what it read of ledgers (at deaths; a full ping): a plain ping reads none

    def deposit(self, client: Account, fd: int, header: str, forward: bool = False) -> int | None:
        """*client* sends refs to the memfd *fd* (taken over here): kept by inode.
        *forward*: a segment it received and sends on (it did not make it): it is
        one of the segment's senders, not a user (as a user, a relay's deposit would
        keep every memfd it forwarded for the relay's life). One without a header
        (nothing counts its refs) is kept at least ORPHAN_TTL from this deposit, as
        from its depositor's let-go. *header*: where its header lies (``P.SEG_KINDS``):
        one that trails a storage lies in its last HEADER_BYTES, on a page boundary.
        Its inode, None for a descriptor that is no file."""
        try:
            st = os.fstat(fd)
            ino = P.identity(st)
        except OSError:
            os.close(fd)
            return None
        at = st.st_size - _native.HEADER_BYTES if header == "trail" else 0
        if header == "trail" and (at <= 0 or at % _native.HEADER_BYTES):
            header = ""  # not a storage's trailing header: treated as none
        seg = self.memfds.get(ino)
        if seg is None:
            seg = self.memfds[ino] = Segment(ino, fd, bool(header), at)
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
            if not seg.header and not seg.users:
                seg.until = max(seg.until, time.monotonic() + ORPHAN_TTL)
        self._sends(client, seg)
        if not forward and ino not in client.segs:
            client.segs.add(ino)
            self.use(seg)
        self._count_out_unreached(seg)
        return ino

    def batch(self, inos: list[int]) -> None:
        """These memfds were deposited in one record (the storages torch moved for one
        message): a receiver that fetches one of them gets those after it with it."""
        batch = tuple(inos)
        for ino in inos:
            self.memfds[ino].batch = batch

    def fetch(self, ino: int, most: int = 1) -> list[tuple[int, int]]:
        """The memfd *ino*'s (inode, descriptor), then those of the memfds deposited
        after it with it that the broker keeps a descriptor of (*most* in all): the
        next storages of its message, which its receiver loads next. Empty if it
        keeps none of *ino*."""
        seg = self.memfds.get(ino)
        if seg is None or seg.fd < 0:
            return []
        found = [(ino, seg.fd)]
        batch = seg.batch
        for other in batch[batch.index(ino) + 1 :] if batch else ():
            if len(found) >= most:
                break
            kept = self.memfds.get(other)
            if kept is not None and kept.fd >= 0:
                found.append((other, kept.fd))
        return found

    def _sends(self, client: Account, seg: Segment) -> None:
        """*client* sends refs in *seg*: while it lives, they keep *seg* (see ``reach``)."""
        if client not in seg.senders:
            seg.senders.add(client)
            client.sent.add(seg)

    def hold(self, client: Account, names, fd: int = -1) -> None:
        """*client* made these files and holds them. *fd*: one file's descriptor, its
        file gone (its directory went with a broker that died): its header is read
        through it, and nothing is unlinked at its close."""
        for name in names:
            if name in client.holds or not P.is_segment_name(name):
                continue
            seg = self.files.get(name)
            if seg is None:
                seg = self.files[name] = Segment(name, -1, True)
            if fd >= 0 and seg.fd < 0:
                _unmap_header(seg)
                seg.fd, fd, seg.header = fd, -1, True
            client.holds.add(name)
            self._sends(client, seg)
            self.use(seg)
            self._count_out_unreached(seg)
        if fd >= 0:
            os.close(fd)

    def _count_out_unreached(self, seg: Segment) -> None:
        """Count out of *seg* what the ledgers of dead processes said they held in it
        while the broker could not reach it (it knew no descriptor or file of it: a
        broker restarted, and its owner had not come back yet): exactly as at their
        deaths (``count_out``)."""
        pending = self.unreached.pop(seg.key, None)
        if pending:
            self._count_out_entries(seg, pending)

    def use(self, seg: Segment) -> None:
        seg.users += 1
        self.draining.discard(seg)
        if isinstance(seg.key, int):
            self.forwardable.pop(seg.key, None)

    def _unuse(self, seg: Segment) -> None:
        """One user less; with none left, *seg* goes once nothing reaches it
        (``reach``). A memfd without a header (a storage torch shared for the user:
        its depositor lets go of it at its death) is kept ORPHAN_TTL from then: no
        header counts its refs in flight, so the broker cannot tell when the last
        was loaded, and treats them as refs whose senders are gone (ORPHANED). A
        file never made (a name held for later) goes."""
        seg.users -= 1
        if seg.users > 0:
            return
        if isinstance(seg.key, int) and not seg.header:
            seg.until = time.monotonic() + ORPHAN_TTL
            self.draining.add(seg)
            return
        self.draining.add(seg)
        self.settle(seg, time.monotonic())

    def reach(self, seg: Segment) -> int:
        """What can still reach *seg*, whose users all let go of it:

        HELD        a process holds its generation (the header's holders: exact, each
                    counted out at its death from its ledger): it may forward it, so
                    the segment stays (a file unlinked once sent == loaded would be
                    gone under the DataLoader batches the main process forwards).
                    In a RETIRED generation the count may be one too many (a process
                    killed mid-take or mid-let-go): there, a live process's ledger
                    naming it decides (``_held_in_ledgers``), or a phantom hold would
                    keep the segment for the program's life;
        SENT        refs sent in its generation are not all loaded (a ref loaded again
                    counts once: its ticket; a generation whose tickets ran past the
                    bitmap, UNCOUNTED, cannot tell) and one of their senders lives: they
                    wait for it, however long (a timer would drop a retired slab's
                    messages while their sender lives);
        ORPHANED    such refs, every sender dead: kept ORPHAN_TTL from then;
        UNREACHED   nothing: it goes now."""
        try:
            header = self._header(seg)
        except _AtLimit:
            return SENT  # unknown for now: kept, and settled again
        if header is None:
            return UNREACHED
        try:
            if header[3] > 0:
                if not _native.hdr_flags(seg.addr) & _native.RETIRED or (seg.key, header[0]) in self._held_in_ledgers():
                    return HELD
            if self._loaded(seg, header):
                return UNREACHED
        except OSError:
            self._truncated(seg)
            return UNREACHED
        return SENT if seg.senders else ORPHANED

    def _held_in_ledgers(self) -> set[tuple[int | str, int]]:
        """(segment, generation) of every entry of every known client's ledger, read
        at most every LEDGER_SCAN_EVERY seconds (only a held RETIRED generation asks)."""
        now = time.monotonic()
        if now - self.ledgers_read_at >= LEDGER_SCAN_EVERY:
            self.ledgers_read_at = now
            self.ledger_holds = {(key, gen) for fd in self.ledgers() for key, gen, _state in self.read_ledger(fd)}
        return self.ledger_holds

    def settle(self, seg: Segment, now: float) -> None:
        """*seg*, draining (no user), closed if nothing reaches it; timed while only
        refs of dead senders do. One only held is looked at every HELD_LOOK_EVERY
        (only its holders' let-go, which posts nothing, frees it): a drain costs
        the same however much receivers keep."""
        reach = self.reach(seg)
        if reach == UNREACHED:
            self._close(seg)
        elif reach == ORPHANED:
            if not seg.until:
                seg.until = now + ORPHAN_TTL
            elif now >= seg.until:
                log.debug("let go of segment %s: refs sent in it not loaded within %.0f s (SHMREDUCE_ORPHAN_TTL)", seg.key, ORPHAN_TTL)
                self._close(seg)
        else:
            seg.until = 0.0
            if reach == HELD:
                seg.look = now + HELD_LOOK_EVERY
                if isinstance(seg.key, int) and seg.fd >= 0 and not seg.forwarded and self._all_loaded(seg):
                    self._forwardable(seg)

    @staticmethod
    def _loaded(seg: Segment, header: tuple[int, int, int, int]) -> bool:
        """Whether every ref sent in the generation of *seg*'s *header* was loaded: as
        many loaded as sent, each counted (not UNCOUNTED). OSError: truncated under it."""
        return header[1] <= header[2] and not _native.hdr_flags(seg.addr) & _native.UNCOUNTED

    def _all_loaded(self, seg: Segment) -> bool:
        """Whether every ref sent in *seg*'s generation was loaded (its header says)."""
        try:
            header = self._header(seg)
            return header is not None and self._loaded(seg, header)
        except OSError:
            return False

    def _forwardable(self, seg: Segment) -> None:
        """*seg*, a memfd only held, keeps its descriptor if it is one of the newest
        FORWARDABLE such; the oldest one's is closed (see FORWARDABLE)."""
        assert isinstance(seg.key, int)
        self.forwardable.setdefault(seg.key, seg)
        while len(self.forwardable) > FORWARDABLE:
            oldest = self.forwardable.pop(next(iter(self.forwardable)))
            if oldest.fd >= 0:
                os.close(oldest.fd)
                oldest.fd = -1

    def _header(self, seg: Segment) -> tuple[int, int, int, int] | None:
        """(generation, sent, loaded, holders) of *seg*, or None if it has none."""
        if not seg.header:
            return None
        if not seg.addr:
            fd = seg.fd
            if fd < 0 and isinstance(seg.key, int):
                return None  # a memfd whose descriptor was let go of keeps its header mapped
            try:
                if fd < 0:
                    fd = self.room(lambda: os.open(os.path.join(self.dir, str(seg.key)), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC))
                try:
                    if os.fstat(fd).st_size < seg.at + _native.HEADER_BYTES:
                        raise ValueError("smaller than a header")
                    seg.addr = map_shared(fd, _native.HEADER_BYTES, seg.at)
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

    def _truncated(self, seg: Segment) -> None:
        """*seg*'s file was truncated by a process of the user: its header is gone, and
        so are the bytes of what was sent in it (their loads fail, stale); the broker
        goes on, and treats it as a segment without a header."""
        log.warning("segment %s was truncated under its header by another process: what was sent in it is lost", seg.key)
        seg.header = False
        _unmap_header(seg)

    def _close(self, seg: Segment) -> None:
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

    def drop(self, client: Account, inos) -> None:
        for ino in inos:
            if ino in client.segs:
                client.segs.discard(ino)
                self._unuse(self.memfds[ino])

    def release(self, client: Account, names) -> None:
        for name in names:
            if name in client.holds:
                client.holds.discard(name)
                self._unuse(self.files[name])

    def count_out(self, client: Account) -> None:
        """A receiver died: count it out of the holders of every generation its
        ledger says it holds. An entry of a segment the broker keeps no descriptor or
        file of waits in ``unreached`` until one comes (its owner, back after a broker
        restart, deposits what it keeps), and is counted out then,
        as here; a segment nobody brings again was let go of by its owner (closed, or
        dead: nobody reuses it)."""
        found: dict[int | str, list[tuple[int, int]]] = {}
        for key, gen, state in self.read_ledger(client.ledger):
            found.setdefault(key, []).append((gen, state))
        for key, entries in found.items():
            seg = self.memfds.get(key) if isinstance(key, int) else self.files.get(key)
            if seg is None:
                self.unreached.setdefault(key, []).extend(entries)
            else:
                self._count_out_entries(seg, entries)
        close_ledger(client)

    def _count_out_entries(self, seg: Segment, entries: list[tuple[int, int]]) -> None:
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

    def read_ledger(self, fd: int) -> list[tuple[int | str, int, int]]:
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

    def drain(self, now: float) -> None:
        """Close the segments nobody uses that nothing reaches any more, or whose time
        is up (``reach``); at most every DRAIN_EVERY seconds (a header read each)."""
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
                    self.settle(seg, now)
            elif now >= seg.until:  # a storage torch shared, its depositor gone or done with it
                self._close(seg)

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

    def let_go(self, client: Account) -> None:
        """*client*'s process uses nothing here any more (it died, or lives on without
        connections): its deposits and holds go as at a death; what it sent stays
        while in flight."""
        self.drop(client, list(client.segs))
        self.release(client, list(client.holds))

    def forget(self, client: Account) -> None:
        """*client* is gone: it sends nothing more, and what it used goes (``let_go``)."""
        for seg in client.sent:
            seg.senders.discard(client)  # its refs still in flight keep their segments ORPHAN_TTL from now
        client.sent.clear()
        self.let_go(client)

    def close_all(self) -> None:
        """The broker stops: every descriptor and header it keeps is let go of."""
        for seg in list(self.memfds.values()) + list(self.files.values()):
            _unmap_header(seg)
            if seg.fd >= 0:
                os.close(seg.fd)
        self.memfds.clear()
        self.files.clear()


def close_ledger(client: Account) -> None:
    if client.ledger >= 0:
        os.close(client.ledger)
        client.ledger, client.ledger_key = -1, 0


def _unmap_header(seg: Segment) -> None:
    """Unmap the header the broker read of *seg*, if it did."""
    if seg.addr:
        unmap(seg.addr, _native.HEADER_BYTES)
        seg.addr = 0
