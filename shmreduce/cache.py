"""Weak-reference storage cache: sender ``storage -> segment``, receiver ``segment -> storage``.

Owns the only record of which shared segment backs which live storage in this
process. Entries hold torch weak pointers to the StorageImpl (``_torch.WeakStorage``),
never the storage itself, so caching never keeps memory alive. Dead entries are
purged in batches; the ``file_system`` names they held are returned to the caller,
who releases them at the broker. Fork-safe: the lock is replaced in the child.
"""

from __future__ import annotations

import os
import threading
from typing import NamedTuple

import torch

from shmreduce._torch import WeakStorage

PURGE_MIN_ENTRIES = 128
PURGE_BYTES = 64 << 20  # purge at least every 64 MiB of new segments: frees fs files promptly


class Segment(NamedTuple):
    """A piece of shared memory backing exactly one storage.

    kind "fd": an anonymous memfd, *name* is its "dev:ino" identity, *program* is "".
    kind "fs": a file *name* in the program directory *program*, held at its broker.
    """

    kind: str
    program: str
    name: str
    nbytes: int


class StorageCache:
    def __init__(self) -> None:
        self._by_cdata: dict[int, tuple[WeakStorage, Segment]] = {}
        self._by_segment: dict[tuple[str, str, str], WeakStorage] = {}
        self._limit = PURGE_MIN_ENTRIES
        self._bytes_since_purge = 0
        self._after_fork()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def segment_of(self, storage: torch.UntypedStorage) -> Segment | None:
        entry = self._by_cdata.get(storage._cdata)
        if entry is None or entry[0].expired():
            return None
        return entry[1]

    def storage_of(self, segment: Segment) -> torch.UntypedStorage | None:
        weak = self._by_segment.get(segment[:3])
        return None if weak is None else weak.get()

    def remember(self, storage: torch.UntypedStorage, segment: Segment) -> dict[str, list[str]]:
        """Record the pair; return fs names to release, by program, if a purge ran."""
        weak = WeakStorage(storage)
        with self._lock:
            self._by_cdata[storage._cdata] = (weak, segment)
            self._by_segment[segment[:3]] = weak
            self._bytes_since_purge += segment.nbytes
            if len(self._by_cdata) < self._limit and self._bytes_since_purge < PURGE_BYTES:
                return {}
            return self._purge_locked()

    def purge(self) -> dict[str, list[str]]:
        with self._lock:
            return self._purge_locked()

    def _purge_locked(self) -> dict[str, list[str]]:
        released: dict[str, list[str]] = {}
        for cdata, (weak, segment) in list(self._by_cdata.items()):
            if not weak.expired():
                continue
            del self._by_cdata[cdata]
            key = segment[:3]
            if self._by_segment.get(key) is weak:
                del self._by_segment[key]
                if segment.kind == "fs":
                    released.setdefault(segment.program, []).append(segment.name)
        self._limit = max(PURGE_MIN_ENTRIES, 2 * len(self._by_cdata))
        self._bytes_since_purge = 0
        return released

    def live_names(self, program: str) -> list[str]:
        """The fs segment names of *program* that some live storage here still maps."""
        with self._lock:
            return [
                seg.name
                for weak, seg in self._by_cdata.values()
                if seg.kind == "fs" and seg.program == program and not weak.expired()
            ]

    def forget(self, program: str, names: list[str]) -> None:
        """Drop the fs segments *names* of *program* (their files are gone): the
        storages that map them are shared anew if sent again."""
        gone = set(names)
        with self._lock:
            for cdata, (weak, seg) in list(self._by_cdata.items()):
                if seg.kind == "fs" and seg.program == program and seg.name in gone:
                    del self._by_cdata[cdata]
                    if self._by_segment.get(seg[:3]) is weak:
                        del self._by_segment[seg[:3]]

    def live_count(self) -> int:
        with self._lock:
            return sum(1 for weak, _ in self._by_cdata.values() if not weak.expired())

    def __len__(self) -> int:
        return len(self._by_cdata)


cache = StorageCache()
