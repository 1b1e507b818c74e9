"""multiprocessing.Pool and ProcessPoolExecutor map over tensors, both directions."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

import shmreduce


def double_in_place(t: torch.Tensor) -> float:
    # Parent -> worker: the worker's write lands in the parent's memory.
    t.mul_(2)
    return float(t.sum())


def make_tensor(i: int) -> torch.Tensor:
    # Worker -> parent: a tensor made here arrives shared, not copied.
    return torch.full((256,), float(i))


def worker_stats(_: int) -> tuple:
    return shmreduce.is_registered(), shmreduce.get_sharing_strategy(), os.getpid()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pool_map_both_directions(strategy, method):
    ctx = mp.get_context(method)
    inputs = [torch.full((128,), float(i)) for i in range(8)]
    pool = ctx.Pool(2)
    try:
        assert all(reg and strat == strategy for reg, strat, _ in pool.map(worker_stats, range(4)))
        sums = pool.map(double_in_place, inputs, chunksize=2)
        before = shmreduce.stats()
        outputs = pool.map(make_tensor, range(8))
        after = shmreduce.stats()
    finally:
        pool.close()
        pool.join()
    assert sums == [2.0 * i * 128 for i in range(8)]
    for i, t in enumerate(inputs):
        assert torch.equal(t, torch.full((128,), 2.0 * i)), "worker's in-place write not seen"
    for i, t in enumerate(outputs):
        assert torch.equal(t, torch.full((256,), float(i))) and t.is_shared()
    assert after["storages_received"] - before["storages_received"] >= 8
    del inputs, outputs
    gc.collect()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_process_pool_executor_both_directions(strategy, method):
    inputs = [torch.arange(64, dtype=torch.float64) + i for i in range(6)]
    with ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context(method)) as ex:
        sums = list(ex.map(double_in_place, inputs, timeout=60))
        before = shmreduce.stats()
        outputs = list(ex.map(make_tensor, range(6), timeout=60))
        after = shmreduce.stats()
        futures = [ex.submit(make_tensor, 7) for _ in range(2)]
        extra = [f.result(timeout=60) for f in futures]
    assert sums == [float((torch.arange(64, dtype=torch.float64) + i).sum() * 2) for i in range(6)]
    for i, t in enumerate(inputs):
        assert torch.equal(t, (torch.arange(64, dtype=torch.float64) + i) * 2)
    assert [t[0].item() for t in outputs] == [float(i) for i in range(6)]
    assert all(t.is_shared() and t.shape == (256,) for t in outputs + extra)
    assert after["storages_received"] - before["storages_received"] >= 6
    del inputs, outputs, extra
    gc.collect()
