"""One pickled message = one deposit at the broker, then one claim or fetch by its receiver.

``share(storage)`` (sender) returns the ``SegmentRef`` a pickle carries, as a plain tuple;
``receive(ref)`` (receiver) turns it back into a storage. Inside a ``sending()``
scope (opened by ``registry``'s ``ForkingPickler.dumps`` and by ``shmreduce.dumps``)
every storage of the message joins one deposit, sent when the scope closes; outside
a scope (a plain ``ForkingPickler(file).dump()``, e.g. spawn's process object) each
storage is deposited on its own. A file_descriptor receiver fetches a message's
descriptors only for a slab it does not map yet, and claims the message when its
``receiving()`` scope closes if it never did; ``receiving()`` scopes also close
whatever a failed or partial load left over.
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, NamedTuple, TypeVar

import torch

from shmreduce import _torch, program, segments, slabs
from shmreduce.broker import client as broker
from shmreduce.broker.protocol import KEY_LEN, is_program_dir
from shmreduce.cache import Segment, cache
from shmreduce.errors import OutOfSharedMemory, SharingError, stale_message
from shmreduce.strategy import get_sharing_strategy

_T = TypeVar("_T")

MAX_PENDING = 64  # fetched messages whose refs have not all been rebuilt yet


class SegmentRef(NamedTuple):
    """What a pickle carries for one shared storage: names the fields of the plain
    tuple ``share`` returns (plain tuples pickle and load in C, on the hot path)."""

    kind: str  # "fd" | "fs"
    program: str  # broker directory the message was deposited with
    message: bytes  # deposit key
    name: str  # segment identity (see cache.Segment)
    nbytes: int
    # fd: index of the descriptor in the deposit. fs: the handle's tag, a keyed hash
    # of (message, name, nbytes) under the program's authkey (see fs_tag): nothing
    # asks the broker before a file is mapped, so the receiver checks the tag instead.
    slot: int


def fs_tag(directory: str, message: bytes, name: str, nbytes: int) -> int:
    """The tag of a file_system handle: refuses forged or mixed-up directories, keys,
    names, sizes."""
    h = _tagger().copy()
    h.update(b"%s/%s%s/%d" % (directory.encode(), message, name.encode(), nbytes))
    return int.from_bytes(h.digest(), "little")


_taggers: dict[bytes, "hashlib.blake2b"] = {}


def _tagger() -> "hashlib.blake2b":
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
    "storages_received": 0,
    "bytes_received": 0,
    "messages_sent": 0,
    "messages_received": 0,
}


def counters() -> dict[str, int]:
    return dict(_counters)


# -- sending -----------------------------------------------------------------------


# Message keys: a random per-process prefix and a counter. Unique without a
# getrandom() call per message; the prefix is drawn again in a forked child.
_key_prefix = os.urandom(KEY_LEN - 8)
_key_count = itertools.count()


def _new_key() -> bytes:
    return _key_prefix + next(_key_count).to_bytes(8, "little")


class _Outgoing:
    """The deposit a message is building, per broker it touches."""

    __slots__ = ("key", "program", "root", "fds", "nbytes", "slots", "buffers", "keep", "holds", "inflight", "files")

    def __init__(self) -> None:
        self.key = _new_key()
        prog = program.current()
        self.program, self.root = prog.directory, prog.root_pid
        self.fds: list[int] = []  # the deposit's descriptors (one per slab), by slot
        self.nbytes = 0  # the memory behind the storages torch shared among them
        self.slots: dict[str, int] = {}  # slab identity -> slot
        self.buffers: list[Any] = []  # the slabs among them (their mappings own the fds)
        self.keep: list[torch.UntypedStorage] = []  # keeps torch's descriptors valid until the deposit
        self.holds: dict[str, list[str]] = {}  # new fs files, by program: held by this process
        self.inflight: dict[str, dict[str, None]] = {}  # fs names the receiver will hold
        self.files = ""  # the program directory new fs files go to, once its broker is live

    def add(self, storage: torch.UntypedStorage) -> tuple:
        """The storage's ref (a ``SegmentRef`` as a plain tuple) in this message."""
        segment = cache.segment_of(storage)
        if segment is not None and segment.kind == "fs" and not self.files:
            # Its files went with a broker that died since: checking the broker
            # forgets them, and the storage is shared again (issue 11, item 5).
            self._files_dir()
            segment = cache.segment_of(storage)
        if segment is None:
            segment = _move_once(storage, self._new_segment)
        else:
            _counters["storages_reused"] += 1
        kind, directory, name, nbytes = segment
        if kind == "fs":
            self.inflight.setdefault(directory, {})[name] = None
            return ("fs", directory, self.key, name, nbytes, fs_tag(directory, self.key, name, nbytes))
        ident = name.rpartition("/")[0]
        slot = self.slots.get(ident)
        if slot is None:
            slot = self._slot(ident, storage)
        return ("fd", self.program, self.key, name, nbytes, slot)

    def _slot(self, ident: str, storage: torch.UntypedStorage) -> int:
        """Add the descriptor of slab *ident* (or of a storage torch shared) to the deposit."""
        buffer = slabs.lookup(ident)
        if buffer is not None:
            fd = slabs.descriptor(buffer)
            self.buffers.append(buffer)
        else:
            fd = _torch.storage_fd(storage)  # a storage torch shared keeps its own descriptor
            self.nbytes += storage.nbytes()
            self.keep.append(storage)
        slot = self.slots[ident] = len(self.fds)
        self.fds.append(fd)
        return slot

    def _new_segment(self, storage: torch.UntypedStorage) -> Segment:
        """The segment of a storage the cache does not know (moved into one if need be)."""
        if storage.is_shared():
            segment = segments.adopt_fd(storage)
            if segment is not None:
                _remember(storage, segment)
                return segment
            segments.refuse_foreign_file(storage)
        if get_sharing_strategy() == "file_system":
            segment = self._in_file(segments.move_to_file, storage)
        else:
            nbytes = storage.nbytes()
            slab = _slab_for(nbytes)
            offset = slab.move(storage)
            segment = Segment("fd", "", f"{slab.ident}/{offset}", nbytes)
        self._created(storage, segment)
        return segment

    def _files_dir(self) -> str:
        """The program directory of this message's fs segments, its broker checked live
        once per message (a connected client keeps it, and so the directory, alive)."""
        if not self.files:
            self.files = _live_program().directory
        return self.files

    def _in_file(self, make: Callable[[Any, str, str], _T], arg: Any) -> _T:
        """``make(arg, directory, name)``: a new file in the program directory, its
        broker live, its name held there before the file exists.

        If that broker died after the check, its directory may be gone: check again
        (a new broker makes it) and try once more. A full mount may be full of files
        whose storages died since the last purge: release them and try once more.
        """
        try:
            return self._new_file(make, arg)
        except segments.ProgramDirectoryGone:
            self.files = ""  # check the broker again
            return self._new_file(make, arg)
        except OutOfSharedMemory:
            _release(cache.purge())
            broker.client_for(self.files, self.root).ping()  # barrier: the broker unlinked them
            return self._new_file(make, arg)

    def _new_file(self, make: Callable[[Any, str, str], _T], arg: Any) -> _T:
        directory = self._files_dir()
        return make(arg, directory, _names.take(directory, self.root))

    def _created(self, storage: torch.UntypedStorage, segment: Segment) -> None:
        """Account for a segment this process just made for *storage*: a new fs file
        is held by this process (sent with the deposit, or as a hold)."""
        if segment.kind == "fs":
            self.holds.setdefault(segment.program, []).append(segment.name)
        _counters["storages_shared"] += 1
        _counters["bytes_shared"] += segment.nbytes
        _remember(storage, segment)

    def flush(self, deliver: bool = True) -> None:
        """Send the deposit (or, if not *deliver*, only the holds of new fs files)."""
        try:
            if not deliver:
                for directory, holds in self.holds.items():
                    broker.client_for(directory, self.root).hold(holds)
                return
            targets = self.holds.keys() | self.inflight.keys()
            if self.fds:
                targets.add(self.program)
            for directory in targets:
                fds = self.fds if directory == self.program else []
                holds = self.holds.get(directory, [])
                inflight = list(self.inflight.get(directory, ()))
                nbytes = self.nbytes + sum(map(slabs.extent, self.buffers)) if fds else 0
                broker.client_for(directory, self.root if directory == self.program else None).deposit(self.key, fds, holds, inflight, nbytes)
            if self.fds or self.inflight:
                _counters["messages_sent"] += 1
        finally:
            self.keep.clear()
            self.buffers.clear()


class _NameReserve:
    """file_system file names this process holds at its broker before it makes the
    files, a batch at a time: a sender killed in the middle of a pickle leaves files
    its broker still removes, as its holds go with its connection (issue 11, item 17).
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


RESERVED_NAMES = 64
_names = _NameReserve()

_local = threading.local()


_OPEN = object()  # _local.out of a sending scope that has no storage yet


class sending:
    """``with sending():`` groups every storage pickled inside into one deposit, sent
    when the scope closes (nested scopes join the outer one). If the block raises,
    nothing is delivered; new fs files are still held by this process. A scope that
    shared nothing (most of multiprocessing's own messages) costs no deposit."""

    __slots__ = ("outer",)

    def __enter__(self) -> None:
        self.outer = getattr(_local, "out", None) is not None
        if not self.outer:
            _local.out = _OPEN

    def __exit__(self, exc_type: type | None, *_: object) -> None:
        if not self.outer:
            out, _local.out = _local.out, None
            if out is not _OPEN:
                out.flush(deliver=exc_type is None)


def share(storage: torch.UntypedStorage) -> tuple:
    """Move *storage* into shared memory (once) and add it to the current message;
    return its ``SegmentRef`` as a plain tuple."""
    out = getattr(_local, "out", None)
    if out is None:
        with sending():
            return share(storage)
    if out is _OPEN:
        out = _local.out = _Outgoing()
    return out.add(storage)


# A storage moves into shared memory once, whatever the number of threads pickling it
# at the same time (one tensor put on several queues: each feeder thread pickles it),
# and share_memory_() takes the same path. The check-then-move runs under a lock of
# that storage: the copy into the segment releases the GIL, and another thread must
# not copy from memory this one is swapping away (issue 11: EFAULT, wrong bytes, lost
# writes). torch guards its own moves alike (torch/storage.py,
# _share_memory_lock_protected).
_moving: dict[int, list] = {}  # storage _cdata -> [lock, threads using it]
_moving_guard = threading.Lock()


def _move_once(storage: torch.UntypedStorage, move: Callable[[torch.UntypedStorage], Segment]) -> Segment:
    """*storage*'s segment: ``move(storage)`` by the first thread to get here, the
    segment it made for every thread that waited meanwhile."""
    key = storage._cdata
    with _moving_guard:
        entry = _moving.get(key)
        if entry is None:
            entry = _moving[key] = [threading.Lock(), 0]
        entry[1] += 1
    try:
        with entry[0]:
            segment = cache.segment_of(storage)
            if segment is not None:
                _counters["storages_reused"] += 1
                return segment
            return move(storage)
    finally:
        with _moving_guard:
            entry[1] -= 1
            if not entry[1]:
                del _moving[key]


def share_in_place(storage: torch.UntypedStorage) -> None:
    """Move *storage* into a shared segment now, outside any message (``share_memory_``).

    A new ``file_system`` file is held by this process at its broker, as it would be
    after a send.
    """
    if cache.segment_of(storage) is not None:
        return
    out = _Outgoing()
    try:
        _move_once(storage, out._new_segment)
    finally:
        out.flush(deliver=False)


def new_shared(nbytes: int) -> torch.UntypedStorage:
    """A new zero-filled storage in a shmreduce segment of the current strategy.

    What torch's ``UntypedStorage._new_shared`` does with its own shared memory; a
    DataLoader worker's collate allocates each batch with it, so the batch is then
    sent without another copy. A new ``file_system`` file is held by this process.
    """
    if nbytes <= 0:
        return torch.UntypedStorage(0)
    out = _Outgoing()
    try:
        if get_sharing_strategy() == "file_system":
            segment, storage = out._in_file(segments.new_file, nbytes)
        else:
            slab = _slab_for(nbytes)
            offset, storage = slab.new(nbytes)
            segment = Segment("fd", "", f"{slab.ident}/{offset}", nbytes)
        out._created(storage, segment)
    finally:
        out.flush(deliver=False)
    return storage


def _slab_for(nbytes: int) -> slabs.Writer:
    """The slab a new storage of *nbytes* goes to: this thread's current slab, filled
    across messages until full (so a steady receiver maps it once, and needs no round
    trip for the messages after), or one of its own for a large storage. Per thread:
    feeder threads pickle at once, and a forked child starts its own."""
    if nbytes > slabs.SLAB_ITEM_MAX:
        return slabs.Writer(nbytes)
    slab = getattr(_local, "slab", None)
    if slab is None or not slab.fits(nbytes):
        slab = _local.slab = slabs.Writer(slabs.SLAB_WINDOW)
    return slab


def let_go() -> None:
    """Stop keeping memory for later messages: this thread's current slab, and the
    slabs kept mapped for reuse (``unregister()``). Storages still alive keep theirs."""
    _local.__dict__.pop("slab", None)
    slabs.drop_kept()


def _live_program() -> program.Program:
    """This program, with a live connection to its broker, before files are made in
    (or sent from) its directory: a connected client keeps the broker, and so the
    directory, alive, where an idle broker might otherwise exit, and remove it, in
    between; a broker that died is replaced (a new one makes the directory)."""
    prog = program.current()
    broker.client_for(prog.directory, prog.root_pid).connect()
    return prog


def _remember(storage: torch.UntypedStorage, segment: Segment) -> None:
    """Record the pair in the cache; release the fs names a purge it ran freed."""
    if segment.kind == "fs" and not _purger.started:
        _purger.start()
    released = cache.remember(storage, segment)
    if released:
        _release(released)


PURGE_EVERY = 0.5  # seconds between two looks for file_system files whose storages died


class _Purger:
    """A daemon thread that releases, every PURGE_EVERY, the file_system files whose
    storages died in this process, whether or not anything else is shared: a file
    goes within about a second of the last process letting go (its broker unlinks it
    once nobody holds it), instead of at some later share's purge (issue 12).
    Started with this process's first file_system segment, again in a forked child."""

    def __init__(self) -> None:
        self.started = False

    def start(self) -> None:
        self.started = True
        threading.Thread(target=self._run, name="shmreduce-purge", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(PURGE_EVERY)
            try:
                released = cache.purge()
                if released:
                    _release(released)
            except Exception:  # noqa: BLE001  interpreter shutdown tears modules down under it
                return


_purger = _Purger()


def _release(released: dict[str, list[str]]) -> None:
    for directory, names in released.items():
        # Holds belong to a connection: once it closed (unregister(), a broker that
        # died) the broker dropped them, and a new connection holds none of these.
        client = broker.connected_client(directory)
        if client is None:
            continue
        try:
            client.release(names)
        except SharingError:
            pass  # that broker is gone, and with it every hold


# -- receiving ---------------------------------------------------------------------


class _Incoming:
    """A message this process has started to receive.

    Inside a ``receiving()`` scope the broker hears of it at most twice: a fetch of
    its descriptors (one round trip) only for a file_descriptor slab this process
    does not map yet, and, if there was none, a claim when the load ends
    (fire-and-forget: the message's file_system files become this process's, its
    descriptors are closed). Outside a scope (see ``_incoming``) it is settled at its
    first reference.
    """

    __slots__ = ("client", "message", "fds", "idents", "fetched", "claimed")

    def __init__(self, client: broker.BrokerClient, message: bytes) -> None:
        self.client, self.message = client, message
        self.fds: list[int | None] = []  # fetched, by slot, until mapped or closed
        self.idents: dict[int, str] = {}  # slot -> slab identity, once its fd is used
        self.fetched = False  # its descriptors (and names) came with a fetch
        self.claimed = False  # the broker was told its names are ours

    def fetch(self) -> None:
        """The message's descriptors, once (one round trip; its names come too)."""
        if not self.fetched:
            self.fetched = self.claimed = True
            self.fds = list(self.client.fetch(self.message) or ())

    def slab(self, slot: int, ident: str) -> Any:
        """This process's new mapping of the slab in *slot*, which must be *ident*,
        fetching the message's descriptors first if need be (the mapping owns its fd)."""
        self.fetch()
        if not 0 <= slot < len(self.fds):
            raise stale_message(f"cannot receive segment {ident}")
        known = self.idents.get(slot)
        if known is not None:
            if known != ident:
                raise _not_in_slot(ident, slot)
            buffer = slabs.lookup(ident)
            if buffer is None:  # every storage of it died during the load
                raise stale_message(f"cannot receive segment {ident}")
            return buffer
        fd = self.fds[slot]
        if fd is None:
            raise stale_message(f"cannot receive segment {ident}")
        buffer = slabs.receive(fd, ident)  # checks the identity; owns fd from now on
        self.fds[slot] = None
        self.idents[slot] = ident
        return buffer

    def known(self, slot: int) -> None:
        """A ref of *slot* in a slab this process maps already: if the message was
        fetched, that slot's descriptor is not needed."""
        if 0 <= slot < len(self.fds) and slot not in self.idents:
            fd = self.fds[slot]
            if fd is not None:
                os.close(fd)
                self.fds[slot] = None

    def close(self) -> None:
        """Close the descriptors no storage took; claim the message, done, if the
        broker has not heard of this receipt (it then closes its descriptors)."""
        for i, fd in enumerate(self.fds):
            if fd is not None:
                os.close(fd)
                self.fds[i] = None
        if not self.claimed:
            self.claimed = True
            try:
                self.client.claim(self.message, done=True)
            except SharingError:
                pass  # that broker is gone, and the message with it


def _not_in_slot(ident: str, slot: int) -> SharingError:
    return SharingError(f"segment {ident} is not in slot {slot} of its message: forged or corrupted message")


_pending: "OrderedDict[tuple[str, bytes], _Incoming]" = OrderedDict()
_pending_lock = threading.Lock()


def _incoming(directory: str, message: bytes, kind: str) -> _Incoming:
    """The pending entry of a message, starting its receipt on its first reference.

    Its file_system files exist while the message holds them, so they are mapped
    at once; the claim that makes them this process's comes when the load ends (see
    ``_Incoming``).
    """
    key = (directory, message)
    entry = _pending.get(key)
    if entry is not None:
        return entry
    client = broker.client_for(directory)
    if not client.connected():
        # A directory named by a pickle could be anywhere: only one shmreduce made,
        # in this machine's shm base, is ever connected to (a connected broker has
        # proved itself in its handshake). A receiver never starts a broker.
        if not os.path.isdir(directory):
            raise stale_message(f"cannot receive from {directory!r}: no such program directory")
        if not is_program_dir(directory, program.shm_base()):
            raise SharingError(f"refusing handle for {directory!r}: not a shmreduce program directory (forged message?)")
    entry = _Incoming(client, message)
    scope = getattr(_local, "incoming", None)
    if scope is None:
        # Outside a receiving() scope (a plain pickle.load, e.g. spawn's process
        # object) nothing tells when the message ends: settle it now. file_system:
        # claim its files, leaving any descriptors for a later fd ref's fetch;
        # file_descriptor: fetch them (one round trip).
        if kind == "fs":
            entry.claimed = True
            client.claim(message)
        else:
            entry.fetch()
    _counters["messages_received"] += 1
    with _pending_lock:
        _pending[key] = entry
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


def receive(ref: tuple) -> torch.UntypedStorage:
    """The storage *ref* (a ``SegmentRef`` or its plain tuple) names: from the cache
    if this process maps it already."""
    kind, directory, message, name, nbytes, slot = _checked(ref)
    entry = _incoming(directory, message, kind)
    segment = Segment(kind, "" if kind == "fd" else directory, name, nbytes)
    storage = cache.storage_of(segment)
    if storage is not None:
        if kind == "fd":
            entry.known(slot)
        return storage
    if kind == "fd":
        storage = _map_slab_item(entry, name, nbytes, slot)
    else:
        if slot != fs_tag(directory, message, name, nbytes):
            raise SharingError(
                f"refusing file_system handle {name!r}: its tag does not match its handle "
                "(forged or corrupted message, or another program's)"
            )
        storage = segments.map_file(segment)
    _counters["storages_received"] += 1
    _counters["bytes_received"] += nbytes
    _remember(storage, segment)
    return storage


def _checked(ref: Any) -> tuple:
    """*ref*'s fields, each of the type and range a ``SegmentRef`` has, or
    SharingError: the one place a handle from a pickle is checked before use."""
    try:
        kind, directory, message, name, nbytes, slot = ref
    except (TypeError, ValueError):
        raise SharingError(f"not a shmreduce segment handle: {ref!r}") from None
    if (
        (kind != "fd" and kind != "fs")
        or type(directory) is not str
        or type(message) is not bytes
        or len(message) != KEY_LEN
        or type(name) is not str
        or type(nbytes) is not int
        or nbytes <= 0
        or type(slot) is not int
        or (kind == "fd" and slot < 0)
    ):
        raise SharingError(f"not a shmreduce segment handle: {ref!r} (forged or corrupted message?)")
    return ref


def _map_slab_item(entry: _Incoming, name: str, nbytes: int, slot: int) -> torch.UntypedStorage:
    """The storage named "dev:ino/offset": in a slab this process maps already, or in
    the slab of *slot* of the message's descriptors."""
    ident, _, offset = name.rpartition("/")
    if not ident or not (offset.isascii() and offset.isdigit()):
        raise SharingError(f"not a shmreduce segment handle: {name!r} of {nbytes!r} bytes (forged message?)")
    buffer = slabs.lookup(ident)
    if buffer is None:
        buffer = entry.slab(slot, ident)
    else:
        entry.known(slot)
    start = int(offset)
    if start + nbytes > slabs.extent(buffer):
        raise SharingError(f"segment {name} of {nbytes} bytes does not match its handle (beyond its slab): forged or corrupted message")
    return slabs.view(buffer, start, nbytes)


class receiving:
    """``with receiving():`` closes whatever the messages loaded inside left unclaimed
    (nested scopes join the outer one)."""

    __slots__ = ("outer",)

    def __enter__(self) -> None:
        self.outer = getattr(_local, "incoming", None) is not None
        if not self.outer:
            _local.incoming = []

    def __exit__(self, *_: object) -> None:
        if not self.outer:
            keys, _local.incoming = _local.incoming, None
            for key in keys:
                _forget(key)


def pending_count() -> int:
    return len(_pending)


def _after_fork_in_child() -> None:
    global _pending_lock, _key_prefix, _moving_guard
    _key_prefix = os.urandom(KEY_LEN - 8)
    _pending_lock = threading.Lock()
    _moving_guard = threading.Lock()
    _moving.clear()
    _names.names.clear()  # the parent's holds, not ours
    _purger.started = False  # its thread did not come along
    for entry in _pending.values():
        entry.claimed = True  # the parent's to fetch or claim, not ours
        entry.close()
    _pending.clear()
    _local.__dict__.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _hold_live_names(client: broker.BrokerClient) -> None:
    # A new connection (first use, after fork, after a broker restart) holds again
    # every file_system segment this process still maps. Files that went with a
    # broker that died are forgotten: their storages are shared anew when sent again.
    _names.drop(client.directory)
    names = cache.live_names(client.directory)
    if not names:
        return
    try:
        present = set(os.listdir(client.directory))
    except OSError:
        present = set()
    gone = [name for name in names if name not in present]
    if gone:
        cache.forget(client.directory, gone)
    held = [name for name in names if name in present]
    if held:
        client.hold(held)


broker.on_connect.append(_hold_live_names)
