"""``shmreduce doctor`` and ``cleanup`` after a program dies whole.

A program whose every process was SIGKILLed, broker and janitor included, leaves its
directory: its lock is free and nothing uses it, so it is stale at once (it used to be
"none ... all good" for STALE_MIN_AGE seconds). One whose broker died while a process
of it still maps its files is not. ``doctor`` says what its columns mean, and
``doctor --json`` piped into a reader that stops early ends quietly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from helpers import broker_procs, gone, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)

PROGRAM = """
import sys, torch, shmreduce
from shmreduce import program
shmreduce.register(strategy="file_system")
t = torch.ones(1 << 16)
t.share_memory_()  # a segment file of this program, mapped here
print(program.current().directory, flush=True)
sys.stdin.readline()
"""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmreduce", *args], capture_output=True, text=True, env=ENV, timeout=60, cwd=ROOT)


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert wait_for(lambda: all(gone(p) for p in pids), 10)


@pytest.mark.swap_path
def test_a_program_killed_whole_is_stale_at_once():
    prog = subprocess.Popen([sys.executable, "-c", PROGRAM], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert prog.stdout is not None
        directory = prog.stdout.readline().strip()
        assert os.path.isdir(directory), directory
        _kill(list(broker_procs(directory)))  # the broker and its janitor: the root still maps its file
        out = _cli("doctor")
        assert directory not in out.stdout.split("stale program directories", 1)[1].split("\n", 1)[0], out.stdout
        prog.kill()  # and now the root: every process of the program is gone
        prog.wait(10)
        out = _cli("doctor")
        line = out.stdout.split("stale program directories", 1)[1].split("\n", 1)[0]
        assert out.returncode != 0 and directory in line, out.stdout
        out = _cli("cleanup", "--yes")
        assert f"removed {directory}" in out.stdout, out.stdout
        assert not os.path.exists(directory)
    finally:
        if prog.poll() is None:
            prog.kill()
            prog.wait(10)
        for stream in (prog.stdin, prog.stdout):
            if stream is not None:
                stream.close()


def test_a_starting_broker_keeps_its_young_directory():
    # A directory younger than STALE_MIN_AGE, lock free, whose launcher still runs (a
    # process whose command line names it, as every broker process's does): kept.
    from shmreduce.broker import protocol as P
    from shmreduce.program import shm_base

    directory = os.path.join(shm_base(), "shmreduce-0a0b0c0d0e0f1011")
    os.mkdir(directory, 0o700)
    for entry in (P.MARKER_NAME, P.LOCK_NAME):
        open(os.path.join(directory, entry), "w").close()
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "shmreduce.broker.server", directory, "1"])
    try:
        out = _cli("cleanup", "--yes")
        assert out.returncode == 0 and os.path.isdir(directory), out.stdout
    finally:
        launcher.kill()
        launcher.wait()
    out = _cli("cleanup", "--yes")  # its launcher gone: stale at once
    assert f"removed {directory}" in out.stdout, out.stdout


@pytest.mark.parametrize("reader", ["true", "head -c 1"])
def test_doctor_json_into_a_reader_that_stops_ends_quietly(reader):
    done = subprocess.run(
        f"{sys.executable} -m shmreduce doctor --json | {reader}", shell=True, capture_output=True, text=True, env=ENV, timeout=60, cwd=ROOT
    )
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def test_doctor_explains_a_program_whose_root_exited():
    # A broker whose root exited while a process of its program (this one) is still
    # connected: "alive: no" in its row, and no orphan; doctor says why.
    from shmreduce.broker import client
    from shmreduce.program import shm_base

    dead = subprocess.Popen(["true"])
    dead.wait()
    directory = os.path.join(shm_base(), "shmreduce-5566778899aabbcc")
    c = client.BrokerClient(directory, dead.pid)
    try:
        c.ping()
        out = _cli("doctor")
    finally:
        c.close()
    orphans = next(line for line in out.stdout.splitlines() if "orphan brokers" in line)
    assert "root exited" in orphans and "connected" in orphans, out.stdout
    assert "alive: whether the program's root process lives" in out.stdout, out.stdout
    assert "this user's programs on this machine" in out.stdout, out.stdout
    assert wait_for(lambda: not os.path.exists(directory), 10)
