"""One pickled message = one deposit at the broker, then one claim (and at most one
fetch) by its receiver.

``share(storage)`` (sender) moves a storage into this process's pool (``pool``) once
and returns the ``SegmentRef`` a pickle carries, as a plain tuple; ``receive(ref)``
(receiver) turns it back into a storage. Inside a ``sending()`` scope (opened by
``registry``'s ``ForkingPickler.dumps`` and by ``shmreduce.dumps``) every storage of
the message joins one deposit, sent when the scope closes; outside a scope (a plain
``ForkingPickler(file).dump()``, e.g. spawn's process object) each storage is
deposited on its own. A file_descriptor receiver fetches a message's descriptors
only for a segment it does not map yet; it claims the message, naming the
generations it keeps, when its ``receiving()`` scope closes. ``collect()`` then lets
go of what died, at most every PURGE_EVERY seconds in a quiet process.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch

from shmreduce import _torch, pool, program, segments
from shmreduce.broker import client as broker
from shmreduce.broker.protocol import KEY_LEN, gen_name, is_program_dir
from shmreduce.cache import Place, cache
from shmreduce.errors import OutOfSharedMemory, SharingError, stale_message
from shmreduce.strategy import get_sharing_strategy

_T = TypeVar("_T")
log = logging.getLogger("shmreduce")

MAX_PENDING = 64  # fetched messages whose refs have not all been rebuilt yet


class SegmentRef(NamedTuple):
    """What a pickle carries for one shared storage: names the fields of the plain
    tuple ``share`` returns (plain tuples pickle and load in C, on the hot path).
    Checked in one place, ``_checked``."""

    kind: str  # "fd" | "fs"
    program: str  # broker directory the message was deposited with
    message: bytes  # deposit key
    segment: int | str  # fd: the memfd's inode; fs: the file's name
    gen: int  # the segment's generation (0: a segment shmreduce does not pool)
    offset: int
    nbytes: int
    # fd: index of the descriptor in the deposit. fs: the handle's tag, a keyed hash
    # of its directory, message, file and generation under the program's authkey (see
    # fs_tag): nothing asks the broker before a file is mapped, so the receiver checks
    # the tag instead, once per message and generation.
    slot: int


def fs_tag(directory: str, message: bytes, name: str, gen: int) -> int:
    """The tag of a file_system handle: refuses forged or mixed-up directories, keys,
    names, generations. Computed once per message and generation on either side:
    offsets and sizes are checked against the mapped segment itself (``_native``)."""
    h = _tagger().copy()
    h.update(b"%s/%s%s/%d" % (directory.encode(), message, name.encode(), gen))
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
    "storages_received": 0,
    "bytes_received": 0,
    "messages_sent": 0,
    "messages_received": 0,
}


def counters() -> dict[str, int]:
    return dict(_counters)


# -- pools -------------------------------------------------------------------------


def _program_dir() -> str:
    return program.current().directory


def _notices() -> list[str]:
    client = broker.connected_client(_program_dir())
    return client.notices() if client is not None else []


def _release_files(directory: str, names: list[str]) -> None:
    client = broker.connected_client(directory)
    if client is not None:
        _quietly(client.release, names)


def _make_file(size: int) -> pool.Segment:
    """A new file_system segment: a file in the program directory, its broker live,
    its name held there before the file exists (a sender killed mid-pickle leaves
    nothing: issue 11, item 17).

    If that broker died after the check, its directory may be gone: check again (a
    new broker makes it) and try once more. A full mount may be full of segments
    nobody uses any more: let go of them, and try once more.
    """
    try:
        return _new_file(size)
    except segments.ProgramDirectoryGone:
        return _new_file(size)
    except OutOfSharedMemory:
        _fs_full()
        return _new_file(size)


def _fs_full() -> None:
    """The file_system mount is full: let go of every file this process does not use
    (free notices taken in first), and wait until the broker has unlinked them."""
    prog = program.current()
    client = broker.client_for(prog.directory, prog.root_pid)
    collect()
    client.ping()  # barrier: our releases are in, the notices they caused are out
    collect()
    _fs_pool.trim(idle=-1.0)
    client.ping()  # barrier: the broker unlinked the files nobody holds


def _new_file(size: int) -> pool.Segment:
    prog = _live_program()
    name = _names.take(prog.directory, prog.root_pid)
    fd = segments.create_file(prog.directory, name, size)
    try:
        return pool.Segment("fs", name, prog.directory, fd, size, fd)
    except OSError as exc:
        os.close(fd)
        raise segments.os_error(exc, f"mapping {prog.directory}/{name}") from exc


_fd_pool = pool.FdPool(_program_dir, _notices)
_fs_pool = pool.FilePool(_make_file, _program_dir, _notices, _release_files, _fs_full)


# -- sending -----------------------------------------------------------------------


# Message keys: a random per-process prefix and a counter. Unique without a
# getrandom() call per message; the prefix is drawn again in a forked child.
_key_prefix = os.urandom(KEY_LEN - 8)
_key_count = itertools.count()


def _new_key() -> bytes:
    return _key_prefix + next(_key_count).to_bytes(8, "little")


class _Outgoing:
    """The deposit a message is building: its descriptors (file_descriptor) and the
    names it holds until received, per broker directory it touches."""

    __slots__ = ("key", "program", "root", "fds", "slots", "keep", "names", "gens", "tags", "holds", "announced", "files")

    def __init__(self) -> None:
        self.key = _new_key()
        prog = program.current()
        self.program, self.root = prog.directory, prog.root_pid
        self.fds: list[int] = []  # the deposit's descriptors, one per memfd, by slot
        self.slots: dict[int, int] = {}  # memfd inode -> slot
        self.keep: list[torch.UntypedStorage] = []  # keeps torch's descriptors valid until the deposit
        self.names: dict[str, dict[str, None]] = {}  # directory -> names the message holds
        self.gens: set[int] = set()  # generations among them
        self.tags: dict[int, int] = {}  # file_system generation -> its handles' tag
        self.holds: dict[str, list[str]] = {}  # directory -> generations this process starts holding
        self.announced: list[pool.Segment] = []
        self.files = False  # the fs program directory's broker was checked live

    def add(self, storage: torch.UntypedStorage) -> tuple:
        """The storage's ref (a ``SegmentRef`` as a plain tuple) in this message."""
        key = _storage_key(storage)
        place = cache.place_of(storage, key)
        if not self.files and (place.segment.kind == "fs" if place is not None else _current_pool() is _fs_pool):
            # Once per message, before its first file is named or filled: a broker
            # that died since is replaced now, and the files that went with it are
            # forgotten (the storage is shared again: issue 11, item 5) or held at the
            # new broker. Without it a sender went on packing messages into its slab,
            # a file of the dead broker's directory, until its next deposit noticed
            # (issue 19, item 4). One non-blocking peek when the broker lives.
            self.files = True
            _live_program()
            place = cache.place_of(storage, key)
        if place is None:
            place = _move_once(storage, key)
        else:
            _counters["storages_reused"] += 1
        seg, gen, offset, nbytes = place
        if seg.kind == "fs":
            directory = seg.directory
            self._hold(directory, seg, gen)
            self.names.setdefault(directory, {})[seg.key] = None
            tag = self.tags.get(gen)
            if tag is None:
                tag = self.tags[gen] = fs_tag(directory, self.key, seg.key, gen)
            return ("fs", directory, self.key, seg.key, gen, offset, nbytes, tag)
        if gen:
            self._hold(self.program, seg, gen)
        slot = self.slots.get(seg.key)
        if slot is None:
            slot = self.slots[seg.key] = len(self.fds)
            if seg.fd is None:  # a storage torch shared keeps its own descriptor
                self.fds.append(_torch.storage_fd(storage))
                self.keep.append(storage)
            else:
                self.fds.append(seg.fd)
        return ("fd", self.program, self.key, seg.key, gen, offset, nbytes, slot)

    def _hold(self, directory: str, seg: pool.Segment, gen: int) -> None:
        """The message holds generation *gen*; its owner too, from its first send on."""
        if gen in self.gens:
            return
        self.gens.add(gen)
        name = gen_name(gen)
        self.names.setdefault(directory, {})[name] = None
        if seg.pool is not None and not seg.announced and seg.gen == gen and seg.pid == os.getpid():
            seg.announced = True
            self.announced.append(seg)
            self.holds.setdefault(directory, []).append(name)

    def flush(self, deliver: bool = True) -> None:
        """Send the deposit (or, if not *deliver*, nothing: the generations it would
        have announced are this process's alone again)."""
        try:
            if not deliver:
                for seg in self.announced:
                    seg.announced = False
                return
            targets = set(self.names)
            if self.fds:
                targets.add(self.program)
            releases = _take_releases() if pool.has_dead() else None
            for directory in targets:
                fds = self.fds if directory == self.program else []
                client = broker.client_for(directory, self.root if directory == self.program else None)
                if releases is not None:
                    _send_releases(releases, directory, client)
                client.deposit(self.key, fds, self.holds.get(directory, []), list(self.names.get(directory, ())))
            if releases is not None:
                _send_releases(releases)
            _counters["messages_sent"] += 1
        finally:
            self.keep.clear()


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


RESERVED_NAMES = 16
_names = _NameReserve()

_local = threading.local()


_OPEN = object()  # _local.out of a sending scope that has no storage yet


class sending:
    """``with sending():`` groups every storage pickled inside into one deposit, sent
    when the scope closes (nested scopes join the outer one). If the block raises,
    nothing is delivered. A scope that shared nothing (most of multiprocessing's own
    messages) costs no deposit."""

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
# One lock of a fixed set per storage (by its key): two storages may share one, which
# costs them a wait, never correctness; no lock is made per storage.
_STRIPES = 64
_stripes = [threading.Lock() for _ in range(_STRIPES)]
_storage_key = _torch.storage_key
_torch_is_shared = _torch.torch_is_shared
_swap_memory = _torch.swap_memory


def _move_once(storage: torch.UntypedStorage, key: int) -> Place:
    """*storage*'s place (*key*: its ``storage_key``): moved into this process's pool
    by the first thread to get here (in place: every tensor viewing it sees the
    shared memory), the place it made for every thread that waited meanwhile."""
    with _stripes[(key >> 4) % _STRIPES]:
        place = cache.place_of(storage, key)
        if place is not None:
            _counters["storages_reused"] += 1
            return place
        nbytes = storage.nbytes()
        if _torch_is_shared(storage):  # the cache does not know it: torch's answer is the answer
            place = _adopt(storage, key, nbytes)
            if place is not None:
                return place
        seg, gen, offset, shared = _current_pool().place(nbytes, storage)
        _swap_memory(storage, shared)
        return _placed(storage, Place(seg, gen, offset, nbytes), key)


def _current_pool() -> pool.Pool:
    return _fs_pool if get_sharing_strategy() == "file_system" else _fd_pool


def _adopt(storage: torch.UntypedStorage, key: int, nbytes: int) -> Place | None:
    """The place of a storage torch shared by descriptor: where it is (a segment
    shmreduce does not pool). None for one torch shared otherwise: it moves into the
    pool like any other, unless it is mapped from a file shmreduce did not make
    (refused)."""
    seg = pool.adopt(storage)
    if seg is None:
        segments.refuse_foreign_file(storage)
        return None
    place = Place(seg, 0, 0, nbytes)
    cache.remember(storage, place, key)
    return place


def _placed(storage: torch.UntypedStorage, place: Place, key: int | None = None) -> Place:
    _counters["storages_shared"] += 1
    _counters["bytes_shared"] += place.nbytes
    cache.remember(storage, place, key)
    if not _collector.started:
        _collector.ensure()
    return place


def share_in_place(storage: torch.UntypedStorage) -> None:
    """Move *storage* into a shared segment now, outside any message (``share_memory_``)."""
    key = _storage_key(storage)
    if cache.place_of(storage, key) is None:
        _move_once(storage, key)


def new_shared(nbytes: int) -> torch.UntypedStorage:
    """A new zero-filled storage in a shmreduce segment of the current strategy.

    What torch's ``UntypedStorage._new_shared`` does with its own shared memory; a
    DataLoader worker's collate allocates each batch with it, so the batch is then
    sent without another copy.
    """
    if nbytes <= 0:
        return torch.UntypedStorage(0)
    seg, gen, offset, storage = _current_pool().place(nbytes, None)
    _placed(storage, Place(seg, gen, offset, nbytes))
    return storage


def let_go_slabs() -> None:
    """End this thread's current slabs: their generations end with their last storages."""
    for p in (_fd_pool, _fs_pool):
        p.local.__dict__.pop("slab", None)


def let_go() -> None:
    """Stop keeping memory for later messages: this thread's current slabs, the free
    segments of the pools, the segments kept mapped for reuse (``unregister()``).
    Storages still alive keep theirs."""
    gc.collect()  # storages in reference cycles die now, not at some later collection
    let_go_slabs()
    collect()
    _fd_pool.let_go()
    _fs_pool.let_go()
    pool.drop_kept()


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


def _unclaimed(directory: str, key: bytes) -> bool:
    entry = _pending.get((directory, key))
    return entry is not None and bool(entry.keep)


def _take_releases(wait: bool = False) -> pool.Releases:
    """What died since the last call; *wait*: also for a call running in another
    thread (the collector's) to finish, so that its effects are seen on return."""
    releases = pool.Releases()
    if wait or pool.has_dead():
        with _releases_lock:
            pool.settle(releases, _unclaimed)
    return releases


def _send_releases(releases: pool.Releases, directory: str | None = None, client: broker.BrokerClient | None = None) -> None:
    """Send what *releases* holds for *directory* (every directory if None)."""
    for held_dir in [d for d in releases.held if directory is None or d == directory]:
        names = releases.held.pop(held_dir)
        target = client or broker.connected_client(held_dir)
        if target is not None:
            _quietly(target.release, names)
    for msg_dir, key in [k for k in releases.kept if directory is None or k[0] == directory]:
        names = releases.kept.pop((msg_dir, key))
        target = client or broker.connected_client(msg_dir)
        if target is not None:
            _quietly(target.release, names, key)


def _quietly(send: Callable[..., None], *args: Any) -> None:
    # Holds belong to a connection: once it closed (unregister(), a broker that died)
    # the broker dropped them, and a new connection holds none of these.
    try:
        send(*args)
    except SharingError:
        pass


def collect(linger: float = 0.0) -> None:
    """Let go now of what died here: generations (at the broker, or back to the pool),
    free notices taken in, idle segments closed, dead cache entries dropped. A
    receiver's parked tokens go once parked *linger* seconds (all of them by
    default; the collector thread gives them ``pool.LINGER``)."""
    cache.purge()
    pool.unpark(linger)
    _send_releases(_take_releases(wait=True))
    for p in (_fd_pool, _fs_pool):
        if p.waiting:
            p.reap()
        p.trim()


class _Collector:
    """A daemon thread that runs ``collect`` every PURGE_EVERY, whether or not anything
    else is sent or received: memory is reusable (or returned) within about a second
    of the last process letting go (issue 12). Started with this process's first
    segment, again in a forked child."""

    def __init__(self) -> None:
        self.started = False
        self.logged = float("-inf")  # when it last logged an error

    def ensure(self) -> None:
        if not self.started:
            self.started = True
            threading.Thread(target=self._run, name="shmreduce-collect", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(PURGE_EVERY)
            try:
                collect(pool.LINGER)
            except Exception:  # noqa: BLE001  a failure here must not stop the letting go for good
                if sys.is_finalizing():
                    return  # interpreter shutdown tears modules down under it
                now = time.monotonic()
                if now - self.logged >= 60.0:  # once a minute at most
                    self.logged = now
                    log.exception("shmreduce's collector thread hit an error letting go of memory; it goes on")


_collector = _Collector()


# -- receiving ---------------------------------------------------------------------


class _Incoming:
    """A message this process has started to receive.

    Inside a ``receiving()`` scope the broker hears of it at most twice: a fetch of
    its descriptors (one round trip) only for a memfd this process does not map yet,
    and a claim when the load ends (fire-and-forget), naming what this process keeps
    through the message: the generations (and files) of the storages it made
    anew. Outside a scope (see ``_incoming``) each reference is claimed at once.
    """

    __slots__ = ("client", "message", "fds", "inos", "fetched", "delivered", "claimed", "keep", "last")

    def __init__(self, client: broker.BrokerClient, message: bytes) -> None:
        self.client, self.message = client, message
        self.fds: list[int | None] = []  # fetched, by slot, until mapped or closed
        self.inos: dict[int, int] = {}  # slot -> memfd inode, once its fd is mapped
        self.fetched = False
        self.delivered = False  # the broker was told it reached this process
        self.claimed = False  # its final claim was sent
        self.keep: list[str] = []  # names to keep, not yet claimed
        self.last: tuple | None = None  # (segment key, generation, segment, token) of the last storage made (in a scope)

    def fetch(self) -> None:
        """The message's descriptors, once (one round trip)."""
        if not self.fetched:
            self.fetched = self.delivered = True
            self.fds = list(self.client.fetch(self.message) or ())

    def segment(self, slot: int, ino: int) -> pool.Segment:
        """This process's new mapping of the memfd in *slot*, which must be *ino*,
        fetching the message's descriptors first if need be."""
        self.fetch()
        if not 0 <= slot < len(self.fds):
            raise stale_message(f"cannot receive segment {ino}")
        known = self.inos.get(slot)
        if known is not None:
            if known != ino:
                raise _not_in_slot(ino, slot)
            seg = pool.lookup("fd", ino)
            if seg is None:  # every storage of it died during the load
                raise stale_message(f"cannot receive segment {ino}")
            return seg
        fd = self.fds[slot]
        if fd is None:
            raise stale_message(f"cannot receive segment {ino}")
        self.fds[slot] = None
        seg = pool.open_fd(fd, ino)  # checks the identity; owns fd from now on
        self.inos[slot] = ino
        return seg

    def known(self, slot: int) -> None:
        """A ref of *slot* in a segment this process maps already: if the message was
        fetched, that slot's descriptor is not needed."""
        if 0 <= slot < len(self.fds) and slot not in self.inos:
            fd = self.fds[slot]
            if fd is not None:
                os.close(fd)
                self.fds[slot] = None

    def claim_now(self) -> None:
        """Outside a scope: claim what this reference keeps now, the message not done
        (delivered: it goes with this process's connections at the latest)."""
        if self.keep or not self.delivered:
            self.delivered = True
            try:
                self.client.claim(self.message, done=False, keep=self.keep)
            except SharingError:
                pass
            self.keep = []  # only now: until the claim is sent, what it keeps is not released (_unclaimed)

    def close(self) -> None:
        """Close the descriptors no storage took; claim the message, done."""
        self.last = None
        for i, fd in enumerate(self.fds):
            if fd is not None:
                os.close(fd)
                self.fds[i] = None
        if not self.claimed:
            self.claimed = True
            try:
                self.client.claim(self.message, done=True, keep=self.keep)
            except SharingError:
                pass  # that broker is gone, and the message with it
            self.keep = []  # only now: until the claim is sent, what it keeps is not released (_unclaimed)


def _not_in_slot(ino: int, slot: int) -> SharingError:
    return SharingError(f"segment {ino} is not in slot {slot} of its message: forged or corrupted message")


_pending: OrderedDict[tuple[str, bytes], _Incoming] = OrderedDict()
_pending_lock = threading.Lock()


def _incoming(directory: str, message: bytes, kind: str) -> tuple[_Incoming, bool]:
    """The pending entry of a message, starting its receipt on its first reference;
    and whether it is in a ``receiving()`` scope."""
    key = (directory, message)
    entry = _pending.get(key)
    scope = getattr(_local, "incoming", None)
    if entry is not None:
        return entry, scope is not None
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
    entry = _Incoming(client, message)
    if scope is None and kind == "fd":
        # Outside a receiving() scope (a plain pickle.load, e.g. spawn's process
        # object) nothing tells when the message ends: its descriptors come now.
        entry.fetch()
    _counters["messages_received"] += 1
    with _pending_lock:
        _pending[key] = entry
        if scope is not None:
            scope.append(key)
        while len(_pending) > MAX_PENDING:
            oldest = next(iter(_pending))
            _pending[oldest].close()  # claimed before it leaves _pending (see _forget)
            del _pending[oldest]
    _collector.ensure()
    return entry, scope is not None


def _forget(key: tuple[str, bytes]) -> None:
    entry = _pending.get(key)
    if entry is not None:
        # Claimed while still pending (see _unclaimed): a release under its key, from
        # the collector thread, then reaches the broker after the claim it undoes.
        entry.close()
        with _pending_lock:
            if _pending.get(key) is entry:
                del _pending[key]


def receive(ref: tuple) -> torch.UntypedStorage:
    """The storage *ref* (a ``SegmentRef`` or its plain tuple) names: from the cache
    if this process has it already."""
    storage = receive_tensor(ref, None)
    assert isinstance(storage, torch.UntypedStorage)
    return storage


def receive_tensor(ref: tuple, layout: tuple | None) -> torch.UntypedStorage | torch.Tensor:
    """What ``receive(ref)`` returns, or, given a tensor's *layout* (DLPack dtype,
    itemsize, size, stride) and where that tensor spans its storage exactly, the
    tensor itself, made over the mapping in one step (its storage is the storage
    ``receive`` would return, and is cached as such)."""
    kind, directory, message, segkey, gen, offset, nbytes, slot = _checked(ref)
    entry, scoped = _incoming(directory, message, kind)
    storage = cache.storage_at((kind, segkey, gen, offset))
    if storage is not None and storage.nbytes() == nbytes:
        if kind == "fd" and entry.fds:
            entry.known(slot)
        if not scoped:
            entry.claim_now()
        return storage
    last = entry.last
    token = None
    if last is not None and last[0] == segkey and last[1] == gen:
        # The message's previous storage lay in this generation too (a slab's small
        # storages): same segment, same token, nothing to look up.
        seg, token = last[2], last[3]
        if not token.acquire():
            token = None  # every storage of it died, and settle took it, meanwhile
    if token is None:
        if kind == "fs" and slot != fs_tag(directory, message, segkey, gen):
            raise SharingError(
                f"refusing file_system handle {segkey!r}: its tag does not match its handle "
                "(forged or corrupted message, or another program's)"
            )
        seg, token = _token_for(entry, kind, directory, message, segkey, gen, slot)
        if scoped:
            entry.last = (segkey, gen, seg, token)
    tensor = None
    try:
        if layout is not None:
            tensor = token.tensor(offset, nbytes, *layout)
        storage = token.storage(offset, nbytes) if tensor is None else tensor.untyped_storage()
    finally:
        token.release()  # the load's hold: from now on its storages (and a park) hold it
    if not scoped:
        entry.claim_now()
    _counters["storages_received"] += 1
    _counters["bytes_received"] += nbytes
    cache.remember(storage, Place(seg, gen, offset, nbytes))
    return storage if tensor is None else tensor


def _token_for(entry: _Incoming, kind: str, directory: str, message: bytes, segkey: Any, gen: int, slot: int) -> tuple[pool.Segment, Any]:
    """The segment *segkey* as mapped here (found, or mapped now: its descriptor
    fetched first if need be) and the token of its generation *gen*, held once for
    the caller to release: live, or dead but not yet settled (it revives with what it
    kept), or new (checked against the segment's header and named in the message's
    claim). Parked once its generation has come in more than one message, or is met
    again while its token lives."""
    seg = pool.lookup(kind, segkey)
    if kind == "fd":
        if seg is None:
            seg = entry.segment(slot, segkey)
        elif entry.fds:
            entry.known(slot)
    elif seg is None or seg.directory != directory:
        seg = pool.open_file(directory, segkey)
    token = seg.live_token(gen)
    if token is not None and token.acquire():
        if gen and seg.pool is None:  # a live token of an earlier message: a slab's, here again
            pool.park(seg, token)
        return seg, token
    if gen:
        if seg.header() != gen & 0xFFFFFFFFFFFFFFFF:
            raise stale_message(f"segment {segkey!r} holds other data now (generation {gen:x} is over)")
        names = [gen_name(gen), segkey] if kind == "fs" else [gen_name(gen)]
        entry.keep.extend(names)
        token = seg.new_token(gen, (directory, message, names))
        if seg.rtokens >= 2:  # the generation came in more than one message (a slab's)
            pool.park(seg, token)
    else:
        token = seg.new_token(0, None)
    if seg.pool is None:
        pool.keep(seg)
    return seg, token


def _checked(ref: Any) -> tuple:
    """*ref*'s fields, each of the type and range a ``SegmentRef`` has, or
    SharingError: the one place a handle from a pickle is checked before use."""
    try:
        kind, directory, message, segkey, gen, offset, nbytes, slot = ref
    except (TypeError, ValueError):
        raise SharingError(f"not a shmreduce segment handle: {ref!r}") from None
    if (
        (kind != "fd" and kind != "fs")
        or type(directory) is not str
        or type(message) is not bytes
        or len(message) != KEY_LEN
        or type(segkey) is not (int if kind == "fd" else str)
        or type(gen) is not int
        or not 0 <= gen < 1 << 96
        or type(offset) is not int
        or offset < 0
        or type(nbytes) is not int
        or nbytes <= 0
        or type(slot) is not int
        or (kind == "fd" and slot < 0)
    ):
        raise SharingError(f"not a shmreduce segment handle: {ref!r} (forged or corrupted message?)")
    return ref


class receiving:
    """``with receiving():`` claims the messages loaded inside when the load ends, and
    closes whatever a failed or partial load left over (nested scopes join the outer
    one). Then lets go of what died since the last message."""

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
            if pool.has_dead():
                _send_releases(_take_releases())


def pending_count() -> int:
    return len(_pending)


def stats() -> dict[str, int]:
    """This process's pools and mappings (see ``shmreduce.stats``)."""
    result = pool.mapped_stats()
    for p in (_fd_pool, _fs_pool):
        for name, value in p.stats().items():
            result[f"{p.kind}_{name}"] = value
    return result


def _before_fork() -> None:
    # The child may use the storages alive now without the broker knowing: their
    # segments are never reused.
    _fd_pool.retire_all()
    _fs_pool.retire_all()


def _after_fork_in_child() -> None:
    global _pending_lock, _key_prefix, _stripes, _releases_lock
    _key_prefix = os.urandom(KEY_LEN - 8)
    _pending_lock = threading.Lock()
    _stripes = [threading.Lock() for _ in range(_STRIPES)]  # a parent's thread may have held one
    _releases_lock = threading.Lock()
    _names.names.clear()  # the parent's holds, not ours
    _collector.started = False  # its thread did not come along
    _fd_pool.reset_after_fork()
    _fs_pool.reset_after_fork()
    for entry in _pending.values():
        entry.claimed = True  # the parent's to fetch or claim, not ours
        entry.close()
    _pending.clear()
    _local.__dict__.clear()
    _connected_before.clear()


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


_connected_before: set[str] = set()


def _on_connect(client: broker.BrokerClient) -> None:
    # A new connection (first use, after fork, after a broker restart). After a
    # restart, the broker that knew who holds what is gone: nothing sent through it
    # is reused, and files that went with it are forgotten (their storages are shared
    # anew when sent again).
    directory = client.directory
    _names.drop(directory)
    if directory not in _connected_before:
        _connected_before.add(directory)
        return
    try:
        present = set(os.listdir(directory))
    except OSError:
        present = set()

    def file_gone(seg: pool.Segment) -> bool:
        return seg.kind == "fs" and seg.directory == directory and seg.key not in present

    # This process's files that outlived the broker (all of its processes were
    # killed: nobody removed the directory) are held at the new one, which knows
    # nothing of them: else it unlinked each as soon as the first message naming it
    # was done, while this process went on filling and reusing it, and every message
    # after failed ('shared-memory file ... is gone', issue 19, item 4).
    kept = [seg.name for seg in _fs_pool.owned() if seg.directory == directory and seg.key in present]
    if kept:
        client.hold(kept)
    _fd_pool.retire_all(announced_only=True)
    _fs_pool.retire_all(announced_only=True)
    _fs_pool.retire_where(file_gone)
    cache.forget(lambda p: file_gone(p.segment))


broker.on_connect.append(_on_connect)
