"""One pickled message = one deposit at the broker and one fetch by its receiver.

``share(storage)`` (sender) returns the ``SegmentRef`` a pickle carries;
``receive(ref)`` (receiver) turns it back into a storage. Inside a ``sending()``
scope (opened by ``registry``'s ``ForkingPickler.dumps`` and by ``shmreduce.dumps``)
every storage of the message joins one deposit, sent when the scope closes; outside
a scope (a plain ``ForkingPickler(file).dump()``, e.g. spawn's process object) each
storage is deposited on its own. The receiver fetches a message's descriptors on its
first reference to it and hands them out to the rest; ``receiving()`` scopes close
whatever a failed or partial load left over.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator, NamedTuple

import torch

from shmreduce import _torch, program, segments
from shmreduce.broker import client as broker
from shmreduce.broker.protocol import DIR_PREFIX, KEY_LEN
from shmreduce.cache import Segment, cache
from shmreduce.errors import SharingError, stale_message
from shmreduce.strategy import get_sharing_strategy

MAX_PENDING = 64  # fetched messages whose refs have not all been rebuilt yet


class SegmentRef(NamedTuple):
    """What a pickle carries for one shared storage."""

    kind: str  # "fd" | "fs"
    program: str  # broker directory the message was deposited with
    message: bytes  # deposit key
    name: str  # segment identity (see cache.Segment)
    nbytes: int
    slot: int  # fd: index of the descriptor in the deposit; fs: -1


_counters = {
    "storages_shared": 0,
    "bytes_shared": 0,
    "storages_reused": 0,
    "storages_received": 0,
    "bytes_received": 0,
    "messages_sent": 0,
    "messages_received": 0,
}


def counters() -> dict[str, int]:
    return dict(_counters)


# -- sending -----------------------------------------------------------------------


class _Outgoing:
    """The deposit a message is building, per broker it touches."""

    __slots__ = ("key", "fds", "slots", "keep", "holds", "inflight")

    def __init__(self) -> None:
        self.key = os.urandom(KEY_LEN)
        self.fds: list[int] = []
        self.slots: dict[str, int] = {}
        self.keep: list[torch.UntypedStorage] = []  # keeps each fd valid until the deposit
        self.holds: dict[str, list[str]] = {}
        self.inflight: dict[str, list[str]] = {}

    def add(self, storage: torch.UntypedStorage, segment: Segment) -> SegmentRef:
        if segment.kind == "fd":
            slot = self.slots.get(segment.name)
            if slot is None:
                slot = self.slots[segment.name] = len(self.fds)
                self.fds.append(_torch.storage_fd(storage))
                self.keep.append(storage)
            return SegmentRef("fd", program.current().directory, self.key, segment.name, segment.nbytes, slot)
        names = self.inflight.setdefault(segment.program, [])
        if segment.name not in names:
            names.append(segment.name)
        return SegmentRef("fs", segment.program, self.key, segment.name, segment.nbytes, -1)

    def flush(self, deliver: bool = True) -> None:
        own = program.current()
        targets = set(self.holds) | (set(self.inflight) if deliver else set())
        if deliver and self.fds:
            targets.add(own.directory)
        for directory in targets:
            fds = self.fds if deliver and directory == own.directory else []
            inflight = self.inflight.get(directory, []) if deliver else []
            holds = self.holds.get(directory, [])
            broker.client_for(directory, own.root_pid).deposit(self.key, fds, holds, inflight)
        if deliver and (self.fds or self.inflight):
            _counters["messages_sent"] += 1
        self.keep.clear()


_local = threading.local()


@contextmanager
def sending() -> Iterator[None]:
    """Group every storage pickled inside into one deposit (nested scopes join the outer)."""
    if getattr(_local, "out", None) is not None:
        yield
        return
    out = _local.out = _Outgoing()
    try:
        yield
    except BaseException:
        _local.out = None
        out.flush(deliver=False)  # new fs files are still ours to hold
        raise
    _local.out = None
    out.flush()


def _segment_for(storage: torch.UntypedStorage, out: _Outgoing) -> Segment:
    segment = cache.segment_of(storage)
    if segment is not None:
        _counters["storages_reused"] += 1
        return segment
    if storage.is_shared():
        segment = segments.adopt_fd(storage)
    if segment is None:
        if get_sharing_strategy() == "file_system":
            prog = program.current()
            if not os.path.isdir(prog.directory):
                # The broker makes the directory; gone means that broker died.
                broker.client_for(prog.directory, prog.root_pid).connect(fresh=True)
            segment = segments.move_to_file(storage, prog.directory)
            out.holds.setdefault(prog.directory, []).append(segment.name)
        else:
            segment = segments.move_to_memfd(storage)
        _counters["storages_shared"] += 1
        _counters["bytes_shared"] += segment.nbytes
    _release(cache.remember(storage, segment))
    return segment


def share(storage: torch.UntypedStorage) -> SegmentRef:
    """Move *storage* into shared memory (once) and add it to the current message."""
    out = getattr(_local, "out", None)
    if out is not None:
        return out.add(storage, _segment_for(storage, out))
    with sending():
        out = _local.out
        return out.add(storage, _segment_for(storage, out))


def _release(released: dict[str, list[str]]) -> None:
    for directory, names in released.items():
        try:
            broker.client_for(directory, os.getpid()).release(names)
        except SharingError:
            pass  # that broker is gone, and with it every hold


# -- receiving ---------------------------------------------------------------------


class _Fetched:
    __slots__ = ("fds", "left", "unknown")

    def __init__(self, fds: list[int] | None) -> None:
        self.unknown = fds is None
        self.fds: list[int | None] = list(fds or ())
        self.left = len(self.fds)

    def take(self, slot: int) -> int | None:
        if not 0 <= slot < len(self.fds):
            return None
        fd = self.fds[slot]
        if fd is not None:
            self.fds[slot] = None
            self.left -= 1
        return fd

    def close(self) -> None:
        for i, fd in enumerate(self.fds):
            if fd is not None:
                os.close(fd)
                self.fds[i] = None
        self.left = 0


_pending: "OrderedDict[tuple[str, bytes], _Fetched]" = OrderedDict()
_pending_lock = threading.Lock()


def _fetched(ref: SegmentRef) -> _Fetched:
    key = (ref.program, ref.message)
    with _pending_lock:
        entry = _pending.get(key)
        if entry is not None:
            return entry
    if not os.path.basename(ref.program).startswith(DIR_PREFIX) or len(ref.message) != KEY_LEN:
        raise SharingError(f"refusing handle for {ref.program!r}: not a shmreduce program directory (forged message?)")
    if not os.path.isdir(ref.program):
        # Its broker is gone (the janitor removed the directory): never start a new
        # broker for a directory named by a pickle, which could be anywhere.
        raise stale_message(f"cannot receive from {ref.program!r}: no such program directory")
    entry = _Fetched(broker.client_for(ref.program, os.getpid()).fetch(ref.message))
    if not entry.unknown:
        _counters["messages_received"] += 1
    with _pending_lock:
        _pending[key] = entry
        scope = getattr(_local, "incoming", None)
        if scope is not None:
            scope.append(key)
        while len(_pending) > MAX_PENDING:
            _pending.popitem(last=False)[1].close()
    return entry


def _forget(key: tuple[str, bytes]) -> None:
    with _pending_lock:
        entry = _pending.pop(key, None)
    if entry is not None:
        entry.close()


def receive(ref: SegmentRef) -> torch.UntypedStorage:
    """The storage *ref* names: from the cache if this process maps it already."""
    if not isinstance(ref, SegmentRef) or ref.kind not in ("fd", "fs"):
        raise SharingError(f"not a shmreduce segment handle: {ref!r}")
    entry = _fetched(ref)
    segment = Segment(ref.kind, "" if ref.kind == "fd" else ref.program, ref.name, ref.nbytes)
    fd = entry.take(ref.slot) if ref.kind == "fd" else None
    try:
        storage = cache.storage_of(segment)
        if storage is None:
            if entry.unknown or (ref.kind == "fd" and fd is None):
                raise stale_message(f"cannot receive segment {ref.name}")
            storage = segments.map_fd(fd, segment) if fd is not None else segments.map_file(segment)
            _counters["storages_received"] += 1
            _counters["bytes_received"] += ref.nbytes
            _release(cache.remember(storage, segment))
        return storage
    finally:
        if fd is not None:
            os.close(fd)


@contextmanager
def receiving() -> Iterator[None]:
    """Close whatever the messages loaded inside left unclaimed."""
    if getattr(_local, "incoming", None) is not None:
        yield
        return
    keys: list[tuple[str, bytes]] = []
    _local.incoming = keys
    try:
        yield
    finally:
        _local.incoming = None
        for key in keys:
            _forget(key)


def pending_count() -> int:
    return len(_pending)


def _after_fork_in_child() -> None:
    global _pending_lock
    _pending_lock = threading.Lock()
    for entry in _pending.values():
        entry.close()
    _pending.clear()
    _local.__dict__.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _hold_live_names(client: broker.BrokerClient) -> None:
    # A new connection (first use, after fork, after a broker restart) holds again
    # every file_system segment this process still maps.
    names = cache.live_names(client.directory)
    if names:
        client.hold(names)


broker.on_connect.append(_hold_live_names)
