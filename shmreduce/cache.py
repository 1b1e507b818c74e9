"""Weak-reference storage cache: ``storage -> Place`` (where it lies in a shared
segment) and ``Place -> storage`` (so a storage received twice is one storage).

Owns the only record of which shared segment backs which live storage in this
process. Entries hold torch weak pointers to the StorageImpl (``_torch.WeakStorage``),
never the storage itself, so caching never keeps memory alive (the ``Segment`` a
place names stays mapped until its entry is purged: dead entries go in batches, at
the latest every ``transfer.PURGE_EVERY``). It never talks to the broker: what a
storage's death lets go of is the business of its segment generation (``pool``).
Fork-safe: the lock is replaced in the child.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from shmreduce._torch import WeakStorage, storage_key

PURGE_MIN_ENTRIES = 128  # a purge walks every entry: at most once per this many new ones (see _purge_locked)


class Place(NamedTuple):
    """Where a storage lies: *nbytes* at *offset* of generation *gen* of *segment*
    (a ``pool.Segment``). *gen* 0: a segment shmreduce does not pool (a storage
    torch shared by descriptor), at offset 0."""

    segment: Any
    gen: int
    offset: int
    nbytes: int

    @property
    def key(self) -> tuple:
        """The place's identity in every process that maps it."""
        return (self.segment.kind, self.segment.key, self.gen, self.offset)


class StorageCache:
    def __init__(self) -> None:
        self._by_storage: dict[int, tuple[WeakStorage, Place]] = {}
        self._by_place: dict[tuple, WeakStorage] = {}
        self._limit = PURGE_MIN_ENTRIES
        self._after_fork()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def place_of(self, storage: torch.UntypedStorage, key: int | None = None) -> Place | None:
        """*storage*'s place, if it has one (*key*: its ``storage_key``, if known)."""
        entry = self._by_storage.get(storage_key(storage) if key is None else key)
        if entry is None or entry[0].expired():
            return None
        return entry[1]

    def storage_at(self, key: tuple) -> torch.UntypedStorage | None:
        weak = self._by_place.get(key)
        return None if weak is None else weak.get()

    def remember(self, storage: torch.UntypedStorage, place: Place, key: int | None = None) -> None:
        """Record the pair (purging dead entries once they outnumber live ones)."""
        weak = WeakStorage(storage)
        if key is None:
            key = storage_key(storage)
        with self._lock:
            self._by_storage[key] = (weak, place)
            self._by_place[place.key] = weak
            if len(self._by_storage) >= self._limit:
                self._purge_locked()

    def purge(self) -> None:
        with self._lock:
            self._purge_locked()

    def _purge_locked(self) -> None:
        for cdata, (weak, place) in list(self._by_storage.items()):
            if weak.expired():
                del self._by_storage[cdata]
                key = place.key
                if self._by_place.get(key) is weak:
                    del self._by_place[key]
        self._limit = max(PURGE_MIN_ENTRIES, 2 * len(self._by_storage))

    def forget(self, gone: Callable[[Place], bool]) -> None:
        """Drop the places *gone* says no longer exist (files that went with a broker
        that died): their storages are shared anew if sent again."""
        with self._lock:
            for cdata, (weak, place) in list(self._by_storage.items()):
                if gone(place):
                    del self._by_storage[cdata]
                    if self._by_place.get(place.key) is weak:
                        del self._by_place[place.key]

    def live_places(self) -> list[Place]:
        with self._lock:
            return [place for weak, place in self._by_storage.values() if not weak.expired()]

    def live_count(self) -> int:
        with self._lock:
            return sum(1 for weak, _ in self._by_storage.values() if not weak.expired())

    def clear(self) -> None:
        """Forget everything (a test acting as a process that never saw these storages)."""
        with self._lock:
            self._by_storage.clear()
            self._by_place.clear()

    def __len__(self) -> int:
        return len(self._by_storage)


cache = StorageCache()
