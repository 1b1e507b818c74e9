"""Isolation (SPEC 9): only the same program (authkey) and user reach its shared memory.

A process with another authkey is refused by the broker (SharingError); another user
(uid 65534, dropped to in a fork child) can neither connect nor open the program's
files; the program directory is 0700, segment files and the socket 0600.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import stat

import pytest
import torch

import shmreduce
from shmreduce import program
from shmreduce.broker import client as broker_client
from shmreduce.broker import protocol as P

from helpers import forget_mappings, run_in_child

TIMEOUT = 20.0


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
    if strategy == "file_system":
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
