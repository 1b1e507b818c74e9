"""Recycled pools of shared memory: segments, their generations, and who holds them.

A ``Segment`` is one piece of shared memory mapped in this process: a memfd
(``file_descriptor``) or a file in the program directory (``file_system``). It owns
its mapping, its bounds and, for a memfd, its descriptor. A sending process keeps a
``Pool`` of the segments it made, one per strategy: small storages (up to
``SLAB_ITEM_MAX``) are packed at offsets into its thread's current *slab*
(``SLAB_SIZE`` bytes), across messages; mid-size ones (up to ``ARENA_ITEM_MAX``) the
same way into its current *arena* (``ARENA_SIZE``, less on a small file_system mount:
``FilePool.arena_size``); a larger storage gets a segment of its size class (eight
classes per doubling).

Generations. A segment is filled anew in *generations*. A generation is a number
unique in the program, written into the segment's first ``HEADER`` bytes with its
shared counters (refs sent, refs loaded, holders: ``broker/protocol.py``). In each
process the storages of one generation are made by one *gen*, a ``_native.Gen``:
a storage over the mapping through DLPack, its range checked in C. The Gen counts
its live storages (and holds: the slab it is, a load in progress) natively; torch's
deleter decrements the count when a storage dies, on any thread, and the Gen whose
count reaches zero is handed to ``settle`` (``_native.dead()``): "the last storage
of generation G died here" is known exactly, without weak references. The Gen
keeps its segment, and so the mapping. A Gen whose count reached zero is revived
by a new storage until ``settle`` takes it. When a Gen dies:

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

A receiver finds a segment it maps already by identity (a memfd's inode, a file's
name) and checks the header against the handle's generation: a stale handle is a
``SharingError``, never another message's bytes. It keeps its ``KEPT_SEGMENTS``
latest mappings after their last storage dies (one descriptor each under
``file_descriptor``, none under ``file_system``): the next message in one costs no
round trip, no descriptor, no mapping. A segment its owner lets go of while free
has its pages punched out first (``Pool.discard``): a kept mapping of it pins its
header page only, in memory or in the file_system mount.

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
while the owner holds it as a receiver (``settle``) and goes back to a new broker
while its refs wait to be loaded. A deposit ends in ``Segment.undeposit``, which
unindexes the segment's gen with it: the C sender (``_native.reduce``) never sends
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

import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from shmreduce import _faults, _native, _platform, _torch, segments
from shmreduce.broker import client as broker
from shmreduce.errors import OutOfSharedMemory, SharingError, out_of_shm

HEADER = _native.HEADER_BYTES  # a pooled segment's shared header (generation, counters, tickets); storages start after
ALIGN = _native.ALIGN  # a slab places each storage on a cache line, as torch's CPU allocator aligns (Gen.put)
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
KEPT_SEGMENTS = int(os.environ.get("SHMREDUCE_KEPT_SEGMENTS", "8"))
REAP_PER_TAKE = 8  # waiting segments a take() looks at (Pool.reap_waiting): its cost, however much is kept
# A pool keeps at most IDLE_SEGMENTS segments free and as many waiting (their
# generation over here, held elsewhere or with refs in flight): each keeps a
# descriptor here and, under file_descriptor, one at the broker. Past that, the
# longest waiting leaves the pool (never reused: its memory goes back once its holders
# let go of it) and the oldest free one is closed, so this process and its broker hold a
# bounded number of descriptors however much receivers keep (SPEC 12).
IDLE_SEGMENTS = 16
_PAGE = mmap.PAGESIZE
_T = TypeVar("_T")

_U64 = ctypes.c_uint64
_Gen = _native.Gen
# A receiver's live Gens by their refs' template (kind, directory, segment,
# generation, tag: the sender's Gen's own tuple), published once held
# (``Gen.publish``): ``_native.load`` / ``rebuild`` load through them in one C call;
# ``_native.dead()`` takes a Gen out as it ends.
live: dict[tuple, Any] = {}
# DLPack's dtype (code, bits, lanes) and the itemsize of each torch dtype it carries
# (``reductions`` fills it on first use).
dtypes: dict[torch.dtype, tuple[int, int, int, int]] = {}
_native.init(_torch.from_dlpack, SharingError, dtypes, live, _torch.swap_memory, _torch.dlpack_versioned())


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


# -- segments ----------------------------------------------------------------------

# Every segment mapped in this process, by (kind, key): a memfd by its inode, a file
# by its name. Weak: a segment is kept by its live Gens, its pool, the kept list.
_mapped: weakref.WeakValueDictionary[tuple, Segment] = weakref.WeakValueDictionary()
_kept: OrderedDict[tuple, Segment] = OrderedDict()
_kept_lock = threading.Lock()  # a leaf: loader threads keep and look up at once
# Every mapping is registered by its address in ``_native`` (``segment_at``), which
# finds the segment a storage lies in, for Python and for ``_native.reduce``.


class Segment:
    """One shared-memory segment mapped in this process; unmapped (and its
    descriptor closed) when the last reference goes. ``fd`` never changes."""

    __slots__ = (
        "kind",
        "key",
        "directory",
        "fd",
        "addr",
        "size",
        "pid",
        "gen",
        "gen",
        "pool",
        "deposited",
        "tag",
        "retired",
        "sealed",
        "since",
        "filled",
        "__weakref__",
    )

    def __init__(self, kind: str, key: int | str, directory: str, fd: int | None, size: int, map_fd: int) -> None:
        _native.guard_faults()  # a file another process cuts under this mapping: an error, not a SIGBUS (cut)
        addr = _platform.map_shared(map_fd, size)
        self.kind, self.key, self.directory = kind, key, directory  # directory: fs only
        self.fd, self.addr, self.size = fd, addr, size
        self.pid = os.getpid()
        self.gen = 0  # the generation whose Gen lives here (or is being filled)
        self.gen: weakref.ref | None = None
        self.pool: Pool | None = None  # the pool that made it, in its owner only, until it leaves (Pool.leave)
        self.deposited = False  # a memfd: its descriptor is at this process's broker (undeposit)
        self.tag: tuple[int, int] = (0, 0)  # a file: (generation, its refs' tag), see transfer.fs_tag
        self.retired = False  # never reused: closed once free
        self.sealed = False  # filled no further (its file went with a broker that died)
        self.since = 0.0  # when it became free
        self.filled = 0  # its pages up to here are allocated (written through fd, or allocate())
        # Unmapped (and its descriptor closed) once the segment is gone: a weakref
        # callback, run after every weak reference to it is cleared, never __del__,
        # which runs while _mapped can still hand the dying segment to another thread.
        weakref.finalize(self, _unmap_close, addr, size, fd).atexit = False  # at exit the OS does it, after any last use
        _mapped[(kind, key)] = self
        _native.mapped(addr, size, weakref.ref(self))

    @property
    def name(self) -> str:
        """A file_system segment's file name."""
        return str(self.key)

    def header(self) -> int:
        return int(_U64.from_address(self.addr).value)

    def begin(self, gen: int) -> Any:
        """Start generation *gen* (owner): header written, a new Gen, empty."""
        assert self.fd is not None
        try:
            os.pwrite(self.fd, gen.to_bytes(8, "little"), 0)  # allocates the page if need be
        except OSError as exc:
            raise self._write_error(exc, self.size, "writing a segment header") from exc
        self.filled = max(self.filled, HEADER)  # its first page is allocated now
        return self.new_gen(gen, None)

    def new_gen(self, gen: int, entry: tuple | None) -> Any:
        """The Gen of *gen* in this process, made held once: its maker ``release()``s
        that hold (or hands it to a ``Hold``). *entry*: a receiver's, its ledger entry
        for *gen* (``hdr_hold`` counted it in the header), let go of when the Gen
        dies (``settle``)."""
        gen = _Gen(self, self.addr, self.size, gen, HEADER if gen else 0)
        gen.info = (entry, os.getpid())
        self.gen, self.gen = weakref.ref(gen), gen
        return gen

    def seal(self) -> None:
        """Fill it no further, nor send from it: its file went with a broker that died,
        or its memfd with the broker it was deposited at (a storage in it is shared anew)."""
        self.sealed = True
        gen = self.live_gen(self.gen)
        if gen is not None:
            gen.seal()  # a slab: nothing more is placed in it

    def lose(self) -> None:
        """Its file was cut by another process (``cut``): never filled, reused or sent
        from again; what lies in it is lost."""
        self.retired = True
        self.seal()

    def undeposit(self) -> bool:
        """Its memfd's descriptor is no longer kept at this process's broker for it:
        nothing sends from it without depositing it again, ``_native.reduce`` included
        (its index dropped with the deposit). Whether it was deposited."""
        was, self.deposited = self.deposited, False
        _native.unindex(self.addr)
        return was

    def outside_its_pool(self) -> bool:
        """Made here (a pooled generation, its descriptor here) and let go of by its
        pool: this process holds it at most, as any receiver, and what it deposits of
        it is a forward, which lasts while it holds it."""
        return self.pool is None and self.fd is not None and self.gen != 0 and self.pid == os.getpid()

    def index(self, gen: Any, template: tuple) -> None:
        """``_native.reduce`` sends storages of *gen* from now on, with refs of
        *template*, while what the caller checked holds: a memfd deposited (another
        thread may let go of the deposit meanwhile: then it is not indexed)."""
        gen.index(template)
        if self.kind == "fd" and not self.deposited:
            _native.unindex(self.addr)

    def live_gen(self, gen: int) -> Any | None:
        """The Gen of *gen*, if it still makes storages here (alive, or dead but not
        yet settled: a new storage revives it)."""
        ref = self.gen
        gen = ref() if ref is not None else None
        return gen if gen is not None and self.gen == gen and not gen.ended else None

    def fill(self, gen: Any, offset: int, nbytes: int, source: torch.UntypedStorage | None, zero: bool = True) -> torch.UntypedStorage:
        """Write *source*'s bytes (or zeros, unless not *zero*) at *offset*; the storage
        there. Not *zero*: pages written before keep this program's old bytes.

        Into pages allocated already (a reused segment), a copy through the mapping:
        twice the speed of ``pwrite`` for 64 MiB here (9.8 against 4.9 GB/s), once
        this process has touched them. Else through the descriptor: the kernel
        allocates the missing pages now (no page fault per page), so a full memory
        limit is an error here rather than a SIGBUS later."""
        assert self.fd is not None
        end = offset + nbytes
        if end <= self.filled:
            if source is None and not zero:
                return gen.storage(offset, nbytes)
            return gen.place(offset, nbytes, source)  # its address read at the copy, in C
        written = self.filled  # zeros: what an earlier generation wrote there is cleared
        try:
            segments.fill(self.fd, nbytes, source, offset)
        except OSError as exc:
            raise self._write_error(exc, nbytes, "filling a shared segment") from exc
        if offset <= self.filled:
            self.filled = end
        if source is None and zero and written > offset:
            gen.place(offset, written - offset, None)  # the storage it returns goes at once
        return gen.storage(offset, nbytes)

    def reserve(self, cursor: int, nbytes: int) -> bool:
        """Allocate the pages a storage of *nbytes* placed after *cursor* (a Gen's)
        would take, a chunk ahead; False if it does not fit (a new arena is due)."""
        end = -(-cursor // ALIGN) * ALIGN + nbytes
        if end > self.size:
            return False
        if end > self.filled:
            upto = min(self.size, -(-max(end, self.filled + ARENA_CHUNK) // _PAGE) * _PAGE)
            self._allocate(self.filled, upto)
            self.filled = upto
        return True

    def allocate(self) -> None:
        """Allocate every page of the segment now (a slab, once): later copies into
        its mapping cannot fault on a full memory limit."""
        self._allocate(0, self.size)
        self.filled = self.size

    def _allocate(self, start: int, end: int) -> None:
        """Allocate the pages of bytes *start* to *end* (a page boundary or the size)
        and map them here: one call (``_platform.populate``), not a write fault per
        page as the copies into them come (a kept 128 KiB tensor's 32 pages: about a
        tenth of the program's CPU per message, producer and consumer);
        ``posix_fallocate`` where the kernel cannot."""
        fresh = -(-start // _PAGE) * _PAGE  # the first page nothing lies in yet
        start -= start % _PAGE
        try:
            try:
                if _platform.populate(self.addr + start, end - start):
                    return
            except OSError:
                _platform.release(self.addr + fresh, end - fresh)  # what it allocated before it failed
                raise
            assert self.fd is not None
            os.posix_fallocate(self.fd, start, end - start)
        except OSError as exc:
            raise self._write_error(exc, end - start, "allocating a shared segment") from exc

    def _write_error(self, exc: OSError, nbytes: int, what: str) -> SharingError:
        if self.kind == "fs" and exc.errno in _FULL:
            return out_of_shm(self.directory, nbytes, exc.strerror or str(exc))
        return _no_memory(exc, what, nbytes)


def cut(exc: OSError) -> bool:
    """Whether *exc* says a segment's memory is gone: a header function or a copy into
    it met a SIGBUS, its file truncated by another process of the user (a memfd is
    sealed against it). The guard (``_native.guard_faults``, installed by every process
    that maps a segment) turns that SIGBUS into this error."""
    return exc.errno == errno.EFAULT


def _unmap_close(addr: int, size: int, fd: int | None) -> None:
    # Out of the index first: once unmapped, another thread may map the address anew.
    _native.unmapped(addr)
    _platform.unmap(addr, size)
    if fd is not None:
        os.close(fd)


def _mapped_now() -> list[Segment]:
    """Every segment mapped here now: its weak references listed without allocating
    per item (a WeakValueDictionary's own iteration fails if another thread maps a
    segment meanwhile, which a collection's finalizer can let run mid-way)."""
    return [seg for seg in (ref() for ref in _mapped.valuerefs()) if seg is not None]


def segment_at(ptr: int, nbytes: int) -> Segment | None:
    """The segment whose mapping holds the *nbytes* at address *ptr*, if any: a live
    storage there is of the segment's live generation (``seg.gen``), unless the
    segment is sealed (its file went with a broker that died: shared anew)."""
    seg: Segment | None = _native.segment_at(ptr, nbytes)
    return None if seg is None or seg.sealed else seg


def lookup(kind: str, key: int | str) -> Segment | None:
    """This process's mapping of a segment, if it has one."""
    seg = _mapped.get((kind, key))
    if seg is not None and (kind, key) in _kept:
        with _kept_lock:
            if (kind, key) in _kept:
                _kept.move_to_end((kind, key))
    return seg


def keep(seg: Segment) -> None:
    """Keep a received segment mapped after its last storage dies (the latest
    KEPT_SEGMENTS of them): its owner goes on filling or reusing it."""
    if KEPT_SEGMENTS <= 0:
        return
    with _kept_lock:
        _kept[(seg.kind, seg.key)] = seg
        _kept.move_to_end((seg.kind, seg.key))
        dropped = [_kept.popitem(last=False) for _ in range(len(_kept) - KEPT_SEGMENTS)]
    del dropped  # a segment that dies here unmaps outside the lock


def open_fd(fd: int, ino: int) -> Segment:
    """Map a received memfd, which must be *ino* (its identity: device and inode),
    and close *fd*: a mapping needs no descriptor, so a receiver keeping thousands
    of tensors holds none per segment (issue 27, item 4). Sending from it again
    fetches its descriptor anew (``transfer._deposit``)."""
    try:
        got, size = segments.fd_identity(fd)
        if got != ino or size <= 0:
            raise SharingError(f"received descriptor does not match its handle (memfd {got}, expected {ino}): forged or corrupted message")
        return Segment("fd", ino, "", None, size, fd)
    except OSError as exc:
        raise segments.os_error(exc, "mapping a received segment") from exc
    finally:
        os.close(fd)


def open_file(directory: str, name: str) -> Segment:
    """Map the file *name* of *directory* (no descriptor kept)."""
    fd = segments.open_file(directory, name)
    try:
        size = os.fstat(fd).st_size
        return Segment("fs", name, directory, None, size, fd)
    except OSError as exc:
        raise segments.os_error(exc, f"mapping {directory}/{name}") from exc
    finally:
        os.close(fd)


def adopt(storage: torch.UntypedStorage) -> Segment | None:
    """The segment of a storage torch already put in fd-backed shared memory: a
    segment shmreduce does not pool (generation 0), kept while that storage lives."""
    try:
        fd = _torch.storage_fd(storage)
    except RuntimeError:
        return None
    if fd < 0:
        return None
    ino, size = segments.fd_identity(fd)
    seg = _mapped.get(("fd", ino))
    if seg is None:
        dup = os.dup(fd)
        try:
            seg = Segment("fd", ino, "", dup, size, dup)
        except OSError as exc:
            os.close(dup)
            raise segments.os_error(exc, "mapping a shared storage") from exc
    return seg


# -- gens ------------------------------------------------------------------------


class Hold:
    """One count on a Gen held by Python, not by a storage (a thread's current
    slab): let go of when the holder drops it, whatever the thread or the time (a
    thread's slab goes with its thread-local data)."""

    __slots__ = ("seg", "gen")

    def __init__(self, seg: Segment, gen: Any, take: bool = True) -> None:
        """*take*: acquire a count now; else the maker's hold of a new Gen is handed over."""
        self.seg, self.gen = seg, None
        if take and not gen.acquire():
            raise RuntimeError("a hold on a Gen that is over")
        self.gen = gen

    def __del__(self) -> None:
        if self.gen is not None:
            self.gen.release()


def has_dead() -> bool:
    """Whether settle has something to do (one atomic load)."""
    return _native.pending()


def settle(dead: list[Any] | None = None) -> None:
    """Account for every generation whose last storage died here since the last call.

    In its owner the generation is over here: its segment is free at once if nobody
    holds it elsewhere and every ref sent in it was loaded (``_native.hdr_end``),
    else it waits for that (``Pool.reap_waiting``). A receiver lets go of its hold: its
    ledger entry cleared, then the header's holders (``broker.client.let_go``).
    *dead*: gens taken from ``_native.dead()`` already."""
    pid = os.getpid()
    for gen in _native.dead() if dead is None else dead:
        info: Any = gen.info
        entry, owner = info
        if owner != pid:
            continue  # a forked child's copy of its parent's Gen: not ours to tell
        seg: Segment = gen.owner  # type: ignore[assignment]
        gen = gen.number
        if entry is not None:
            # The ledger says "dropping" before the header counts this process out, and
            # is cleared after: a process killed in between is retired, not guessed.
            if broker.dropping(entry):  # else this process is exiting: its brokers count it out
                _faults.point("letgo.ledger")
                try:
                    _native.hdr_unhold(seg.addr, gen)
                except OSError:  # cut: nothing left to count out of
                    pass
                _faults.point("letgo.unhold")
                broker.let_go(entry)
            if seg.outside_its_pool():
                # Its deposit was a forward, kept at the broker while something reaches
                # it, this hold among them: the next send from it deposits again.
                seg.undeposit()
            continue
        pool = seg.pool
        if pool is None or seg.gen != gen:
            continue
        if seg.retired or not pool.active:
            pool.leave(seg)  # never reused: what is in flight in it stays readable (the broker)
        elif not pool.end_generation(seg, gen):
            pool.add_waiting(seg, gen)  # held elsewhere, or refs to it in flight


def _in_use() -> list[Segment]:
    """The segments with a storage (or a hold) alive here now."""
    in_use = []
    for seg in _mapped_now():
        gen = seg.live_gen(seg.gen)
        if gen is not None and gen.live:
            in_use.append(seg)
    return in_use


def live_segments() -> int:
    return len(_in_use())


def retire_in_use() -> None:
    """Before a fork: every generation with a storage (or a hold) alive here now is
    retired in its header, never reused by its owner, whoever that is: the child
    keeps what it inherits without counting itself a holder (SPEC 14), and its pages
    go back to the system once the last process maps them no more."""
    for seg in _in_use():
        if seg.gen:
            try:
                _native.hdr_retire(seg.addr, seg.gen)  # its owner, this process or another, reads it there
            except OSError:
                seg.lose()  # cut: never reused anyway


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
    ) -> tuple[Segment, int, int, torch.UntypedStorage, Any]:
        """Put *source*'s bytes (or zeros; unless *zero*, whatever this program left
        there) in a segment: (segment, generation, offset, the new storage there, the
        generation's Gen)."""
        self.active = True
        if nbytes <= ARENA_ITEM_MAX:
            tier = _SLAB if nbytes <= SLAB_ITEM_MAX else _ARENA
            current = self.local.__dict__.get(tier.name)
            if current is not None:
                # put() claims the place first: the one placement routine, which
                # ``_native.reduce`` uses for the same slab. The pages are allocated
                # already (a slab's when it is made, an arena's a chunk ahead: reserve),
                # so a plain copy into the mapping cannot fault on a full memory limit.
                seg, gen = current.seg, current.gen
                try:
                    fits: bool | None = tier is _SLAB or seg.reserve(gen.cursor, nbytes)
                except OutOfSharedMemory:
                    fits = None  # handled below, outside this handler: one exception if _own fails too
                if fits is None:
                    # A full mount: the arena ends (its generation with its last
                    # storage) and this storage gets a segment of its own, as before
                    # arenas: a stream through a small /dev/shm reuses one segment.
                    self.drop_current(tier)
                    return self._own(nbytes, source, zero)
                if fits:
                    try:
                        put = gen.put(nbytes, source, zero)
                    except OSError as exc:
                        if not cut(exc):
                            raise
                        seg.lose()  # its generation ends with its last storage (end)
                        self.drop_current(tier)
                        return self.place(nbytes, source, zero)
                    if put is not None:
                        return seg, seg.gen, put[0], put[1], gen
            try:
                self._new_current(tier)
                made = True
            except OutOfSharedMemory:
                if tier is _SLAB:
                    raise
                made = False
            if not made:
                return self._own(nbytes, source, zero)  # no room for a new arena's header
            return self.place(nbytes, source, zero)
        return self._own(nbytes, source, zero)

    def _own(self, nbytes: int, source: torch.UntypedStorage | None, zero: bool) -> tuple[Segment, int, int, torch.UntypedStorage, Any]:
        """*source*'s bytes in a segment of its own (its size class)."""
        seg = self.take(class_size(nbytes))
        offset = HEADER
        gen = self._twice(lambda last: self._begin(seg, retry=not last))
        try:
            storage = self._twice(lambda last: seg.fill(gen, offset, nbytes, source, zero))
        except OSError as exc:
            if not cut(exc):
                raise
            seg.lose()  # cut by another process under this copy: its generation ends with the Gen
            return self._own(nbytes, source, zero)
        finally:
            gen.release()  # the maker's hold: failing, the Gen's death gives the segment back (settle)
        return seg, seg.gen, offset, storage, gen

    def _twice(self, attempt: Callable[[bool], _T]) -> _T:
        """``attempt(False)``; on a full mount (which may be full of segments nobody
        uses any more: ``full`` lets go of them) ``attempt(True)`` once more, outside
        the first one's handler: one exception, its cause chained once."""
        try:
            return attempt(False)
        except OutOfSharedMemory:
            pass
        self.full()
        return attempt(True)

    def _begin(self, seg: Segment, retry: bool) -> Any:
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
            self._twice(lambda last: seg.allocate())
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
        found = {id(seg): seg for seg in _mapped_now() if seg.pool is self and seg.live_gen(seg.gen) is not None}
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
        for seg in _mapped_now():
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
            raise _no_memory(exc, "memfd_create", size) from exc
        try:
            os.ftruncate(fd, size)  # no memory until written
            # Its size for good: no process (the broker, which maps every header, least)
            # can be killed with SIGBUS by another that shrinks it (issue 29, item 1).
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            ino, _ = segments.fd_identity(fd)
            return Segment("fd", ino, "", fd, size, fd)
        except OSError as exc:
            os.close(fd)
            raise _no_memory(exc, "mapping a new memfd", size) from exc

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


_FULL = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)
_END_STALE, _END_WAIT, _END_FREED, _END_RETIRED = _native.END_STALE, _native.END_WAIT, _native.END_FREED, _native.END_RETIRED


def _in_flight(seg: Segment, gen: int) -> bool:
    """Whether refs sent in *seg*'s generation *gen* wait to be loaded (its header
    says; one whose tickets ran past the bitmap cannot tell: they may)."""
    now, sent, loaded, _holders = _native.hdr_read(seg.addr)
    return now == gen and (sent > loaded or bool(_native.hdr_flags(seg.addr) & _native.UNCOUNTED))


def _no_memory(exc: OSError, what: str, nbytes: int) -> SharingError:
    if exc.errno in _FULL:
        return SharingError(f"out of memory for a {nbytes}-byte shared segment: {exc.strerror}")
    return segments.os_error(exc, what)


def drop_kept() -> None:
    _kept.clear()


def forget_mappings() -> None:
    """Forget every segment this process maps (they stay mapped while storages use
    them): a forked child then receives like a process that never saw them."""
    _kept.clear()
    _mapped.clear()
    live.clear()
    _native.forget_mapped()


def seal_where(gone: Callable[[Segment], bool]) -> None:
    """Never fill or send from again the mapped segments *gone* names (their files
    went with a broker that died): a storage in one is shared anew when sent."""
    for seg in _mapped_now():
        if gone(seg):
            seg.seal()
    _native.unindex_all()  # reduce() sends from none of them (each is indexed again once sent from here)


def forget_deposits() -> None:
    """This process's broker is new: it keeps none of the memfds sent before."""
    for seg in _mapped_now():
        seg.deposited = False
    _native.unindex_all()  # reduce() sends from none until each is deposited again


def let_go_of_here() -> list[Segment]:
    """The memfds this process made that its pool let go of and it still maps (it
    holds them as a receiver), with their descriptors."""
    return [seg for seg in _mapped_now() if seg.kind == "fd" and seg.outside_its_pool()]


def mapped_stats() -> dict[str, int]:
    segs = _mapped_now()
    return {
        "segments_mapped": len(segs),
        "bytes_mapped": sum(s.size for s in segs),
        "descriptors": sum(1 for s in segs if s.fd is not None),
        "segments_kept": len(_kept),
    }


def _after_fork_in_child() -> None:
    global _gen_prefix, _gen_count, _gen_lock, _kept_lock
    _gen_prefix = int.from_bytes(os.urandom(3), "little") << 40
    _gen_count = 0
    _gen_lock = threading.Lock()
    _kept_lock = threading.Lock()
    live.clear()  # nor theirs to load through: what this process keeps, it holds itself
    _native.unindex_all()  # nor to send from without depositing them itself
    for seg in _mapped_now():
        # Never revive a Gen of the parent's here: what this process keeps, it claims
        # itself (a new Gen), or its owner could reuse memory this process reads.
        seg.gen_ref = None
        seg.deposited = False  # the parent's deposit, not ours


os.register_at_fork(after_in_child=_after_fork_in_child)

__all__ = ["FdPool", "FilePool", "Pool", "Segment"]
