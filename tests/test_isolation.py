"""Isolation: only the same program (authkey) and user reach its shared memory.

A process with another authkey is refused by the broker (SharingError); another user
(uid 65534, dropped to in a fork child) can neither connect nor open the program's
files; the program directory is 0700, segment files and the socket 0600.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import shutil
import socket
import stat
import tempfile

import pytest
import torch

import shmreduce
from shmreduce import _torch, doctor, program
from shmreduce.broker import client as broker_client
from shmreduce.broker import protocol as P
from shmreduce.broker import server

from helpers import forget_mappings, gone, run_in_child, wait_for

TIMEOUT = 20.0
PR_SET_DUMPABLE = 4


def _share_fs():
    t = torch.ones(64)
    data = shmreduce.dumps(t)
    prog = program.current()
    names = [n for n in os.listdir(prog.directory) if n.startswith(P.SEG_PREFIX)]
    return t, data, prog, names


def test_modes(strategy):
    t, data, prog, names = _share_fs()
    st = os.lstat(prog.directory)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert stat.S_IMODE(os.lstat(os.path.join(prog.directory, P.SOCKET_NAME)).st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(os.path.join(prog.directory, P.LOCK_NAME)).st_mode) & 0o077 == 0
    if strategy == "file_system" and _torch.path() == "swap":  # without the swap torch's memfd, no file
        assert names
        for n in names:
            assert stat.S_IMODE(os.lstat(os.path.join(prog.directory, n)).st_mode) == 0o600
    else:
        assert not names  # memfd: nothing named in any file system
    shmreduce.loads(data)


def test_other_authkey_refused(strategy):
    t, data, prog, _ = _share_fs()

    def other_program():
        mp.current_process().authkey = os.urandom(32)
        broker_client.close_all()
        forget_mappings()  # another program maps none of ours (a fork inherits them)
        return float(shmreduce.loads(data).sum())

    status, message = run_in_child(other_program)
    assert status == "SharingError", (status, message)
    # fd: the broker refuses the connection; fs: the handle's tag, keyed by the
    # authkey, does not match (the files are mapped before any broker contact)
    assert "authkey" in message or "refused" in message or "another program" in message, message
    # the broker and the program are unharmed
    assert run_in_child(lambda: float(shmreduce.loads(data).sum())) == ("ok", 64.0)


def test_raw_connection_with_wrong_key_is_closed(strategy):
    t, data, prog, _ = _share_fs()

    def connect_wrong():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(5)
        sock.connect(os.path.join(prog.directory, P.SOCKET_NAME))
        try:
            P.client_handshake(sock, b"wrong key")
        except (P.ProtocolError, OSError) as exc:
            return f"refused: {exc}"
        finally:
            sock.close()
        return "accepted"

    result = run_in_child(connect_wrong)
    assert result[0] == "ok" and result[1].startswith("refused"), result
    assert run_in_child(lambda: float(shmreduce.loads(data).sum())) == ("ok", 64.0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")
def test_other_user_cannot_connect_or_open(strategy):
    t, data, prog, names = _share_fs()
    authkey = bytes(mp.current_process().authkey)

    def as_nobody():
        # A stranger to the segments: a fork child inherits its parent's mappings,
        # memory it already has (as with torch), which no check can take back.
        forget_mappings()
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        out = {}
        # same authkey, other user: the socket is unreachable (0700 dir) and, were it
        # reachable, SO_PEERCRED would refuse
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(5)
            sock.connect(os.path.join(prog.directory, P.SOCKET_NAME))
            P.client_handshake(sock, authkey)
            out["connect"] = "connected"
        except (OSError, P.ProtocolError) as exc:
            out["connect"] = type(exc).__name__
        for n in names:
            try:
                os.open(os.path.join(prog.directory, n), os.O_RDONLY)
                out["open"] = "opened"
            except OSError as exc:
                out["open"] = type(exc).__name__
        try:
            os.listdir(prog.directory)
            out["list"] = "listed"
        except OSError as exc:
            out["list"] = type(exc).__name__
        try:
            shmreduce.loads(data)
            out["loads"] = "loaded"
        except shmreduce.SharingError:
            out["loads"] = "SharingError"
        except Exception as exc:  # noqa: BLE001
            out["loads"] = type(exc).__name__
        return out

    status, out = run_in_child(as_nobody)
    assert status == "ok", out
    assert out["connect"] == "PermissionError", out
    assert out["list"] == "PermissionError", out
    assert out.get("open", "PermissionError") == "PermissionError", out
    assert out["loads"] == "SharingError", out
    # the message is still there for the real receiver
    assert run_in_child(lambda: float(shmreduce.loads(data).sum())) == ("ok", 64.0)


def _broker_seen_by_its_user(base: str) -> dict:
    """In a fork child: become uid 65534, start a broker (its launcher, as a sender's
    client would, without an exec: the interpreter may be where uid 65534 cannot run
    it), deposit a memfd, and look at the broker from outside as any other process of
    that user would, reading what ``shmreduce doctor``, death detection and the tests
    read of it."""
    os.environ.pop("SHMREDUCE_BROKER_LOG", None)  # the session's log file is root's: the broker logs to stderr
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    # Dumpable again, as a program the user starts is (the change of uid made it not):
    # else the broker forked below would inherit that, whatever the broker does.
    assert ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) == 0
    directory = os.path.join(base, P.DIR_PREFIX + os.urandom(8).hex())
    assert server.launch(directory, os.getpid(), bytes(mp.current_process().authkey)) == 0
    c = broker_client.BrokerClient(directory, None)
    c.ping()
    broker = c.broker_pid
    fd = os.memfd_create("shmreduce-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    c.segment(fd, header="")  # the broker keeps a descriptor of it
    ino = P.identity(os.fstat(fd))
    os.close(fd)
    full = c.ping(full=True)
    out: dict = {"uid": os.getuid(), "broker": broker, "descriptors": full["descriptors"]}
    try:
        out["listed"] = len(os.listdir(f"/proc/{broker}/fd"))
    except OSError as exc:
        out["listed"] = type(exc).__name__
    opened, refused = 0, set()
    for n in range(full["lowest_free_descriptor"] + 8):
        try:
            os.close(os.open(f"/proc/{broker}/fd/{n}", os.O_RDWR))
            opened += 1
        except OSError as exc:
            refused.add(type(exc).__name__)
    out["opened"], out["refused"] = opened, sorted(refused)
    # What doctor reads: /proc/<pid> owned by the user, its cmdline, its stat (the
    # parent, the state), /proc/net/unix. What death detection uses: a pidfd, signal 0.
    out["owner"] = os.stat(f"/proc/{broker}").st_uid
    with open(f"/proc/{broker}/cmdline", "rb") as f:
        out["cmdline"] = bool(f.read())
    with open(f"/proc/{broker}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    out["state"], out["janitor"] = fields[0], int(fields[1])
    out["connections"] = doctor._connected(os.path.join(directory, P.SOCKET_NAME))
    os.close(os.pidfd_open(broker))
    os.kill(broker, 0)
    c.drop([ino])
    c.close(keep=True)  # the broker exits after its grace
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a program as another, unprivileged user (uid 65534)")
def test_the_brokers_descriptors_are_closed_to_other_processes_of_its_user():
    """A same-user process without the authkey must not open the broker's memfds
    read-write through /proc/<broker>/fd. The broker is not dumpable: its
    /proc/<pid>/fd is closed to every other non-root process of the user, while what
    death detection, the tests and ``shmreduce doctor`` read of it still works, and a
    full ping gives its own count of descriptors."""
    base = tempfile.mkdtemp(prefix="shmrt-nobody-", dir="/dev/shm")
    os.chown(base, 65534, 65534)
    out: dict = {}
    try:
        status, out = run_in_child(_broker_seen_by_its_user, base)
        assert status == "ok", out
        assert out["uid"] == 65534
        assert out["listed"] == "PermissionError", out
        assert out["opened"] == 0 and out["refused"] == ["PermissionError"], out
        assert out["owner"] == 65534 and out["cmdline"] and out["state"] in ("S", "R"), out
        assert out["connections"] == 2 and out["descriptors"] > 0, out
    finally:
        pids = [pid for pid in (out.get("broker"), out.get("janitor")) if pid]
        assert wait_for(lambda: all(gone(pid) for pid in pids), 10), f"broker processes still run: {pids}"
        shutil.rmtree(base, ignore_errors=True)
