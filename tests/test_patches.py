"""shmreduce.patches: every patch on torch and multiprocessing comes and goes with
register()/unregister(), and "is_shared() is true => share_memory_() keeps the memory"
holds registered and unregistered."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys

import pytest
import torch

import shmreduce

TIMEOUT = 30
CTX = mp.get_context("fork")

# Run in a fresh interpreter: the originals are recorded before shmreduce does anything.
_ROUND_TRIPS = r"""
import torch, shmreduce
from multiprocessing.reduction import ForkingPickler

NAMES = ("is_shared", "share_memory_", "_new_shared")


def snapshot():
    return (
        {name: torch.UntypedStorage.__dict__.get(name) for name in NAMES},
        torch.UntypedStorage.is_shared,
        ForkingPickler.__dict__["dumps"],
        ForkingPickler.__dict__["loads"],
        dict(ForkingPickler._extra_reducers),
        dict(__import__("multiprocessing").current_process()._config),
        torch.set_num_threads,
    )


import torch.multiprocessing  # torch's own reducers, as register() would find them
before = snapshot()
assert torch.UntypedStorage.is_shared is torch._C.StorageBase.is_shared
for strategy in ("file_descriptor", "file_system"):
    shmreduce.set_sharing_strategy(strategy)
    t = torch.arange(8.0)
    out = shmreduce.loads(shmreduce.dumps(t))
    assert torch.equal(out, t)
    assert snapshot() == before, f"a bare dumps/loads ({strategy}) patched something"
    shmreduce.register()
    assert snapshot() != before
    s = torch.arange(8.0)
    s.share_memory_()
    assert s.is_shared()
    shmreduce.unregister()
    assert snapshot() == before, f"unregister() ({strategy}) left a patch"
    assert torch.UntypedStorage.is_shared is torch._C.StorageBase.is_shared
    del t, out, s
print("ok")
"""


def test_patches_come_only_with_register_and_go_with_unregister():
    done = subprocess.run([sys.executable, "-c", _ROUND_TRIPS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def _sender(conn) -> None:
    """Send a tensor, keep it; write it in place when told to."""
    t = torch.arange(16.0)
    conn.send(t)
    if conn.poll(TIMEOUT) and conn.recv() == "write":
        t.fill_(7)
        conn.send("done")
    conn.close()


def _check_invariant(torch_strategy: str | None) -> bool:
    """Receive a tensor from a forked sender (unregister first if *torch_strategy*,
    then set it); if the tensor is_shared(), share_memory_() it and check that the
    sender's later in-place write is still seen. Returns is_shared()."""
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_sender, args=(child,))
    proc.start()
    child.close()
    try:
        assert parent.poll(TIMEOUT), "sender did not send"
        received = parent.recv()
        if torch_strategy is not None:
            shmreduce.unregister()
            torch.multiprocessing.set_sharing_strategy(torch_strategy)
        shared = received.is_shared()
        if shared:
            received.share_memory_()
        parent.send("write")
        assert parent.poll(TIMEOUT) and parent.recv() == "done"
    finally:
        parent.close()
        proc.join(TIMEOUT)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert proc.exitcode == 0
    if shared:
        assert received.eq(7).all(), "is_shared() was true, yet share_memory_() moved the memory"
    return shared


def test_is_shared_implies_share_memory_keeps_memory_while_registered(strategy):
    assert _check_invariant(None)  # a received storage reports is_shared()


# Both of our strategies' storages are views of pooled segments: once unregistered,
# torch sees private memory (is_shared() false), so the invariant holds trivially.
# Not here: torch's own file_system share_memory_, which starts torch_shm_manager and
# leaves its socket open in this process.
@pytest.mark.parametrize(
    "ours, torchs",
    [("file_descriptor", "file_descriptor"), ("file_descriptor", "file_system"), ("file_system", "file_descriptor")],
)
def test_is_shared_implies_share_memory_keeps_memory_after_unregister(ours, torchs):
    """Sent under shmreduce's strategy *ours*, then share_memory_() by torch under *torchs*."""
    with shmreduce.registered(strategy=ours):
        shared = _check_invariant(torchs)
    assert not shared  # a view of a pooled segment is private memory to torch
