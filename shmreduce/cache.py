"""Where a storage lies, and which storage lies at a place.

``place_of(storage)``: a storage's ``Place`` (its segment, generation, offset, size)
is where its memory is. A storage whose data lies inside a segment this process maps
is in that segment's live generation, at its address minus the mapping's: found by
address (``pool.segment_at``), with no record kept per storage. So a storage sent
twice is moved once, and a received storage (or a slice of one) sent on goes out
from where it is. The one exception, a storage torch shared by descriptor itself
(a segment shmreduce maps elsewhere, generation 0), is remembered by its
StorageImpl (``remember_adopted``) with a weak reference.

Which storage lies at a place is not kept here: it is the identity map of each token
(a generation in this process, ``Gen.stored`` / ``Gen.remember``, in C), so that
views of one storage sent in one message or in several arrive over one storage (and
a process loading its own ref gets its own storage back): offset -> a weak reference
to the storage, never the storage, gone with the token when the generation's last
storage here dies, so nothing is ever swept entry by entry. The load paths
(``Gen.load``, ``_native.rebuild``) and the senders (``transfer._placed``,
``_native.reduce``) read and fill it there. Fork-safe: the lock is replaced in the
child.

Weak references to a storage's Python object are weak references to its
StorageImpl: torch keeps one Python object per StorageImpl for as long as any
tensor uses it (pinned by ``tests/test_torch_api.py``).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, NamedTuple

import torch

from shmreduce import pool
from shmreduce._torch import storage_key


class Place(NamedTuple):
    """Where a storage lies: *nbytes* at *offset* of generation *gen* of *segment*
    (a ``pool.Segment``). *gen* 0: a segment shmreduce does not pool (a storage
    torch shared by descriptor), at offset 0."""

    segment: Any
    gen: int
    offset: int
    nbytes: int


class StorageCache:
    def __init__(self) -> None:
        self._adopted: dict[int, tuple[weakref.ref, Place]] = {}  # storage key -> place
        self._after_fork()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def place_of(self, storage: torch.UntypedStorage, key: int | None = None) -> Place | None:
        """*storage*'s place, if it lies in shared memory shmreduce knows (*key*: its
        ``storage_key``, if known: only a storage torch shared needs it)."""
        nbytes = storage.nbytes()
        ptr = storage.data_ptr()
        seg = pool.segment_at(ptr, nbytes)
        if seg is not None:
            return Place(seg, seg.gen, ptr - seg.addr, nbytes)
        if self._adopted:
            entry = self._adopted.get(storage_key(storage) if key is None else key)
            if entry is not None and entry[0]() is not None:
                return entry[1]
        return None

    def remember_adopted(self, storage: torch.UntypedStorage, place: Place, key: int) -> None:
        """A storage torch shared by descriptor lies in *place* (a segment mapped
        elsewhere in this process)."""
        with self._lock:
            for dead in [k for k, (weak, _) in self._adopted.items() if weak() is None]:
                del self._adopted[dead]
            self._adopted[key] = (weakref.ref(storage), place)

    def clear(self) -> None:
        """Forget everything (a test acting as a process that never saw these storages)."""
        with self._lock:
            self._adopted.clear()


cache = StorageCache()
