"""The states the caps on what is kept give a segment, met by every path.

A pool keeps at most ``pool.IDLE_SEGMENTS`` segments waiting: past that the longest
waiting leave it (retired, never reused); the broker keeps the descriptors of the
newest ``FORWARDABLE`` memfds that processes only hold. Each is a state of a segment
that a broker restart's bring-back, the C sender's index (``_native.reduce``) and
``transfer.settle_dead`` meet: messages in a retired segment survive a broker restart while
their sender lives; a process that sends on what it holds of its own segments,
after its pool let go of them, neither sends refs the broker cannot serve nor
leaves the broker keeping them for good. Real processes, a real broker.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
from typing import Any

import pytest
import torch

import shmreduce
from shmreduce import _native, pool, program, segments, transfer
from shmreduce.broker import client as broker_client

from helpers import broker_procs, gone, let_go_now, wait_for

CTX = mp.get_context("fork")
TIMEOUT = 30.0
KiB = 1 << 10
OWN = 75 * KiB  # int32 elements: 300 KiB, a segment each (past pool.ARENA_ITEM_MAX)


def _broker() -> broker_client.BrokerClient:
    prog = program.current()
    return broker_client.client_for(prog.directory, prog.root_pid)


def _read(conn: Any) -> None:
    """Load every message (i, tensor) sent on *conn* until None, dropping each; answer
    (loaded with its bytes, refused, loaded with wrong bytes)."""
    right = refused = wrong = 0
    while True:
        try:
            msg = conn.recv()
        except shmreduce.SharingError:
            refused += 1
            continue
        if msg is None:
            break
        i, t = msg
        if bool((t == i).all()):
            right += 1
        else:
            wrong += 1
        del msg, t
    conn.send((right, refused, wrong))


def _reader() -> tuple[Any, Any]:
    """A process that maps nothing of ours (forked before any tensor exists) and reads."""
    ours, theirs = CTX.Pipe()
    proc = CTX.Process(target=_read, args=(theirs,))
    proc.start()
    theirs.close()
    return proc, ours


def _result(proc: Any, conn: Any) -> tuple[int, int, int]:
    conn.send(None)
    assert conn.poll(TIMEOUT), "the reader did not answer"
    result = conn.recv()
    proc.join(TIMEOUT)
    conn.close()
    return result


def _send_all(proc: Any, conn: Any, msgs: list[Any]) -> tuple[int, int, int]:
    for msg in msgs:
        conn.send(msg)
    return _result(proc, conn)


def _memfds() -> tuple[int, int]:
    """(memfds the broker keeps, those of them this process's pool deposited)."""
    let_go_now()
    deposited = sum(1 for seg in transfer._fd_pool.owned() if seg.deposited)
    return _broker().ping()["segments"], deposited


def _brokers_memfds_are_its_pools() -> bool:
    """Whether the broker keeps no memfd but those this process's pool deposited."""
    kept, deposited = _memfds()
    return kept == deposited


# -- a broker restart meets retired segments --------------------------------------


def _consume(q: Any, go: Any, n: int, conn: Any) -> None:
    go.wait(TIMEOUT)
    right = refused = wrong = 0
    for _ in range(n):
        try:
            i, t = q.get(timeout=TIMEOUT)
        except shmreduce.SharingError:
            refused += 1
            continue
        if bool((t == i).all()):
            right += 1
        else:
            wrong += 1
        del t
    conn.send((right, refused, wrong))


@pytest.mark.swap_path
@pytest.mark.parametrize("killed", ["server", "server and janitor"])
def test_messages_in_segments_the_pool_retired_survive_a_broker_restart_while_their_sender_lives(registered_fd: None, killed: str) -> None:
    """A producer puts 40 messages of 1 MiB on an unbounded queue and drops its tensors:
    its pool keeps 16 waiting and retires the other 24. Its broker is SIGKILLed (the
    server, or the server and its janitor); the producer sends one more message, and
    so connects to a new broker, before the consumer reads: every one of the 41
    messages loads its own bytes."""
    q, go = CTX.Queue(), CTX.Event()
    ours, theirs = CTX.Pipe()
    consumer = CTX.Process(target=_consume, args=(q, go, 41, theirs))
    consumer.start()  # before any tensor: it maps none of them
    try:
        sent = transfer.counters()["messages_sent"]
        for i in range(40):
            q.put((i, torch.full((1 << 18,), float(i))))
        assert wait_for(lambda: transfer.counters()["messages_sent"] >= sent + 40, TIMEOUT)
        gc.collect()
        transfer.collect()
        p = transfer._fd_pool
        assert len(p.waiting) == pool.IDLE_SEGMENTS, (len(p.waiting), len(p.leaving))
        directory = program.current().directory
        server = _broker().broker_pid
        victims = list(broker_procs(directory)) if killed == "server and janitor" else [server]
        assert server in victims, (server, victims)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: all(gone(pid) for pid in victims), TIMEOUT)
        q.put((40, torch.full((1 << 18,), 40.0)))
        shmreduce.loads(shmreduce.dumps(torch.ones(4)))  # this process is connected to the new broker on return
        assert _broker().broker_pid not in victims
        assert wait_for(lambda: transfer.counters()["messages_sent"] >= sent + 42, TIMEOUT)
        go.set()
        assert ours.poll(TIMEOUT * 2), "the consumer did not answer"
        assert ours.recv() == (41, 0, 0), "(loaded, refused, wrong bytes)"
    finally:
        go.set()
        consumer.join(TIMEOUT)
        if consumer.is_alive():
            consumer.kill()
            consumer.join()
    assert wait_for(lambda: not p.leaving and not p.waiting and _brokers_memfds_are_its_pools(), TIMEOUT), (
        [(_native.hdr_read(s.addr), g) for s, g in p.leaving.values()],
        len(p.waiting),
        _memfds(),
    )
    q.close()
    q.join_thread()


# -- a process sends on its own segments, held as a receiver -----------------------


@pytest.mark.swap_path
@pytest.mark.parametrize("first_send", ["while its pool keeps them", "once its pool let go of them"])
def test_a_process_that_sends_on_its_own_segments_it_holds_after_its_pool_let_go_of_them_loses_nothing_and_pins_nothing(
    registered_fd: None, first_send: str
) -> None:
    """A process loads 16 of its own messages of 300 KiB (it holds its segments as a
    receiver) and sends them to a child, before or after 40 new messages push those
    segments out of its pool; then it sends them, and views of them, to a process
    that never mapped them: each loads its bytes (none sent from a descriptor its
    broker let go of), and once all is dropped the broker keeps no memfd the pool
    does not (none deposited as the pool's that nobody drops)."""
    first, first_conn = _reader()
    stranger, stranger_conn = _reader()
    mine, back = CTX.Pipe()
    for i in range(16):
        mine.send((i, torch.full((OWN,), i, dtype=torch.int32)))
    gc.collect()
    transfer.collect()  # their generations are over here: they wait for their refs
    held = [back.recv() for _ in range(16)]  # this process holds them now, as a receiver
    keys = {segments.segment_at(t.data_ptr(), t.nbytes).key for _i, t in held}  # type: ignore[union-attr]
    assert len(keys) == 16

    if first_send == "while its pool keeps them":
        assert _send_all(first, first_conn, held) == (16, 0, 0)
    blobs = [shmreduce.dumps((i, torch.full((OWN,), 100 + i, dtype=torch.int32))) for i in range(40)]
    gc.collect()
    transfer.collect()
    p = transfer._fd_pool
    assert not keys & set(p.waiting), "still waiting in the pool"
    if first_send == "once its pool let go of them":
        assert _send_all(first, first_conn, held) == (16, 0, 0)
    for i, t in held:
        stranger_conn.send((i, t))
        stranger_conn.send((i, t[1:]))
    assert _result(stranger, stranger_conn) == (32, 0, 0), "(loaded, refused, wrong bytes)"
    for i, blob in enumerate(blobs):
        j, t = shmreduce.loads(blob)
        assert j == i and bool((t == 100 + i).all())
    del held, blobs, t
    assert wait_for(_brokers_memfds_are_its_pools, TIMEOUT), _memfds()
