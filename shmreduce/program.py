"""The program identity: which broker and directory this process's shares go to.

A *program* is a process that shares first (its *root*) and every process it
starts: they share one broker and one directory. The identity is created lazily,
inherited by forked children through memory and by spawn/forkserver children
through ``registry``'s process-config hook.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from typing import NamedTuple

from shmreduce.broker.protocol import DIR_PREFIX

DEFAULT_SHM_BASE = "/dev/shm"


class Program(NamedTuple):
    directory: str
    root_pid: int


_current: Program | None = None


def shm_base() -> str:
    """Where program directories live: $SHMREDUCE_SHM_DIR, else /dev/shm, else the temp dir."""
    base = os.environ.get("SHMREDUCE_SHM_DIR")
    if base:
        return os.path.abspath(base)
    if os.path.isdir(DEFAULT_SHM_BASE) and os.access(DEFAULT_SHM_BASE, os.W_OK | os.X_OK):
        return DEFAULT_SHM_BASE
    return tempfile.gettempdir()


def current() -> Program:
    global _current
    if _current is None:
        token = secrets.token_hex(8)
        _current = Program(os.path.join(shm_base(), f"{DIR_PREFIX}{token}"), os.getpid())
    return _current


def peek() -> Program | None:
    return _current


def adopt(program: Program | None) -> None:
    global _current
    _current = program
