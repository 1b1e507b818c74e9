"""Fresh programs that fork while another thread is inside a first-use initialization.

Run as ``python first_use_programs.py STRATEGY RUNS`` in a fresh interpreter: it
imports torch and shmreduce and initializes nothing else, then forks RUNS programs of
each kind below, AT_ONCE at a time, each as fresh as a new interpreter in what
shmreduce and torch initialize on first use (the dtype table, torch's quantized
engine, the broker, the first slab). Prints one JSON line: each kind's exit codes, one
per program (0: at each point, the child forked there was done within CHILD_TIMEOUT;
REACHED_NOT + i: no thread reached the i-th point; CHILD_FAILED + i: the child forked
at the i-th point failed or hung; -9: the program hung, killed after RUN_TIMEOUT).

Each kind names pause points of ``shmreduce._faults``, in the order one thread (not
the main one) reaches them. That thread stops at each while the main thread forks a
child there, and goes on once the fork is made, or once the fork waits for it
(``fork.waits``: for a lock it holds):

``first_share``  torch's ``test_fs_sharing`` pattern: register(), put ``[x, x[:, 1]]`` on a
    queue (twice: one message for each child), fork a Process that gets it and fills
    it; the queue's feeder thread, making the program's first share, stops where it
    starts the broker and where it makes its first slab.
``register``  a thread registers: it stops where it initializes what torch initializes
    on first use, then holding the registry's lock; each child registers and reads
    torch's quantized engine.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

import shmreduce
from shmreduce import _faults, _torch, program, registry  # noqa: F401  imported: registering in a program costs no import

# The first slab is the swap path's: without the swap torch moves the storage, into no slab.
FIRST_SHARE = ("broker.launch", "pool.new_current") if _torch.path() == "swap" else ("broker.launch",)
KINDS = {"first_share": FIRST_SHARE, "register": ("prepare.torch", "registry.locked")}
CHILD_TIMEOUT = 10.0
RUN_TIMEOUT = 40.0
PAUSE_TIMEOUT = 5.0  # a paused thread goes on after this, fork or not
AT_ONCE = 4  # programs running at once
REACHED_NOT = 10
CHILD_FAILED = 20


def _pauses(points: tuple[str, ...]) -> tuple[queue.Queue, dict[str, threading.Event]]:
    """(reached, go): the hook of each of *points*, in a thread but this one, puts the
    point on *reached* and waits for ``go[point]``, which a fork's wait for a lock
    (``fork.waits``) sets too."""
    reached: queue.Queue = queue.Queue()
    go = {point: threading.Event() for point in points}
    paused: list[str] = []
    main = threading.get_ident()

    def pause(point: str) -> Callable[[], None]:
        def hook() -> None:
            if threading.get_ident() != main and point not in paused:
                paused.append(point)
                reached.put(point)
                go[point].wait(PAUSE_TIMEOUT)

        return hook

    for point in points:
        _faults.pauses[point] = pause(point)

    def fork_waits() -> None:
        for point in paused:
            go[point].set()

    _faults.pauses["fork.waits"] = fork_waits
    return reached, go


def _fill(q: Any, filled: Any) -> None:
    data = q.get(timeout=CHILD_TIMEOUT)
    data[0][:] = 4  # data[1] is a view of it
    filled.set()


def _fork_at_each(points: tuple[str, ...], start: Callable[[], None], fork: Callable[[], Callable[[], bool]]) -> int:
    """start() the thread that reaches *points*; at each, fork() a child (it returns
    whether the child was done, waiting for it); 0 once every child was."""
    reached, go = _pauses(points)
    start()
    children = []
    for i in range(len(points)):
        try:
            point = reached.get(timeout=PAUSE_TIMEOUT)
        except queue.Empty:
            return REACHED_NOT + i
        children.append(fork())
        go[point].set()
    for i, done in enumerate(children):
        if not done():
            return CHILD_FAILED + i
    return 0


def _first_share(strategy: str, points: tuple[str, ...]) -> int:
    x = torch.zeros(5, 5)
    q: Any = mp.Queue()

    def start() -> None:
        shmreduce.register(strategy=strategy)
        for _ in points:
            q.put([x, x[:, 1]])  # the feeder thread makes the program's first share

    def fork() -> Callable[[], bool]:
        filled = mp.Event()
        child = mp.Process(target=_fill, args=(q, filled), daemon=True)
        child.start()

        def done() -> bool:
            ok = filled.wait(CHILD_TIMEOUT)
            child.join(CHILD_TIMEOUT)
            return ok and child.exitcode == 0 and bool(x.eq(4).all())

        return done

    return _fork_at_each(points, start, fork)


def _register(strategy: str, points: tuple[str, ...]) -> int:
    def fork() -> Callable[[], bool]:
        pid = os.fork()
        if pid == 0:
            shmreduce.register(strategy=strategy)  # the dtype table, the registry's lock
            torch.backends.quantized.engine  # noqa: B018  what the table's quantized dtypes would set up
            os._exit(0)
        return lambda: _exit_code(pid, CHILD_TIMEOUT) == 0

    registering = threading.Thread(target=shmreduce.register, kwargs={"strategy": strategy})
    code = _fork_at_each(points, registering.start, fork)
    registering.join(PAUSE_TIMEOUT)
    return code


def _exit_code(pid: int, timeout: float) -> int:
    """*pid*'s exit code once it exits; -9 if it had not within *timeout* (killed then)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.01)


def _program(strategy: str, kind: str) -> None:
    os.setsid()  # its own group: a hung program is killed whole, its children with it
    program.adopt(None)  # its own identity, its own broker
    run = _first_share if kind == "first_share" else _register
    os._exit(run(strategy, KINDS[kind]))


def main() -> None:
    strategy, runs = sys.argv[1], int(sys.argv[2])
    todo = [kind for kind in KINDS for _ in range(runs)]
    running: dict[int, tuple[str, float]] = {}  # pid -> (kind, deadline)
    codes: dict[str, list[int]] = {kind: [] for kind in KINDS}
    while todo or running:
        while todo and len(running) < AT_ONCE:
            kind = todo.pop()
            pid = os.fork()
            if pid == 0:
                try:
                    _program(strategy, kind)
                finally:
                    os._exit(CHILD_FAILED)
            running[pid] = (kind, time.monotonic() + RUN_TIMEOUT)
        time.sleep(0.01)
        for pid, (kind, deadline) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done and time.monotonic() < deadline:
                continue
            if not done:  # hung: the program and its children
                os.killpg(pid, signal.SIGKILL)
                status = os.waitpid(pid, 0)[1]
            codes[kind].append(os.waitstatus_to_exitcode(status))
            del running[pid]
    print(json.dumps(codes))


if __name__ == "__main__":
    main()
