"""Each op of the broker's protocol (protocol.py), one test each at least, through a
real broker process and the real client: what the broker keeps after it, what it
answers, and that it logs no error of its own (a record a client sent in good faith
never costs that client its connection)."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Iterator

import pytest
import torch

import shmreduce
from shmreduce import _native, program
from shmreduce.broker import client as broker_client
from shmreduce.broker import protocol as P
from shmreduce.cache import cache
from shmreduce.pool import ARENA_ITEM_MAX

from helpers import let_go_now, wait_for

TIMEOUT = 30.0
CTX = mp.get_context("fork")
NUMEL = ARENA_ITEM_MAX // 4 + 16  # a float32 tensor this long gets a segment of its own


@pytest.fixture
def broker_log() -> Iterator[Callable[[], str]]:
    """What this session's brokers log from now on (every broker of the session
    appends to one file, conftest.py): a function that reads it."""
    path = os.environ["SHMREDUCE_BROKER_LOG"]
    start = os.path.getsize(path) if os.path.exists(path) else 0

    def read() -> str:
        if not os.path.exists(path):
            return ""
        with open(path) as f:
            f.seek(start)
            return f.read()

    yield read


def _quiet(log: str) -> None:
    """No error of the broker's own, no connection it dropped."""
    for line in ("Traceback", "unexpected error", "dropped the connection"):
        assert line not in log, log


def _connected(root: bool = True, ledger: broker_client.Ledger | None = None) -> broker_client.BrokerClient:
    """A client of this program's broker of its own (its own identity), connected;
    *root*: a sender's (it may start the broker)."""
    prog = program.current()
    client = broker_client.BrokerClient(prog.directory, prog.root_pid if root else None, ledger)
    client.connect()
    return client


def _memfd() -> int:
    fd = os.memfd_create("shmreduce-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, mmap.PAGESIZE)  # a header of zeros: nothing sent in it, nobody holds it
    return fd


def _fetchable(client: broker_client.BrokerClient, ino: int) -> bool:
    """Whether the broker answers a fetch of memfd *ino* with its descriptor."""
    fd = client.fetch(ino)
    if fd is None:
        return False
    try:
        return P.identity(os.fstat(fd)) == ino
    finally:
        os.close(fd)


def _name() -> str:
    return P.SEG_PREFIX + os.urandom(12).hex()


# -- S, a file's descriptor (SEG_FILE) ---------------------------------------------------


def test_a_segment_record_of_a_file_is_answered_and_the_file_held_until_released(tmp_path, broker_log):
    # The record a process sends, after a broker restart, for each file of its pool
    # that went with the old broker's directory and that another process holds or
    # may load: the new broker keeps its descriptor (to read its header) as a hold.
    with shmreduce.registered(strategy="file_system"):
        client = _connected()
        try:
            before = client.ping(full=True)
            name = _name()
            path = tmp_path / name
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, mmap.PAGESIZE)
                os.unlink(path)  # gone, as with the directory of a broker that died
                client.segment_file(fd, name)
            finally:
                os.close(fd)
            counters = client.ping(full=True)
            assert counters["segment_files"] == before["segment_files"] + 1, counters
            assert counters["descriptors"] == before["descriptors"] + 1, counters  # the file's, kept
            assert counters["connections"] == before["connections"], counters  # none dropped
            client.release([name])
            assert wait_for(lambda: client.ping()["segment_files"] == before["segment_files"], TIMEOUT)
            assert wait_for(lambda: client.ping(full=True)["descriptors"] == before["descriptors"], TIMEOUT)
        finally:
            client.close(keep=True)
    _quiet(broker_log())


# -- S, a memfd; F; X ---------------------------------------------------------------------


def test_a_deposited_memfd_is_fetched_by_its_inode_until_its_depositor_drops_it(registered_fd, broker_log):
    # A pooled one: nothing in flight in it, it goes at once. One without a header
    # stays ORPHAN_TTL after the drop (nothing counts its refs in flight): that one
    # is test_without_torch.test_a_broker_keeps_a_memfd_and_hands_it_back.
    sender, receiver = _connected(), _connected(root=False)
    fd = _memfd()
    try:
        before = sender.ping()["segments"]
        ino = P.identity(os.fstat(fd))
        sender.segment(fd, header="lead")
        assert sender.ping()["segments"] == before + 1
        assert _fetchable(receiver, ino)
        sender.drop([ino])
        assert wait_for(lambda: sender.ping()["segments"] == before, TIMEOUT)  # nothing in flight in it
        assert not _fetchable(receiver, ino)
    finally:
        os.close(fd)
        sender.close(keep=True)
        receiver.close(keep=True)
    _quiet(broker_log())


def test_a_forwarded_memfd_is_kept_only_while_something_reaches_it(registered_fd, broker_log):
    # A relay sends on a segment it received: it does not use it (no drop to come),
    # so the broker keeps it only while refs sent in it wait or a process holds it.
    relay = _connected()
    fd = _memfd()
    try:
        before = relay.ping()["segments"]
        relay.segment(fd, header="lead", forward=True)
        # Its header says nothing was sent in it and nobody holds it: it goes.
        assert wait_for(lambda: relay.ping()["segments"] == before, TIMEOUT)
    finally:
        os.close(fd)
        relay.close(keep=True)
    _quiet(broker_log())


def test_a_fetch_of_a_memfd_nobody_deposited_is_refused_and_the_connection_kept(registered_fd, broker_log):
    receiver = _connected(root=False)
    fd = _memfd()
    try:
        connections = receiver.ping()["connections"]
        assert not _fetchable(receiver, P.identity(os.fstat(fd)))
        assert receiver.ping()["connections"] == connections
    finally:
        os.close(fd)
        receiver.close(keep=True)
    _quiet(broker_log())


def test_a_drop_of_a_memfd_another_client_deposited_changes_nothing(registered_fd, broker_log):
    sender, other = _connected(), _connected()
    fd = _memfd()
    try:
        ino = P.identity(os.fstat(fd))
        sender.segment(fd, header="lead")
        other.drop([ino])
        other.ping()  # a barrier: its drop was read
        assert _fetchable(other, ino)
        sender.drop([ino])
        assert wait_for(lambda: not _fetchable(other, ino), TIMEOUT)
    finally:
        os.close(fd)
        sender.close(keep=True)
        other.close(keep=True)
    _quiet(broker_log())


# -- H, R ---------------------------------------------------------------------------------


def test_a_held_file_is_kept_until_every_holder_releases_it(registered_fd, broker_log):
    # A release counts only from a holder, once however often it held the file.
    first, second, stranger = _connected(), _connected(), _connected()
    try:
        before = first.ping()["segment_files"]
        name = _name()
        first.hold([name])
        second.hold([name])
        first.hold([name])
        stranger.release([name, _name()])
        assert stranger.ping()["segment_files"] == before + 1  # a barrier: every post read
        first.release([name])
        assert stranger.ping()["segment_files"] == before + 1  # second holds it still
        second.release([name])
        assert wait_for(lambda: stranger.ping()["segment_files"] == before, TIMEOUT)
    finally:
        for client in (first, second, stranger):
            client.close(keep=True)
    _quiet(broker_log())


# -- L, K, P ------------------------------------------------------------------------------


def test_a_posted_ledger_is_what_the_broker_reads_as_held(registered_fd, broker_log):
    directory = program.current().directory
    ledger = broker_client.Ledger(directory)
    client = _connected(root=False, ledger=ledger)  # connecting posts its ledger
    try:
        before = client.ping(full=True)["generations_held"]
        index = ledger.hold(_name(), 7)
        assert client.ping(full=True)["generations_held"] == before + 1
        ledger.mark(index, P.FREE)
        assert client.ping(full=True)["generations_held"] == before
    finally:
        client.close(keep=True)
        ledger.close()
    _quiet(broker_log())


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "no_keep"])
def test_a_client_that_closes_saying_it_lives_on_lets_go_of_its_holds(registered_fd, broker_log, keep):
    # With K the broker counts it out of what it used at once; without, a live
    # process's holds stay until it reconnects (the same identity) or dies.
    client, observer = _connected(), _connected()
    try:
        before = observer.ping()["segment_files"]
        name = _name()
        client.hold([name])
        assert observer.ping()["segment_files"] == before + 1
        connections = observer.ping()["connections"] - len(client.sockets())
        client.close(keep=keep)
        assert wait_for(lambda: observer.ping()["connections"] == connections, TIMEOUT)
        assert observer.ping()["segment_files"] == (before if keep else before + 1)
        if not keep:
            client.release([name])  # it reconnects as itself, and lets go
            assert wait_for(lambda: observer.ping()["segment_files"] == before, TIMEOUT)
    finally:
        client.close(keep=True)
        observer.close(keep=True)
    _quiet(broker_log())


def test_a_ping_answers_after_every_posted_record_and_a_full_one_says_more(registered_fd, broker_log):
    client = _connected()
    try:
        plain = client.ping()
        assert plain["pid"] == client.broker_pid and "descriptors" not in plain
        name = _name()
        client.hold([name])  # posted: no answer; the next ping has read it
        full = client.ping(full=True)
        assert full["segment_files"] == plain["segment_files"] + 1
        assert full["records"]["H"] == plain["records"].get("H", 0) + 1
        assert {"generations_held", "descriptors", "libtorch_mapped"} <= set(full)
        client.release([name])
    finally:
        client.close(keep=True)
    _quiet(broker_log())


# -- S of files after a broker restart, end to end ------------------------------------------


def _keep(conn) -> None:
    """A receiver that keeps every tensor it gets (holding its generation), answering
    with its sum."""
    kept = []
    while (t := conn.recv()) is not None:
        kept.append(t)
        conn.send(float(t.sum()))


@pytest.mark.swap_path
def test_file_segments_held_or_in_flight_at_a_broker_restart_are_held_at_the_new_one(broker_log, monkeypatch):
    # file_system: a receiver holds one segment, a message in another is not loaded
    # yet; the broker is killed and its directory goes. The owner's next connection
    # brings both files to the new broker by descriptor: each record answered, so
    # that the new broker counts the receiver out of the first at its death.
    results = []
    real = broker_client.BrokerClient.segment_file

    def recorded(self, fd: int, name: str) -> None:
        try:
            real(self, fd, name)
        except Exception as exc:
            results.append(repr(exc))
            raise
        results.append("ok")

    monkeypatch.setattr(broker_client.BrokerClient, "segment_file", recorded)
    with shmreduce.registered(strategy="file_system"):
        ours, theirs = CTX.Pipe()
        proc = CTX.Process(target=_keep, args=(theirs,))
        proc.start()
        theirs.close()
        try:
            held = torch.full((NUMEL,), 1.0)
            ours.send(held)
            assert ours.poll(TIMEOUT) and ours.recv() == float(NUMEL)
            place = cache.place_of(held.untyped_storage())
            assert place is not None
            seg = place.segment
            assert _native.hdr_read(seg.addr)[3] == 1  # the receiver holds it
            flying = torch.full((NUMEL,), 2.0)
            blob = shmreduce.dumps(flying)  # in flight: sent, not loaded
            directory = program.current().directory
            client = broker_client.client_for(directory, program.current().root_pid)
            old = client.broker_pid
            os.kill(old, signal.SIGKILL)
            assert wait_for(lambda: not os.path.exists(directory), TIMEOUT)
            client.connect()  # a new broker: both files go to it
            assert client.broker_pid not in (0, old)
            assert results == ["ok", "ok"], results
            assert client.ping()["segment_files"] == 2
            # A new hold connects the receiver to the new broker (its ledger posted
            # there); killed, it is counted out of the first file's header.
            ours.send(torch.full((NUMEL,), 3.0))
            assert ours.poll(TIMEOUT) and ours.recv() == 3.0 * NUMEL
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(TIMEOUT)
            assert wait_for(lambda: _native.hdr_read(seg.addr)[3] == 0, TIMEOUT), _native.hdr_read(seg.addr)
            assert float(shmreduce.loads(blob).sum()) == 2.0 * NUMEL  # the message in flight loads
            del held, place, flying, blob
            let_go_now()
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(TIMEOUT)
            ours.close()
    _quiet(broker_log())
