"""The shared segments this process maps, and the descriptor-level helpers under
them (``pool`` keeps the segments this process made, for reuse).

A ``Segment`` is one piece of shared memory mapped in this process: a memfd
(``file_descriptor``) or a file in the program directory (``file_system``). It owns
its mapping, its bounds and, for a memfd, its descriptor. Every segment mapped here
is registered by its identity (``lookup``) and by its address (``segment_at``, in
``_native``), whoever made it.

A receiver finds a segment it maps already by identity (a memfd's inode, a file's
name) and checks the header against the handle's generation: a stale handle is a
``SharingError``, never another message's bytes. It keeps its ``KEPT_SEGMENTS``
latest mappings after their last storage dies (``keep``; no descriptor kept): the
next message in one costs no round trip, no descriptor, no mapping.

A file_system segment is a named file, mode 0600, in the program directory; a
file_descriptor segment is a memfd. Bytes go in through the descriptor, never a
fresh mapping: every page is allocated by that write, so a full mount is a
``SharingError`` now rather than a SIGBUS later.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from shmreduce import _native, _platform, _torch, forking
from shmreduce._native import Gen
from shmreduce.broker.protocol import DIR_PREFIX, SEG_PREFIX, identity, is_segment_name
from shmreduce.errors import SharingError, out_of_shm, too_many_files

if TYPE_CHECKING:
    from shmreduce.pool import Pool  # a segment's pool, in its owner: typing only, pool imports this module

HEADER = _native.HEADER_BYTES  # a pooled segment's shared header (generation, counters, tickets); storages start after
ALIGN = _native.ALIGN  # a slab places each storage on a cache line, as torch's CPU allocator aligns (Gen.put)
KEPT_SEGMENTS = int(os.environ.get("SHMREDUCE_KEPT_SEGMENTS", "8"))
_PAGE = mmap.PAGESIZE
_U64 = ctypes.c_uint64


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
    global _name_prefix, _kept_lock
    _name_prefix = os.urandom(6).hex()
    _kept_lock = threading.Lock()
    live.clear()  # nor theirs to load through: what this process keeps, it holds itself
    _native.unindex_all()  # nor to send from without depositing them itself
    for seg in mapped_now():
        # Never revive a Gen of the parent's here: what this process keeps, it claims
        # itself (a new Gen), or its owner could reuse memory this process reads.
        seg.gen_ref = None
        seg.deposited = False  # the parent's deposit, not ours
        if seg.counter is not None:
            seg.counter = _counter(seg)  # the parent's messages in flight are not this process's


forking.part("segments", after_in_child=_after_fork_in_child)


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


def _open_checked(directory: str, name: str) -> int:
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


# -- the segments mapped in this process ---------------------------------------


class GenInfo(NamedTuple):
    """What a Gen's maker tells ``transfer.settle_dead`` of it: the fields of ``Gen.info``,
    in this order. Written as a plain tuple, not a GenInfo: with GenInfo instances,
    tests/test_pool.py's past_its_cap[file_system] keeps segments when it runs after
    a failed test_broker_ops adopted-memfd test (the cause is not known yet)."""

    entry: tuple | None  # a receiver's: its ledger entry for the generation, let go of when the Gen dies
    pid: int  # the process that made it: a forked child's copy of it is not the child's to settle


# A receiver's live Gens by their refs' template (kind, directory, segment,
# generation, tag: the sender's Gen's own tuple), published once held
# (``Gen.publish``): ``_native.load`` / ``rebuild`` load through them in one C call;
# ``_native.dead()`` takes a Gen out as it ends.
live: dict[tuple, Gen] = {}
# DLPack's dtype (code, bits, lanes) and the itemsize of each torch dtype it carries
# (``reductions`` fills it on first use).
dtypes: dict[torch.dtype, tuple[int, int, int, int]] = {}
_native.init(_torch.from_dlpack, SharingError, dtypes, live, _torch.swap_memory, _torch.dlpack_versioned())

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
        "gen_ref",
        "pool",
        "deposited",
        "tag",
        "retired",
        "sealed",
        "since",
        "filled",
        "trailer",
        "extent",
        "counter",
        "__weakref__",
    )

    def __init__(self, kind: str, key: int | str, directory: str, fd: int | None, size: int, map_fd: int) -> None:
        _native.guard_faults()  # a file another process cuts under this mapping: an error, not a SIGBUS (cut)
        addr = _platform.map_shared(map_fd, size)
        self.kind, self.key, self.directory = kind, key, directory  # directory: fs only
        self.fd, self.addr, self.size = fd, addr, size
        self.pid = os.getpid()
        self.gen = 0  # the generation whose Gen lives here (or is being filled)
        self.gen_ref: weakref.ref | None = None
        self.pool: Pool | None = None  # the pool that made it, in its owner only, until it leaves (Pool.leave)
        self.deposited = False  # a memfd: its descriptor is at this process's broker (undeposit)
        self.tag: tuple[int, int] = (0, 0)  # a file: (generation, its refs' tag), see transfer.fs_tag
        self.retired = False  # never reused: closed once free
        self.sealed = False  # filled no further (its file went with a broker that died)
        self.since = 0.0  # when it became free
        self.filled = 0  # its pages up to here are allocated (written through fd, or allocate())
        self.trailer = 0  # a storage torch moved for shmreduce: where its header lies, past it (trail)
        self.extent = 0  # ... and the bytes that storage spans, from 0
        self.counter: Gen | None = None  # such a storage's, where it was moved: counts its refs sent (counting)
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

    def begin(self, number: int) -> Gen:
        """Start generation *number* (owner): header written, a new Gen, empty."""
        assert self.fd is not None
        try:
            os.pwrite(self.fd, number.to_bytes(8, "little"), 0)  # allocates the page if need be
        except OSError as exc:
            raise self._write_error(exc, self.size, "writing a segment header") from exc
        self.filled = max(self.filled, HEADER)  # its first page is allocated now
        return self.new_gen(number, None)

    def new_gen(self, number: int, entry: tuple | None) -> Gen:
        """The Gen of *number* in this process, made held once: its maker ``release()``s
        that hold (or hands it to a ``Hold``). *entry*: a receiver's, its ledger entry
        for *number* (``hdr_hold`` counted it in the header), let go of when the Gen
        dies (``transfer.settle_dead``)."""
        if number:
            gen = Gen(self, self.addr, self.size, number, HEADER)
        elif self.trailer:
            gen = Gen(self, self.addr, self.extent, 0, 0, self.trailer)
        else:
            gen = Gen(self, self.addr, self.size, 0, 0)
        gen.info = (entry, os.getpid())  # GenInfo's fields
        self.gen_ref, self.gen = weakref.ref(gen), number
        return gen

    def counting(self) -> Gen:
        """A held Gen that counts one ref of this segment's trailing header sent (a
        storage torch moved: ``trail``), for the sending scope (``_native.count_sent``):
        its mover's ``counter`` (which keeps it from being let go of meanwhile:
        ``transfer._drop_adopted``), else one of its own, as a forwarder's."""
        counter = self.counter
        if counter is not None and counter.acquire():
            return counter
        return _counter(self)

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

    def index(self, gen: Gen, template: tuple) -> None:
        """``_native.reduce`` sends storages of *gen* from now on, with refs of
        *template*, while what the caller checked holds: a memfd deposited (another
        thread may let go of the deposit meanwhile: then it is not indexed)."""
        gen.index(template)
        if self.kind == "fd" and not self.deposited:
            _native.unindex(self.addr)

    def live_gen(self, number: int) -> Gen | None:
        """The Gen of *number*, if it still makes storages here (alive, or dead but not
        yet settled: a new storage revives it)."""
        ref = self.gen_ref
        gen = ref() if ref is not None else None
        return gen if gen is not None and self.gen == number and not gen.ended else None

    def fill(self, gen: Gen, offset: int, nbytes: int, source: torch.UntypedStorage | None, zero: bool = True) -> torch.UntypedStorage:
        """Write *source*'s bytes (or zeros, unless not *zero*) at *offset*; the storage
        there. Not *zero*: pages written before keep this program's old bytes.

        Into pages allocated already (a reused segment), a copy through the mapping:
        about twice the speed of ``pwrite`` for a large storage, once this process has
        touched them. Else through the descriptor: the kernel
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
            fill(self.fd, nbytes, source, offset, self.addr)
        except OSError as exc:
            raise self._write_error(exc, nbytes, "filling a shared segment") from exc
        if offset <= self.filled:
            self.filled = end
        if source is None and zero and written > offset:
            gen.place(offset, written - offset, None)  # the storage it returns goes at once
        return gen.storage(offset, nbytes)

    def reserve(self, cursor: int, nbytes: int, ahead: int) -> bool:
        """Allocate the pages a storage of *nbytes* placed after *cursor* (a Gen's)
        would take, *ahead* bytes ahead; False if it does not fit (a new arena is due)."""
        end = -(-cursor // ALIGN) * ALIGN + nbytes
        if end > self.size:
            return False
        if end > self.filled:
            upto = min(self.size, -(-max(end, self.filled + ahead) // _PAGE) * _PAGE)
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
        return no_memory(exc, what, nbytes)


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


def mapped_now() -> list[Segment]:
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
    of tensors holds none per segment. Sending from it again
    fetches its descriptor anew (``transfer._deposit``)."""
    try:
        got, size = fd_identity(fd)
        if got != ino or size <= 0:
            raise SharingError(f"received descriptor does not match its handle (memfd {got}, expected {ino}): forged or corrupted message")
        return Segment("fd", ino, "", None, size, fd)
    except OSError as exc:
        raise os_error(exc, "mapping a received segment") from exc
    finally:
        os.close(fd)


def open_file(directory: str, name: str) -> Segment:
    """Map the file *name* of *directory* (no descriptor kept)."""
    fd = _open_checked(directory, name)
    try:
        size = os.fstat(fd).st_size
        return Segment("fs", name, directory, None, size, fd)
    except OSError as exc:
        raise os_error(exc, f"mapping {directory}/{name}") from exc
    finally:
        os.close(fd)


def adopt(storage: torch.UntypedStorage, moved: bool = False) -> Segment | None:
    """The segment of a storage torch already put in fd-backed shared memory: a
    segment shmreduce does not pool (generation 0), kept while that storage lives.
    Mapped without a descriptor of its own: torch keeps one while the storage lives
    (``transfer._deposit`` sends that), so a sender holds none per storage once its
    storages died, however many it sent.
    *moved*: torch moved it for shmreduce (a torch without the swap): a header trails
    it (``trail``), which counts its refs in flight as a pooled segment's does."""
    try:
        fd = _torch.storage_fd(storage)
    except RuntimeError:
        return None
    if fd < 0:
        return None
    at = _trail(fd, storage.nbytes()) if moved else 0
    ino, size = fd_identity(fd)
    seg = _mapped.get(("fd", ino))
    if seg is None:
        try:
            seg = Segment("fd", ino, "", None, size, fd)
        except OSError as exc:
            raise os_error(exc, "mapping a shared storage") from exc
    if at and not seg.trailer:
        try:
            _native.hdr_trail(seg.addr + at, storage.nbytes())
        except OSError as exc:
            raise SharingError(_native.CUT_MESSAGE) from exc
        seg.trailer, seg.extent = at, storage.nbytes()
        seg.counter = _counter(seg)
    return seg


def _trail(fd: int, nbytes: int) -> int:
    """Grow the memfd *fd* torch moved a storage of *nbytes* into by a header, on the
    page after the storage's last (torch's own mappings of it end before): refs to
    it are counted sent and loaded there, so its broker keeps it while one waits to
    be loaded, as a pooled segment (protocol.py, "Lifetimes"). Where it lies."""
    at = -(-nbytes // _PAGE) * _PAGE
    try:
        os.ftruncate(fd, at + HEADER)
        os.posix_fallocate(fd, at, HEADER)
    except OSError as exc:
        raise no_memory(exc, "a shared storage's header", HEADER) from exc
    return at


def find_trailer(seg: Segment) -> None:
    """A received memfd named by a ref of generation 0 with a ticket: a storage torch
    moved, its header past it (``trail``), if its size says so and that header gives
    its extent (a forged ticket on another memfd counts nothing). Refs to it are
    bounded by that extent, as by the memfd's size before it grew."""
    at = seg.size - HEADER
    if seg.trailer or seg.kind != "fd" or at <= 0 or at % _PAGE:
        return
    try:
        extent = _native.hdr_extent(seg.addr + at)
    except OSError:
        raise SharingError(_native.CUT_MESSAGE) from None
    if 0 < extent <= at < extent + _PAGE:
        seg.trailer, seg.extent = at, extent


def _counter(seg: Segment) -> Gen:
    """A Gen, held once, that counts refs of *seg* sent in its trailing header: its
    mover's ``counter``, held for as long as it sends them (``transfer._drop_adopted``
    releases it), or one message's (``Segment.counting``, a forwarder's)."""
    gen = Gen(seg, seg.addr, seg.extent, 0, 0, seg.trailer)
    gen.info = (None, -1)  # GenInfo's fields: nobody's to settle
    return gen


_FULL = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)


def no_memory(exc: OSError, what: str, nbytes: int) -> SharingError:
    if exc.errno in _FULL:
        return SharingError(f"out of memory for a {nbytes}-byte shared segment: {exc.strerror}")
    return os_error(exc, what)


def _in_use() -> list[Segment]:
    """The segments with a storage (or a hold) alive here now."""
    in_use = []
    for seg in mapped_now():
        gen = seg.live_gen(seg.gen)
        if gen is not None and gen.live:
            in_use.append(seg)
    return in_use


def live_segments() -> int:
    return len(_in_use())


def retire_in_use() -> None:
    """Before a fork: every generation with a storage (or a hold) alive here now is
    retired in its header, never reused by its owner, whoever that is: the child
    keeps what it inherits without counting itself a holder, and its pages
    go back to the system once the last process maps them no more."""
    moved = [seg for seg in mapped_now() if seg.counter is not None]  # storages torch moved, alive here
    for seg in _in_use() + moved:
        if seg.gen or seg.trailer:  # a storage torch moved: its holds, in generation 0, as a pooled one's
            try:
                _native.hdr_retire(seg.addr + seg.trailer, seg.gen)  # its owner, this process or another, reads it there
            except OSError:
                seg.lose()  # cut: never reused anyway


def drop_kept() -> None:
    _kept.clear()


def seal_where(gone: Callable[[Segment], bool]) -> None:
    """Never fill or send from again the mapped segments *gone* names (their files
    went with a broker that died): a storage in one is shared anew when sent."""
    for seg in mapped_now():
        if gone(seg):
            seg.seal()
    _native.unindex_all()  # reduce() sends from none of them (each is indexed again once sent from here)


def forget_deposits() -> None:
    """This process's broker is new: it keeps none of the memfds sent before."""
    for seg in mapped_now():
        seg.deposited = False
    _native.unindex_all()  # reduce() sends from none until each is deposited again


def let_go_of_here() -> list[Segment]:
    """The memfds this process made that its pool let go of and it still maps (it
    holds them as a receiver), with their descriptors."""
    return [seg for seg in mapped_now() if seg.kind == "fd" and seg.outside_its_pool()]


def mapped_stats() -> dict[str, int]:
    segs = mapped_now()
    return {
        "segments_mapped": len(segs),
        "bytes_mapped": sum(s.size for s in segs),
        "descriptors": sum(1 for s in segs if s.fd is not None),
        "segments_kept": len(_kept),
    }


# What other modules use (transfer, pool, cache, reductions, stats).
__all__ = [
    "ALIGN",
    "HEADER",
    "KEPT_SEGMENTS",
    "GenInfo",
    "ProgramDirectoryGone",
    "Segment",
    "adopt",
    "create_file",
    "cut",
    "drop_kept",
    "dtypes",
    "fd_identity",
    "fill",
    "find_trailer",
    "forget_deposits",
    "keep",
    "let_go_of_here",
    "live",
    "live_segments",
    "lookup",
    "mapped_now",
    "mapped_stats",
    "new_name",
    "no_memory",
    "open_fd",
    "open_file",
    "os_error",
    "refuse_foreign_file",
    "retire_in_use",
    "seal_where",
    "segment_at",
]
