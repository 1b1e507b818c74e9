"""Every actor, every event: the events of a program's life, in real processes.

Each test is one event that a program lives through while its tensors
must keep their bytes and its memory must not be pinned for good:

* the broker is SIGKILLed while a receiver holds a generation; a new one
  starts; the receiver, known to the new broker from its next load, exits or is
  SIGKILLed still holding it: it is counted out (before: holders stayed 1, and the
  owner's segment waited in its pool for the owner's life);
* messages queued in a generation that a fork retired, waiting longer than
  ``SHMREDUCE_ORPHAN_TTL`` while their sender lives, are still loaded (before: all
  dropped at the TTL, "let go of and reused" / "file ... is gone");
* batches a DataLoader's workers made, forwarded by the main process once the
  workers exited, load in the receiver (before, file_system: 0 of 2, "file ... is
  gone: its program exited");
* a relay forwarding what short-lived producers made, to a consumer that
  drops it, leaves nothing at the broker (before, file_descriptor: one memfd per
  message, for the relay's life);
* a gc callback that forks while the first share of a process starts
  the broker does not deadlock it (before: hung on ``_launch_lock``).

Every wait is bounded; every child is joined, and killed if it outlives its wait; the
module's leak check (conftest) finds no broker, file or descriptor left.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import subprocess
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from shmreduce import _native, _torch, program, transfer
from shmreduce.broker import client as broker_client
from shmreduce.cache import cache

from helpers import let_go_now, run_program, wait_for

FORK = mp.get_context("fork")
TIMEOUT = 20.0  # any single wait
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB_FLOATS = 1 << 18  # a float32 tensor of 1 MiB: a segment of its own
EXIT = object()  # what a receiver is asked to do to exit at once, holding what it kept


# -- plumbing --------------------------------------------------------------------------


def _loader(conn: Any, keep: bool) -> None:
    """A receiver: loads each message (a pickle's bytes) and answers ("ok", its sum) or
    ("error", what the load raised); *keep*: keeps every tensor it loaded. ``b"exit"``:
    exits at once, holding what it kept; ``b""``: returns."""
    torch.set_num_threads(1)  # a fork child must not use its parent's OpenMP pool: a large op hangs
    kept = []
    while (data := conn.recv_bytes()) != b"":
        if data == b"exit":
            os._exit(0)
        try:
            t = ForkingPickler.loads(data)
        except Exception as exc:  # noqa: BLE001  the answer is the test's
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("ok", float(t.sum())))
        if keep:
            kept.append(t)
        del t
        transfer.collect()


@contextmanager
def receiver(keep: bool = False) -> Iterator[tuple[Any, Callable[[Any], tuple[str, Any]]]]:
    """A fork child running ``_loader``, forked now (before the test's tensors exist:
    it maps none of them). Yields (process, ask): ``ask(obj)`` sends *obj* pickled and
    returns the answer. Stopped at the end (killed if it does not exit)."""
    ours, theirs = FORK.Pipe()
    proc = FORK.Process(target=_loader, args=(theirs, keep))
    proc.start()
    theirs.close()

    def ask(obj: Any) -> tuple[str, Any]:
        if obj is EXIT:
            ours.send_bytes(b"exit")
            return ("exit", None)
        ours.send_bytes(bytes(ForkingPickler.dumps(obj)))
        assert ours.poll(TIMEOUT), "the receiver did not answer"
        return ours.recv()

    try:
        yield proc, ask
    finally:
        try:
            ours.send_bytes(b"")
        except OSError:
            pass  # it died (killed by the test)
        proc.join(TIMEOUT)
        if proc.is_alive():
            proc.kill()
            proc.join()
        ours.close()


def _client() -> broker_client.BrokerClient:
    prog = program.current()
    return broker_client.client_for(prog.directory, prog.root_pid)


def _holders(addr: int) -> int:
    return _native.hdr_read(addr)[3]


def _run_program(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_program(script, *args, env=env, timeout=TIMEOUT)


# -- a broker restart forgets nothing a live process holds --------------------------------


@pytest.mark.swap_path
@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_a_receiver_holding_across_a_broker_restart_is_counted_out_at_its_death(strategy: str, how: str) -> None:
    """R keeps a 1 MiB tensor; the broker is SIGKILLed and a new one starts; R loads one
    more message (its ledger goes to the new broker), then exits or is SIGKILLed still
    holding the first: the new broker counts it out of the first generation too."""
    with receiver(keep=True) as (proc, ask):
        first = torch.full((MiB_FLOATS,), 1.0)
        assert ask(first) == ("ok", float(MiB_FLOATS))
        place = cache.place_of(first.untyped_storage())
        assert place is not None
        seg = place.segment
        del place
        assert _holders(seg.addr) == 1  # R holds it
        client = _client()
        old = client.broker_pid
        os.kill(old, signal.SIGKILL)
        assert wait_for(lambda: not os.path.exists(program.current().directory), TIMEOUT)
        second = torch.full((MiB_FLOATS,), 2.0)
        assert ask(second) == ("ok", 2.0 * MiB_FLOATS)  # a new broker; R's ledger goes there
        assert client.broker_pid not in (0, old)
        del first, second
        let_go_now()
        if how == "sigkill":
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGKILL)
        else:
            ask(EXIT)
        proc.join(TIMEOUT)
        assert wait_for(lambda: _holders(seg.addr) == 0, 5.0), (
            f"R's hold of a generation it took before the broker restart was never counted out: header {_native.hdr_read(seg.addr)}"
        )


# -- messages queued in a retired generation wait while their sender lives ---------------

_RETIRED_SLAB = textwrap.dedent(
    """
    import gc, multiprocessing as mp, os, sys, time
    import torch, shmreduce
    from shmreduce import transfer

    def receive(go, conn):
        go.recv()
        got = []
        for i in range(10):
            try:
                t = conn.recv()
                got.append("ok" if float(t.sum()) == 16.0 * i else "wrong bytes")
            except shmreduce.SharingError as exc:
                got.append(str(exc)[:120])
        go.send(got)

    shmreduce.register(strategy=sys.argv[1])
    ctx = mp.get_context("fork")
    go, go_r = ctx.Pipe()
    to_r, r_end = ctx.Pipe()
    r = ctx.Process(target=receive, args=(go_r, r_end))
    r.start()  # before any tensor: it maps none of them
    held = torch.ones(4)
    held.share_memory_()  # in this thread's current slab
    helper = ctx.Process(target=os._exit, args=(0,))
    helper.start()  # retires what this process holds: the slab's generation
    helper.join(10)
    for i in range(10):
        to_r.send(torch.full((16,), float(i)))  # queued in the pipe, in the same slab
    del held
    for _ in range(20):  # this sender goes on: its slab fills, and the next one is used
        torch.zeros(16000).share_memory_()
    gc.collect()
    transfer.collect()
    time.sleep(float(os.environ["SHMREDUCE_ORPHAN_TTL"]) + 1.5)  # this sender lives on
    transfer.collect()
    go.send("go")
    assert go.poll(10), "the receiver did not answer"
    print("RESULT", go.recv(), flush=True)
    r.join(10)
    """
)


@pytest.mark.swap_path
@pytest.mark.parametrize("strategy_name", ["file_descriptor", "file_system"])
def test_messages_queued_in_a_retired_generation_wait_while_their_sender_lives(strategy_name: str) -> None:
    out = _run_program(_RETIRED_SLAB, strategy_name, env={"SHMREDUCE_ORPHAN_TTL": "1", "SHMREDUCE_BROKER_GRACE": "0.3"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, out.stdout + out.stderr[-3000:]
    got = eval(lines[0].removeprefix("RESULT "))  # noqa: S307  our own child's repr of a list of str
    lost = [g for g in got if g != "ok"]
    assert not lost, f"{len(lost)} of 10 messages of a live sender lost after SHMREDUCE_ORPHAN_TTL: {lost[:2]}"


# -- forwarding what a finished process made ---------------------------------------------


class _Numbers(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1024,), float(i))


def test_batches_whose_workers_exited_are_forwarded(strategy: str) -> None:
    """The main process keeps every 4th batch of an epoch (2 workers, not persistent);
    once the workers exited it forwards them to a trainer: every one loads there."""
    with receiver() as (_trainer, ask):
        loader = DataLoader(_Numbers(), batch_size=2, num_workers=2, persistent_workers=False)
        kept = [batch for i, batch in enumerate(loader) if i % 4 == 0]
        del loader
        gc.collect()
        client = _client()
        # The workers are gone and counted out: only this process is a client now.
        assert wait_for(lambda: client.ping()["clients"] == 1, TIMEOUT), client.ping()
        answers = [ask(batch) for batch in kept]
        expected = [("ok", float(batch.sum())) for batch in kept]
        loaded = sum(a == e for a, e in zip(answers, expected, strict=True))
        assert loaded == len(kept), f"{loaded} of {len(kept)} forwarded batches loaded: {answers}"
        del kept
        let_go_now()


# -- what an exited producer deposited does not stay at the broker -----------------------


def _producer(conn: Any, i: int) -> None:
    torch.set_num_threads(1)  # as in _loader
    conn.send(torch.full((MiB_FLOATS,), float(i)))


def _relay(source: Any, sink: Any, report: Any) -> None:
    """Forward each message of *source* to *sink*, wait for its answer, drop it."""
    torch.set_num_threads(1)  # as in _loader
    while (t := source.recv()) is not None:
        sink.send(t)
        assert sink.poll(TIMEOUT), "the consumer did not answer"
        answer = sink.recv()
        del t
        gc.collect()
        transfer.collect()
        report.send(answer)


def _consumer(conn: Any) -> None:
    torch.set_num_threads(1)  # as in _loader
    while (t := conn.recv()) is not None:
        total = float(t.sum())
        del t
        transfer.collect()
        conn.send(total)


@pytest.mark.parametrize("strategy", ["file_descriptor"], indirect=True)
def test_a_relay_of_exited_producers_leaves_nothing_at_the_broker(strategy: str) -> None:
    producers = 12
    relay_in, to_relay = FORK.Pipe(duplex=False)
    to_consumer, consumer_end = FORK.Pipe()
    reports, report_end = FORK.Pipe(duplex=False)
    consumer = FORK.Process(target=_consumer, args=(consumer_end,))
    relay = FORK.Process(target=_relay, args=(relay_in, to_consumer, report_end))
    procs = [consumer, relay]
    try:
        consumer.start()
        relay.start()
        for i in range(producers):
            p = FORK.Process(target=_producer, args=(to_relay, i))
            procs.append(p)
            p.start()
            p.join(TIMEOUT)
            assert p.exitcode == 0, p.exitcode
            assert reports.poll(TIMEOUT), "the relay did not forward"
            assert reports.recv() == float(i) * MiB_FLOATS
        client = _client()
        # Without the swap each message is a memfd of torch's, kept ORPHAN_TTL from the
        # relay's forward and from its producer's death (nothing counts its refs).
        ttl = float(os.environ.get("SHMREDUCE_ORPHAN_TTL", "60")) if _torch.path() == "adopt" else 0.0
        assert wait_for(lambda: client.ping()["segments"] == 0, 5.0 + ttl), (
            f"memfds kept at the broker after every message was loaded and dropped and their producers exited: {client.ping()}"
        )
    finally:
        to_relay.send(None)
        relay.join(TIMEOUT)
        to_consumer.send(None)
        consumer.join(TIMEOUT)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for conn in (to_relay, relay_in, to_consumer, consumer_end, reports, report_end):
            conn.close()
    assert relay.exitcode == 0 and consumer.exitcode == 0, (relay.exitcode, consumer.exitcode)


# -- a fork from a gc callback during the first share ------------------------------------

_GC_FORK = textwrap.dedent(
    """
    import gc, os, sys
    import torch, shmreduce
    from shmreduce.broker import client

    shmreduce.register(strategy=sys.argv[1])
    forked = []

    def fork_once(phase, info):
        # During the launch of the broker (this thread holds _launch_lock): a
        # collection set off by an allocation there runs this callback.
        if phase == "start" and not forked and client._launch_lock.locked():
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            forked.append(pid)

    gc.callbacks.append(fork_once)
    gc.set_threshold(1)
    try:
        data = shmreduce.dumps(torch.arange(4.0))  # the first share: starts the broker
    finally:
        gc.callbacks.remove(fork_once)
        gc.set_threshold(700)
    for pid in forked:
        os.waitpid(pid, 0)
    print("RESULT", len(forked), float(shmreduce.loads(data).sum()), flush=True)
    """
)


@pytest.mark.parametrize("strategy_name", ["file_descriptor", "file_system"])
def test_a_gc_callback_that_forks_during_the_first_share_does_not_hang(strategy_name: str) -> None:
    out = _run_program(_GC_FORK, strategy_name)
    assert out.returncode != -signal.SIGKILL, f"hung (killed after {TIMEOUT:.0f} s): {out.stderr[-2000:]}"
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT 1 6.0" in out.stdout, out.stdout + out.stderr[-2000:]


# -- unregister() with messages in flight or tensors held --------------------------------

_UNREGISTER_IN_FLIGHT = textwrap.dedent(
    """
    import gc, multiprocessing as mp, os, sys, time
    import torch, shmreduce

    def receive(go, conn):
        go.recv()
        got = []
        for i in range(20):
            try:
                t = conn.recv()
                got.append("ok" if float(t.sum()) == float(i) * t.numel() else "wrong bytes")
            except shmreduce.SharingError as exc:
                got.append(str(exc)[:120])
        go.send(got)

    shmreduce.register(strategy=sys.argv[1])
    ctx = mp.get_context("fork")
    go, go_r = ctx.Pipe()
    to_r, r_end = ctx.Pipe()
    r = ctx.Process(target=receive, args=(go_r, r_end))
    r.start()  # before any tensor: it maps none of them
    for i in range(20):  # small ones in a slab, large ones in segments of their own
        to_r.send(torch.full((16 if i % 2 else 100_000,), float(i)))
    gc.collect()
    shmreduce.unregister()  # this process lives on, its messages queued
    time.sleep(float(os.environ["SHMREDUCE_ORPHAN_TTL"]) + 1.5)
    go.send("go")
    assert go.poll(15), "the receiver did not answer"
    print("RESULT", go.recv(), flush=True)
    r.join(10)
    """
)


@pytest.mark.swap_path
@pytest.mark.parametrize("strategy_name", ["file_descriptor", "file_system"])
def test_messages_in_flight_outlive_their_senders_unregister(strategy_name: str) -> None:
    """A sender unregisters (and lives) while 20 messages are queued: loaded seconds
    later, every one has its bytes (before: all 20 failed, "no such program directory")."""
    out = _run_program(_UNREGISTER_IN_FLIGHT, strategy_name, env={"SHMREDUCE_ORPHAN_TTL": "1", "SHMREDUCE_BROKER_GRACE": "0.3"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, out.stdout + out.stderr[-3000:]
    got = eval(lines[0].removeprefix("RESULT "))  # noqa: S307  our own child's repr of a list of str
    lost = [g for g in got if g != "ok"]
    assert not lost, f"{len(lost)} of 20 messages lost after their sender's unregister(): {lost[:2]}"


def _hold_unregister_and(conn: Any, how: str) -> None:
    torch.set_num_threads(1)
    import shmreduce

    kept = ForkingPickler.loads(conn.recv_bytes())
    shmreduce.unregister()  # this process lets go of nothing: it keeps the tensor
    conn.send(float(kept.sum()))
    conn.recv()  # until told
    if how == "exit":
        os._exit(0)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.swap_path
@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_a_receiver_that_unregistered_is_counted_out_at_its_death(strategy: str, how: str) -> None:
    """R loads and keeps a tensor, unregisters, then exits or is SIGKILLed still
    holding it: it is counted out, and the owner's segment is free once the owner drops
    its own (before: holders stayed 1, the segment pinned for the owner's life)."""
    ours, theirs = FORK.Pipe()
    proc = FORK.Process(target=_hold_unregister_and, args=(theirs, how))
    proc.start()
    theirs.close()
    try:
        t = torch.full((MiB_FLOATS,), 3.0)
        ours.send_bytes(bytes(ForkingPickler.dumps(t)))
        assert ours.poll(TIMEOUT)
        assert ours.recv() == 3.0 * MiB_FLOATS
        place = cache.place_of(t.untyped_storage())
        assert place is not None
        seg = place.segment
        del place
        assert _holders(seg.addr) == 1  # R holds it, unregistered
        ours.send("go")
        proc.join(TIMEOUT)
        assert wait_for(lambda: _holders(seg.addr) == 0, 5.0), (
            f"R unregistered, then died holding its tensor: never counted out (header {_native.hdr_read(seg.addr)})"
        )
        del t
        let_go_now()
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        ours.close()
