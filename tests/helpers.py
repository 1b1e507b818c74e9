"""Shared test helpers: bounded waits, broker discovery, leak snapshots."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import shmreduce
from shmreduce import program
from shmreduce.broker import client as broker_client
from shmreduce.broker import protocol as P


@contextmanager
def without_dlpack_exchange_api() -> Iterator[type]:
    """The native core as on a torch whose Tensor has no DLPack exchange API (before
    2.10): bound to a Tensor subclass without one, which the block gets; torch.Tensor
    bound again after."""
    import torch

    from shmreduce import reductions

    class NoApi(torch.Tensor):
        __dlpack_c_exchange_api__ = None

    reductions.bind_sender(NoApi)
    try:
        yield NoApi
    finally:
        reductions.bind_sender()


@contextmanager
def without_swap() -> Iterator[None]:
    """This process as on a torch without ``UntypedStorage._swap_data_ptr_`` (before
    2.12): torch moves each storage sent and shmreduce adopts it (``_torch.path()``,
    in Python and in the native core); the swap bound again after."""
    from shmreduce import _native, _torch, segments
    from shmreduce.errors import SharingError

    swap = _torch.swap_memory
    _torch.swap_memory = None
    _native.init(_torch.from_dlpack, SharingError, segments.dtypes, segments.live, None, _torch.dlpack_versioned())
    try:
        yield
    finally:
        _torch.swap_memory = swap
        _native.init(_torch.from_dlpack, SharingError, segments.dtypes, segments.live, swap, _torch.dlpack_versioned())


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()


def shm_base() -> str:
    return program.shm_base()


def shm_entries() -> set[str]:
    """Everything under the shm base (program dirs and their files)."""
    base = shm_base()
    found = set()
    for root, dirs, files in os.walk(base):
        for name in dirs + files:
            found.add(os.path.join(root, name))
    return found


def seg_files(directory: str) -> set[str]:
    """The segment files in a program directory (none once it is gone)."""
    try:
        return {n for n in os.listdir(directory) if n.startswith(P.SEG_PREFIX)}
    except FileNotFoundError:
        return set()


def broker_procs(directory: str | None = None) -> dict[int, int]:
    """pid -> parent pid of every live broker process (launcher, janitor, server)
    serving *directory*, or any directory under our shm base."""
    base = shm_base().encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" or b"shmreduce.broker.server" not in argv:
            continue
        if directory.encode() in argv if directory is not None else any(a.startswith(base) for a in argv):
            found[int(entry)] = int(fields[1])
    return found


def broker_pids() -> list[int]:
    """Live broker (server or janitor) processes serving a directory under our shm base."""
    return list(broker_procs())


def brokers_under(base: str) -> list[int]:
    """Live broker processes serving a program directory in *base* (a job's own shm base)."""
    pids = []
    for pid in broker_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if base.encode() + b"/" in f.read():
                    pids.append(pid)
        except OSError:
            pass
    return pids


def open_fds() -> set[str]:
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return fds


def shutdown_and_check_leaks(fds_before: set[str], timeout: float = 15.0) -> None:
    """Drop our connections and assert no shm files, brokers or descriptors remain.

    A module that never imported the registry or transfer (the torch-free ones) has
    nothing registered and nothing to collect: neither is imported here for it."""
    if "shmreduce.registry" in sys.modules:
        shmreduce.unregister()
    broker_client.close_all()
    gc.collect()
    if "shmreduce.transfer" in sys.modules:
        from shmreduce import transfer

        transfer.collect()  # what died since (the collector thread would within 0.5 s)
    assert wait_for(lambda: not broker_pids(), timeout), f"broker still running: {broker_pids()}; {what_brokers_hold()}"
    assert wait_for(lambda: not shm_entries(), timeout), f"left in shm dir: {sorted(shm_entries())}"
    leaked = {fd for fd in open_fds() - fds_before if "memfd:shmreduce" in fd or "shmreduce" in fd or "socket:" in fd}
    assert not leaked, f"descriptors leaked: {leaked}"


def what_brokers_hold() -> str:
    """For a failure message: each live broker's counters (a fresh connection's ping,
    closed again) and the last 'no client left' line of the session's broker log
    (conftest: DEBUG, to a file), which lists every message it stayed for."""
    parts = []
    base = shm_base()
    for entry in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        directory = os.path.join(base, entry)
        if not P.is_program_dir(directory, base):
            continue
        client = broker_client.BrokerClient(directory, None)
        try:
            parts.append(f"{entry}: {client.ping(full=True)}")
        except Exception as exc:  # noqa: BLE001  a diagnostic: whatever it says
            parts.append(f"{entry}: no answer ({exc})")
        finally:
            client.close(keep=True)  # it posted this process's ledger: not to be counted out twice
    path = os.environ.get("SHMREDUCE_BROKER_LOG")
    if path and os.path.exists(path):
        with open(path, errors="replace") as f:
            stayed = [line for line in f if "no client left" in line]
        parts.append(f"last 'no client left' line of {path}: {stayed[-1] if stayed else 'none'}")
    return "; ".join(parts) or "no program directory"


def run_in_child(fn, *args, timeout: float = 20.0):
    """Run fn(*args) in a fork child; return ("ok", value) or (exception type name, message).

    Bounded: the child is joined, and killed if it outlives *timeout*.
    """
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()

    def target():
        try:
            b.send(("ok", fn(*args)))
        except BaseException as exc:  # noqa: BLE001
            b.send((type(exc).__name__, str(exc)))

    p = ctx.Process(target=target)
    p.start()
    try:
        assert a.poll(timeout), "child hung"
        return a.recv()
    finally:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
        a.close()
        b.close()


def _echo_pipe(conn) -> None:
    while (obj := conn.recv()) is not None:
        conn.send(obj)


@contextmanager
def pipe_echo(ctx, timeout: float = 30.0) -> Iterator[Callable[[Any], Any]]:
    """A child of *ctx* that sends back whatever it receives over a Pipe.

    Yields ``send(obj) -> obj as received back``; joins the child on exit.
    """
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo_pipe, args=(child,))
    proc.start()
    child.close()

    def send(obj: Any) -> Any:
        parent.send(obj)
        assert parent.poll(timeout), "echo child did not answer"
        return parent.recv()

    try:
        yield send
    finally:
        parent.send(None)
        proc.join(timeout)
        parent.close()
    assert proc.exitcode == 0


class SegmentRef(NamedTuple):
    """A ref (``transfer.share``'s plain tuple: its fields are in transfer's module
    docstring), read by name in tests: ``SegmentRef(*transfer.share(storage))``."""

    kind: str
    program: str
    segment: int | str
    gen: int
    offset: int
    nbytes: int
    tag: int
    ticket: int


def forget_mappings() -> None:
    """In a forked child: forget the segments inherited from the parent (its storage
    cache, its file_descriptor slabs), so the child receives like a process that never
    saw them."""
    from shmreduce import _native, segments
    from shmreduce.cache import cache

    cache.clear()
    # Every segment this process maps is forgotten (each stays mapped while storages use it).
    segments._kept.clear()
    segments._mapped.clear()
    segments.live.clear()
    _native.forget_mapped()


def let_go_now() -> None:
    """Let go at once of what died in this process, and wait until the broker has
    heard and answered (its free notices taken in): what the collector thread does
    within a second."""
    import gc

    from shmreduce import program, transfer
    from shmreduce.broker.client import connected_client

    gc.collect()
    transfer.collect()
    client = connected_client(program.current().directory)
    if client is not None:
        client.ping()
    transfer.collect()


@contextmanager
def running(proc: Any, timeout: float = 60.0) -> Iterator[Any]:
    """Start *proc*; at the end of the block it must exit with 0 within *timeout*.
    Killed if it still lives, whatever happened: never left behind."""
    proc.start()
    try:
        yield proc
        proc.join(timeout)
        assert proc.exitcode == 0, proc.exitcode
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


def gone(pid: int) -> bool:
    """Whether process *pid* has exited (a zombie, or reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@contextmanager
def small_mount(directory: Any, size: str) -> Iterator[str]:
    """A tmpfs of *size* (mount's ``size=``) mounted at *directory*, made here (the tests
    run as root, in a private mount namespace): a /dev/shm small enough to fill. At the
    end of the block it must be empty within 15 s (nothing left behind), and is
    unmounted. Skips the test where mounting is not allowed."""
    import pytest

    mnt = str(directory)
    os.mkdir(mnt)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", mnt], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        assert wait_for(lambda: not os.listdir(mnt), 15), os.listdir(mnt)
        subprocess.run(["umount", "-l", mnt], check=True)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_program(script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 20.0) -> subprocess.CompletedProcess:
    """Run *script* as a program of its own (its root: its broker goes with it), in its
    own session, with the tests' helpers importable; killed whole if it outlives *timeout*."""
    full_env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.path.join(ROOT, 'tests')}", **(env or {}))
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
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, -signal.SIGKILL, out, err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
