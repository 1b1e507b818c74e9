"""shmreduce.numpy_support: opt-in sharing of large numpy arrays."""

from __future__ import annotations

import gc
import multiprocessing as mp
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import shmreduce
from shmreduce import numpy_support

TIMEOUT = 30
BIG = 1 << 16


@pytest.fixture
def numpy_shared():
    shmreduce.share_numpy(min_nbytes=BIG)
    try:
        yield
    finally:
        shmreduce.unshare_numpy()


def roundtrip(a):
    return shmreduce.loads(shmreduce.dumps(a))


def test_exported_and_reversible():
    assert shmreduce.share_numpy is numpy_support.share_numpy
    assert np.ndarray not in shmreduce.list_reducers()
    shmreduce.share_numpy()
    shmreduce.share_numpy(min_nbytes=10)  # idempotent, updates the threshold
    assert shmreduce.list_reducers()[np.ndarray] is numpy_support.reduce_ndarray
    shmreduce.unshare_numpy()
    shmreduce.unshare_numpy()
    assert np.ndarray not in shmreduce.list_reducers()
    with pytest.raises(ValueError):
        shmreduce.share_numpy(min_nbytes=-1)


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(BIG, dtype=np.float32),
        lambda: np.arange(BIG, dtype=">i8").reshape(256, -1),
        lambda: np.asfortranarray(np.random.default_rng(0).random((300, 200))),
        lambda: np.arange(BIG * 2, dtype=np.float64)[::2],
        lambda: np.zeros(BIG, dtype=[("a", "<i4"), ("b", "<f8")]),
        lambda: np.arange(BIG).astype("datetime64[s]"),
        lambda: np.array(["abcd"] * BIG, dtype="U4"),
        lambda: np.ones(BIG, dtype=bool),
        lambda: np.full(BIG, np.nan, dtype=np.float16),
    ],
)
def test_roundtrip_faithful_and_shared(numpy_shared, make):
    a = make()
    before = shmreduce.stats()["storages_shared"]
    b = roundtrip(a)
    assert shmreduce.stats()["storages_shared"] == before + 1
    assert type(b) is np.ndarray and b.dtype == a.dtype and b.shape == a.shape
    assert b.tobytes() == a.tobytes()
    if a.flags.f_contiguous and not a.flags.c_contiguous:
        assert b.flags.f_contiguous
    assert b.flags.writeable
    del b
    gc.collect()


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(10, dtype=np.float32),  # below threshold
        lambda: np.array([object()] * BIG, dtype=object),  # objects
        lambda: np.zeros(0),
        lambda: np.zeros(BIG).view(np.recarray),  # a subclass
    ],
)
def test_fallback_pickles_by_value(numpy_shared, make):
    a = make()
    before = shmreduce.stats()["storages_shared"]
    b = roundtrip(a)
    assert shmreduce.stats()["storages_shared"] == before
    assert type(b) is type(a) and b.shape == a.shape and b.dtype == a.dtype


def test_received_array_is_forwarded_without_copy(numpy_shared):
    b = roundtrip(np.ones(BIG))
    before = shmreduce.stats()
    c = roundtrip(b)
    after = shmreduce.stats()
    assert after["storages_shared"] == before["storages_shared"]  # no new segment
    assert after["storages_reused"] > before["storages_reused"]
    c[0] = 42.0
    assert b[0] == 42.0  # same memory
    del b, c
    gc.collect()


def test_not_shared_without_opt_in(strategy):
    a = np.ones(BIG * 4)
    before = shmreduce.stats()["storages_shared"]
    b = pickle.loads(ForkingPickler.dumps(a))
    assert shmreduce.stats()["storages_shared"] == before and np.array_equal(a, b)


def _child(q_in, q_out):
    a = q_in.get(timeout=TIMEOUT)
    a *= 2  # writes into the shared segment
    q_out.put(a)  # sent back without a copy


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_between_processes(strategy, numpy_shared, method):
    ctx = mp.get_context(method)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_child, args=(q_in, q_out))
    p.start()
    try:
        a = np.arange(BIG, dtype=np.float64)
        q_in.put(a)
        back = q_out.get(timeout=TIMEOUT)
    finally:
        p.join(TIMEOUT)
    assert p.exitcode == 0
    assert np.array_equal(back, np.arange(BIG, dtype=np.float64) * 2)
    # a copy at send time: the sender's own array is not aliased
    assert np.array_equal(a, np.arange(BIG, dtype=np.float64))
    if method == "fork":
        # share_numpy is inherited by a forked child: the reply came back over the
        # same segment (spawn children must call share_numpy() themselves).
        assert shmreduce.stats()["storages_received"] >= 1
    for q in (q_in, q_out):
        q.close()
        q.join_thread()
    del back
    gc.collect()
