"""register_reducer with user types: MRO dispatch, removal, and real processes."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import cast

import pytest
import torch

import shmreduce

TIMEOUT = 30
# Stands in for a tensor where a test must pickle none (see the comments where it is used).
NO_TENSOR = cast(torch.Tensor, 0)


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    lock: threading.Lock = field(default_factory=threading.Lock)  # not picklable


@dataclass
class WeightedBatch(Batch):
    pass


@dataclass
class SpecialBatch(WeightedBatch):
    pass


calls: list[str] = []


def rebuild_batch(cls, x, y):
    return cls(x=x, y=y)


def reduce_batch(b):
    calls.append("batch")
    return rebuild_batch, (type(b), b.x, b.y)


def reduce_special(b):
    calls.append("special")
    return rebuild_batch, (type(b), b.x, b.y)


@pytest.fixture
def batch_reducer():
    calls.clear()
    shmreduce.register_reducer(Batch, reduce_batch)
    try:
        yield
    finally:
        for cls in list(shmreduce.list_reducers()):
            if cls in (Batch, SpecialBatch):
                shmreduce.unregister_reducer(cls)


def roundtrip(obj):
    return shmreduce.loads(shmreduce.dumps(obj))


def test_subclass_dispatch_nearest_wins(batch_reducer):
    b = roundtrip(WeightedBatch(torch.ones(2), torch.zeros(2)))
    assert type(b) is WeightedBatch and calls == ["batch"]
    shmreduce.register_reducer(SpecialBatch, reduce_special)
    calls.clear()
    roundtrip(SpecialBatch(torch.ones(2), torch.zeros(2)))
    roundtrip(WeightedBatch(torch.ones(2), torch.zeros(2)))
    assert calls == ["special", "batch"]
    shmreduce.unregister_reducer(SpecialBatch)
    calls.clear()
    roundtrip(SpecialBatch(torch.ones(2), torch.zeros(2)))
    assert calls == ["batch"]
    gc.collect()


def test_subclass_dispatch_through_forking_pickler(strategy, batch_reducer):
    s = SpecialBatch(torch.arange(3.0), torch.ones(3))
    got = pickle.loads(ForkingPickler.dumps(s))
    assert type(got) is SpecialBatch and calls == ["batch"] and torch.equal(got.x, s.x)
    del got
    gc.collect()


def test_removal_restores_default_pickling(strategy):
    shmreduce.register_reducer(Batch, reduce_batch)
    assert shmreduce.list_reducers()[Batch] is reduce_batch
    shmreduce.unregister_reducer(Batch)
    assert Batch not in shmreduce.list_reducers()
    with pytest.raises(KeyError):
        shmreduce.unregister_reducer(Batch)
    # Without the reducer the lock makes the dataclass unpicklable again. (No tensors
    # inside: see test_failed_pickle_under_file_system_lets_broker_exit.)
    with pytest.raises(TypeError):
        ForkingPickler.dumps(Batch(NO_TENSOR, NO_TENSOR))
    with pytest.raises(TypeError):
        shmreduce.dumps(WeightedBatch(NO_TENSOR, NO_TENSOR))


def test_reducer_registered_before_register_applies_after(batch_reducer):
    with shmreduce.registered():
        got = pickle.loads(ForkingPickler.dumps(WeightedBatch(torch.ones(2), torch.ones(2))))
        assert type(got) is WeightedBatch
    # unregister() took the reducer out of ForkingPickler, but it stays in the table
    # (no tensors here: unregistered, torch's fd reducer would start resource_sharer)
    assert Batch in shmreduce.list_reducers()
    with pytest.raises(TypeError):
        ForkingPickler.dumps(Batch(NO_TENSOR, NO_TENSOR))
    del got
    gc.collect()


def _child(q_in, q_out):
    b = q_in.get(timeout=TIMEOUT)
    b.x.add_(1)  # shared with the parent
    q_out.put(SpecialBatch(x=b.x * 10, y=b.y))  # child -> parent through the (forked) reducer


def test_custom_type_between_processes(strategy, batch_reducer):
    ctx = mp.get_context("fork")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_child, args=(q_in, q_out))
    p.start()
    try:
        b = WeightedBatch(torch.zeros(4), torch.ones(4))
        q_in.put(b)
        back = q_out.get(timeout=TIMEOUT)
    finally:
        p.join(TIMEOUT)
    assert p.exitcode == 0
    assert torch.equal(b.x, torch.ones(4)), "child's in-place write not seen"
    assert type(back) is SpecialBatch and torch.equal(back.x, torch.full((4,), 10.0)) and back.x.is_shared()
    for q in (q_in, q_out):
        q.close()
        q.join_thread()
    del back, b
    gc.collect()


_FAILED_PICKLE = r"""
import gc, os, sys, threading, time
import torch, shmreduce
from multiprocessing.reduction import ForkingPickler
from shmreduce.broker import client
sys.path.insert(0, sys.argv[1])
from helpers import broker_pids, wait_for
shmreduce.register(strategy="file_system")
try:
    ForkingPickler.dumps({"t": torch.ones(4), "lock": threading.Lock()})
except TypeError:
    pass
gc.collect()
shmreduce.unregister()
client.close_all()
ok = wait_for(lambda: not broker_pids(), timeout=5)
print("broker exited" if ok else f"broker still running: {broker_pids()}")
sys.exit(0 if ok else 1)
"""


def test_failed_pickle_under_file_system_lets_broker_exit():
    # In a fresh interpreter (with its own shm dir under ours) so a stuck broker cannot
    # fail this module's leak check; it goes away when that interpreter exits.
    proc = subprocess.run(
        [sys.executable, "-c", _FAILED_PICKLE, os.path.dirname(os.path.abspath(__file__))],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
