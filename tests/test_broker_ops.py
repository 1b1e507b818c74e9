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


def _keep(conn) -> None:
    """A receiver that keeps every tensor it gets (holding its generation), answering
    with its sum."""
    kept = []
    while (t := conn.recv()) is not None:
        kept.append(t)
        conn.send(float(t.sum()))


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
