"""One broker per program, always: the lock, not the path, decides who removes a
program directory.

Before the fix, a janitor removed its program directory by path after its server had
removed it already, and a sweep removed a directory by path after it had checked (and
let go of) its lock: in either window a fresh broker's directory was deleted under it,
and the program's next process started a second broker. Each window is forced here
deterministically: a janitor stopped (SIGSTOP) while its server exits and a new broker
starts, a sweep interleaved (a hook in a child) with a new broker taking the directory.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import shmreduce
from shmreduce import program
from shmreduce.broker import client as broker_client
from shmreduce.broker import protocol as P

from helpers import broker_procs, run_in_child, wait_for

TIMEOUT = 10.0


def _pairs(directory: str) -> list[tuple[int, int]]:
    """(janitor, server) of every broker serving *directory* (a server: a broker
    process whose parent is one too)."""
    procs = broker_procs(directory)
    return [(parent, pid) for pid, parent in procs.items() if parent in procs]


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _serving_pid(directory: str) -> int:
    """The pid of the broker a fresh connection to *directory* reaches (no start)."""
    client = broker_client.BrokerClient(directory, None, broker_client.Ledger())
    try:
        return client.ping()["pid"]
    finally:
        client.close(keep=True)
        assert client.ledger is not None
        client.ledger.close()


def test_a_janitor_never_removes_the_directory_of_the_broker_after_its_own():
    """Before the fix the janitor, let go on (SIGCONT) after a new broker had made the
    directory anew, removed it: the new broker served a deleted socket, and the next
    sender started a second broker."""
    with shmreduce.registered(strategy="file_system"):
        prog = program.current()
        directory = prog.directory
        broker_client.client_for(directory, prog.root_pid).connect()
        assert wait_for(lambda: len(_pairs(directory)) == 1, TIMEOUT)
        ((janitor, server),) = _pairs(directory)
        os.kill(janitor, signal.SIGSTOP)
        try:
            broker_client.close_all()  # no client left: the server exits, removing the directory
            assert wait_for(lambda: _state(server) in ("Z", "gone") and not os.path.exists(directory), TIMEOUT)
            broker_client.client_for(directory, prog.root_pid).connect()  # a new broker, a new directory
            fresh = [pair for pair in _pairs(directory) if pair[0] != janitor]
            assert len(fresh) == 1, _pairs(directory)
            new_server = fresh[0][1]
        finally:
            os.kill(janitor, signal.SIGCONT)
        assert wait_for(lambda: _state(janitor) in ("Z", "gone"), TIMEOUT)
        time.sleep(0.2)  # what the old janitor did, it did: it has exited
        assert os.path.exists(os.path.join(directory, P.SOCKET_NAME)), "the old janitor removed the new broker's directory"
        assert run_in_child(_serving_pid, directory) == ("ok", new_server)
        assert [pair[1] for pair in _pairs(directory)] == [new_server], "not one broker"


def _sweep_while_a_new_broker_takes_the_directory(base: str, directory: str) -> tuple[list[str], bool]:
    """In a child: *directory* is a dead program's (its lock free, made long ago). The
    sweep finds it stale; then, before it removes it, the directory is removed and
    made anew by a fresh broker, which holds its lock (also made long ago: only the
    lock tells them apart). (what the sweep removed, whether the fresh broker's
    directory is still there)"""
    import fcntl

    from shmreduce.broker import programdir

    old = time.time() - 2 * programdir.STALE_MIN_AGE
    programdir.make_program_dir(directory)
    os.utime(directory, (old, old))
    held: list[int] = []
    real_lock_is_free = programdir.lock_is_free

    def lock_is_free(path: str) -> bool:
        free = real_lock_is_free(path)
        if free and path == directory and not held:
            # The window: the dead program's directory goes, a fresh broker makes it
            # anew and locks it.
            tomb = directory + ".test-tomb"
            os.rename(directory, tomb)
            programdir.make_program_dir(directory)
            held.append(os.open(os.path.join(directory, P.LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600))
            fcntl.flock(held[0], fcntl.LOCK_EX)
            os.utime(directory, (old, old))
            import shutil

            shutil.rmtree(tomb)
        return free

    programdir.lock_is_free = lock_is_free  # type: ignore[assignment]
    try:
        removed = programdir.sweep_stale(base)
        return removed, os.path.exists(os.path.join(directory, P.LOCK_NAME))
    finally:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
        for fd in held:
            os.close(fd)


def test_a_sweep_never_removes_a_directory_whose_lock_a_live_broker_took_since():
    """Before the fix the sweep removed the fresh broker's directory (it had checked
    the lock of the one before, and removed by path)."""
    base = program.shm_base()
    directory = os.path.join(base, f"{P.DIR_PREFIX}{os.urandom(8).hex()}")
    status, value = run_in_child(_sweep_while_a_new_broker_takes_the_directory, base, directory)
    assert status == "ok", value
    removed, there = value
    assert directory not in removed and there, "the sweep removed a directory a live broker holds"


def _sweep_a_stale_directory(base: str, directory: str) -> tuple[list[str], bool]:
    from shmreduce.broker import programdir

    old = time.time() - 2 * programdir.STALE_MIN_AGE
    programdir.make_program_dir(directory)
    os.close(os.open(os.path.join(directory, P.LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600))
    os.utime(directory, (old, old))
    return programdir.sweep_stale(base), os.path.exists(directory)


def test_a_sweep_removes_a_dead_programs_directory():
    base = program.shm_base()
    directory = os.path.join(base, f"{P.DIR_PREFIX}{os.urandom(8).hex()}")
    status, value = run_in_child(_sweep_a_stale_directory, base, directory)
    assert status == "ok", value
    assert value == ([directory], False)


def test_a_sweep_removes_what_an_interrupted_removal_or_making_left():
    # A process killed inside rmtree of its renamed directory leaves
    # `shmreduce-<token>.gone-<pid>`, one killed while making one `.new-<pid>`: a sweep
    # removes them once their process is dead, never a live process's.
    import shutil
    import subprocess
    import sys

    from shmreduce.broker import programdir

    base = program.shm_base()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    names = [f"{P.DIR_PREFIX}{os.urandom(8).hex()}.gone-{dead_pid}", f"{P.DIR_PREFIX}{os.urandom(8).hex()}.new-{dead_pid}"]
    live = f"{P.DIR_PREFIX}{os.urandom(8).hex()}.gone-{os.getpid()}"
    old = time.time() - programdir.STALE_MIN_AGE - 5
    for name in [*names, live]:
        path = os.path.join(base, name)
        os.mkdir(path, 0o700)
        with open(os.path.join(path, "seg-" + "0" * 24), "wb") as f:
            f.write(b"x" * 4096)
        os.utime(path, (old, old))
    try:
        removed = programdir.sweep_stale(base)
        assert sorted(os.path.basename(p) for p in removed if ".gone-" in p or ".new-" in p) == sorted(names)
        assert not any(os.path.exists(os.path.join(base, n)) for n in names)
        assert os.path.isdir(os.path.join(base, live)), "a live process's removal was swept from under it"
    finally:
        for name in [*names, live]:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


_KILLED_PROGRAM = """
import torch, shmreduce
from shmreduce import program
shmreduce.register(strategy="file_system")
assert torch.equal(shmreduce.loads(shmreduce.dumps(torch.arange(300_000.0))), torch.arange(300_000.0))
print(program.current().directory, flush=True)
import sys; sys.stdin.read()
"""


@pytest.mark.swap_path
def test_the_next_register_removes_what_a_program_killed_with_its_broker_left():
    # SIGKILL of a program's processes, its broker and janitor included, leaves its
    # directory (with a seg- file) for the next program that starts a broker. The next program's register() sweeps it.
    import subprocess
    import sys

    from shmreduce.broker import programdir

    root = subprocess.Popen([sys.executable, "-c", _KILLED_PROGRAM], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert root.stdout is not None
    directory = root.stdout.readline().strip()
    try:
        assert os.path.isdir(directory)
        for pid in broker_procs(directory):
            os.kill(pid, signal.SIGKILL)
        root.kill()
        root.wait(30)
        assert wait_for(lambda: not broker_procs(directory), 10)
        assert any(n.startswith(P.SEG_PREFIX) for n in os.listdir(directory)), "nothing was left to sweep"
        old = time.time() - programdir.STALE_MIN_AGE - 5
        os.utime(directory, (old, old))  # as if killed STALE_MIN_AGE ago
        nxt = subprocess.run([sys.executable, "-c", "import shmreduce; shmreduce.register()"], capture_output=True, text=True, timeout=60)
        assert nxt.returncode == 0, nxt.stderr
        assert not os.path.exists(directory), "the next register() left a dead program's directory"
    finally:
        if root.poll() is None:
            root.kill()
            root.wait()
