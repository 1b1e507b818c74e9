"""A full file_system mount recovers once the tensors that filled it are dropped:
a file creation that finds no room releases the files of dead
storages first, rather than failing until some later share happens to purge them.
A full mount met while writing a new segment's header is the same OutOfSharedMemory,
after the same one retry."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import shmreduce
from shmreduce import program, transfer
from shmreduce.broker import client as broker_client
from shmreduce.errors import OutOfSharedMemory

from helpers import seg_files, small_mount, wait_for

CHILD = textwrap.dedent(
    """
    import gc, sys
    import torch, shmreduce
    from shmreduce import _platform
    _platform.populating = sys.argv[1] == "populate"  # the other path: posix_fallocate
    shmreduce.register(strategy="file_system")
    for i in range(40):  # 10 MiB through a 2 MiB mount, 256 KiB at a time (in an arena until it is full)
        t = torch.full((1 << 16,), float(i))
        out = shmreduce.loads(shmreduce.dumps(t))
        assert out[0].item() == float(i)
        del t, out
    # and a full mount is still a SharingError that says what to do
    keep = [torch.zeros(1 << 16) for _ in range(12)]
    try:
        shmreduce.dumps(keep)
    except shmreduce.SharingError as exc:
        assert "SHMREDUCE_SHM_DIR" in str(exc), exc
    else:
        raise AssertionError("12 x 256 KiB fitted a 2 MiB mount")
    print("ok")
    """
)


@pytest.fixture
def tiny_mount(tmp_path):
    with small_mount(tmp_path / "shm", "2m") as mnt:
        yield mnt


@pytest.mark.swap_path
@pytest.mark.parametrize("allocate", ["populate", "fallocate"])
def test_a_full_file_system_mount_recovers_once_tensors_are_dropped(tiny_mount, allocate):
    # Slabs' and arenas' pages are allocated and mapped in one call
    # (MADV_POPULATE_WRITE), or by posix_fallocate where the kernel cannot: a full
    # mount is a SharingError either way, never a SIGBUS.
    env = dict(os.environ, SHMREDUCE_SHM_DIR=tiny_mount)
    done = subprocess.run([sys.executable, "-c", CHILD, allocate], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


# -- a full mount met while writing a segment's header ----------------------------------


def _fail_header_writes(monkeypatch, times: int) -> list[int]:
    """The next *times* segment header writes (8 bytes at offset 0) of this thread
    find the mount full (the collector thread's writes go through); the failures
    left, as a one-item list."""
    real = os.pwrite
    left = [times]
    me = threading.get_ident()

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        if offset == 0 and len(data) == 8 and left[0] and threading.get_ident() == me:
            left[0] -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return left


BIG = (1 << 16) + 16  # floats: a storage beyond an arena's, in a segment of its own


@pytest.mark.swap_path
def test_a_full_mount_at_a_header_write_is_out_of_shared_memory(monkeypatch):
    with shmreduce.registered(strategy="file_system"):
        _fail_header_writes(monkeypatch, 1 << 30)
        with pytest.raises(OutOfSharedMemory, match="SHMREDUCE_SHM_DIR"):
            shmreduce.dumps(torch.full((BIG,), 1.0))
        monkeypatch.undo()
        assert shmreduce.loads(shmreduce.dumps(torch.full((BIG,), 2.0))).eq(2.0).all()  # the next message works


@pytest.mark.swap_path
def test_a_header_write_that_finds_the_mount_full_is_tried_again_after_letting_go(monkeypatch):
    with shmreduce.registered(strategy="file_system"):
        left = _fail_header_writes(monkeypatch, 1)  # room comes back once dead segments are let go of
        t = torch.full((BIG,), 3.0)
        assert shmreduce.loads(shmreduce.dumps(t)).eq(3.0).all()
        assert left == [0]  # the first header write did fail: this was the retry


@pytest.mark.swap_path
def test_a_segment_whose_header_cannot_be_written_is_not_left_behind(monkeypatch):
    with shmreduce.registered(strategy="file_system"):
        shmreduce.loads(shmreduce.dumps(torch.ones(2)))  # the program directory and its broker
        transfer.let_go()
        directory = program.current().directory
        before = len(seg_files(directory))
        _fail_header_writes(monkeypatch, 1 << 30)
        for _ in range(3):
            with pytest.raises(OutOfSharedMemory):
                shmreduce.dumps(torch.full((BIG,), 1.0))
        monkeypatch.undo()
        transfer.collect()
        broker_client.client_for(program.current().directory).ping()  # barrier: the releases are in
        assert wait_for(lambda: len(seg_files(directory)) <= before, 5.0), (before, seg_files(directory))


@pytest.mark.swap_path
def test_no_memory_at_a_header_write_under_file_descriptor_is_a_sharing_error(monkeypatch):
    with shmreduce.registered(strategy="file_descriptor"):
        _fail_header_writes(monkeypatch, 1 << 30)
        with pytest.raises(shmreduce.SharingError, match="out of memory") as info:
            shmreduce.dumps(torch.full((BIG,), 1.0))
        assert not isinstance(info.value, OutOfSharedMemory)  # not the file_system mount's advice
        monkeypatch.undo()
        assert shmreduce.loads(shmreduce.dumps(torch.full((BIG,), 2.0))).eq(2.0).all()
