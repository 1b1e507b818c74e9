"""A process is counted out when it dies, never because a connection of it closed.

The broker drops a connection for one bad record or one I/O error, and a client's
process may lose a connection while it lives. Before the fix the broker counted a
process whose connections had all closed (without K) out of every generation its
ledger held: holders 1 -> 0 while its tensors were alive, and the owner's next message
of the same size overwrote them. Now the broker learns a death from the kernel (a
pidfd per client process): a live process stays known, with what it holds, and its
new connections join it; a dead one is counted out once, promptly.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import select
import signal
import socket

import pytest
import torch

from shmreduce import _native, program, transfer
from shmreduce.broker import client as broker_client
from shmreduce.broker import protocol as P
from shmreduce.cache import cache
from shmreduce.pool import ARENA_ITEM_MAX

from helpers import let_go_now, wait_for

TIMEOUT = 10.0
CTX = mp.get_context("fork")
NUMEL = ARENA_ITEM_MAX // 4 + 16  # a float32 tensor this long gets a segment of its own
STREAM = 20  # messages of the same size after the cut


def _cut(how: str) -> int:
    """In a receiver: make the broker drop every connection of this process while it
    lives; how many there were."""
    client = broker_client.connected_client(program.current().directory)
    assert client is not None
    socks = client.sockets()
    for sock in socks:
        if how == "malformed":
            P.send_record(sock, b"?", P.NO_KEY)  # an unknown op: the broker drops the connection
        else:
            sock.shutdown(socket.SHUT_RDWR)  # its end of the stream: the broker reads it and drops
    if how == "malformed":
        for sock in socks:  # the broker closed each: read and dropped
            poller = select.poll()
            poller.register(sock, select.POLLHUP | select.POLLRDHUP)
            assert poller.poll(TIMEOUT * 1000), "the broker kept a connection that sent a malformed record"
    return len(socks)


def _close_unkept() -> bool:
    """In a receiver, while the test holds the broker stopped: fill its post connection
    and close its connections as ``close_all`` does (a K first: it lives on), the K
    timing out on the full buffer; whether its connections are closed."""
    client = broker_client.connected_client(program.current().directory)
    assert client is not None and client.post is not None
    broker_client.IO_TIMEOUT = 0.5  # the K's wait, not the default 10 s
    for sock in client.sockets():
        broker_client._kernel_timeouts(sock)
    record = P.DROP + P.NO_KEY + P.encode_inos([1])  # of no memfd the broker knows: nothing done
    try:
        while True:
            client.post.send(record, socket.MSG_DONTWAIT)
    except BlockingIOError:
        pass
    broker_client.close_all()
    return client.post is None and client.sock is None


def _receiver(conn) -> None:
    """Keeps the first tensor it receives; answers every other with its sum and drops
    it; on ("cut", how) loses its connections; on ("unkept",) closes them with its K
    lost (``_close_unkept``); on "check" answers whether the kept tensor still has its
    bytes."""
    kept = None
    while (order := conn.recv()) is not None:
        if order == ("unkept",):
            conn.send(_close_unkept())
        elif isinstance(order, tuple):
            conn.send(_cut(order[1]))
        elif order == "check":
            assert kept is not None
            conn.send(bool((kept == 1.0).all()))
        elif kept is None:
            kept = order
            conn.send(float(kept.sum()))
        else:
            total = float(order.sum())
            del order
            gc.collect()
            transfer.collect()  # let go before answering: the owner then sees it
            conn.send(total)


def _client() -> broker_client.BrokerClient:
    prog = program.current()
    return broker_client.client_for(prog.directory, prog.root_pid)


def _holders(seg) -> int:
    return _native.hdr_read(seg.addr)[3]


class _Receiver:
    def __init__(self) -> None:
        self.ours, theirs = CTX.Pipe()
        self.proc = CTX.Process(target=_receiver, args=(theirs,))
        self.proc.start()  # before any tensor exists: it inherits no mapping
        theirs.close()

    def ask(self, order):
        self.ours.send(order)
        assert self.ours.poll(30), "receiver did not answer"
        return self.ours.recv()

    def stop(self) -> int | None:
        try:
            self.ours.send(None)
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.ours.close()
        return self.proc.exitcode


def _hold(*receivers: _Receiver):
    """Each receiver keeps a tensor of ones; the owner lets go of its own: only the
    receivers' holds keep the segment from reuse. Its segment."""
    first = torch.full((NUMEL,), 1.0)
    for receiver in receivers:
        assert receiver.ask(first) == float(NUMEL)
    place = cache.place_of(first.untyped_storage())
    assert place is not None
    seg = place.segment
    del first, place
    let_go_now()
    assert _holders(seg) == len(receivers)
    return seg


def _cut_and_wait(receiver: _Receiver, how: str) -> None:
    client = _client()
    before = client.ping()["connections"]
    cut = receiver.ask(("cut", how))
    assert cut >= 1
    # Every connection of the receiver read to its end and dropped by the broker.
    assert wait_for(lambda: client.ping()["connections"] == before - cut, TIMEOUT)


@pytest.mark.swap_path
@pytest.mark.parametrize("how", ["malformed", "shutdown"])
def test_a_live_receiver_whose_connections_the_broker_dropped_keeps_its_bytes(strategy, how):
    """Before the fix: counted out at the drop (holders 1 -> 0), the owner's next
    message of the same size reused the segment and the kept tensor read 2.0."""
    receiver = _Receiver()
    try:
        seg = _hold(receiver)
        _cut_and_wait(receiver, how)
        for i in range(2, 2 + STREAM):
            t = torch.full((NUMEL,), float(i))
            assert receiver.ask(t) == float(i) * NUMEL  # under file_descriptor: fetched on a new connection
            del t
            let_go_now()
        assert receiver.ask("check") is True, "the kept tensor was overwritten"
        assert _holders(seg) == 1, "a live receiver was counted out"
    finally:
        code = receiver.stop()
    assert code == 0
    # It exited (holding): counted out once, promptly.
    assert wait_for(lambda: _holders(seg) == 0, TIMEOUT), _native.hdr_read(seg.addr)
    assert _client().ping(full=True)["generations_held"] == 0


@pytest.mark.swap_path
def test_a_receiver_killed_after_its_connections_were_dropped_is_counted_out_once(strategy):
    """A receiver that lost its connections, reconnected (same identity) and was then
    killed is counted out exactly once: its ledger is known to one client there, not
    to the old identity and a new one (which would count it out twice, taking another
    receiver's hold with it)."""
    receiver, other = _Receiver(), _Receiver()
    try:
        seg = _hold(receiver, other)
        _cut_and_wait(receiver, "malformed")
        _one_more_message_then_kill(receiver)
        assert wait_for(lambda: _holders(seg) == 1, TIMEOUT), _native.hdr_read(seg.addr)
        assert _client().ping(full=True)["generations_held"] == 1
        assert other.ask("check") is True
        assert _holders(seg) == 1, "counted out twice"
    finally:
        codes = [receiver.stop(), other.stop()]
    assert codes == [-signal.SIGKILL, 0]
    assert wait_for(lambda: _holders(seg) == 0, TIMEOUT)


def _one_more_message_then_kill(receiver: _Receiver) -> None:
    """A new message to *receiver*: a new segment (the first is held), fetched through
    its next client (under file_descriptor), held in the same ledger; the broker must
    know the two generations once each. Then SIGKILL it. (Small enough for torch's sum
    to run on one thread: a forked child's OpenMP may hang.)"""
    t = torch.full((NUMEL,), 3.0)
    assert receiver.ask(t) == 3.0 * NUMEL
    del t
    let_go_now()
    counters = _client().ping(full=True)
    assert counters["generations_held"] == 2, f"a ledger known twice (or not at all): {counters}"
    assert receiver.proc.pid is not None
    os.kill(receiver.proc.pid, signal.SIGKILL)
    receiver.proc.join(TIMEOUT)


@pytest.mark.swap_path
def test_a_receiver_whose_keep_record_was_lost_is_counted_out_once(strategy):
    """``close(keep=True)`` must not swallow the timeout of a K that could not be
    posted (the broker stopped, the post buffer full): the broker would keep that
    identity, alive and away, with the process's ledger; the process's next client, a
    new identity, would post the same ledger: the receiver's holds known twice, and
    its death counting them out twice, taking another receiver's hold with it."""
    receiver, other = _Receiver(), _Receiver()
    try:
        seg = _hold(receiver, other)
        broker = _client().ping()["pid"]
        assert broker > 1
        os.kill(broker, signal.SIGSTOP)
        try:
            assert receiver.ask(("unkept",)) is True
        finally:
            os.kill(broker, signal.SIGCONT)
        _one_more_message_then_kill(receiver)
        assert wait_for(lambda: _holders(seg) <= 1, TIMEOUT), _native.hdr_read(seg.addr)
        assert _client().ping(full=True)["generations_held"] == 1
        assert other.ask("check") is True
        assert _holders(seg) == 1, "counted out twice"
    finally:
        codes = [receiver.stop(), other.stop()]
    assert codes == [-signal.SIGKILL, 0]
    assert wait_for(lambda: _holders(seg) == 0, TIMEOUT)


def _exit_holding(conn) -> None:
    t = conn.recv()
    conn.send(float(t.sum()))
    conn.recv()
    os._exit(0)  # no atexit: its connections close with the process


@pytest.mark.swap_path
@pytest.mark.parametrize("atexit", [True, False], ids=["atexit", "os_exit"])
def test_a_receiver_that_exits_holding_is_counted_out_promptly(strategy, atexit):
    ours, theirs = CTX.Pipe()
    receiver = _Receiver() if atexit else None
    if receiver is not None:
        proc = receiver.proc
    else:
        proc = CTX.Process(target=_exit_holding, args=(theirs,))
        proc.start()
    theirs.close()
    try:
        first = torch.full((NUMEL,), 1.0)
        if receiver is not None:
            assert receiver.ask(first) == float(NUMEL)
        else:
            ours.send(first)
            assert ours.poll(30) and ours.recv() == float(NUMEL)
        place = cache.place_of(first.untyped_storage())
        assert place is not None
        seg = place.segment
        del first, place
        let_go_now()
        assert _holders(seg) == 1
        if receiver is not None:
            assert receiver.stop() == 0
        else:
            ours.send("exit")
            proc.join(TIMEOUT)
            assert proc.exitcode == 0
        assert wait_for(lambda: _holders(seg) == 0, 2.0), _native.hdr_read(seg.addr)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        ours.close()
