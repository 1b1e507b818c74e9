"""What keeps a segment (and its broker) alive, and that nothing a client posted is
lost on its way out.

A pooled segment's header counts the refs sent and loaded in its generation and the
receivers holding it; its owner reuses it only with no holder and nothing in flight.
A receiver that dies holding a generation is counted out by the broker, from the
ledger it posted (what it holds, in shared memory), once its connections closed:
an entry the broker misses, or counts twice, either keeps the segment from reuse
for good or lets its owner overwrite memory a live receiver still reads. The broker stays after its last client
only for refs still in flight (draining), while the program's root lives.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import multiprocessing as mp
import os
import signal
import socket

import pytest
import torch

import shmreduce
from shmreduce import _native, program, transfer
from shmreduce.broker import client as broker_client
from shmreduce.broker import protocol as P
from shmreduce.cache import cache
from shmreduce.pool import ARENA_ITEM_MAX

from helpers import broker_pids, wait_for

TIMEOUT = 10.0
CTX = mp.get_context("fork")
NUMEL = ARENA_ITEM_MAX // 4 + 16  # a float32 tensor this long gets a segment of its own


@pytest.fixture
def broker_log(monkeypatch, tmp_path):
    """A fresh broker for this test (started on first use) that logs to a file; gone
    again at the end, which a segment left in flight would prevent."""
    broker_client.close_all()
    assert wait_for(lambda: not broker_pids(), TIMEOUT)
    path = tmp_path / "broker.log"
    monkeypatch.setenv("SHMREDUCE_BROKER_LOG", str(path))
    monkeypatch.setenv("SHMREDUCE_LOG_LEVEL", "DEBUG")  # "no client left" is a DEBUG line: normal operation is quiet
    yield path
    broker_client.close_all()
    assert wait_for(lambda: not broker_pids(), TIMEOUT), f"broker still running: {_log_text(path)}"


def _log_text(path) -> str:
    return path.read_text() if path.exists() else ""


def _client() -> broker_client.BrokerClient:
    prog = program.current()
    return broker_client.client_for(prog.directory, prog.root_pid)


def _segment_of(t: torch.Tensor):
    place = cache.place_of(t.untyped_storage())
    assert place is not None, "not a shared tensor"
    return place.segment


def _holders(seg) -> int:
    return _native.hdr_read(seg.addr)[3]


class _Memfd:
    """A pooled-looking memfd made here: *gen* in its header, mapped."""

    def __init__(self, gen: int) -> None:
        self.fd = os.memfd_create("shmreduce-test", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, mmap.PAGESIZE)
        os.pwrite(self.fd, gen.to_bytes(8, "little"), 0)
        self.ino = P.identity(os.fstat(self.fd))
        self.gen = gen
        self.map = mmap.mmap(self.fd, mmap.PAGESIZE)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))  # the export goes with the temporary

    def header(self) -> tuple[int, int, int, int]:
        return _native.hdr_read(self.addr)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


def _ledger(client: broker_client.BrokerClient) -> broker_client.Ledger:
    assert client.ledger is not None
    return client.ledger


def _receivers(count: int) -> list[broker_client.BrokerClient]:
    """*count* receiver identities, both connections open, each opened by a process
    that exited since: closing them here is its process's end (the broker counts out a
    live process only once it dies)."""
    directory = program.current().directory
    clients = [broker_client.BrokerClient(directory, None, broker_client.Ledger()) for _ in range(count)]
    for c in clients:
        _connect_in_a_child(c)
    return clients


def _connect_in_a_child(client: broker_client.BrokerClient) -> None:
    """Open *client*'s connections in a forked child, which hands them here and exits."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            client.ping()
            client._post_socket(start=False)
            assert client.sock is not None and client.post is not None
            socket.send_fds(theirs, [b"c"], [client.sock.fileno(), client.post.fileno()])
            code = 0
        finally:
            os._exit(code)
    try:
        _, status = os.waitpid(pid, 0)
        assert status == 0, status
        _msg, fds, _flags, _addr = socket.recv_fds(ours, 1, 2)
        assert len(fds) == 2, fds
        client.sock, client.post = (socket.socket(fileno=fd) for fd in fds)
    finally:
        ours.close()
        theirs.close()


# -- a receiver that goes while holding a generation --------------------------------------


def _hold_until_killed(conn) -> None:
    """A receiver: maps the segment and lets go of it (its connections open, the
    mapping kept), then holds the next message's generation until it is killed."""
    t = shmreduce.loads(conn.recv_bytes())
    assert float(t.sum()) == 3.0 * NUMEL
    del t
    gc.collect()
    transfer.collect()  # its hold goes: U, then counted out of the header by itself
    conn.send("mapped")
    kept = shmreduce.loads(conn.recv_bytes())  # the segment mapped already: no request to the broker
    conn.send(float(kept.sum()))
    conn.recv()  # killed here, holding *kept*


@pytest.mark.swap_path
@pytest.mark.parametrize("queued", [False, True], ids=["read", "queued"])
def test_a_receiver_killed_holding_a_generation_is_counted_out_and_the_owner_reuses_the_segment(strategy, queued):
    # queued: the broker is stopped from before the receiver's load until after its
    # death: its close is read after the ledger entry the load wrote, which counts.
    ours, theirs = CTX.Pipe()
    proc = CTX.Process(target=_hold_until_killed, args=(theirs,))
    proc.start()  # before the tensor exists: it inherits no mapping of it
    stopped = 0
    try:
        t = torch.full((NUMEL,), 3.0)
        ours.send_bytes(shmreduce.dumps(t))
        assert ours.poll(30) and ours.recv() == "mapped"
        seg = _segment_of(t)
        assert _holders(seg) == 0
        if queued:
            stopped = _client().broker_pid
            os.kill(stopped, signal.SIGSTOP)
        ours.send_bytes(shmreduce.dumps(t))
        assert ours.poll(30) and ours.recv() == 3.0 * NUMEL
        _gen, sent, loaded, holders = _native.hdr_read(seg.addr)
        assert (sent, loaded, holders) == (2, 2, 1)  # every ref loaded: only the hold keeps it
        # Its own storage dead, the owner does not reuse a segment a receiver holds.
        del t
        gc.collect()
        transfer.collect()
        other = torch.full((NUMEL,), 5.0)
        transfer.share_in_place(other.untyped_storage())
        assert _segment_of(other) is not seg
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(TIMEOUT)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if stopped:
            os.kill(stopped, signal.SIGCONT)
        if proc.is_alive():
            proc.kill()
            proc.join(TIMEOUT)
        ours.close()
        theirs.close()
    assert wait_for(lambda: _holders(seg) == 0, TIMEOUT), _native.hdr_read(seg.addr)
    again = torch.full((NUMEL,), 6.0)
    transfer.share_in_place(again.untyped_storage())
    assert _segment_of(again) is seg, "the owner did not reuse a segment nobody holds"
    assert bool((again == 6.0).all()) and bool((other == 5.0).all())


def _hold_then(conn, unregister: bool) -> None:
    """A receiver: holds the message's generation; on "go", unregisters (if
    *unregister*: its connections close while it still holds) and lets go of its
    storage; reports the tensor's sum whenever asked."""
    kept = shmreduce.loads(conn.recv_bytes())
    conn.send(float(kept.sum()))
    while (order := conn.recv()) is not None:
        if order == "go":
            if unregister:
                shmreduce.unregister()
            del kept
            gc.collect()
            transfer.collect()
            conn.send("let go")
        else:
            conn.send(float(kept.sum()))


@pytest.mark.swap_path
def test_a_receiver_whose_connections_close_while_it_holds_is_counted_out_once(strategy):
    # A receiver that unregisters (its connections close: the broker counts it out of
    # the header) and then lets go of its storage (which counts it out again, itself)
    # must not take another receiver's count with it: the owner would overwrite
    # memory that receiver still reads.
    first_conn, first_theirs = CTX.Pipe()
    second_conn, second_theirs = CTX.Pipe()
    first = CTX.Process(target=_hold_then, args=(first_theirs, True))
    second = CTX.Process(target=_hold_then, args=(second_theirs, False))
    first.start()
    second.start()  # both before the tensor exists
    try:
        t = torch.full((NUMEL,), 3.0)
        for conn in (first_conn, second_conn):
            conn.send_bytes(shmreduce.dumps(t))
            assert conn.poll(30) and conn.recv() == 3.0 * NUMEL
        seg = _segment_of(t)
        assert _holders(seg) == 2
        first_conn.send("go")
        assert first_conn.poll(30) and first_conn.recv() == "let go"
        client = _client()
        assert wait_for(lambda: client.ping()["clients"] == 2, TIMEOUT)  # this process and the second receiver
        del t
        gc.collect()
        transfer.collect()  # the owner's storage dead: the segment is free only if nobody holds it
        other = torch.full((NUMEL,), 5.0)
        transfer.share_in_place(other.untyped_storage())
        second_conn.send("sum")
        assert second_conn.poll(30) and second_conn.recv() == 3.0 * NUMEL, "the owner overwrote a segment a receiver holds"
        assert _segment_of(other) is not seg
        assert _holders(seg) == 1, _native.hdr_read(seg.addr)
    finally:
        for conn, proc in ((first_conn, first), (second_conn, second)):
            conn.send(None)
            proc.join(TIMEOUT)
            if proc.is_alive():
                proc.kill()
                proc.join(TIMEOUT)
            conn.close()
        first_theirs.close()
        second_theirs.close()
    assert first.exitcode == 0 and second.exitcode == 0


def test_a_let_go_written_before_a_close_counts(broker_log):
    # A receiver lets go of a generation (its ledger entry cleared, then counted out
    # of the header by itself) and closes, the broker stopped meanwhile: the broker
    # reads the ledger as it is at the close and does not count the receiver out a
    # second time, which would take the other receiver's count.
    prog = program.current()
    sender = broker_client.BrokerClient(prog.directory, prog.root_pid)
    sender.connect()
    seg = _Memfd(int.from_bytes(os.urandom(8), "little") | 1)
    first, second = _receivers(2)
    try:
        sender.segment(seg.fd, header="lead")
        entries = {}
        for receiver in (first, second):
            assert _native.hdr_hold(seg.addr, seg.gen)
            entries[receiver] = _ledger(receiver).hold(seg.ino, seg.gen)
            assert _ledger(receiver).mark(entries[receiver], P.HELD)
        counters = sender.ping(full=True)
        assert (counters["segments"], counters["generations_held"]) == (1, 2), counters
        pid = sender.broker_pid
        os.kill(pid, signal.SIGSTOP)
        try:
            assert _ledger(first).mark(entries[first], P.DROPPING)
            assert _native.hdr_unhold(seg.addr, seg.gen)
            assert _ledger(first).mark(entries[first], P.FREE)
            first.close()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert wait_for(lambda: sender.ping()["clients"] == 2, TIMEOUT)  # the first receiver is gone
        assert seg.header()[3] == 1, seg.header()
        assert sender.ping(full=True)["generations_held"] == 1
        second.close()  # closes holding: the broker counts it out
        assert wait_for(lambda: seg.header()[3] == 0, TIMEOUT), seg.header()
        assert sender.ping(full=True)["generations_held"] == 0
    finally:
        for c in (first, second, sender):
            c.close()
            if c.ledger is not None:
                c.ledger.close()
        seg.close()
    assert "no client left, staying" not in _log_text(broker_log)


def test_a_receiver_gone_before_its_owners_hold_is_read_is_still_counted_out(broker_log):
    # file_system: a receiver maps a file by name, with no request to the broker; the
    # owner's H record for it (posted before the file was made) may still be queued
    # on the owner's post connection when the broker reads the receiver's close: the
    # broker serves ready connections in turn, and a receiver's may come first (it
    # was ready in the broker's previous batch, while the owner's records came in).
    # The broker must still count the receiver out of the file's header.
    prog = program.current()
    sender = broker_client.BrokerClient(prog.directory, prog.root_pid)
    sender.connect()
    (receiver,) = _receivers(1)
    name = "seg-" + os.urandom(12).hex()
    gen = int.from_bytes(os.urandom(8), "little") | 1
    path = os.path.join(prog.directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    m = None
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        os.pwrite(fd, gen.to_bytes(8, "little"), 0)
        m = mmap.mmap(fd, mmap.PAGESIZE)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        pid = sender.broker_pid
        os.kill(pid, signal.SIGSTOP)  # records queue up; the broker serves them in the order they came
        try:
            assert _native.hdr_hold(addr, gen)
            _ledger(receiver).mark(_ledger(receiver).hold(name, gen), P.HELD)
            receiver.close()  # its process is gone
            sender.hold([name])
        finally:
            os.kill(pid, signal.SIGCONT)
        assert wait_for(lambda: sender.ping()["clients"] == 1, TIMEOUT)
        assert wait_for(lambda: _native.hdr_read(addr)[3] == 0, TIMEOUT), _native.hdr_read(addr)
    finally:
        if m is not None:
            m.close()
        os.close(fd)
        receiver.close()
        _ledger(receiver).close()
        sender.close()  # the file's holder goes: the broker unlinks it
    assert wait_for(lambda: not os.path.exists(path), TIMEOUT)


# -- what keeps a broker after its last client ----------------------------------------------


@pytest.mark.swap_path
def test_a_broker_left_with_refs_in_flight_logs_them_and_goes_once_they_are_loaded(registered_fd, broker_log):
    t = torch.arange(6.0)
    data = shmreduce.dumps(t)  # counted sent, not loaded
    seg = _segment_of(t)
    gen = _native.hdr_read(seg.addr)[0]
    pid = _client().broker_pid
    broker_client.close_all()  # the program's root (this process) lives: the segment keeps the broker
    assert wait_for(lambda: "no client left" in _log_text(broker_log), TIMEOUT)
    line = next(line for line in _log_text(broker_log).splitlines() if "no client left" in line)
    assert f"segment {seg.key} (header ({gen}, 1, 0, 0)" in line, line
    assert pid in broker_pids()
    assert shmreduce.loads(data).tolist() == t.tolist()  # counted loaded (mapped here: no connection)
    assert wait_for(lambda: pid not in broker_pids(), TIMEOUT), _log_text(broker_log)


def test_a_client_retired_by_close_all_never_connects_again(registered_fd, broker_log):
    # A thread may hold this process's client of a directory across close_all() (as
    # unregister() calls it): a load connecting to post its ledger, a release.
    # Reconnected, that client held a connection nothing closed, and the
    # broker would never exit.
    t = torch.full((4,), 2.0)
    data = shmreduce.dumps(t)
    seg = _segment_of(t)
    stale = broker_client.client_for(program.current().directory)
    assert stale.connected()
    broker_client.close_all()
    assert not stale.connected()
    for call in (
        stale.connect,
        lambda: stale.release(["seg-" + "0" * 24]),
        lambda: stale.fetch(seg.key),
        stale.ping,
    ):
        with pytest.raises(shmreduce.SharingError):
            call()
        assert not stale.connected(), "a client close_all() dropped connected again"
    assert broker_client.client_for(program.current().directory) is not stale
    assert shmreduce.loads(data).tolist() == [2.0] * 4  # its ref loaded: nothing in flight
    # broker_log: every connection closed, the broker goes
