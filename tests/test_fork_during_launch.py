"""Errors, never hangs, while the broker starts: a fork racing a program's first share never hangs
the program, and every message arrives.

The program is a reduction of torch's ``test_fs_sharing``: a queue's feeder
thread makes the program's first share (and so starts its broker) while the main
thread forks a child at once. Before the fix the child inherited the pipes of the
launch in progress and the launch waited for an end-of-file that never came: 3 of 10
such programs hung under ``file_system``. Each run here is a fresh program (a fork of
this process that forgets the program identity), several at once, each bounded.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest
import torch

CTX = mp.get_context("fork")
RUNS = 20  # fresh programs per strategy
AT_ONCE = 5
RUN_TIMEOUT = 25.0


def _fill(q, e):
    a, b = q.get(timeout=15)
    a.fill_(4)  # b is a view of a: both are 4s now
    assert b.eq(4).all()
    e.set()


def _program(strategy: str) -> None:
    """One fresh program: the reduced test, then exit 0 if every message arrived."""
    os.setsid()  # its own group: a hung run is killed whole, launcher included
    import shmreduce
    from shmreduce import program

    program.adopt(None)  # a fresh program: its own identity, its own broker
    shmreduce.register(strategy=strategy)
    x = torch.zeros(5, 5)
    q = CTX.Queue()
    e = CTX.Event()
    q.put([x, x[:, 1]])  # the feeder thread makes the program's first share
    p = CTX.Process(target=_fill, args=(q, e))  # fork right away
    p.start()
    arrived = e.wait(15)
    p.join(15)
    os._exit(0 if arrived and p.exitcode == 0 and bool(x.eq(4).all()) else 3)


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_a_fork_racing_the_first_share_never_hangs(strategy):
    results: list[int | None] = []
    running: list[tuple[Any, float]] = []
    todo = RUNS
    while todo or running:
        while todo and len(running) < AT_ONCE:
            proc = CTX.Process(target=_program, args=(strategy,))
            proc.start()
            running.append((proc, time.monotonic() + RUN_TIMEOUT))
            todo -= 1
        time.sleep(0.02)
        for entry in list(running):
            proc, deadline = entry
            if proc.exitcode is None and time.monotonic() < deadline:
                continue
            if proc.exitcode is None and proc.pid is not None:  # hung: kill its whole group
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.join(5)
            results.append(proc.exitcode)
            running.remove(entry)
    hung = sum(1 for code in results if code == -signal.SIGKILL)
    failed = sum(1 for code in results if code not in (0, -signal.SIGKILL))
    assert (hung, failed) == (0, 0), f"{strategy}: {hung} of {RUNS} programs hung, {failed} lost their message: {results}"


FORKS = 40  # children forked while the first share runs
CHILD_LIFE = 30.0  # seconds each lives: a DataLoader worker outlives any launch


def _storm(strategy: str, conn) -> None:
    """A fresh program that forks long-lived children for as long as its first share
    (from another thread) takes; sends back how long that share took and its error."""
    os.setsid()
    import threading

    import shmreduce
    from shmreduce import program

    program.adopt(None)
    shmreduce.register(strategy=strategy)
    done = threading.Event()
    errors: list[str] = []

    def share() -> None:
        try:
            shmreduce.dumps(torch.zeros(5))
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))
        done.set()

    started = time.monotonic()
    threading.Thread(target=share).start()
    children: list[int] = []
    while not done.is_set() and len(children) < FORKS:
        pid = os.fork()
        if pid == 0:
            time.sleep(CHILD_LIFE)
            os._exit(0)
        children.append(pid)
    done.wait(CHILD_LIFE / 3)
    took = time.monotonic() - started
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    conn.send((took, errors))
    os._exit(0)


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_children_forked_during_the_launch_do_not_hold_it_up(strategy):
    """Deterministic: with children forked all through the launch, before the fix some
    child always held a pipe of the launch and the share took as long as that child
    lived (24 to 28 s, 6 of 6 programs)."""
    ours, theirs = CTX.Pipe()
    proc = CTX.Process(target=_storm, args=(strategy, theirs))
    proc.start()
    theirs.close()
    try:
        assert ours.poll(CHILD_LIFE), "the program hung"
        took, errors = ours.recv()
    finally:
        proc.join(5)
        if proc.exitcode is None and proc.pid is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.join(5)
        ours.close()
    assert not errors
    assert took < 5.0, f"the first share took {took:.1f} s while children were forked"
