"""A broker killed five times during a stream: never a hang, at
most the messages in flight at each kill lost, and a new broker that converges.

*In flight at a kill*: pickled before every process killed was gone, and not yet
received when the kill began. Only those can go with a broker. Under file_system a
ref names a file the dead broker's directory took with it; under file_descriptor a
ref to a memfd the receiver does not map yet, whose descriptor went with the dead
broker (a memfd the receiver maps already needs no broker). Anything pickled after
the kill reaches the new broker (the sender deposits again, with its next ref, each
memfd it keeps) and must arrive. How many are in flight is the backlog at that
moment, which load decides: the bound is on *which* messages, not on how many.

What looked like a hang: nothing in shmreduce. The queue's feeder runs
up to a pipe's worth of messages (~200) ahead of the consumer; under load it had
pickled the whole stream before the last kills, so no process needed a broker after
them and none was started. The earlier form of this test (test_broker_restart.py)
then failed an assert inside the program ("not one broker pair"), and its parent
waited out its time limit: reported as a hang. Its losses beyond its bound were
messages pickled before a kill but received more than its 0.3 s window later (the
backlog, again): in flight, by the count above. Here the queue is bounded (the
producer stays QUEUED messages ahead at most, so it is still sending, and restarts
the broker, after every kill), a missing broker is reported, and in flight is
counted, not timed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
import time

import pytest
import torch

import shmreduce
from shmreduce import program

from helpers import broker_procs, gone, wait_for

CTX = mp.get_context("fork")
STREAM = 1000  # messages: a 1 KiB and a 400 KB tensor each, every 2 ms
KILLS = (100, 280, 460, 640, 820)  # after this many received, the program's broker is killed
QUEUED = 20  # messages the producer may be ahead of the consumer
STALL = 20.0  # seconds without a message: the stream hung
LIMIT = 150.0  # seconds for the whole program


class _Stamp:
    """Unpickles as the time its message began to be pickled (CLOCK_MONOTONIC is one
    clock for every process); the producer keeps the same times by index."""

    stamps: dict[int, float] = {}

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self):
        now = time.monotonic()
        _Stamp.stamps[self.index] = now
        return (float, (now,))


def _produce(q, report) -> None:
    for i in range(STREAM):
        q.put((_Stamp(i), i, torch.full((256,), float(i)), torch.full((100_000,), float(i))))
        time.sleep(0.002)
    q.put(None)
    q.close()
    q.join_thread()  # every message pickled: its stamp is in
    report.send(_Stamp.stamps)


def _one_pair(directory: str) -> tuple[int, int] | None:
    """(janitor, server) if exactly one broker pair serves *directory* (no launcher)."""
    procs = broker_procs(directory)
    pairs = [(parent, pid) for pid, parent in procs.items() if parent in procs]
    return pairs[0] if len(pairs) == 1 and len(procs) == 2 else None


def _stream_program(strategy: str, conn) -> None:
    """A fresh program: a spawn producer streams to this process over an mp.Queue;
    its broker is killed 5 times (the server alone, or janitor and server). Sends
    back what it saw; exits 0."""
    os.setsid()
    program.adopt(None)
    shmreduce.register(strategy=strategy)
    spawn = mp.get_context("spawn")
    q = spawn.Queue(maxsize=QUEUED)
    ours, theirs = spawn.Pipe()
    producer = spawn.Process(target=_produce, args=(q, theirs))
    producer.start()
    directory = program.current().directory
    got: set[int] = set()
    errors: list[str] = []
    # Per kill: (when it began, when every process killed was gone, the last index received before)
    kills: list[tuple[float, float, int]] = []
    last = -1
    received = 0
    while True:
        try:
            item = q.get(timeout=STALL)
        except queue.Empty:
            errors.append(f"stream stalled {STALL:.0f} s after message {last}")
            break
        except shmreduce.SharingError as exc:
            errors.append(str(exc))
            item = ()
        received += 1
        if item is None:
            break
        if item:
            _stamp, i, small, big = item
            assert small[0] == i and big[-1] == i
            got.add(i)
            last = i
        if received in KILLS:
            pair = None
            deadline = time.monotonic() + 10
            while pair is None and time.monotonic() < deadline:
                pair = _one_pair(directory)
                time.sleep(0.01)
            if pair is None:
                errors.append(f"not one broker pair: {broker_procs(directory)}")
                continue
            begun = time.monotonic()
            victims = pair if len(kills) % 2 else pair[1:]  # janitor and server, or the server alone
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            while not all(gone(pid) for pid in victims):
                time.sleep(0.001)
            kills.append((begun, time.monotonic(), last))
    stamps = ours.recv() if ours.poll(STALL) else {}
    producer.join(STALL)
    if producer.is_alive():
        producer.kill()
        producer.join()
    conn.send((directory, got, stamps, kills, errors, producer.exitcode))
    shmreduce.unregister()
    sys.exit(0)


def in_flight(stamps: dict[int, float], kills: list[tuple[float, float, int]]) -> set[int]:
    """The messages in flight at some kill: pickled before its victims were gone, not
    received when it began."""
    return {i for i, stamp in stamps.items() for _begun, gone, last in kills if i > last and stamp <= gone}


def _lose_on_the_other_core(stop) -> None:
    while not stop.is_set():
        pass


@pytest.mark.parametrize("load", [False, True], ids=["idle", "loaded"])
@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_broker_killed_five_times_in_a_stream_loses_only_what_was_in_flight(strategy, load):
    """Before the fix, under file_descriptor on a loaded machine, one run of two hung
    until its time limit and the other lost messages pickled after a restart."""
    stop = CTX.Event()
    busy = CTX.Process(target=_lose_on_the_other_core, args=(stop,)) if load else None
    if busy is not None:
        busy.start()
    ours, theirs = CTX.Pipe()
    proc = CTX.Process(target=_stream_program, args=(strategy, theirs))
    proc.start()
    theirs.close()
    try:
        assert ours.poll(LIMIT), "the program hung"
        directory, got, stamps, kills, errors, producer_code = ours.recv()
        proc.join(30)
    finally:
        if proc.exitcode is None and proc.pid is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.join(5)
        ours.close()
        stop.set()
        if busy is not None:
            busy.join(10)
            if busy.is_alive():
                busy.kill()
                busy.join()
    assert proc.exitcode == 0 and producer_code == 0
    assert not [e for e in errors if "stalled" in e or "broker pair" in e], errors
    assert len(kills) == len(KILLS) and len(stamps) == STREAM
    lost = set(range(STREAM)) - got
    excused = in_flight(stamps, kills)
    unexcused = sorted(lost - excused)
    print(f"{strategy}: {len(lost)} lost of {STREAM}, {len(excused)} in flight at the kills")
    assert not unexcused, f"{len(unexcused)} of {len(lost)} lost were not in flight at a kill, e.g. {unexcused[:5]}; errors: {errors[-3:]}"
    assert wait_for(lambda: not broker_procs(directory) and not os.path.exists(directory), 10), "left behind"
