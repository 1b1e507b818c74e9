"""Recycled pools of shared memory: segments, their generations, and who holds them.

A sending process keeps a ``Pool`` of the segments (``segments.Segment``) it made,
one per strategy: small storages (up to ``SLAB_ITEM_MAX``) are packed at offsets
into its thread's current *slab* (``SLAB_SIZE`` bytes), across messages; mid-size
ones (up to ``ARENA_ITEM_MAX``) the same way into its current *arena* (``ARENA_SIZE``,
less on a small file_system mount: ``FilePool.arena_size``); a larger storage gets a
segment of its size class (eight classes per doubling).

Generations. A segment is filled anew in *generations*. A generation is a number
unique in the program, written into the segment's first ``HEADER`` bytes with its
shared counters (refs sent, refs loaded, holders: ``broker/protocol.py``). In each
process the storages of one generation are made by one *Gen*, a ``_native.Gen``:
a storage over the mapping through DLPack, its range checked in C. The Gen counts
its live storages (and holds: the slab it is, a load in progress) natively; torch's
deleter decrements the count when a storage dies, on any thread, and the Gen whose
count reaches zero is handed to ``transfer.settle_dead`` (``_native.dead()``): "the
last storage of generation G died here" is known exactly, without weak references. The Gen
keeps its segment, and so the mapping. A Gen whose count reached zero is revived
by a new storage until ``settle_dead`` takes it. When a Gen dies:

- in the owner: the generation is over here. The segment is free at once if nobody
  holds the generation elsewhere and every ref sent in it was loaded
  (``_native.hdr_end``, which ends the generation in the header: a stale ref is
  refused); else it waits (``Pool.waiting``) and is checked again when the pool
  needs a segment and by the collector, every ``transfer.PURGE_EVERY``.
- in a receiver: it lets go of the generation (its entry in this process's
  ledger, which the broker reads if it dies, cleared first, then the header's
  holders: no record). In a stream of messages in one slab, each dropped before
  the next arrives, the next message's storage revives the Gen before it is
  settled: a slab's generation is held once, not once per message.

A free segment is reused with its pages already in memory (no page fault per page,
no new descriptor, no new mapping in any process that keeps it mapped). Memory stays
valid wherever it is mapped until every process has let go of every storage in it:
aliasing holds as with torch.

A receiver keeps its latest mappings after their last storage dies
(``segments.keep``). A segment its owner lets go of while free has its pages punched
out first (``Pool.discard``): a kept mapping of it pins its header page only, in
memory or in the file_system mount.

Copies: a slab's pages are allocated when it is made, so a small storage is one
copy into the mapping; a larger one is copied through the mapping into pages its
segment has already, through its descriptor into new ones (no page fault per page).

Transitions. Each change of a generation is one operation on (segment, generation)
that does nothing, and says so, when the header no longer holds that generation:
``hdr_end`` (in C, under the header's FREEING bit) frees it or claims its retired
close for exactly one caller; ``Pool.waiting`` keeps the generation each segment
waits for, and only the caller whose transition it was takes the entry out. No
thread acts on a generation read before another thread could run: a stale reaper
ends nothing of the next generation.

Locks. ``Pool.lock`` guards the free lists and ``waiting``, and is a leaf: nothing
is called out (no post to the broker, no hook) while it is held: what is closed is
taken out under it and closed after (``_close_all``). The broker client's lock is
taken before it (a reconnection's hook reads this pool under the client's lock);
``transfer`` writes the whole order.

States. Whether a segment is its pool's is ``Segment.pool`` (the pool in its
owner, until ``Pool.leave``, the one way out: in use, free, waiting, or *leaving*,
retired with refs in flight, kept until they are loaded). Every path asks it: a memfd
deposited while its pool keeps it is the pool's (the broker counts it a user, dropped
at ``leave``, and a broker restart gets it back, ``transfer._bring_back``); one
deposited once no pool keeps it is a forward, which nobody drops: a received one's,
or its owner's once its pool let go of it (``Segment.outside_its_pool``), which lasts
while the owner holds it as a receiver (``transfer.settle_dead``) and goes back to a new broker
while its refs wait to be loaded. A deposit ends in ``Segment.undeposit``, which
unindexes the segment's Gen with it: the C sender (``_native.reduce``) never sends
from a descriptor its broker may have let go of.

Memory bounds: a pool keeps at most ``POOL_BYTES`` of free segments (the
``SHMREDUCE_POOL_BYTES`` setting), ``IDLE_SEGMENTS`` of them, and closes any left
free for ``POOL_IDLE`` seconds; past ``IDLE_SEGMENTS`` waiting, the longest waiting
leaves the pool, never reused (descriptors stay bounded however much receivers
keep; one per segment with refs in flight, as at the broker); a closed memfd's
memory returns to the system once no process maps it, a closed file's once the
broker unlinks it. Segments alive at a ``fork()`` are never
reused (the child may use their storages without its parent's pool knowing).
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from shmreduce import _faults, _native, _platform, forking, segments
from shmreduce._native import Gen
from shmreduce.errors import OutOfSharedMemory, SharingError
from shmreduce.segments import HEADER, Segment

SLAB_ITEM_MAX = _native.SLAB_ITEM_MAX  # storages up to this size share their thread's current slab
SLAB_SIZE = 1 << 20
# Storages above SLAB_ITEM_MAX up to ARENA_ITEM_MAX share their thread's current arena
# (ARENA_SIZE bytes, at least 64 of them, its pages allocated ARENA_CHUNK at a time as
# it fills), as small ones share slabs: a kept 128 KiB tensor costs no new segment, no
# descriptor, no broker record. An arena (a slab) is free once every storage placed in
# it is gone: a kept storage keeps its whole arena, at most ARENA_SIZE per storage kept
# (a buffer that keeps a run of messages: ARENA_SIZE at most beyond what it keeps).
ARENA_ITEM_MAX = 1 << 18
ARENA_SIZE = 16 << 20
ARENA_CHUNK = 1 << 20
# A file_system arena is at most this share of its mount (one ARENA_ITEM_MAX storage
# at least): on a mount smaller than 8 arenas, what a stream pins beyond its live data
# (the partly dead arenas at either end of a run of messages) stays a small share of
# the mount, instead of one arena filling it while a few messages in it are in flight.
ARENA_MOUNT_SHARE = 8
POOL_BYTES = int(os.environ.get("SHMREDUCE_POOL_BYTES", str(1 << 30)))
POOL_IDLE = float(os.environ.get("SHMREDUCE_POOL_IDLE", "10"))
REAP_PER_TAKE = 8  # waiting segments a take() looks at (Pool.reap_waiting): its cost, however much is kept
# A pool keeps at most IDLE_SEGMENTS segments free and as many waiting (their
# generation over here, held elsewhere or with refs in flight): each keeps a
# descriptor here and, under file_descriptor, one at the broker. Past that, the
# longest waiting leaves the pool (never reused: its memory goes back once its holders
# let go of it) and the oldest free one is closed, so this process and its broker hold a
# bounded number of descriptors however much receivers keep.
IDLE_SEGMENTS = 16
_PAGE = mmap.PAGESIZE
_T = TypeVar("_T")


class _Tier:
    """Where a thread packs storages of one size range: its current slab or arena."""

    __slots__ = ("name", "size")

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size


_SLAB, _ARENA = _Tier("slab", SLAB_SIZE), _Tier("arena", ARENA_SIZE)


def class_size(nbytes: int) -> int:
    """The size of the segment a storage of *nbytes* gets: header included, rounded
    up to one of eight classes per doubling (at most 1/8 spare) and to pages."""
    need = nbytes + HEADER
    step = max(_PAGE, 1 << max(need.bit_length() - 4, 0))
    return -(-need // step) * step


# -- holds and retries -----------------------------------------------------------


class Hold:
    """One count on a Gen held by Python, not by a storage (a thread's current
    slab): let go of when the holder drops it, whatever the thread or the time (a
    thread's slab goes with its thread-local data)."""

    __slots__ = ("seg", "gen")

    def __init__(self, seg: Segment, gen: Gen, take: bool = True) -> None:
        """*take*: acquire a count now; else the maker's hold of a new Gen is handed over."""
        self.seg = seg
        self.gen: Gen | None = None  # none yet: a failed acquire() leaves nothing to release
        if take and not gen.acquire():
            raise RuntimeError("a hold on a Gen that is over")
        self.gen = gen

    def __del__(self) -> None:
        if self.gen is not None:
            self.gen.release()


def twice(full: Callable[[], None], attempt: Callable[[bool], _T]) -> _T:
    """``attempt(False)``; on a full mount (which may be full of segments nobody uses
    any more: ``full()`` lets go of them) ``attempt(True)`` once more, outside the
    first one's handler: one exception, its cause chained once."""
    try:
        return attempt(False)
    except OutOfSharedMemory:
        pass
    full()
    return attempt(True)


# -- generations -------------------------------------------------------------------

# Generation numbers: 64 bits, as a header holds them (a wider one would be compared
# by its low bits only): a random per-process prefix (24 bits) and a counter (40
# bits), never 0 (a segment shmreduce does not pool). Only its owner starts
# generations in a segment, so a stale ref never meets its number again there;
# drawn again in a forked child.
_gen_prefix = int.from_bytes(os.urandom(3), "little") << 40
_gen_count = 0
_gen_lock = threading.Lock()


def new_gen_number() -> int:
    global _gen_count
    with _gen_lock:
        _gen_count += 1
        return _gen_prefix | (_gen_count & 0xFFFFFFFFFF) or 1


# -- pools -------------------------------------------------------------------------


class Pool:
    """The segments of one strategy this process made: free ones by size, those
    waiting until nobody holds their generation, the current slab of each thread."""

    kind = ""

    def __init__(self) -> None:
        self.free: dict[int, list[Segment]] = {}
        # segment key -> (the segment, its generation that is over here, not yet free):
        # the generation its caller saw goes with it to every transition (``end_generation``).
        self.waiting: dict[int | str, tuple[Segment, int]] = {}
        # Retired past IDLE_SEGMENTS waiting with refs in flight: kept (its descriptor, its
        # deposit or hold) until every ref sent in it is loaded, so that a broker
        # restart meanwhile gets it back (``transfer._bring_back``); then closed.
        self.leaving: dict[int | str, tuple[Segment, int]] = {}
        self.free_bytes = 0
        self.made = 0  # segments made, for stats
        self.reused = 0
        self.active = True  # until deactivate() (unregister()), and again from the next place(): free segments are kept
        self.lock = threading.Lock()
        self.local = threading.local()

    # What a strategy provides.
    def create(self, size: int) -> Segment:
        raise NotImplementedError

    def directory(self) -> str:
        raise NotImplementedError

    def full(self) -> None:
        """The memory behind this pool is full: free what can be freed."""

    def arena_size(self) -> int:
        """The size of this pool's next arena."""
        return ARENA_SIZE

    # Placing storages.
    def place(
        self, nbytes: int, source: torch.UntypedStorage | None, zero: bool = True
    ) -> tuple[Segment, int, int, torch.UntypedStorage, Gen]:
        """Put *source*'s bytes (or zeros; unless *zero*, whatever this program left
        there) in a segment: (segment, generation, offset, the new storage there, the
        generation's Gen)."""
        self.active = True
        if nbytes > ARENA_ITEM_MAX:
            return self._own(nbytes, source, zero)
        tier = _SLAB if nbytes <= SLAB_ITEM_MAX else _ARENA
        while True:
            current = self.local.__dict__.get(tier.name)
            if current is not None:
                # put() claims the place first: the one placement routine, which
                # ``_native.reduce`` uses for the same slab. The pages are allocated
                # already (a slab's when it is made, an arena's a chunk ahead: reserve),
                # so a plain copy into the mapping cannot fault on a full memory limit.
                seg, gen = current.seg, current.gen
                mount_full = False
                try:
                    room = tier is _SLAB or seg.reserve(gen.cursor, nbytes, ARENA_CHUNK)
                except OutOfSharedMemory:
                    room, mount_full = False, True  # handled below, outside this handler: one exception if _own fails too
                if mount_full:
                    # The arena ends (its generation with its last storage) and this
                    # storage gets a segment of its own size class, which the next
                    # storage of that size reuses: a stream through a small /dev/shm
                    # goes on in one segment.
                    self.drop_current(tier)
                    return self._own(nbytes, source, zero)
                if room:
                    try:
                        put = gen.put(nbytes, source, zero)
                    except OSError as exc:
                        if not segments.cut(exc):
                            raise
                        seg.lose()  # its generation ends with its last storage (end_generation)
                        self.drop_current(tier)
                        continue  # into a new one
                    if put is not None:
                        return seg, seg.gen, put[0], put[1], gen
            try:
                self._new_current(tier)
                continue  # placed in it on the next turn
            except OutOfSharedMemory:
                if tier is _SLAB:
                    raise
            return self._own(nbytes, source, zero)  # no room for a new arena's header (outside the handler)

    def _own(self, nbytes: int, source: torch.UntypedStorage | None, zero: bool) -> tuple[Segment, int, int, torch.UntypedStorage, Gen]:
        """*source*'s bytes in a segment of its own (its size class)."""
        seg = self.take(class_size(nbytes))
        offset = HEADER
        gen = twice(self.full, lambda last: self._begin(seg, retry=not last))
        try:
            storage = twice(self.full, lambda last: seg.fill(gen, offset, nbytes, source, zero))
        except OSError as exc:
            if not segments.cut(exc):
                raise
            seg.lose()  # cut by another process under this copy: its generation ends with the Gen
            return self._own(nbytes, source, zero)
        finally:
            gen.release()  # the maker's hold: failing, the Gen's death gives the segment back (settle_dead)
        return seg, seg.gen, offset, storage, gen

    def _begin(self, seg: Segment, retry: bool) -> Gen:
        """*seg*'s new generation's Gen. A segment whose header cannot be written
        has no Gen to give it back when it dies: it leaves the pool, unless a full
        mount is to be tried once more (*retry*)."""
        try:
            return seg.begin(new_gen_number())
        except SharingError as exc:
            if not (retry and isinstance(exc, OutOfSharedMemory)):
                self.leave(seg)
            raise

    def _new_current(self, tier: _Tier) -> None:
        """This thread's next slab or arena: the thread keeps its Gen, so a
        generation spans many messages and ends only once the segment is full (and
        every storage in it is gone). A slab's pages are allocated at once, an arena's
        as it fills (``Segment.reserve``)."""
        seg = self.take(tier.size if tier is _SLAB else self.arena_size())
        if tier is _SLAB and seg.filled < seg.size:
            twice(self.full, lambda last: seg.allocate())
        _faults.pause("pool.new_current")
        self.drop_current(tier)
        hold = Hold(seg, self._begin(seg, retry=False), take=False)
        self.local.__dict__[tier.name] = hold
        if tier is _SLAB:
            _native.set_slab(self.kind == "fs", hold.gen)  # reduce() fills it too, once indexed

    def take(self, size: int) -> Segment:
        """A free segment of *size*, else a new one."""
        free = self.free.get(size)
        if not free and self.waiting:
            self.reap_waiting(most=REAP_PER_TAKE)
            free = self.free.get(size)
        if free:
            with self.lock:
                seg = free.pop() if free else None
                if seg is not None:
                    self.free_bytes -= seg.size
            if seg is not None:
                if seg.kind == "fs" and seg.fd is not None and os.fstat(seg.fd).st_size < seg.size:
                    seg.lose()  # cut by another process while free
                    self.leave(seg)
                    return self.take(size)
                self.reused += 1
                return seg
        seg = self.create(size)
        seg.pool = self
        self.made += 1
        return seg

    def reap_waiting(self, most: int | None = None) -> None:
        """Give back the waiting segments that are free now (nobody holds their
        generation and every ref sent in it was loaded: their headers say), close
        those retired meanwhile. *most*: look at that many only, the longest waiting
        first, and send each that must still wait to the back of the line: a take()
        costs the same however much receivers keep, and every waiting segment is
        looked at in turn (the collector looks at all of them, every PURGE_EVERY)."""
        # Each entry carries the generation it waits for: another thread may end it,
        # give the segment back and begin the next one before this loop reaches it,
        # and ``end_generation`` then does nothing. Taken under the lock, which nothing this
        # thread could run meanwhile takes (deleters and finalizers never do).
        with self.lock:
            if most is None:
                pairs = list(self.waiting.values())
            else:
                pairs = list(itertools.islice(self.waiting.values(), most))
        for seg, gen in pairs:
            _faults.pause("reap.end")
            if not self.end_generation(seg, gen, waited=True) and most is not None:
                with self.lock:
                    if self.waiting.get(seg.key) == (seg, gen):
                        del self.waiting[seg.key]
                        self.waiting[seg.key] = (seg, gen)
        if most is None and self.leaving:
            with self.lock:
                leaving = list(self.leaving.values())
            loaded = [seg for seg, gen in leaving if not _in_flight(seg, gen)]
            with self.lock:
                taken = [seg for seg in loaded if self.leaving.pop(seg.key, (None, 0))[0] is seg]
            for seg in taken:  # loaded, not free: its holders keep reading it, so closed, not discarded
                self.leave(seg)

    def generation_over(self, seg: Segment, gen: int) -> None:
        """*seg*'s generation *gen* is over here (its owner's last storage of it died,
        ``transfer.settle_dead``): given back if free, else waiting until it is; closed,
        never reused, if retired or this pool is no longer active (what is in flight in
        it stays readable: the broker keeps it)."""
        if seg.gen != gen:
            return  # reused since: that generation is over already
        if seg.retired or not self.active:
            self.leave(seg)
        elif not self.end_generation(seg, gen):
            self.add_waiting(seg, gen)  # held elsewhere, or refs to it in flight

    def add_waiting(self, seg: Segment, gen: int) -> None:
        """*seg*'s generation *gen* is over here but not free: reaped later. Past
        IDLE_SEGMENTS waiting, the longest waiting leave the pool, never reused."""
        with self.lock:
            self.waiting[seg.key] = (seg, gen)
            over = list(itertools.islice(self.waiting.values(), max(0, len(self.waiting) - IDLE_SEGMENTS)))
            for old, _gen in over:
                # Never reused (a reaper that frees it meanwhile closes it: give_back).
                # Its header is left as it is: the holders it counts are exact (a
                # RETIRED one's are not).
                old.retired = True
                del self.waiting[old.key]
        for old, old_gen in over:
            if _in_flight(old, old_gen):
                with self.lock:
                    self.leaving[old.key] = (old, old_gen)  # closed once its refs are loaded (reap)
            else:
                self.leave(old)  # kept by the broker while a process holds its generation

    def end_generation(self, seg: Segment, gen: int, waited: bool = False) -> bool:
        """*seg*'s generation *gen* is over in its owner: given back if free (nobody
        holds it, every ref sent was loaded), closed if retired (a fork, a process dead
        mid-hold: never reused); False if it must wait. One transition in the header
        (``hdr_end``): of every thread that ends (segment, generation), one gives it
        back or closes it; a stale pair (the segment reused since) does nothing.
        *waited*: it is in ``waiting``, taken out by the thread whose transition it was."""
        try:
            done = _native.hdr_end(seg.addr, gen)
        except OSError:
            # Cut by another process: what was sent in it is lost. Closed by the one
            # caller that takes it out of ``waiting`` (no header says which one now).
            seg.lose()
            with self.lock:
                claimed = not waited or self.waiting.get(seg.key) == (seg, gen)
                if waited and claimed:
                    del self.waiting[seg.key]
            if claimed:
                self.leave(seg)
            return True
        if done == _END_WAIT:
            return False
        if waited or done == _END_STALE:
            with self.lock:
                if self.waiting.get(seg.key, (None, 0)) == (seg, gen):
                    del self.waiting[seg.key]
        if done == _END_FREED:
            self.give_back(seg)
        elif done == _END_RETIRED:
            seg.retired = True
            self.leave(seg)
        return True

    def give_back(self, seg: Segment) -> None:
        """*seg* is free: nobody anywhere holds a storage in it."""
        if seg.pid != os.getpid() or seg.fd is None:
            return
        if seg.retired or not self.active:
            self.discard(seg)  # not reused: after unregister(), memory goes back as storages die
            return
        seg.since = time.monotonic()
        with self.lock:
            self.free.setdefault(seg.size, []).append(seg)
            self.free_bytes += seg.size
            over = self._trim_locked(lambda s: False) if self._over_locked() else []  # the oldest, down to the caps
        self._close_all(over)

    def trim(self, idle: float = POOL_IDLE) -> None:
        """Close the segments free for more than *idle* seconds."""
        if not self.free_bytes:
            return
        cutoff = time.monotonic() - idle
        with self.lock:
            due = self._trim_locked(lambda s: s.since <= cutoff)
        self._close_all(due)

    def _over_locked(self) -> bool:
        """Whether the free segments are over a cap: POOL_BYTES, IDLE_SEGMENTS."""
        return self.free_bytes > POOL_BYTES or sum(map(len, self.free.values())) > IDLE_SEGMENTS

    def _trim_locked(self, due: Callable[[Segment], bool]) -> list[Segment]:
        """Take out of the free lists the oldest segments over the caps and those
        *due*: the caller closes them once it let go of the lock."""
        oldest = sorted((s for segs in self.free.values() for s in segs), key=lambda s: s.since)
        taken = []
        for seg in oldest:
            if not self._over_locked() and not due(seg):
                continue
            self.free[seg.size].remove(seg)
            self.free_bytes -= seg.size
            taken.append(seg)
        return taken

    def _close_all(self, segs: list[Segment]) -> None:
        """Close *segs*, taken out of the pool under its lock, with the lock let go of:
        closing posts to the broker, whose client's lock a reconnection holds while its
        hook takes this pool's lock (the order is written in the module docstring)."""
        for seg in segs:
            _faults.pause("pool.closing")
            self.discard(seg)

    def discard(self, seg: Segment) -> None:
        """*seg*, free (``hdr_end`` freed its generation: no storage lives in it
        anywhere, no ref to it waits), leaves the pool, its pages given back first.
        A receiver keeps its latest mappings after their storages die (``keep``): a
        kept mapping of a segment let go of would pin its pages (in the file_system
        mount: a whole arena's) until that receiver maps other segments, and a sender
        is refused for want of room meanwhile; nor can a sender ask a receiver in
        another process to let go. The owner punches the pages out of the segment
        itself, wherever it is mapped: nothing reads them any more (reuse would
        overwrite them). The header page stays: a stale ref's load counts itself in
        and out of it (``hdr_hold``), which a page punched in between would split
        over two pages. A kept mapping pins that page, no more."""
        start = -(-HEADER // _PAGE) * _PAGE  # the first page after the header
        _platform.release(seg.addr + start, seg.size - start)
        self.leave(seg)

    def leave(self, seg: Segment) -> None:
        """*seg* leaves the pool, once (its memory goes once nothing maps it): its
        deposit or hold at the broker let go of. From then on this process is one of
        its holders at most, as any receiver (``transfer._deposit``)."""
        if seg.pool is self:
            seg.pool = None
            self.release_at_broker(seg)

    def release_at_broker(self, seg: Segment) -> None:
        """What the broker keeps of *seg* for this pool is let go of (a strategy's)."""

    def owned(self) -> list[Segment]:
        """Every segment of this pool this process still has: in use, free,
        waiting until its generation is free, or leaving once its refs are loaded."""
        found = {id(seg): seg for seg in segments.mapped_now() if seg.pool is self and seg.live_gen(seg.gen) is not None}
        with self.lock:
            for segs in self.free.values():
                found.update((id(seg), seg) for seg in segs)
        found.update((id(seg), seg) for seg, _gen in self.waiting.copy().values())
        found.update((id(seg), seg) for seg, _gen in self.leaving.copy().values())
        return [seg for seg in found.values() if seg.pid == os.getpid()]

    def retire_where(self, gone: Callable[[Segment], bool]) -> None:
        """Never use again the segments *gone* names (their files went with a broker
        that died): in use, they are filled no further; free, they are closed; one
        waiting until its generation is free is retired in its header, and closed by
        the next reap (a ref in flight to it may never be loaded: only a receiver
        that maps the file already can, and a retired generation keeps its bytes for
        it); any other (its last storage dead but not settled yet) is closed once free
        instead of reused (reused, it would be filled under a name no receiver can open)."""
        for seg in segments.mapped_now():
            if seg.pool is self and gone(seg):
                seg.retired = True
                seg.seal()
        for seg, gen in self.waiting.copy().values():
            if gone(seg):
                try:
                    _native.hdr_retire(seg.addr, gen)
                except OSError:
                    seg.lose()  # cut: the next reap closes it all the same
        _native.unindex_all()
        taken = []
        with self.lock:
            for segs in self.free.values():
                for seg in [s for s in segs if gone(s)]:
                    segs.remove(seg)
                    self.free_bytes -= seg.size
                    seg.retired = True
                    seg.seal()
                    taken.append(seg)
        self._close_all(taken)

    def deactivate(self) -> None:
        """Drop this thread's current slab and every free segment (``unregister()``).
        Those waiting for their generation to be free wait on: a message in flight in
        one is loaded whenever its receiver gets to it, and each is closed, never
        reused, once free (``give_back`` of a pool no longer active)."""
        self.drop_currents()
        self.active = False
        with self.lock:
            taken = self._trim_locked(lambda s: True)
        self._close_all(taken)

    def drop_currents(self) -> None:
        """This thread's current slab and arena are over: their generations end with
        their last storages."""
        self.drop_current(_SLAB)
        self.drop_current(_ARENA)

    def drop_current(self, tier: _Tier) -> None:
        self.local.__dict__.pop(tier.name, None)
        if tier is _SLAB:
            _native.set_slab(self.kind == "fs", None)

    def stats(self) -> dict[str, int]:
        owned = sum(seg.size for seg in self.owned())
        with self.lock:
            free = sum(len(s) for s in self.free.values())
            pinned = max(0, owned - self.free_bytes)
        return {
            "pinned_bytes": pinned,
            "segments_made": self.made,
            "segments_reused": self.reused,
            "segments_free": free,
            "free_bytes": self.free_bytes,
            "segments_waiting": len(self.waiting),
        }

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's segments are the parent's."""
        self.free.clear()
        self.waiting.clear()
        self.leaving.clear()
        self.free_bytes = 0
        self.lock = threading.Lock()
        self.local = threading.local()
        _native.set_slab(self.kind == "fs", None)


class FdPool(Pool):
    """file_descriptor: memfds, not bounded by /dev/shm; a receiver gets each one's
    descriptor once, through the broker, and keeps it while it maps the segment."""

    kind = "fd"

    def __init__(self, directory: Callable[[], str], drop: Callable[[Segment], None]) -> None:
        super().__init__()
        self._directory, self._drop = directory, drop

    def directory(self) -> str:
        return self._directory()

    def create(self, size: int) -> Segment:
        try:
            fd = os.memfd_create("shmreduce", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise segments.no_memory(exc, "memfd_create", size) from exc
        try:
            os.ftruncate(fd, size)  # no memory until written
            # Its size for good: no process (the broker, which maps every header, least)
            # can be killed with SIGBUS by another that shrinks it.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            ino, _ = segments.fd_identity(fd)
            return Segment("fd", ino, "", fd, size, fd)
        except OSError as exc:
            os.close(fd)
            raise segments.no_memory(exc, "mapping a new memfd", size) from exc

    def release_at_broker(self, seg: Segment) -> None:
        if seg.undeposit():
            self._drop(seg)


class FilePool(Pool):
    """file_system: files in the program directory, each held at the broker by this
    process while in its pool; a receiver maps them by name and keeps no descriptor."""

    kind = "fs"

    def __init__(
        self,
        make: Callable[[int], Segment],
        directory: Callable[[], str],
        release: Callable[[str, list[str]], None],
        full: Callable[[], None],
    ) -> None:
        super().__init__()
        self._make, self._directory, self._release = make, directory, release
        self._full = full

    def full(self) -> None:
        self._full()

    def arena_size(self) -> int:
        """ARENA_SIZE, or a 1/ARENA_MOUNT_SHARE share of the mount its files go to if
        that is less (asked at each new arena: a mount can be resized)."""
        try:
            # The program directory's parent: the directory itself is made with the
            # broker, which the first arena may start.
            mount = os.statvfs(os.path.dirname(self.directory()))
        except OSError:
            return ARENA_SIZE  # no mount to ask: making the file says what is wrong
        share = mount.f_blocks * mount.f_frsize // ARENA_MOUNT_SHARE // _PAGE * _PAGE
        if share <= 0:
            return ARENA_SIZE  # a mount without a size (tmpfs size=0)
        return min(ARENA_SIZE, max(share, class_size(ARENA_ITEM_MAX)))

    def directory(self) -> str:
        return self._directory()

    def create(self, size: int) -> Segment:
        return self._make(size)

    def release_at_broker(self, seg: Segment) -> None:
        self._release(seg.directory, [seg.name])


_END_STALE, _END_WAIT, _END_FREED, _END_RETIRED = _native.END_STALE, _native.END_WAIT, _native.END_FREED, _native.END_RETIRED


def _in_flight(seg: Segment, gen: int) -> bool:
    """Whether refs sent in *seg*'s generation *gen* wait to be loaded (its header
    says; one whose tickets ran past the bitmap cannot tell: they may)."""
    now, sent, loaded, _holders = _native.hdr_read(seg.addr)
    return now == gen and (sent > loaded or bool(_native.hdr_flags(seg.addr) & _native.UNCOUNTED))


def _after_fork_in_child() -> None:
    global _gen_prefix, _gen_count, _gen_lock
    _gen_prefix = int.from_bytes(os.urandom(3), "little") << 40
    _gen_count = 0
    _gen_lock = threading.Lock()


forking.part("pool", after_in_child=_after_fork_in_child)

# What other modules use: the pools, their settings, and the helpers transfer shares.
__all__ = [
    "ARENA_ITEM_MAX",
    "ARENA_SIZE",
    "IDLE_SEGMENTS",
    "POOL_BYTES",
    "POOL_IDLE",
    "SLAB_ITEM_MAX",
    "SLAB_SIZE",
    "FdPool",
    "FilePool",
    "Hold",
    "Pool",
    "class_size",
    "new_gen_number",
    "twice",
]
