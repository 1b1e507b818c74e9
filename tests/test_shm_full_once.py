"""A full file_system mount is one exception with its cause chained once, not
``OutOfSharedMemory`` raised twice inside ``pool.place`` (dozens of lines per failed
send, "During handling of the above exception, another exception occurred"
included): the second try runs outside the first one's handler (``pool.twice``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import small_mount

CHILD = textwrap.dedent(
    """
    import torch, shmreduce
    shmreduce.register(strategy="file_system")
    keep = [torch.zeros(1 << 16) for _ in range(12)]  # 3 MiB into a 2 MiB mount
    try:
        shmreduce.dumps(keep)
    except shmreduce.SharingError as exc:
        chain, e = [], exc
        while e is not None:
            chain.append(type(e).__name__)
            e = e.__cause__ or e.__context__
        print(" ".join(chain))
    """
)


@pytest.fixture
def tiny_mount(tmp_path):
    with small_mount(tmp_path / "shm", "2m") as mnt:
        yield mnt


@pytest.mark.swap_path
def test_a_full_mount_is_one_out_of_shared_memory_with_its_cause_once(tiny_mount):
    env = dict(os.environ, SHMREDUCE_SHM_DIR=tiny_mount)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["OutOfSharedMemory", "OSError"], done.stdout
