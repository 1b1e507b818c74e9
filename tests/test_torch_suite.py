"""Checks of torch's own test/test_multiprocessing.py (CPU) that shmreduce must pass
with register() in effect, reproduced here rather than vendored.

Left out on purpose: ``test_fs`` looks for torch's own ``/dev/shm/torch_<pid>*``
file names, which shmreduce's file_system strategy does not make (its files live in
a private ``shmreduce-<id>/`` directory).
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

TIMEOUT = 30
CTX = mp.get_context("fork")


def _requires_grad_in_child(queue) -> None:
    queue.put(queue.get().requires_grad)


def test_non_leaf_variable_sharing_refused_in_torchs_words(strategy):
    """torch's test_non_leaf_variable_sharing matches ``requires_grad``; the message
    says to call detach(), and the detached tensor then goes through."""
    var = torch.arange(1.0, 26).view(5, 5).requires_grad_(True) * 2
    queue = CTX.SimpleQueue()  # put() pickles in this thread, so the error is ours to catch
    try:
        with pytest.raises(RuntimeError, match=r"requires_grad") as refused:
            queue.put(var)
        assert "detach()" in str(refused.value)
        proc = CTX.Process(target=_requires_grad_in_child, args=(queue,))
        proc.start()
        try:
            queue.put(var.detach())
            proc.join(TIMEOUT)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join()
        assert proc.exitcode == 0
        assert queue.get() is False
    finally:
        queue.close()
