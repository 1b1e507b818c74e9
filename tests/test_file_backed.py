"""A storage mapped from a file (``from_file(shared=True)``) is never detached
from its file silently: sending it is refused with SharingError."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

import shmreduce
from shmreduce import SharingError

CTX = mp.get_context("fork")


def _put(q, t):
    q.put(t)


def test_sending_a_file_backed_tensor_is_refused_and_it_keeps_writing_to_its_file(strategy, tmp_path):
    path = tmp_path / "weights.bin"
    t = torch.from_file(str(path), shared=True, size=256, dtype=torch.float32)
    t.fill_(1.0)
    with pytest.raises(SharingError, match="from_file"):
        shmreduce.dumps(t)
    # A queue's feeder thread reports it the same way, and the tensor still writes
    # to its file: nothing moved it.
    r, w = CTX.Pipe(duplex=False)
    with pytest.raises(SharingError, match="detach it from its file"):
        w.send(t)
    r.close()
    w.close()
    t.fill_(3.0)
    on_disk = torch.from_file(str(path), shared=False, size=256, dtype=torch.float32)
    assert on_disk.eq(3.0).all()
    assert t.untyped_storage().filename == str(path)


def test_share_memory_of_a_file_backed_tensor_keeps_its_file(strategy, tmp_path):
    # torch's share_memory_ is a no-op for a storage already shared: it stays on its file.
    path = tmp_path / "state.bin"
    t = torch.from_file(str(path), shared=True, size=16, dtype=torch.float32)
    t.share_memory_()
    t.fill_(5.0)
    assert torch.from_file(str(path), shared=False, size=16, dtype=torch.float32).eq(5.0).all()
