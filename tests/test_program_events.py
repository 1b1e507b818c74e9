"""SPEC 15 through the events of a program's life, in real processes (issue 36).

Each test is one event of issue 36 that a program lives through while its tensors
must keep their bytes and its memory must not be pinned for good:

* item 6: the broker is SIGKILLed while a receiver holds a generation; a new one
  starts; the receiver, known to the new broker from its next load, exits or is
  SIGKILLed still holding it: it is counted out (before: holders stayed 1, and the
  owner's segment waited in its pool for the owner's life);
* item 8: messages queued in a generation that a fork retired, waiting longer than
  ``SHMREDUCE_ORPHAN_TTL`` while their sender lives, are still loaded (before: all
  dropped at the TTL, "let go of and reused" / "file ... is gone");
* item 9: batches a DataLoader's workers made, forwarded by the main process once the
  workers exited, load in the receiver (before, file_system: 0 of 2, "file ... is
  gone: its program exited");
* item 10: a relay forwarding what short-lived producers made, to a consumer that
  drops it, leaves nothing at the broker (before, file_descriptor: one memfd per
  message, for the relay's life);
* item 11 (part): a gc callback that forks while the first share of a process starts
  the broker does not deadlock it (before: hung on ``_launch_lock``).

Every wait is bounded; every child is joined, and killed if it outlives its wait; the
module's leak check (conftest) finds no broker, file or descriptor left.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch

from shmreduce import _native, program, transfer
from shmreduce.broker import client as broker_client

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
    """Run *script* as a program of its own (its root: its broker goes with it), in its
    own session; killed whole if it outlives TIMEOUT."""
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, -signal.SIGKILL, out, err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# -- item 11: a fork from a gc callback during the first share ---------------------------

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
