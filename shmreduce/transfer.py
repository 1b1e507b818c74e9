"""Sharing a storage (sender) and loading it (receiver): no broker record per message.

``share(storage)`` (sender) moves a storage into this process's pool (``pool``)
once and returns the *ref* a pickle carries (below), a plain tuple, counting it
*sent* in its segment's shared header; ``receive(ref)`` (receiver) turns it back
into a storage, counting it *loaded*. A receiver holds each generation it makes
storages of (``_native.hdr_hold``, before it trusts the generation) and lets go when
its last storage of it dies; an owner reuses a segment once its own storages of
the generation died, nobody holds it and every ref sent was loaded (``pool``).

The broker hears only what it needs when a process dies: a memfd the first time
this process sends a ref to it (a round trip: a deposit the broker cannot keep fails
here, before the message exists; a receiver fetches it once, by inode, to map it; the
memfds torch moved a message's storages into go in one deposit and come in one fetch), and,
fire-and-forget, the files a sender made, and once per connection this process's ledger
of the generations it holds as a receiver (written in shared memory: counted out of
their headers if it dies; ``broker.client.Ledger``). In a steady stream, where
receivers map the segments already, a message costs no record to the broker from
either side, and neither does a generation.

These are the general path. A plain CPU tensor is sent and loaded in one C call
(``_native.reduce`` / ``_native.rebuild``) wherever its generation is indexed /
published: ``share`` indexes each generation it sends from (its memfd deposited,
its file's tag computed) and ``_new_gen`` publishes each it holds as a receiver.

A ref is the plain tuple (kind, program, segment, gen, offset, nbytes, tag, ticket),
plain because plain tuples pickle and load in C, on the hot path; checked in one
place, ``_checked``:

- kind: "fd" or "fs"; program: the broker directory that keeps the segment (fd) or
  holds the file (fs); segment: the memfd's identity (fd) or the file's name (fs);
- gen: the segment's generation (0: a segment shmreduce does not pool); offset,
  nbytes: the storage's bytes in the segment;
- tag: fs, a keyed hash of directory, file and generation under the program's
  authkey (``fs_tag``): nothing asks the broker before a file is mapped, so the
  receiver checks the tag instead, once per generation; fd, 0 (the broker
  authenticates);
- ticket: the ref's ticket in its generation (``_native.hdr_issue``): its first load
  sets the ticket's bit in the header and counts it loaded, a repeated load counts
  nothing (broker/protocol.py, "Lifetimes"); 0 for generation 0.

Inside a ``sending()`` scope (``registry``'s ``ForkingPickler.dumps``,
``shmreduce.dumps``) a message's refs are counted sent when the scope closes
without an error; outside one, at once. ``collect()`` lets go of what died, at most
every PURGE_EVERY seconds in a quiet process.

Threads (every ``mp.Queue``'s feeder, the collector, the user's) act on one pool at
once. Locks, in the one order any thread takes them (a later one never waits for an
earlier one):

1. ``_stripes[i]``: one storage's move into shared memory (read its address, copy,
   swap), by the Python path; the C path (``_native.reduce``) reads the address at
   its copy and swaps only if the storage is still where it was read.
2. ``_gens_lock``: finding or making the Gen of a generation this process loads.
3. ``_releases_lock``: ``settle_dead`` (what died is let go of, one thread at a time).
4. the broker client's lock (``broker.client``): its requests and posts, and the
   ``on_connect`` hooks it runs after a reconnection.
5. ``Pool.lock``: a leaf (``pool``).

A sending scope holds the Gen of each ref it pickles until its refs are counted
sent (``_Outgoing``): its generation cannot end under a ref in flight.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from shmreduce import _faults, _native, _torch, forking, pool, program, segments
from shmreduce.broker import client as broker
from shmreduce.broker.protocol import is_program_dir
from shmreduce.cache import Place, cache
from shmreduce.errors import SharingError, stale_message, too_many_files
from shmreduce.strategy import get_sharing_strategy

HEADER = segments.HEADER

log = logging.getLogger("shmreduce")


def fs_tag(directory: str, name: str, gen: int) -> int:
    """The tag of a file_system ref: refuses forged or mixed-up directories, names,
    generations. Computed once per generation on either side: offsets and sizes are
    checked against the mapped segment itself (``_native``)."""
    h = _tagger().copy()
    h.update(b"%s/%s/%d" % (directory.encode(), name.encode(), gen))
    return int.from_bytes(h.digest(), "little")


_taggers: dict[bytes, hashlib.blake2b] = {}


def _tagger() -> hashlib.blake2b:
    """A keyed blake2b, key already absorbed, for this process's authkey (copied per tag)."""
    authkey = multiprocessing.current_process().authkey  # an AuthenticationString: hashable bytes
    tagger = _taggers.get(authkey)
    if tagger is None:
        key = hashlib.blake2b(bytes(authkey), digest_size=32, person=b"shmreduce-fs").digest()
        tagger = _taggers[bytes(authkey)] = hashlib.blake2b(key=key, digest_size=8)
    return tagger


_counters = {
    "storages_shared": 0,
    "bytes_shared": 0,
    "storages_reused": 0,
    "messages_sent": 0,
    "messages_received": 0,
}


def counters() -> dict[str, int]:
    result = dict(_counters)
    storages, nbytes, _again = _native.loaded()  # every load is counted in C (Gen.load, rebuild)
    result["storages_received"] = storages
    result["bytes_received"] = nbytes
    storages, nbytes, reused = _native.shared()  # what _native.reduce moved, and sent again
    result["storages_shared"] += storages
    result["bytes_shared"] += nbytes
    result["storages_reused"] += reused
    return result


# -- pools -------------------------------------------------------------------------


def _program_dir() -> str:
    return program.current().directory


def _release_files(directory: str, names: list[str]) -> None:
    client = broker.connected_client(directory)
    if client is not None:
        _quietly(client.release, names)


def _drop_memfd(seg: segments.Segment) -> None:
    client = broker.connected_client(_program_dir())
    if client is not None:
        _quietly(client.drop, [seg.key])


def _make_file(size: int) -> segments.Segment:
    """A new file_system segment: a file in the program directory, its broker live,
    its name held there before the file exists (a sender killed mid-pickle leaves
    nothing).

    A full mount may be full of segments nobody uses any more: let go of them
    (``_fs_full``), and try once more (``pool.twice``).
    """
    return pool.twice(_fs_full, lambda last: _new_file_in_live_directory(size))


def _new_file_in_live_directory(size: int) -> segments.Segment:
    """A new file in the program directory. If its broker died after the check, the
    directory may be gone: check again (a new broker makes it) and try once more."""
    try:
        return _new_file(size)
    except segments.ProgramDirectoryGone:
        pass  # made again by the next broker: once more, outside this handler
    return _new_file(size)


def _fs_full() -> None:
    """The file_system mount is full: let go of every file this process does not use
    (waiting segments that are free given back first), and wait until the broker
    has unlinked them."""
    prog = program.current()
    client = broker.client_for(prog.directory, prog.root_pid)
    collect()
    _fs_pool.trim(idle=-1.0)
    client.ping()  # barrier: the broker unlinked the files nobody holds


def _new_file(size: int) -> segments.Segment:
    prog = _live_program()
    name = _names.take(prog.directory, prog.root_pid)
    fd = segments.create_file(prog.directory, name, size)
    try:
        return segments.Segment("fs", name, prog.directory, fd, size, fd)
    except OSError as exc:
        os.close(fd)
        raise segments.os_error(exc, f"mapping {prog.directory}/{name}") from exc


_fd_pool = pool.FdPool(_program_dir, _drop_memfd)
_fs_pool = pool.FilePool(_make_file, _program_dir, _release_files, _fs_full)


# -- sending -----------------------------------------------------------------------


class _NameReserve:
    """file_system file names this process holds at its broker before it makes the
    files, a batch at a time: a sender killed in the middle of a pickle leaves files
    its broker still removes, as its holds go with its connection.
    One hold record per RESERVED_NAMES new files; a name held for a file never made
    costs the broker a dict entry until the process lets go."""

    def __init__(self) -> None:
        self.names: dict[str, list[str]] = {}  # program directory -> held, unused

    def take(self, directory: str, root: int) -> str:
        names = self.names.get(directory)
        if not names:
            names = [segments.new_name() for _ in range(RESERVED_NAMES)]
            broker.client_for(directory, root).hold(names)
            names.reverse()
            self.names[directory] = names
        return names.pop()

    def drop(self, directory: str) -> None:
        """Forget the names held at a broker this process no longer talks to."""
        self.names.pop(directory, None)


RESERVED_NAMES = 16
_names = _NameReserve()

_local = threading.local()


class _Outgoing:
    """The message a ``sending()`` scope is pickling: the Gen of each of its refs,
    held once per ref until the scope closes and counts it sent (a storage made while
    pickling, which only the pickler's memo keeps, cannot die, and its generation end,
    before its ref is counted), and whether its broker was checked live."""

    __slots__ = ("counted", "checked", "program", "moved")

    def __init__(self) -> None:
        self.counted: list[_native.Gen] = []
        self.checked = False
        self.program = ""
        # The memfds torch moved this message's storages into, not yet at the broker:
        # torch's descriptor of each, and the storage (which keeps it open).
        self.moved: dict[segments.Segment, tuple[int, torch.UntypedStorage]] = {}


class sending:
    """``with sending():`` counts the refs pickled inside sent when the scope closes
    (nested scopes join the outer one); if the block raises, none is: a message that
    was never pickled whole is never loaded."""

    __slots__ = ("outer",)

    def __enter__(self) -> None:
        self.outer = getattr(_local, "out", None) is not None
        if not self.outer:
            out = _local.out = _Outgoing()
            _native.message(out.counted)  # _native.reduce appends to it too

    def __exit__(self, exc_type: type | None, *_: object) -> None:
        if not self.outer:
            out, _local.out = _local.out, None
            _native.message(None)
            whole = False
            try:
                if exc_type is None and out.moved:
                    _deposit_moved(out.moved)  # a deposit the broker could not keep fails the message
                whole = exc_type is None
            finally:
                if out.counted:
                    _faults.pause("send.counted")
                    _native.count_sent(out.counted, whole)  # and lets go of the scope's holds
                    if whole:
                        _counters["messages_sent"] += 1
                    if _native.pending():
                        _settle()


def share(storage: torch.UntypedStorage) -> tuple:
    """Move *storage* into shared memory (once) and add it to the current message;
    return its ref (the module docstring says what a ref is)."""
    out = getattr(_local, "out", None)
    if out is None:
        with sending():
            return share(storage)
    key = _storage_key(storage)
    place = cache.place_of(storage, key)
    if not out.checked:
        # Once per message, before its first ref: a broker that died since is replaced
        # now. The files that went with it are forgotten (the storage is shared again)
        # or held at the new broker (``_on_connect``), and the
        # memfds it kept go to the new one with their next ref (``_on_connect``): else
        # a sender whose refs all name memfds it deposited before never reconnected,
        # and a receiver that does not map them received none. One non-blocking poll
        # when the broker lives.
        out.checked = True
        _live_program()
        place = cache.place_of(storage, key)
    if place is None:
        place = _move_once(storage, key)
    else:
        _counters["storages_reused"] += 1
    seg, number, offset, nbytes = place
    if seg.kind == "fs":
        tag_gen, tag = seg.tag
        if tag_gen != number:
            tag = fs_tag(seg.directory, seg.key, number)
            seg.tag = (number, tag)
        template = ("fs", seg.directory, seg.key, number, tag)
    else:
        if not out.program:
            out.program = _program_dir()
        if not seg.deposited and not _deposit(seg, storage, number, out):
            # A received memfd its broker let go of (its owner and every other sender
            # gone): what lies in it is shared anew, from this process's pool.
            seg.seal()
            return share(storage)
        template = ("fd", out.program, seg.key, number, 0)
    ticket = 0
    if number:
        try:
            ticket = _native.hdr_issue(seg.addr)
        except OSError:
            raise SharingError(_native.CUT_MESSAGE) from None  # nothing of this ref counted yet
        gen = seg.live_gen(number)
        if gen is not None:
            gen.acquire()  # alive: *storage* is one of its storages
            seg.index(gen, template)  # _native.reduce sends from it from now on
        else:
            # A storage a forked child inherited (its generation retired at the fork,
            # never reused): a Gen of its own only carries the hold and the mapping.
            gen = _native.Gen(seg, seg.addr, seg.size, number, HEADER)
            gen.info = (None, -1)  # GenInfo's fields: nobody's to settle
        out.counted.append(gen)
    elif seg.trailer:  # a storage torch moved for shmreduce: counted in the header past it
        try:
            ticket = _native.hdr_issue(seg.addr + seg.trailer)
        except OSError:
            raise SharingError(_native.CUT_MESSAGE) from None
        out.counted.append(seg.counting())
    kind, directory, key, number, tag = template
    return (kind, directory, key, number, offset, nbytes, tag, ticket)


def _deposit(seg: segments.Segment, storage: torch.UntypedStorage, gen: int, out: _Outgoing) -> bool:
    """This process's first ref to the memfd *seg*: its descriptor goes to the broker.
    A storage torch moved for shmreduce goes with the other storages torch moved for
    the message *out*, when it is whole (``_deposit_moved``). A received one is mapped
    without a descriptor (``segments.open_fd``): the broker's is
    fetched once more, for this deposit; False if the broker keeps it no longer. One
    no pool of this process keeps (its own, let go of by its pool: this process holds
    it as a receiver) is forwarded as a received one is: nothing here will drop it."""
    own = seg.fd if seg.fd is not None else _torch_fd(seg, storage)
    if own is not None and seg.trailer:
        out.moved[seg] = (own, storage)
        return True
    prog = program.current()
    client = broker.client_for(prog.directory, prog.root_pid)
    header = "lead" if gen else "trail" if seg.trailer else ""
    if own is not None:
        client.segment(own, header, forward=seg.outside_its_pool())
    else:
        fd = client.fetch(int(seg.key))
        if fd is None:
            return False
        try:
            # Another process made it: a forward, which the broker keeps while a ref sent
            # in it waits; a storage torch moved has no holders to keep it meanwhile, so
            # this process uses it while its storages of it live (settle_dead lets go).
            client.segment(fd, header, forward=not seg.trailer)
        finally:
            os.close(fd)
    seg.deposited = True
    return True


def _deposit_moved(moved: dict[segments.Segment, tuple[int, torch.UntypedStorage]]) -> None:
    """The memfds torch moved a message's storages into go to the broker in one
    record, before any ref to them is counted sent: its receiver fetches them in one
    round trip too (``_map_ahead``), not one each. Another thread sending one of them
    meanwhile deposits it too (the broker keeps one descriptor): a message never
    leaves before its memfds are at the broker."""
    prog = program.current()
    broker.client_for(prog.directory, prog.root_pid).deposit([(fd, "trail", False) for fd, _storage in moved.values()])
    for seg in moved:
        seg.deposited = True


def _torch_fd(seg: segments.Segment, storage: torch.UntypedStorage) -> int | None:
    """The descriptor torch keeps of *storage*, a storage torch shared that lies in
    *seg* (``segments.adopt``: no descriptor of its own), if it is one; None for one
    this process received (mapped here: its descriptor is the broker's)."""
    if cache.adopted_in(seg) is not storage:
        return None
    try:
        fd = _torch.storage_fd(storage)
    except RuntimeError:
        return None
    return fd if fd >= 0 else None


# A storage moves into shared memory once, whatever the number of threads pickling it
# at the same time (one tensor put on several queues: each feeder thread pickles it),
# and share_memory_() takes the same path. The check-then-move runs under a lock of
# that storage: the copy into the segment releases the GIL, and another thread must
# not copy from memory this one is swapping away (EFAULT, wrong bytes, lost writes).
# torch guards its own moves alike (torch/storage.py,
# _share_memory_lock_protected).
# One lock of a fixed set per storage (by its key): two storages may share one, which
# costs them a wait, never correctness; no lock is made per storage.
_STRIPES = 64
_stripes = [threading.Lock() for _ in range(_STRIPES)]
_storage_key = _torch.storage_key
_torch_is_shared = _torch.torch_is_shared


def _move_once(storage: torch.UntypedStorage, key: int) -> Place:
    """*storage*'s place (*key*: its ``storage_key``): moved into this process's pool
    by the first thread to get here (in place: every tensor viewing it sees the
    shared memory), the place it made for every thread that waited meanwhile."""
    with _stripes[(key >> 4) % _STRIPES]:
        while True:
            place = cache.place_of(storage, key)
            if place is not None:
                _counters["storages_reused"] += 1
                return place
            nbytes = storage.nbytes()
            if _torch_is_shared(storage):  # the cache does not know it: torch's answer is the answer
                place = _adopt(storage, key, nbytes)
                if place is not None:
                    return place
            if _torch.swap_memory is None:
                return _moved_by_torch(storage, key, nbytes)
            ptr = storage.data_ptr()
            seg, number, offset, shared, gen = _current_pool().place(nbytes, storage)
            if _native.move(storage, ptr, shared):
                return _placed(storage, Place(seg, number, offset, nbytes), gen)
            # Moved meanwhile, by _native.reduce in another thread (which takes no
            # stripe): where it lies now is found on the next turn, under this lock.
            del shared


def _moved_by_torch(storage: torch.UntypedStorage, key: int, nbytes: int) -> Place:
    """*storage*'s place once torch moved it into a memfd of its own, in place, and
    shmreduce adopted it: the way in on a torch that cannot swap a storage's memory
    (``_torch.path()``), under either strategy. Its memfd is let go of at the broker
    once the storage dies (``cache.take_dead_adopted``): it exists for shmreduce's
    messages alone, and a stream of fresh tensors must not keep one each."""
    try:
        _torch.share_fd(storage)
    except RuntimeError as exc:
        if "Too many open files" in str(exc):  # torch's shm_open, at this process's limit
            raise too_many_files("torch moving a storage into shared memory") from exc
        raise SharingError(f"torch could not move a storage of {nbytes} bytes into shared memory: {exc}") from exc
    place = _adopt(storage, key, nbytes, moved=True)
    if place is None:
        raise SharingError("torch moved a storage into shared memory that has no descriptor to send")
    _counters["storages_shared"] += 1
    _counters["bytes_shared"] += nbytes
    if not _collector.started:
        _collector.ensure()  # lets go of its memfd once it dies
    return place


def _current_pool() -> pool.Pool:
    return _fs_pool if get_sharing_strategy() == "file_system" else _fd_pool


def _adopt(storage: torch.UntypedStorage, key: int, nbytes: int, moved: bool = False) -> Place | None:
    """The place of a storage torch shared by descriptor: where it is (a segment
    shmreduce does not pool). None for one torch shared otherwise: it moves into the
    pool like any other, unless it is mapped from a file shmreduce did not make
    (refused). *moved*: torch moved it for shmreduce (``_moved_by_torch``); one torch
    shared for the user or for its own reductions keeps its memfd at the broker while
    this process lives, as a pooled segment keeps its messages while their sender
    lives (``_drop_adopted``)."""
    try:
        seg = segments.adopt(storage, moved)
    except OSError as exc:  # its mapping or its header's page, at a limit of this process
        raise segments.os_error(exc, "mapping a storage torch shared") from exc
    if seg is None:
        segments.refuse_foreign_file(storage)
        return None
    place = Place(seg, 0, 0, nbytes)
    cache.remember_adopted(storage, place, key, moved)
    return place


def _placed(storage: torch.UntypedStorage, place: Place, gen: _native.Gen) -> Place:
    """*storage* lies in *place* now (found there by its address from now on; and
    what a ref to it loads here, as torch gives a process its own storage back)."""
    gen.remember(place.offset, storage)
    _counters["storages_shared"] += 1
    _counters["bytes_shared"] += place.nbytes
    if not _collector.started:
        _collector.ensure()
    return place


def share_in_place(storage: torch.UntypedStorage) -> None:
    """Move *storage* into a shared segment now, outside any message (``share_memory_``)."""
    key = _storage_key(storage)
    if cache.place_of(storage, key) is None:
        _move_once(storage, key)


def new_shared(nbytes: int) -> torch.UntypedStorage:
    """A new storage in a shmreduce segment of the current strategy, its contents
    unspecified, as torch's ``UntypedStorage._new_shared`` (and ``UntypedStorage(n)``)
    promise none.

    What torch's ``_new_shared`` does with its own shared memory; a DataLoader
    worker's collate allocates each batch with it (and overwrites every byte), so the
    batch is then sent without another copy. A segment this process reused is not
    zero-filled first (about a quarter of a worker's CPU per batch of 16 x 1 MiB):
    what lies there is bytes this program wrote before, never another program's (a
    pool's segments are its own process's); fresh pages are the kernel's zeros.
    """
    if nbytes <= 0:
        return torch.UntypedStorage(0)
    seg, number, offset, storage, gen = _current_pool().place(nbytes, None, zero=False)
    _placed(storage, Place(seg, number, offset, nbytes), gen)
    return storage


def let_go_slabs() -> None:
    """End this thread's current slabs: their generations end with their last storages."""
    for p in (_fd_pool, _fs_pool):
        p.drop_currents()


def let_go() -> None:
    """Stop keeping memory for later messages: this thread's current slabs, the free
    segments of the pools, the segments kept mapped for reuse (``unregister()``).
    Storages still alive keep theirs."""
    gc.collect()  # storages in reference cycles die now, not at some later collection
    let_go_slabs()
    collect()
    _fd_pool.deactivate()
    _fs_pool.deactivate()
    segments.drop_kept()


def _live_program() -> program.Program:
    """This program, with a live connection to its broker, before files are made in
    (or sent from) its directory: a connected client keeps the broker, and so the
    directory, alive, where an idle broker might otherwise exit, and remove it, in
    between; a broker that died is replaced (a new one makes the directory)."""
    prog = program.current()
    broker.client_for(prog.directory, prog.root_pid).connect()
    return prog


# -- letting go --------------------------------------------------------------------

PURGE_EVERY = 0.5  # seconds between two looks for what died, in a process that is quiet

_releases_lock = threading.Lock()


def _settle(wait: bool = False) -> None:
    """Account for what died since the last call (``settle_dead``); *wait*: also for
    a call running in another thread (the collector's) to finish, so that its effects
    are seen on return."""
    if wait or _native.pending():  # one atomic load
        with _releases_lock:
            settle_dead()


def settle_dead(dead: list[_native.Gen] | None = None) -> None:
    """Account for every generation whose last storage died here since the last call
    (*dead*: Gens taken from ``_native.dead()`` already).

    In its owner the generation is over here: its pool ends it (``Pool.generation_over``).
    A receiver lets go of its hold, taken by ``_new_gen``: its ledger entry cleared,
    then the header's holders (``broker.client.let_go``)."""
    pid = os.getpid()
    relayed = []
    for gen in _native.dead() if dead is None else dead:
        entry, maker = cast(segments.GenInfo, gen.info)
        if maker != pid:
            continue  # a forked child's copy of its parent's Gen: not ours to tell
        seg = cast(segments.Segment, gen.owner)
        if entry is None:
            owner = seg.pool  # read once: another thread may take it out of its pool meanwhile
            if owner is not None:
                owner.generation_over(seg, gen.number)
            continue
        # The ledger says "dropping" before the header counts this process out, and
        # is cleared after: a process killed in between is retired, not guessed.
        if broker.dropping(entry):  # else this process is exiting: its brokers count it out
            _faults.point("letgo.ledger")
            try:
                _native.hdr_unhold(seg.addr + seg.trailer, gen.number)
            except OSError:  # cut: nothing left to count out of
                pass
            _faults.point("letgo.unhold")
            broker.let_go(entry)
        if seg.outside_its_pool():
            # Its deposit was a forward, kept at the broker while something reaches
            # it, this hold among them: the next send from it deposits again.
            seg.undeposit()
        elif seg.trailer and seg.counter is None and seg.undeposit():
            relayed.append(seg.key)  # a storage torch moved, received and sent on: used while it lived here
    client = broker.connected_client(_program_dir()) if relayed else None
    if client is not None:
        _quietly(client.drop, relayed)


def _quietly(send: Callable[..., None], *args: Any) -> None:
    # A release or a drop told a broker that is gone (unregister(), a broker that
    # died): what this process held there went with its connection.
    try:
        send(*args)
    except SharingError:
        pass


def collect() -> None:
    """Let go now of what died here: generations (back to the pool, or let go of as
    a receiver), waiting segments given back once free, idle segments closed, dead
    cache entries dropped."""
    _settle(wait=True)
    _drop_adopted(cache.take_dead_adopted())
    for p in (_fd_pool, _fs_pool):
        if p.waiting or p.leaving:
            p.reap_waiting()
        p.trim()


# Storages torch moved for shmreduce that died while a message naming them was being
# pickled: let go of at the next pass, once that message is counted sent. Taken under
# its lock: the collector thread and a caller of collect() must not release a counter twice.
_dying: list[segments.Segment] = []
_dying_lock = threading.Lock()


def _drop_adopted(segs: list[segments.Segment]) -> None:
    """The memfds of storages torch moved for shmreduce that died here: this process
    sends no more refs to them, and its broker keeps each while a ref sent in it waits
    to be loaded (its trailing header counts them: ``segments.trail``), as a pooled
    segment. One a thread is still pickling a ref of waits for the next pass: let go
    of before that ref is counted sent, it could be closed under it."""
    keys = []
    with _dying_lock:
        segs, _dying[:] = _dying + segs, []
        for seg in segs:
            counter = seg.counter
            if counter is not None:
                if counter.live > 1:  # its mover's hold, and a message's
                    _dying.append(seg)
                    continue
                seg.counter = None
                counter.release()
            if seg.deposited:
                seg.deposited = False  # sent again (forwarded from a mapping here): deposited anew
                keys.append(seg.key)
    client = broker.connected_client(_program_dir()) if keys else None
    if client is not None:
        _quietly(client.drop, keys)


class _Collector:
    """A daemon thread that runs ``collect`` every PURGE_EVERY, whether or not anything
    else is sent or received: memory is reusable (or returned) within about a second
    of the last process letting go. Started with this process's first segment,
    again in a forked child. It waits on a condition, not in a sleep, so that a new
    period (``collect_every``) applies at once: a wait begun under an hour would
    otherwise last the hour."""

    def __init__(self) -> None:
        self.logged = float("-inf")  # when it last logged an error
        self.reset()

    def reset(self) -> None:
        """As new: also in a forked child, where the parent's thread did not come along
        and may have held the condition's lock."""
        self.started = False
        self.changed = threading.Condition()
        self.changes = 0  # of the period, counted by ``repace``
        self.waits_under = 0  # the count the thread's current wait began under

    def ensure(self) -> None:
        if not self.started:
            self.started = True
            threading.Thread(target=self._run, name="shmreduce-collect", daemon=True).start()

    def repace(self) -> None:
        """Wakes the thread to wait PURGE_EVERY anew and returns once it does, so that
        no pass begun before the change runs after the return (10 s at most: a pass
        that takes longer runs on)."""
        with self.changed:
            self.changes += 1
            self.changed.notify_all()
            if self.started:
                self.changed.wait_for(lambda: self.waits_under == self.changes, 10.0)

    def _run(self) -> None:
        while True:
            with self.changed:
                self.waits_under = self.changes
                self.changed.notify_all()
                if self.changed.wait_for(lambda: self.changes != self.waits_under, PURGE_EVERY):
                    continue  # a new period, waited from now
            try:
                collect()
            except Exception:  # noqa: BLE001  a failure here must not stop the letting go for good
                if sys.is_finalizing():
                    return  # interpreter shutdown tears modules down under it
                now = time.monotonic()
                if now - self.logged >= 60.0:  # once a minute at most
                    self.logged = now
                    log.exception("shmreduce's collector thread hit an error letting go of memory; it goes on")


_collector = _Collector()


@contextlib.contextmanager
def collect_every(seconds: float) -> Iterator[None]:
    """PURGE_EVERY is *seconds* inside the block (a test sets an hour to keep the
    collector thread out of its way), and back after it: the thread waits each new
    period from the moment it is set, and no pass it began before runs inside the
    block (``_Collector.repace``)."""
    global PURGE_EVERY
    before = PURGE_EVERY
    PURGE_EVERY = seconds
    _collector.repace()
    try:
        yield
    finally:
        PURGE_EVERY = before
        _collector.repace()


# -- receiving ---------------------------------------------------------------------


def receive(ref: tuple) -> torch.UntypedStorage:
    """The storage *ref* names: from the cache
    if this process has it already."""
    storage = receive_tensor(ref, None)
    assert isinstance(storage, torch.UntypedStorage)
    return storage


def receive_tensor(ref: tuple, meta: tuple | None) -> torch.UntypedStorage | torch.Tensor:
    """What ``receive(ref)`` returns or, given a plain tensor's *meta* that spans
    its storage exactly, the tensor itself, made by ``_native.rebuild`` once the
    generation is published here (its storage is the storage ``receive`` would
    return, and is cached as such). Counts the ref loaded."""
    kind, directory, segkey, number, offset, nbytes, tag, ticket = _checked(ref)
    if not number:
        own = _adopted_here(kind, directory, segkey, offset, nbytes, ticket)
        if own is not None:
            global _own_loads
            _own_loads += 1  # a load of a storage it had already, as Gen.load counts one
            return own
    gen = _held_gen(kind, directory, segkey, number)
    if gen is None:
        _faults.pause("load.gen")
        with _gens_lock:  # one Gen per (segment, generation) here: found again, or made
            gen = _held_gen(kind, directory, segkey, number)
            if gen is None:
                seg = _mapped_segment(kind, directory, segkey)
                if seg is None:
                    seg = _map(kind, directory, segkey, number, tag)
                if ticket and not number:
                    segments.find_trailer(seg)
                gen = _new_gen(seg, kind, directory, segkey, number, tag)
    try:
        if meta is not None:
            # None where the storage was loaded here already (or the tensor is not
            # one it makes): then its storage, from the identity map, below.
            tensor = _native.rebuild(ref, meta, None)
            if tensor is not None:
                _faults.point("load.counted")
                return tensor
        # This process's storage at offset, else a new one (the range checked first),
        # counted loaded once it exists: one routine for both paths (Gen.load).
        storage: torch.UntypedStorage = gen.load(offset, nbytes, ticket)
        if number:
            _faults.point("load.counted")
    finally:
        gen.release()  # the load's hold: from now on its storages hold it
    return storage


_own_loads = 0  # refs loaded as a storage this process adopted (_adopted_here): counted in no Gen


def _adopted_here(kind: str, directory: str, segkey: Any, offset: int, nbytes: int, ticket: int) -> torch.UntypedStorage | None:
    """The storage a ref of generation 0 names, where it is one this process adopted
    (torch shared it here, or moved it: a torch without the swap): the very storage,
    as a pooled one loads as its sender's own (``_placed``), not a second mapping;
    counted loaded in its trailing header, if it has one."""
    seg = _mapped_segment(kind, directory, segkey)
    own = cache.adopted_in(seg) if seg is not None else None
    if own is None or offset != 0 or own.nbytes() != nbytes:
        return None
    assert seg is not None
    if ticket and seg.trailer:
        try:
            _native.hdr_loaded(seg.addr + seg.trailer, ticket)
        except OSError:
            raise SharingError(_native.CUT_MESSAGE) from None
    return own


# Finding or making the Gen of a generation here is one step per (segment,
# generation): two threads loading its first storage at once would otherwise map it
# twice, hold it twice, and leave one Gen the segment does not know (a fork then
# retires the other only, and the child's copy of the first is overwritten). Taken
# before the broker client's lock (a first load fetches a memfd), never under it.
_gens_lock = threading.RLock()


def _mapped_segment(kind: str, directory: str, segkey: Any) -> segments.Segment | None:
    seg = segments.lookup(kind, segkey)
    return None if seg is None or (kind == "fs" and seg.directory != directory) else seg


def _held_gen(kind: str, directory: str, segkey: Any, number: int) -> _native.Gen | None:
    """The live Gen of *number* here, acquired for the caller, if there is one."""
    seg = _mapped_segment(kind, directory, segkey)
    gen = seg.live_gen(number) if seg is not None else None
    return gen if gen is not None and gen.acquire() else None


def _map(kind: str, directory: str, segkey: Any, gen: int, tag: int) -> segments.Segment:
    """Map a segment this process does not map yet: a memfd fetched from the broker
    of *directory* (once per segment), or the file *segkey* there."""
    client = broker.client_for(directory)
    if not client.connected() and not client.broker_pid:
        # A directory named by a pickle could be anywhere: only one shmreduce made,
        # in this machine's shm base, is ever connected to (a broker connected to
        # once has proved itself in its handshake). A receiver never starts a broker.
        if not os.path.isdir(directory):
            raise SharingError(
                f"cannot receive from {directory!r}: no such program directory on this host. A shmreduce "
                "message is valid only on the host, and in the program, that made it, while that program "
                "lives: it came from another machine, or its program has exited (send it again from a live "
                "process of that program). Across hosts, send the data through what connects them "
                "(torch.distributed, RPC) or by value (tensor.numpy())"
            )
        if not is_program_dir(directory, program.shm_base()):
            raise SharingError(f"refusing handle for {directory!r}: not a shmreduce program directory (forged message?)")
    if kind == "fs":
        _check_tag(directory, segkey, gen, tag)
        return segments.open_file(directory, segkey)
    found = client.fetch_with_batch(segkey)
    if not found:
        raise stale_message(f"cannot receive segment {segkey}")
    try:
        return segments.open_fd(found.pop(0)[1], segkey)  # checks the identity; owns the descriptor from now on
    finally:
        _map_ahead(found)


def _map_ahead(found: list[tuple[int, int]]) -> None:
    """Map the memfds (inode, descriptor: this function's) deposited with one this
    message names: the other storages torch moved for it (``_deposit_moved``), which
    its next refs load without a fetch each. Mapped while the message loads (its
    ``receiving`` scope); a ref holds its generation, as any, when it loads."""
    ahead = getattr(_local, "ahead", None)
    for ino, fd in found:
        if ahead is None or segments.lookup("fd", ino) is not None:
            os.close(fd)
            continue
        with contextlib.suppress(SharingError):  # refused again when a ref names it, if one does
            ahead.append(segments.open_fd(fd, ino))  # closes fd


def _check_tag(directory: str, segkey: str, gen: int, tag: int) -> None:
    if tag != fs_tag(directory, segkey, gen):
        raise SharingError(
            f"refusing file_system handle {segkey!r}: its tag does not match its handle (forged or corrupted message, or another program's)"
        )


def _new_gen(seg: segments.Segment, kind: str, directory: str, segkey: Any, number: int, tag: int) -> _native.Gen:
    """A new Gen of *number* in *seg*, held once for the caller to release. A pooled
    generation is held first (counted in the header, then checked to be the one
    there: its owner never reuses the segment under this load), then written in this
    process's ledger (read by the broker if it dies)."""
    if not number and not seg.trailer:
        gen = seg.new_gen(0, None)
    else:
        if kind == "fs":
            _check_tag(directory, segkey, number, tag)
        # The ledger says "taking" before the header counts the hold, "held" after:
        # a process killed in between is retired, not guessed (protocol.py, "Lifetimes").
        # A storage torch moved is held in generation 0 of its trailing header, so that
        # its broker keeps it while a process holds it, as a pooled segment.
        entry = broker.hold(directory, segkey, number)
        _faults.point("load.ledger")
        try:
            held = _native.hdr_hold(seg.addr + seg.trailer, number)
        except OSError:
            broker.let_go(entry)
            raise SharingError(_native.CUT_MESSAGE) from None
        if not held:
            broker.let_go(entry)
            raise stale_message(f"segment {segkey!r} holds other data now (generation {number:x} is over)")
        _faults.point("load.hold")
        broker.held(entry)
        gen = seg.new_gen(number, entry)
        if number:  # _native.load / rebuild load through it from now on (the sender's template)
            gen.publish((kind, directory, segkey, number, tag))
    if seg.pool is None:
        segments.keep(seg)
    if not _collector.started:
        _collector.ensure()  # what this process holds is let go of without further loads
    return gen


def _checked(ref: Any) -> tuple:
    """*ref*'s fields, each of the type and range a ref's has (module docstring), or
    SharingError: the one place a handle from a pickle is checked before use."""
    try:
        kind, directory, segkey, gen, offset, nbytes, tag, ticket = ref
    except (TypeError, ValueError):
        raise SharingError(f"not a shmreduce segment handle: {ref!r}") from None
    if (
        (kind != "fd" and kind != "fs")
        or type(directory) is not str
        or type(segkey) is not (int if kind == "fd" else str)
        or (kind == "fd" and not 0 <= cast(int, segkey) < 1 << 128)  # a device and inode (protocol.identity)
        or type(gen) is not int
        or not 0 <= gen < 1 << 64
        or type(offset) is not int
        or offset < 0
        or type(nbytes) is not int
        or nbytes <= 0
        or type(tag) is not int
        or type(ticket) is not int
        or not 0 <= ticket < 1 << 64
    ):
        raise SharingError(f"not a shmreduce segment handle: {ref!r} (forged or corrupted message?)")
    return ref


class receiving:
    """``with receiving():`` marks one message's load; when it ends, lets go of what
    died since the last message (nested scopes join the outer one)."""

    __slots__ = ("outer",)

    def __enter__(self) -> None:
        self.outer = getattr(_local, "incoming", None) is not None
        if not self.outer:
            _local.incoming = _loads()
            _local.ahead = []  # _map_ahead

    def __exit__(self, *_: object) -> None:
        if not self.outer:
            before, _local.incoming = _local.incoming, None
            _local.ahead = None
            if _loads() != before:
                _counters["messages_received"] += 1
            if _native.pending():
                _settle()


def _loads() -> int:
    """Refs loaded in this process (``Gen.load`` and ``_native.rebuild``), a storage it
    had already included."""
    storages, _nbytes, again = _native.loaded()
    return storages + again + _own_loads


def stats() -> dict[str, int]:
    """This process's pools and mappings (see ``shmreduce.stats``)."""
    result = segments.mapped_stats()
    for p in (_fd_pool, _fs_pool):
        for name, value in p.stats().items():
            result[f"{p.kind}_{name}"] = value
    return result


def _before_fork() -> None:
    # The child keeps the storages alive now, sent or received, without holding
    # their generations: those are retired (broker/protocol.py, "Lifetimes").
    segments.retire_in_use()


def _after_fork_in_child() -> None:
    global _stripes, _releases_lock, _gens_lock, _dying_lock
    _stripes = [threading.Lock() for _ in range(_STRIPES)]  # a parent's thread may have held one
    _releases_lock = threading.Lock()
    _gens_lock = threading.RLock()
    _dying_lock = threading.Lock()
    _names.names.clear()  # the parent's holds, not ours
    _collector.reset()
    _fd_pool.reset_after_fork()
    _fs_pool.reset_after_fork()
    _local.__dict__.clear()
    _native.message(None)
    _native.watch(-1)  # the parent's connection: this process connects anew
    _connected_before.clear()


forking.part("transfer", before=_before_fork, after_in_child=_after_fork_in_child)


_connected_before: set[str] = set()


def _on_connect(client: broker.BrokerClient) -> None:
    # A new connection (first use, after fork, after a broker restart). After a
    # restart, the broker that kept this process's memfds is gone: each goes to the
    # new one with the next ref sent to it; files that went with the old one's
    # directory are forgotten (their storages are shared anew when sent again).
    # Which generation is free is in the segments' headers: that survives the broker.
    directory = client.directory
    _names.drop(directory)
    if directory == _program_dir() and client.post is not None:
        _native.watch(client.post.fileno())  # _native.reduce checks it for a hang-up once per message
    if directory not in _connected_before:
        _connected_before.add(directory)
        return
    if directory == _program_dir():
        segments.forget_deposits()
    try:
        present = set(os.listdir(directory))
    except OSError:
        present = set()

    def file_gone(seg: segments.Segment) -> bool:
        return seg.kind == "fs" and seg.directory == directory and seg.key not in present

    # This process's files that outlived the broker (all of its processes were
    # killed: nobody removed the directory) are held at the new one, which knows
    # nothing of them: else it unlinked each as soon as nothing was in flight in it,
    # while this process went on filling and reusing it, and every message after
    # failed ('shared-memory file ... is gone').
    kept = [seg.name for seg in _fs_pool.owned() if seg.directory == directory and seg.key in present]
    if kept:
        client.hold(kept)
    _fs_pool.retire_where(file_gone)
    segments.seal_where(file_gone)
    if directory == _program_dir():
        _bring_back(client, file_gone)


def _bring_back(client: broker.BrokerClient, file_gone: Callable[[segments.Segment], bool]) -> None:
    """A new broker: it gets every pooled segment this process keeps that another
    process may hold or load (its header says so: holders, or refs not all loaded):
    its memfds, and its files that went with the old broker's directory (by
    descriptor), so that it reads their headers as the old one did: a process that
    holds a generation of one and dies is counted out of it, whenever it took its hold
    (else a receiver killed after a restart pinned the segment it held from before
    for its owner's life). One round trip each, once per restart; a free segment
    goes to it with its next ref, as to any broker."""

    def reachable(seg: segments.Segment) -> bool:
        try:
            _gen, sent, loaded, holders = _native.hdr_read(seg.addr)
        except OSError:
            return False  # cut by another process: nothing in it to bring back
        return seg.fd is not None and seg.gen != 0 and (holders > 0 or sent > loaded)

    for seg in _fd_pool.owned():
        if not seg.deposited and reachable(seg):
            _quietly(client.segment, seg.fd, "lead")
            seg.deposited = True
    # Its own memfds its pool let go of, which it holds as a receiver: those it sent
    # refs in that wait to be loaded go back too, as any sender's (a forward).
    for seg in segments.let_go_of_here():
        _gen, sent, loaded, _holders = _native.hdr_read(seg.addr)
        if not seg.deposited and sent > loaded:
            _quietly(client.segment, seg.fd, "lead", True)
            seg.deposited = True
    # The storages torch moved for it (a torch without the swap) with refs in flight.
    for seg, storage in cache.moved():
        try:
            _gen, sent, loaded, _holders = _native.hdr_read(seg.addr + seg.trailer)
        except OSError:
            continue  # cut by another process: nothing in it to bring back
        fd = _torch_fd(seg, storage)
        if not seg.deposited and fd is not None and sent > loaded:
            _quietly(client.segment, fd, "trail")
            seg.deposited = True
    for seg in _fs_pool.owned():
        if file_gone(seg) and reachable(seg):
            _quietly(client.segment_file, seg.fd, seg.name)


def _on_close(client: broker.BrokerClient) -> None:
    prog = program.peek()
    if prog is not None and client.directory == prog.directory:
        _native.watch(-1)


broker.on_connect.append(_on_connect)
broker.on_close.append(_on_close)
