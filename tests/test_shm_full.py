"""A full file_system mount recovers once the tensors that filled it are dropped
(issue 11, item 17): a file creation that finds no room releases the files of dead
storages first, rather than failing until some later share happens to purge them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import wait_for

CHILD = textwrap.dedent(
    """
    import gc, sys
    import torch, shmreduce
    shmreduce.register(strategy="file_system")
    for i in range(40):  # 10 MiB through a 2 MiB mount, 256 KiB at a time
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
    mnt = tmp_path / "shm"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=1777", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield str(mnt)
    finally:
        assert wait_for(lambda: not os.listdir(mnt), 15), os.listdir(mnt)
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_a_full_file_system_mount_recovers_once_tensors_are_dropped(tiny_mount):
    env = dict(os.environ, SHMREDUCE_SHM_DIR=tiny_mount)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
