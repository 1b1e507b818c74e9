"""cloudpickle: shmreduce.dumps/loads as a custom transport, and register(cloudpickle=True)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import struct
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

import shmreduce

TIMEOUT = 30


# -- dumps / loads over a raw pipe ------------------------------------------------------


def _read_exact(fd: int, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        assert chunk, "pipe closed early"
        buf += chunk
    return buf


def _pipe_child(r: int, w: int) -> None:
    # A forked child must not use the OpenMP pool the parent already started (GNU
    # OpenMP hangs after fork): keep torch single-threaded here, as DataLoader workers do.
    torch.set_num_threads(1)
    (n,) = struct.unpack("!Q", _read_exact(r, 8))
    msg = shmreduce.loads(_read_exact(r, n))
    msg["t"].copy_(msg["fn"](msg["t"]))
    offset = 10.0
    data = shmreduce.dumps({"made": torch.arange(5.0), "fn": lambda x: x + offset})
    os.write(w, struct.pack("!Q", len(data)) + data)


def test_dumps_loads_over_os_pipe_both_directions(strategy):
    ctx = mp.get_context("fork")
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    p = ctx.Process(target=_pipe_child, args=(to_child_r, to_parent_w))
    p.start()
    os.close(to_child_r)
    os.close(to_parent_w)
    try:
        t = torch.ones(100_000)
        k = 3.0
        data = shmreduce.dumps({"t": t, "fn": lambda x: x * k})
        assert len(data) < 2000  # the 400 KB tensor is shared, not in the bytes
        os.write(to_child_w, struct.pack("!Q", len(data)) + data)
        (n,) = struct.unpack("!Q", _read_exact(to_parent_r, 8))
        reply = shmreduce.loads(_read_exact(to_parent_r, n))
    finally:
        p.join(TIMEOUT)
        os.close(to_child_w)
        os.close(to_parent_r)
    assert p.exitcode == 0
    assert torch.equal(t, torch.full((100_000,), 3.0)), "child's write not seen"
    assert torch.equal(reply["fn"](reply["made"]), torch.arange(5.0) + 10) and reply["made"].is_shared()
    del reply, t
    gc.collect()


def test_dumps_loads_work_unregistered():
    assert not shmreduce.is_registered()
    scale = 2
    data = shmreduce.dumps({"fn": lambda x: x * scale, "t": torch.arange(4)})
    got = shmreduce.loads(data)
    assert torch.equal(got["fn"](got["t"]), torch.arange(4) * 2)
    del got
    gc.collect()


# -- register(cloudpickle=True) through mp.Queue ----------------------------------------


def _apply_child(q_in, q_out) -> None:
    fn, t = q_in.get(timeout=TIMEOUT)
    base = float(t.sum())

    class Result:  # a local class, only picklable by value
        def __init__(self, v):
            self.v = v

    q_out.put((Result(fn(t)), lambda: base))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_cloudpickle_queue_lambdas_closures_local_classes(method):
    shmreduce.register(strategy="file_descriptor", cloudpickle=True)
    try:
        ctx = mp.get_context(method)
        q_in, q_out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_apply_child, args=(q_in, q_out))
        p.start()
        try:
            offset = 5.0

            def closure(x):
                return x + offset

            q_in.put((closure, torch.ones(8)))
            result, getter = q_out.get(timeout=TIMEOUT)
        finally:
            p.join(TIMEOUT)
        assert p.exitcode == 0
        assert type(result).__name__ == "Result" and torch.equal(result.v, torch.full((8,), 6.0))
        assert result.v.is_shared() and getter() == 8.0
        for q in (q_in, q_out):
            q.close()
            q.join_thread()
        del result
    finally:
        shmreduce.unregister()
    gc.collect()


def test_cloudpickle_pipe_send_lambda():
    with shmreduce.registered():
        shmreduce.register(cloudpickle=True)
        a, b = mp.Pipe()
        try:
            a.send(lambda: 42)
            assert b.recv()() == 42
        finally:
            a.close()
            b.close()


def test_cloudpickle_is_opt_in_and_undone_by_unregister():
    with shmreduce.registered():
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            ForkingPickler.dumps(lambda: 1)
    shmreduce.register(cloudpickle=True)
    try:
        assert pickle.loads(ForkingPickler.dumps(lambda: 1))() == 1
    finally:
        shmreduce.unregister()
    assert not shmreduce.is_registered()
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        ForkingPickler.dumps(lambda: 1)
    # register() again without the flag does not bring cloudpickle back
    with shmreduce.registered():
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            ForkingPickler.dumps(lambda: 1)
