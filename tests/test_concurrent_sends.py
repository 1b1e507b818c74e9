"""One tensor pickled by several threads at once moves into shared memory
exactly once; every receiver gets its bytes and aliases it.

`for q in queues: q.put(t)` makes each queue's feeder thread pickle `t` at the same
time: the move into shared memory must be synchronised per storage, as torch does
(`torch/storage.py`, `_share_memory_lock_protected`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
import time

import pytest
import torch

import shmreduce

CTX = mp.get_context("fork")
ROUNDS = 8
NUMEL = 1 << 18  # 1 MiB of float32: pwrite of it releases the GIL long enough to race


def _check_and_mark(inbox, outbox, index):
    """Receive tensors; check each one's bytes, write -1 at *index*, report."""
    torch.set_num_threads(1)
    while True:
        item = inbox.get(timeout=60)
        if item is None:
            return
        tag, t = item
        expected = torch.arange(NUMEL, dtype=torch.float32) + tag
        ok = bool(torch.equal(t[4:], expected[4:]))  # t[:4]: the receivers' writes
        t[index] = -1.0  # seen by the parent only if we alias its memory
        outbox.put((tag, index, ok))


def _run_rounds(queues, outbox, rounds):
    seen = []
    for tag in range(rounds):
        t = torch.arange(NUMEL, dtype=torch.float32) + tag
        for q in queues:
            q.put((tag, t))  # every feeder thread pickles t at once
        reports = [outbox.get(timeout=60) for _ in queues]
        assert all(ok for _tag, _i, ok in reports), f"round {tag}: a receiver saw wrong bytes: {reports}"
        seen.append(sum(1 for i in range(len(queues)) if t[i].item() == -1.0))
    return seen


def test_one_tensor_on_several_queues_moves_once_and_every_write_is_seen(strategy):
    queues = [CTX.Queue() for _ in range(4)]
    outbox = CTX.Queue()
    procs = [CTX.Process(target=_check_and_mark, args=(q, outbox, i)) for i, q in enumerate(queues)]
    for p in procs:
        p.start()
    try:
        before = shmreduce.stats()
        seen = _run_rounds(queues, outbox, ROUNDS)
        after = shmreduce.stats()
    finally:
        for q in queues:
            q.put(None)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert seen == [len(queues)] * ROUNDS  # every child's in-place write reached us
    assert after["storages_shared"] - before["storages_shared"] == ROUNDS  # moved once each
    assert all(p.exitcode == 0 for p in procs)


def test_share_memory_and_pickling_race_to_one_move(strategy):
    # share_memory_() takes the same per-storage path as a pickling thread.
    from multiprocessing.reduction import ForkingPickler

    def pickle_it(t: torch.Tensor, start: threading.Barrier, datas: list[bytes]) -> None:
        start.wait(5)
        datas.append(bytes(ForkingPickler.dumps(t)))

    def share_it(t: torch.Tensor, start: threading.Barrier, datas: list[bytes]) -> None:
        start.wait(5)
        t.share_memory_()

    for _ in range(20):
        t = torch.arange(NUMEL, dtype=torch.float32)
        start = threading.Barrier(3)
        datas: list[bytes] = []
        threads = [threading.Thread(target=f, args=(t, start, datas)) for f in (pickle_it, pickle_it, share_it)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert len(datas) == 2 and t.is_shared()
        expected = torch.arange(NUMEL, dtype=torch.float32)
        assert torch.equal(t, expected)
        for data in datas:
            out = ForkingPickler.loads(data)
            assert out.untyped_storage()._cdata == t.untyped_storage()._cdata  # one storage


def _first_share_in_threads(directory_env, count):
    """In a fresh program (its own broker): *count* threads make their first share at once."""
    os.environ["SHMREDUCE_SHM_DIR"] = directory_env
    shmreduce.register(strategy="file_system")
    start = threading.Barrier(count)
    results: list = [None] * count

    def one(i):
        start.wait(5)
        results[i] = shmreduce.dumps(torch.full((1024,), float(i)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return results


def _load_all(datas):
    return [float(shmreduce.loads(d).sum()) for d in datas]


def test_first_shares_from_several_threads_at_once_keep_their_files(tmp_path):
    # file_system start-up: threads that find no connection must not close each
    # other's fresh connections (which drops their holds: the files go).
    from helpers import run_in_child

    base = os.environ["SHMREDUCE_SHM_DIR"]
    for _ in range(6):

        def make_and_load():
            datas = _first_share_in_threads(base, 4)
            time.sleep(0.3)  # let the broker read every record
            values = _load_all(datas)
            shmreduce.unregister()
            from shmreduce.broker import client

            client.close_all()
            return values

        status, values = run_in_child(make_and_load, timeout=60)
        assert status == "ok", values
        assert values == [1024.0 * i for i in range(4)]


# -- the stress test ------------------------------------------------------------------


STRESS_SECONDS = float(os.environ.get("SHMREDUCE_STRESS_SECONDS", "4"))


HEADER = 4  # one counter per consumer: t[i] counts consumer i's receipts of t


def _stress_consumer(inbox, outbox, index):
    torch.set_num_threads(1)
    received = 0
    while True:
        item = inbox.get(timeout=60)
        if item is None:
            outbox.put(("done", index, received))
            return
        for tag, t in item:
            if not torch.equal(t[HEADER:], torch.full((t.numel() - HEADER,), float(tag))):
                outbox.put(("bad", index, tag))
            t[index] += 1.0  # in place, and only this process writes element *index*
            received += 1


def test_stress_threads_and_queues_with_overlapping_tensors(strategy):
    """8 sender threads, 4 queues, overlapping sets of tensors: every byte checked,
    every in-place write seen (exact counts), nothing left behind (the module's
    leak check)."""
    rng = random.Random(11)
    sizes = [64, 1000, 64 << 10, 300 << 10]
    pool = [torch.full((rng.choice(sizes) // 4,), float(tag)) for tag in range(24)]
    for t in pool:
        t[:HEADER] = 0.0
    queues = [CTX.Queue(maxsize=16) for _ in range(HEADER)]
    outbox = CTX.Queue()
    procs = [CTX.Process(target=_stress_consumer, args=(q, outbox, i)) for i, q in enumerate(queues)]
    for p in procs:
        p.start()
    sent = [[0] * len(queues) for _ in pool]
    lock = threading.Lock()
    deadline = time.monotonic() + STRESS_SECONDS

    # At most 9,000 messages: the small tensors share one slab generation, whose header
    # counts the first loads of 32,256 refs exactly; past that it is retired and its
    # memfd kept SHMREDUCE_ORPHAN_TTL seconds (docs/limits.md), longer than the module's
    # leak check waits.
    messages = [0]

    def sender(seed):
        r = random.Random(seed)
        while time.monotonic() < deadline:
            tags = r.sample(range(len(pool)), 3)
            index = r.randrange(len(queues))
            with lock:  # counted before the put: a consumer may write back at once
                if messages[0] >= 9000:
                    return
                messages[0] += 1
                for tag in tags:
                    sent[tag][index] += 1
            queues[index].put([(tag, pool[tag]) for tag in tags], timeout=30)

    threads = [threading.Thread(target=sender, args=(s,)) for s in range(8)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(STRESS_SECONDS + 60)
        for q in queues:
            q.put(None)
        reports = [outbox.get(timeout=60) for _ in queues]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert all(kind == "done" for kind, _i, _n in reports), reports
    assert sum(n for _k, _i, n in reports) == sum(map(sum, sent))
    for tag, t in enumerate(pool):
        assert t[:HEADER].tolist() == [float(n) for n in sent[tag]], f"tensor {tag}: writes lost"
        assert torch.equal(t[HEADER:], torch.full((t.numel() - HEADER,), float(tag)))
    assert all(p.exitcode == 0 for p in procs)


def test_a_64_kib_storage_pickled_by_two_threads_at_once_keeps_its_bytes(strategy):
    # A storage of exactly SLAB_ITEM_MAX bytes: the Python path copies it with the GIL
    # released, while reduce() in C, in the other thread, could swap the same storage
    # into its slab and free the memory under the copy (make asan would read the freed
    # memory).
    from multiprocessing.reduction import ForkingPickler

    from shmreduce.pool import SLAB_ITEM_MAX

    numel = SLAB_ITEM_MAX // 4
    for round_ in range(40):
        t = torch.arange(numel, dtype=torch.float32) + round_
        blobs: list[bytes] = []
        barrier = threading.Barrier(2)

        def pickle_it(t: torch.Tensor, blobs: list[bytes], barrier: threading.Barrier) -> None:
            barrier.wait(10)
            blobs.append(bytes(ForkingPickler.dumps(t)))

        threads = [threading.Thread(target=pickle_it, args=(t, blobs, barrier)) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert len(blobs) == 2
        expected = torch.arange(numel, dtype=torch.float32) + round_
        for blob in blobs:
            got = ForkingPickler.loads(blob)
            assert torch.equal(got, expected), round_
            assert got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


@pytest.mark.swap_path
def test_a_send_from_a_finalizer_inside_another_send_gets_a_place_of_its_own(strategy):
    # The C fast path moved its slab's cursor only after torch's importer had run, and
    # a collection there can run finalizers that send: the nested send took the same
    # place, its bytes overwrote the outer storage's, and both were sent from one
    # offset. A send nested at every collection of an outer send, in turn: each
    # storage keeps its own bytes and place.
    import gc
    from multiprocessing.reduction import ForkingPickler

    ForkingPickler.loads(ForkingPickler.dumps(torch.zeros(16)))  # this thread's slab exists, indexed: the fast path
    for nth in range(12):
        outer = torch.full((256,), 1, dtype=torch.uint8)
        inner = torch.full((256,), 2, dtype=torch.uint8)
        seen = [0]
        nested: list[bytes] = []

        def send_inner(
            phase: str, _info: dict, seen: list[int] = seen, nested: list[bytes] = nested, nth: int = nth, inner: torch.Tensor = inner
        ) -> None:
            if phase == "start" and not nested:
                seen[0] += 1
                if seen[0] > nth:
                    nested.append(bytes(ForkingPickler.dumps(inner)))

        threshold = gc.get_threshold()
        gc.callbacks.append(send_inner)
        gc.set_threshold(1)
        try:
            blob = bytes(ForkingPickler.dumps(outer))
        finally:
            gc.set_threshold(*threshold)
            gc.callbacks.remove(send_inner)
        assert torch.equal(ForkingPickler.loads(blob), outer), nth  # every message is loaded: none is left in flight
        if not nested:
            break  # fewer collections than nth in one send: every one was tried
        assert outer.untyped_storage().data_ptr() != inner.untyped_storage().data_ptr(), nth
        assert torch.equal(outer, torch.full((256,), 1, dtype=torch.uint8)), nth
        assert torch.equal(inner, torch.full((256,), 2, dtype=torch.uint8)), nth
        assert torch.equal(ForkingPickler.loads(nested[0]), inner), nth
    else:
        raise AssertionError("a send made more than 12 collections: raise the bound")
