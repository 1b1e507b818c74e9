"""Where a storage lies, and which storage lies at a place.

``place_of(storage)``: a storage's ``Place`` (its segment, generation, offset, size)
is where its memory is. A storage whose data lies inside a segment this process maps
is in that segment's live generation, at its address minus the mapping's: found by
address (``segments.segment_at``), with no record kept per storage. So a storage sent
twice is moved once, and a received storage (or a slice of one) sent on goes out
from where it is. The one exception, a storage torch shared by descriptor itself
(a segment shmreduce maps elsewhere, generation 0), is remembered by its
StorageImpl (``remember_adopted``) with a weak reference; when that storage dies,
its entry goes, and the segment of one torch moved for shmreduce (*moved*: on a
torch without the swap, ``_torch.path()``) goes to ``take_dead_adopted``
(``transfer.collect`` lets go of its memfd at the broker: a stream of fresh tensors
would otherwise keep every one until the sender exits).

Which storage lies at a place is not kept here: it is the identity map of each Gen
(a generation in this process, ``Gen.stored`` / ``Gen.remember``, in C), so that
views of one storage sent in one message or in several arrive over one storage (and
a process loading its own ref gets its own storage back): offset -> a weak reference
to the storage, never the storage, gone with the Gen when the generation's last
storage here dies, so nothing is ever swept entry by entry. The load paths
(``Gen.load``, ``_native.rebuild``) and the senders (``transfer._placed``,
``_native.reduce``) read and fill it there. Fork-safe: the lock is replaced in the
child.

Weak references to a storage's Python object are weak references to its
StorageImpl: torch keeps one Python object per StorageImpl for as long as any
tensor uses it (pinned by ``tests/test_torch_api.py``).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any, NamedTuple

import torch

from shmreduce import forking, segments
from shmreduce._torch import storage_key


class Place(NamedTuple):
    """Where a storage lies: *nbytes* at *offset* of generation *gen* of *segment*
    (a ``segments.Segment``). *gen* 0: a segment shmreduce does not pool (a storage
    torch shared by descriptor), at offset 0."""

    segment: Any
    gen: int
    offset: int
    nbytes: int


class _Adopted(weakref.ref):
    """A weak reference to an adopted storage, with its key and place, and whether
    torch moved it for shmreduce: its callback (run where the storage dies, any
    thread, perhaps mid-call of this cache) only queues it."""

    __slots__ = ("key", "place", "moved")

    key: int
    place: Place
    moved: bool


class StorageCache:
    def __init__(self) -> None:
        self._adopted: dict[int, _Adopted] = {}  # storage key -> its entry
        self._in_segment: dict[int, _Adopted] = {}  # id() of its segment (its place keeps it) -> its entry
        self._dead: deque[_Adopted] = deque()  # entries whose storage died, not yet taken
        self._after_fork()

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def place_of(self, storage: torch.UntypedStorage, key: int | None = None) -> Place | None:
        """*storage*'s place, if it lies in shared memory shmreduce knows (*key*: its
        ``storage_key``, if known: only a storage torch shared needs it)."""
        nbytes = storage.nbytes()
        ptr = storage.data_ptr()
        seg = segments.segment_at(ptr, nbytes)
        if seg is not None:
            return Place(seg, seg.gen, ptr - seg.addr, nbytes)
        if self._adopted:
            entry = self._adopted.get(storage_key(storage) if key is None else key)
            if entry is not None and entry() is not None:
                return entry.place
        return None

    def remember_adopted(self, storage: torch.UntypedStorage, place: Place, key: int, moved: bool = False) -> None:
        """A storage torch shared by descriptor lies in *place* (a segment mapped
        elsewhere in this process), until it dies; *moved*: torch moved it there for
        shmreduce (``transfer._moved_by_torch``). Constant time: a dead storage's
        entry is queued by its weak reference's callback, not looked for."""
        entry = _Adopted(storage, self._dead.append)
        entry.key, entry.place, entry.moved = key, place, moved
        with self._lock:
            self._adopted[key] = entry
            self._in_segment[id(place.segment)] = entry

    def adopted_in(self, segment: Any) -> torch.UntypedStorage | None:
        """The live adopted storage that lies in *segment*, if any: what a ref to it
        loads in this process (as torch gives a process its own shared storage back)."""
        entry = self._in_segment.get(id(segment))
        return None if entry is None else entry()

    def moved(self) -> list[tuple[Any, torch.UntypedStorage]]:
        """(segment, storage) of every live storage torch moved for shmreduce here."""
        with self._lock:
            entries = list(self._adopted.values())
        found = ((entry.place.segment, entry()) for entry in entries if entry.moved)
        return [(seg, storage) for seg, storage in found if storage is not None]

    def take_dead_adopted(self) -> list[Any]:
        """The segments of the storages torch moved for shmreduce that died since the
        last call; the entries of every adopted storage that died are forgotten (an
        entry a new storage of the same key replaced stays)."""
        segs = []
        with self._lock:
            while self._dead:
                entry = self._dead.popleft()
                if self._adopted.get(entry.key) is entry:
                    del self._adopted[entry.key]
                if self._in_segment.get(id(entry.place.segment)) is entry:
                    del self._in_segment[id(entry.place.segment)]
                if entry.moved:
                    segs.append(entry.place.segment)
        return segs

    def clear(self) -> None:
        """Forget everything (a test acting as a process that never saw these storages)."""
        with self._lock:
            self._adopted.clear()
            self._in_segment.clear()
            self._dead.clear()


cache = StorageCache()
forking.part("cache", after_in_child=cache._after_fork)
