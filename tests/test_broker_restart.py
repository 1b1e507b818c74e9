"""Errors, never hangs, after a broker restart: a tensor shared before its broker died (killed, or
exited idle between unregister() and register()) is sent again on its next send, to
receivers that never had it: a file_system file that went with
the dead broker's directory is shared anew, a memfd is deposited with the new broker."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import shutil
import signal

import pytest
import torch

import shmreduce
from shmreduce import _native, program, transfer
from shmreduce.broker import client as broker_client
from shmreduce.cache import cache
from shmreduce.pool import ARENA_ITEM_MAX

from helpers import broker_pids, broker_procs, forget_mappings, gone, run_in_child, wait_for

CTX = mp.get_context("fork")


def _sums(conn, stranger, keep):
    if stranger:
        forget_mappings()  # forked after the tensors: receive as a process that maps none of them
    kept = []
    while (t := conn.recv()) is not None:
        conn.send(float(t.sum()))
        if keep:
            kept.append(t)  # holds every generation it received


def _start_receiver(stranger=False, keep=False):
    ours, theirs = CTX.Pipe()
    proc = CTX.Process(target=_sums, args=(theirs, stranger, keep))
    proc.start()  # (not stranger) before any tensor exists: it inherits none
    theirs.close()

    def ask(t):
        ours.send(t)
        assert ours.poll(30), "receiver did not answer"
        return ours.recv()

    return proc, ours, ask


def _stop(proc, conn):
    """Stop a receiver, bounded; its exit code."""
    try:
        conn.send(None)
    except OSError:
        pass  # it died already (its error is the test's failure)
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join()
    conn.close()
    return proc.exitcode


def test_resend_after_the_broker_was_killed(strategy):
    # Under file_system the files went with the killed broker's directory: the tensor
    # is shared anew. Under file_descriptor the memfd outlives the broker, but the new
    # broker has none of this process's memfds: each goes to it again with the next
    # ref sent to it, for a receiver that does not map it yet.
    proc, conn, ask = _start_receiver()
    late = late_conn = None
    try:
        t = torch.arange(100.0)
        assert ask(t) == 4950.0
        directory = program.current().directory
        client = broker_client.client_for(directory, program.current().root_pid)
        pid = client.broker_pid
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not os.path.exists(directory), 10)
        for _ in range(3):  # the first send after the kill, and every one after it
            assert ask(t) == 4950.0
        t.add_(1)
        assert ask(t) == 5050.0
        late, late_conn, late_ask = _start_receiver(stranger=True)  # maps nothing: needs the new broker
        assert late_ask(t) == 5050.0
        assert broker_client.client_for(directory).broker_pid not in (0, pid)
    finally:
        codes = [_stop(proc, conn)] + ([] if late is None else [_stop(late, late_conn)])
    assert codes == [0, 0]


def test_resend_after_unregister_register_once_the_idle_broker_exited(strategy):
    t = torch.arange(10.0)
    t.share_memory_()  # shared: a file held at this program's broker, or a memfd of this process
    shmreduce.unregister()
    assert wait_for(lambda: not broker_pids(), 10)  # idle: it exited, its files went
    shmreduce.register(strategy=strategy)
    proc, conn, ask = _start_receiver()
    try:
        for _ in range(2):
            assert ask(t) == 45.0
    finally:
        code = _stop(proc, conn)
    assert code == 0


def _load_and_keep(conn):
    """A receiver: keeps what it loads (answering with its sum); "go" lets go of all."""
    kept: list = []
    while (order := conn.recv()) is not None:
        if order == "go":
            kept.clear()
            gc.collect()
            transfer.collect()
            conn.send("let go")
        else:
            kept.append(shmreduce.loads(order))
            conn.send(float(kept[-1].sum()))


def _sum_as_a_stranger(data):
    forget_mappings()
    return float(shmreduce.loads(data).sum())


@pytest.mark.swap_path
def test_a_segment_whose_file_went_with_the_broker_is_never_reused():
    # A file_system segment waiting for a ref in flight to be loaded when the broker
    # is killed: its file goes with the broker's directory. Once the ref is loaded (by
    # a receiver that maps the segment already), the owner must not fill the segment
    # again: refs to it would name a file no other receiver can open.
    numel = ARENA_ITEM_MAX // 4 + 16  # a segment of its own
    with shmreduce.registered(strategy="file_system"):
        ours, theirs = CTX.Pipe()
        proc = CTX.Process(target=_load_and_keep, args=(theirs,))
        proc.start()  # before the tensor exists

        def ask(order):
            ours.send(order)
            assert ours.poll(30), "receiver did not answer"
            return ours.recv()

        try:
            t = torch.full((numel,), 3.0)
            assert ask(shmreduce.dumps(t)) == 3.0 * numel  # the receiver maps the segment
            assert ask("go") == "let go"
            in_flight = shmreduce.dumps(t)  # sent, not loaded yet
            t_place = cache.place_of(t.untyped_storage())
            assert t_place is not None
            seg = t_place.segment
            del t
            gc.collect()
            transfer.collect()  # the owner's storage is dead; a ref is in flight
            assert transfer._fs_pool.waiting.get(seg.key, (None, 0))[0] is seg
            directory = program.current().directory
            client = broker_client.client_for(directory, program.current().root_pid)
            os.kill(client.broker_pid, signal.SIGKILL)
            assert wait_for(lambda: not os.path.exists(directory), 10)  # the janitor removed the files
            assert shmreduce.loads(shmreduce.dumps(torch.ones(2))).sum().item() == 2  # a new broker
            assert ask(in_flight) == 3.0 * numel  # mapped there: loaded without the file
            assert ask("go") == "let go"
            gc.collect()
            transfer.collect()
            t2 = torch.full((numel,), 4.0)  # the size of the segment that lost its file
            data = shmreduce.dumps(t2)
            assert run_in_child(_sum_as_a_stranger, data) == ("ok", 4.0 * numel)
            assert ask(data) == 4.0 * numel  # it maps the old segment: it must not find the new tensor there
        finally:
            ours.send(None)
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
            ours.close()
            theirs.close()
        assert proc.exitcode == 0


def _message(i: int) -> tuple[int, list[torch.Tensor]]:
    # A small tensor (a slab), a mid-size one (an arena) and a large one (a segment of its own).
    return i, [torch.full((n,), float(i)) for n in (300, 30_000, ARENA_ITEM_MAX // 4 + 16)]


def _load_each_as_a_stranger(blobs: list[bytes]) -> list[str]:
    forget_mappings()
    outcomes = []
    for blob in blobs:
        try:
            i, tensors = shmreduce.loads(blob)
            outcomes.append("ok" if all(bool((t == i).all()) for t in tensors) else "wrong bytes")
        except shmreduce.SharingError as exc:
            outcomes.append("gone" if "is gone" in str(exc) else str(exc))
    return outcomes


@pytest.mark.swap_path  # the files of a pool: where torch moves a storage itself it is a memfd of its own
@pytest.mark.parametrize("killed", ["the server alone", "the server and its janitor"])
def test_file_system_messages_sent_before_a_broker_kill_are_lost_to_a_stranger_only_if_its_janitor_removed_the_files(killed):
    """Under file_system a ref names a file of the program directory. The janitor of a
    broker killed alone removes the directory, files and all: a process that maps none
    of them is refused each message pickled before the kill ("is gone"), though their
    sender lives. A broker killed with its janitor leaves the files, and the new one
    serves them. Every message pickled after the kill arrives (docs/limits.md)."""
    with shmreduce.registered(strategy="file_system"):
        before = [shmreduce.dumps(_message(i)) for i in range(5)]
        directory = program.current().directory
        server = broker_client.client_for(directory, program.current().root_pid).broker_pid
        # The janitor first: killed after its server, it may remove the directory in between.
        victims = [broker_procs(directory)[server], server] if killed == "the server and its janitor" else [server]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: all(gone(pid) for pid in victims), 10)  # its connections closed
        after = [shmreduce.dumps(_message(i)) for i in range(5, 10)]  # through a new broker
        status, outcomes = run_in_child(_load_each_as_a_stranger, before + after, timeout=60)
        assert status == "ok", outcomes
        lost = "gone" if killed == "the server alone" else "ok"
        assert outcomes == [lost] * 5 + ["ok"] * 5, outcomes


# A broker killed again and again during a stream: tests/test_broker_kills.py,
# which counts what was in flight at each kill rather than timing it.


def _launch_while_a_janitor_lets_go(directory: str) -> bool:
    """In a child: the launcher opens the lock of a directory whose dying broker's
    janitor holds it; before its flock, the janitor removes the directory and lets go,
    and another launcher makes the directory anew and locks it. (launched a broker,
    the lock file at the path is still the other launcher's)"""
    import fcntl as real_fcntl

    from shmreduce.broker import programdir, server
    from shmreduce.broker import protocol as P

    programdir.make_program_dir(directory)
    old = os.open(os.path.join(directory, P.LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    real_fcntl.flock(old, real_fcntl.LOCK_EX)  # the dying broker's janitor
    held: list[int] = []

    class Interleave:
        def __getattr__(self, name):
            return getattr(real_fcntl, name)

        def flock(self, fd, op):
            if not held:
                programdir.remove_program_dir(directory, old)  # the janitor's last acts
                os.close(old)
                programdir.make_program_dir(directory)  # another launcher, now the directory's
                held.append(os.open(os.path.join(directory, P.LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600))
                real_fcntl.flock(held[0], real_fcntl.LOCK_EX)
            return real_fcntl.flock(fd, op)

    programdir.fcntl = Interleave()  # type: ignore[assignment]
    server.launch(directory, os.getpid(), b"k" * 32)
    return os.path.exists(os.path.join(directory, P.SOCKET_NAME))


def test_a_launcher_never_serves_a_directory_whose_lock_it_took_on_a_removed_file():
    """Deterministic form of a split under file_descriptor (receivers find no socket
    while the sender deposits with a second broker): a launcher's flock can succeed on
    a removed lock file, and it must not then bind a second broker beside the
    directory's rightful one."""
    directory = os.path.join(program.shm_base(), f"shmreduce-{os.urandom(8).hex()}")
    try:
        status, value = run_in_child(_launch_while_a_janitor_lets_go, directory)
        assert status == "ok", value
        assert value is False, "a second broker serves the directory"
    finally:
        for pid in broker_procs(directory):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)


def _connect_after_a_kill() -> tuple[int, int]:
    """In a child: the broker is killed while this process is connected; connect()
    then. (the broker's pid before, after)"""
    shmreduce.register(strategy="file_system")
    prog = program.current()
    client = broker_client.client_for(prog.directory, prog.root_pid)
    client.connect()
    client.hold(["seg-" + os.urandom(12).hex()])  # a record the broker read: a live connection
    client.ping()
    before = client.broker_pid
    os.kill(before, signal.SIGKILL)
    assert wait_for(lambda: gone(before), 10)
    client.connect()
    return before, client.broker_pid


def test_connect_replaces_a_broker_that_was_killed():
    """connect() asks the post connection for its hang-up, not for something to read:
    a peek that took buffered data for a sign of life would let a sender pack the next
    message into files the dead broker's janitor is removing."""
    status, value = run_in_child(_connect_after_a_kill)
    assert status == "ok", value
    before, after = value
    assert after != before, "connect() kept a connection to a broker that was killed"


# -- what a receiver holds reaches the new broker --------------------------------------

NUMEL = ARENA_ITEM_MAX // 4 + 16  # a float32 tensor this long gets a segment of its own


@pytest.mark.swap_path
def test_a_receiver_killed_after_a_restart_is_counted_out_of_what_it_held_before(registered_fd):
    # A receiver's ledger goes to every broker it connects to. It holds a segment's
    # generation; the broker is killed; the next hold (a new segment) connects it to
    # the new broker, which then knows both holds: killed, the receiver is counted out
    # of the first segment's header too (its owner re-deposited it by sending it
    # again), so that segment is reused, not kept from reuse for good.
    proc, ours, ask = _start_receiver(keep=True)
    try:
        first = torch.full((NUMEL,), 1.0)
        assert ask(first) == float(NUMEL)
        place = cache.place_of(first.untyped_storage())
        assert place is not None
        seg = place.segment
        assert _native.hdr_read(seg.addr)[3] == 1  # the receiver holds it
        client = broker_client.client_for(program.current().directory, program.current().root_pid)
        old = client.broker_pid
        os.kill(old, signal.SIGKILL)
        assert wait_for(lambda: not os.path.exists(program.current().directory), 10)
        assert ask(first) == float(NUMEL)  # sent again: deposited with the new broker
        second = torch.full((NUMEL,), 2.0)
        assert ask(second) == 2.0 * NUMEL  # a new hold: the receiver posts its ledger there
        assert client.broker_pid not in (0, old)
        assert client.ping(full=True)["generations_held"] == 2
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert wait_for(lambda: _native.hdr_read(seg.addr)[3] == 0, 10), _native.hdr_read(seg.addr)
        assert client.ping(full=True)["generations_held"] == 0
    finally:
        _stop(proc, ours)
