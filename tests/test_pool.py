"""Recycled pools of shared memory (shmreduce/pool.py), across real processes:
a sender reuses its segments once nobody holds them, never while anyone does (a
receiver, a fork child, a stale handle), within about a second with nothing else sent,
after a receiver was SIGKILLed; the pool cap, idle trim and kept mappings follow their
settings; segment sizes and bounds, unit by unit."""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

import shmreduce
from shmreduce import _native, pool, program, segments, transfer
from shmreduce.cache import cache

from helpers import forget_mappings, let_go_now, run_in_child, wait_for

CTX = mp.get_context("fork")
MIB = 1 << 20
BIG = MIB // 4  # float32 elements of a 1 MiB tensor: a segment of its own
SMALL = 60 * 1024 // 4  # float32 elements of a 60 KiB tensor: packed in a slab
ANSWER = 20.0  # seconds a child has to answer one message


def _pool_stats(strategy: str) -> dict[str, int]:
    """The counters of this process's pool for *strategy*, without their prefix."""
    prefix = "fd_" if strategy == "file_descriptor" else "fs_"
    return {k[len(prefix) :]: v for k, v in transfer.stats().items() if k.startswith(prefix)}


def _connected() -> None:
    """Connect to the broker before the test makes its segments. A connection made
    afresh (after an earlier test's unregister() closed ours) retires the segments
    alive at that moment (transfer._on_connect), and a file_descriptor segment is
    made before the deposit that connects: the first one would never come back."""
    assert bool(shmreduce.loads(shmreduce.dumps(torch.ones(1)))[0] == 1.0)


def _answer(conn: Connection, timeout: float = ANSWER) -> Any:
    assert conn.poll(timeout), "the child did not answer in time"
    return conn.recv()


@contextmanager
def _child(target: Callable[..., None], *args: Any, exitcode: int | None = 0) -> Iterator[tuple[Connection, Any]]:
    """A fork child running target(conn, *args); yields (our end of the pipe, the
    process). Joined (killed if it hangs) on the way out; its exit code checked
    unless *exitcode* is None."""
    ours, theirs = CTX.Pipe()
    proc = CTX.Process(target=target, args=(theirs, *args))
    proc.start()
    theirs.close()
    try:
        yield ours, proc
        proc.join(ANSWER)
        assert not proc.is_alive(), "the child did not exit"
        if exitcode is not None:
            assert proc.exitcode == exitcode
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(ANSWER)
        ours.close()


# -- receivers (fork children) ---------------------------------------------------------
# Each starts with torch.set_num_threads(1): a fork child must not use the OpenMP pool
# the parent already started (GNU OpenMP hangs after fork), as DataLoader workers do.


def _check_and_drop(conn: Connection) -> None:
    """Check each message's values (message i holds i everywhere) and drop it."""
    torch.set_num_threads(1)
    while (msg := conn.recv()) is not None:
        i, tensors = msg
        ok = all(bool((t == float(i)).all()) for t in tensors)
        del msg, tensors
        conn.send(ok)


def _keep_first(conn: Connection) -> None:
    """Keep message 0's big tensor and its first small one, drop the others; at the
    end, say whether the kept ones still hold message 0's values."""
    torch.set_num_threads(1)
    _, first = conn.recv()
    kept_big, kept_small = first[0], first[1]
    del first
    conn.send(True)
    oks = []
    while (msg := conn.recv()) is not None:
        i, tensors = msg
        oks.append(all(bool((t == float(i)).all()) for t in tensors))
        del msg, tensors
        conn.send(True)
    conn.send((all(oks), bool((kept_big == 0.0).all()), bool((kept_small == 0.0).all())))


def _hold_then_drop(conn: Connection, count: int) -> None:
    """Receive *count* tensors, all held at once, then drop them; stay quiet until told."""
    torch.set_num_threads(1)
    held = [conn.recv() for _ in range(count)]
    ok = all(bool((t == float(i)).all()) for i, t in enumerate(held))
    del held
    gc.collect()
    conn.send(ok)
    conn.recv()


def _hold_forever(conn: Connection, count: int) -> None:
    torch.set_num_threads(1)
    held = [conn.recv() for _ in range(count)]
    conn.send(all(bool((t == float(i)).all()) for i, t in enumerate(held)))
    conn.recv()  # until killed


def _message(i: int, smalls: int = 0) -> tuple[int, list[torch.Tensor]]:
    """Message *i*: a 1 MiB tensor and *smalls* 60 KiB ones, all holding i."""
    return i, [torch.full((BIG,), float(i))] + [torch.full((SMALL,), float(i)) for _ in range(smalls)]


# -- reuse -----------------------------------------------------------------------------


@pytest.mark.swap_path
def test_a_steady_sender_reuses_its_segments(strategy: str) -> None:
    _connected()
    before = _pool_stats(strategy)
    with _child(_check_and_drop) as (conn, _):
        for i in range(30):
            conn.send(_message(i))  # a new tensor each time, dropped once sent
            assert _answer(conn) is True, f"message {i} arrived with wrong values"
        conn.send(None)
    after = _pool_stats(strategy)
    made = after["segments_made"] - before["segments_made"]
    reused = after["segments_reused"] - before["segments_reused"]
    assert made <= 6, f"{made} segments made for 30 messages: {after}"
    assert reused >= 20, f"{reused} reuses for 30 messages: {after}"


@pytest.mark.swap_path
def test_memory_a_receiver_holds_is_never_reused(strategy: str) -> None:
    _connected()
    # Two 60 KiB tensors a message fill a 1 MiB slab every 8 messages: slabs and
    # large segments both come round again while the receiver keeps message 0's.
    before = _pool_stats(strategy)
    with _child(_keep_first) as (conn, _):
        for i in range(31):
            conn.send(_message(i, smalls=2))
            assert _answer(conn) is True
        conn.send(None)
        others_ok, big_ok, small_ok = _answer(conn)
    reused = _pool_stats(strategy)["segments_reused"] - before["segments_reused"]
    assert others_ok, "a message arrived with wrong values"
    assert big_ok, "the large tensor the receiver kept was overwritten"
    assert small_ok, "the small tensor the receiver kept (in a slab) was overwritten"
    assert reused >= 10, f"too little reuse for the test to prove anything: {reused}"


@pytest.mark.swap_path
def test_free_within_about_a_second_without_further_sends(strategy: str) -> None:
    _connected()
    transfer.let_go()  # from an empty pool: what turns up free below is this test's
    assert _pool_stats(strategy)["segments_free"] == 0
    with _child(_hold_then_drop, 3) as (conn, _):
        for i in range(3):
            conn.send(torch.full((BIG,), float(i)))
        assert _answer(conn) is True
        # Nothing is sent or received from here on, and collect() is not called here:
        # the collector threads (transfer._Collector, every PURGE_EVERY = 0.5 s) of both
        # processes let go of the dead generations, and the sender's takes in the
        # broker's free notices.
        freed = wait_for(lambda: (s := _pool_stats(strategy))["segments_free"] > 0 and s["segments_waiting"] == 0, 5.0)
        stats = _pool_stats(strategy)
        conn.send("done")
    assert freed, f"segments not free within 5 s of the last user letting go: {stats}"
    assert stats["segments_free"] == 3, stats


@pytest.mark.swap_path
def test_a_slab_comes_back_after_a_receiver_that_dropped_each_message(strategy: str) -> None:
    # Small tensors of several messages in one slab, each dropped by the receiver
    # before the next arrives (the next message's storages revive the receiver's
    # gen of the slab's generation, or make a new one). Once nothing more comes,
    # the collector threads let go of it: the slab is free again within about a
    # second, with nothing else sent.
    _connected()
    transfer.let_go()  # from an empty pool: what turns up free below is this test's slab
    with _child(_check_and_drop) as (conn, _):
        for i in range(8):
            conn.send((i, [torch.full((1000,), float(i)), torch.full((1000,), float(i))]))
            assert _answer(conn) is True, f"message {i} arrived with wrong values"
        transfer.let_go_slabs()  # the slab's generation ends with its last storage
        gc.collect()
        freed = wait_for(lambda: (s := _pool_stats(strategy))["segments_free"] == 1 and s["segments_waiting"] == 0, 5.0)
        stats = _pool_stats(strategy)
        conn.send(None)
    assert freed, f"the slab was not free within 5 s of the receiver's last message: {stats}"


def _collects_after_an_hour_and_back() -> bool:
    """Whether the collector thread runs a pass within 5 s of its period set to an
    hour and back (nothing else collects here meanwhile)."""
    transfer._collector.ensure()
    with transfer.collect_every(3600.0):
        pass  # a test that keeps the collector out of its way runs here
    passed = threading.Event()
    real = transfer.collect

    def seen() -> None:
        if threading.current_thread().name == "shmreduce-collect":
            passed.set()
        real()

    setattr(transfer, "collect", seen)  # noqa: B010  the thread looks it up at each pass
    try:
        return passed.wait(5.0)
    finally:
        setattr(transfer, "collect", real)  # noqa: B010


@pytest.mark.parametrize("where", ["here", "in a forked child"])
def test_the_collector_collects_again_within_seconds_once_its_period_is_an_hour_and_back(where: str) -> None:
    # A wait begun under the hour lasted the hour: later tests, and a process that
    # set the period back, saw nothing collected. A forked child's collector waits
    # on a condition of its own.
    if where == "here":
        assert _collects_after_an_hour_and_back(), "no pass of the collector within 5 s"
    else:
        assert run_in_child(_collects_after_an_hour_and_back) == ("ok", True)


# -- stale handles ---------------------------------------------------------------------


def _load_check_drop(data: bytes) -> bool:
    torch.set_num_threads(1)
    t = shmreduce.loads(data)
    ok = bool((t == 3.0).all())
    del t
    let_go_now()
    return ok


def _load_again(data: bytes) -> str:
    torch.set_num_threads(1)
    forget_mappings()  # as a process that never mapped the segment
    t = shmreduce.loads(data)
    return f"loaded, values {t[:4].tolist()}"


@pytest.mark.swap_path
def test_a_stale_handle_is_refused_not_read(strategy: str) -> None:
    _connected()
    t = torch.full((BIG,), 3.0)
    data = shmreduce.dumps(t)
    place = cache.place_of(t.untyped_storage())
    assert place is not None
    seg = place.segment
    del t, place
    assert run_in_child(_load_check_drop, data) == ("ok", True)

    # This segment, not a count of free ones: the collector closes segments free
    # for POOL_IDLE meanwhile, an earlier test's among them, so a count of free
    # segments could stand still while this one came back.
    def freed() -> bool:
        let_go_now()
        return any(s is seg for s in seg.pool.free.get(seg.size, ()))

    def story() -> str:
        # Mapped still: seg holds its mapping (unmapped once the segment object dies).
        header, flags = _native.hdr_read(seg.addr), _native.hdr_flags(seg.addr)
        return f"retired {seg.retired}, waiting {seg.key in seg.pool.waiting}, header {header}, flags {flags}, {_pool_stats(strategy)}"

    assert wait_for(freed, 10.0), f"the segment did not come back: {story()}"
    # The segment is free, its header cleared: filled again it would hold other bytes.
    kind, message = run_in_child(_load_again, data)
    assert kind == "SharingError", message
    # The segment is still there (kept in the pool, its memfd at the broker): its
    # header tells the generation is over.
    assert "generation" in message and "is over" in message and "send it again" in message, message


# -- fork ------------------------------------------------------------------------------


def _use_after_fork(conn: Connection, big: torch.Tensor, small: torch.Tensor) -> None:
    """The fork child: receive and check what the parent sends, then check the
    storages it inherited."""
    _check_and_drop(conn)
    conn.send((bool((big == 7.0).all()), bool((small == -7.0).all())))


@pytest.mark.swap_path
def test_segments_alive_at_a_fork_are_never_reused(strategy: str) -> None:
    _connected()
    big = torch.full((BIG,), 7.0)
    small = torch.full((SMALL,), -7.0)
    big.share_memory_()
    small.share_memory_()
    assert cache.place_of(big.untyped_storage()) is not None
    assert cache.place_of(small.untyped_storage()) is not None
    before = _pool_stats(strategy)
    with _child(_use_after_fork, big, small) as (conn, _):
        del big, small  # the parent lets go; only the fork child uses them now
        gc.collect()
        for i in range(1, 21):
            conn.send(_message(i, smalls=2))
            assert _answer(conn) is True
        conn.send(None)
        big_ok, small_ok = _answer(conn)
    reused = _pool_stats(strategy)["segments_reused"] - before["segments_reused"]
    assert big_ok, "a large segment alive at the fork was reused"
    assert small_ok, "a slab alive at the fork was reused"
    assert reused >= 10, f"too little reuse for the test to prove anything: {reused}"


def _all_equal(t: torch.Tensor, value: float) -> bool:
    torch.set_num_threads(1)
    return bool((t == value).all())


@pytest.mark.swap_path
def test_a_retired_file_goes_once_free() -> None:
    # A segment alive at a fork is never reused: once free it is closed, and under
    # file_system its file goes (pool.py: "retired: never reused: closed once free").
    with shmreduce.registered(strategy="file_system"):
        big = torch.full((BIG,), 7.0)
        big.share_memory_()
        place = cache.place_of(big.untyped_storage())
        assert place is not None
        name, directory = place.segment.name, place.segment.directory
        assert run_in_child(_all_equal, big, 7.0) == ("ok", True)  # the fork retires its segment
        del big, place

        def gone() -> bool:
            let_go_now()
            return name not in os.listdir(directory)

        assert wait_for(gone, 5.0), f"{name} still in {directory} after its last user let go"


# -- a receiver killed -------------------------------------------------------------------


@pytest.mark.swap_path
def test_a_killed_receivers_holds_go_with_it(strategy: str) -> None:
    _connected()
    transfer.let_go()
    assert _pool_stats(strategy)["segments_free"] == 0
    with _child(_hold_forever, 3, exitcode=-signal.SIGKILL) as (conn, proc):
        for i in range(3):
            conn.send(torch.full((BIG,), float(i)))
        assert _answer(conn) is True
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(ANSWER)
        # No collect() here either: the collector takes in the broker's notices.
        freed = wait_for(lambda: _pool_stats(strategy)["segments_free"] > 0, 10.0)
        assert freed, f"nothing came back after the receiver was killed: {_pool_stats(strategy)}"
        assert wait_for(lambda: (s := _pool_stats(strategy))["segments_free"] == 3 and s["segments_waiting"] == 0, 10.0), _pool_stats(
            strategy
        )


# -- settings (a fresh interpreter each) ---------------------------------------------------

_SETTINGS_SCRIPT = textwrap.dedent(
    """
    import gc, json, multiprocessing as mp, sys, threading, time
    import torch
    import shmreduce
    from shmreduce import pool, segments, transfer

    CAP = 4 << 20
    strategy = sys.argv[1]
    prefix = "fd_" if strategy == "file_descriptor" else "fs_"
    report = {"settings": [pool.POOL_BYTES, pool.POOL_IDLE, segments.KEPT_SEGMENTS]}
    shmreduce.register(strategy=strategy)


    def receiver(conn):
        torch.set_num_threads(1)  # GNU OpenMP hangs in a fork child of a process that used it
        while (batch := conn.recv()) is not None:
            ok = all(bool((t == float(t.numel())).all()) for t in batch)
            del batch
            gc.collect()
            deadline = time.monotonic() + 3  # the cache lets go of dead entries every 0.5 s
            while transfer.stats()["segments_mapped"] > 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            s = transfer.stats()
            conn.send((ok, s["segments_kept"], s["segments_mapped"], s["descriptors"]))


    worst = [0, 0]  # largest free_bytes seen, and how often it was above 0
    stop = threading.Event()


    def sample():
        while not stop.is_set():
            free = transfer.stats()[prefix + "free_bytes"]
            worst[0] = max(worst[0], free)
            worst[1] += free > 0
            time.sleep(0.002)


    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=receiver, args=(theirs,))
    child.start()
    theirs.close()
    report["child"] = []
    mib = 1 << 20


    def send(sizes):
        ours.send([torch.full((n // 4,), float(n // 4)) for n in sizes])
        assert ours.poll(20)
        report["child"].append(ours.recv())


    def wait(cond, timeout=5):
        deadline = time.monotonic() + timeout
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.005)
        return cond()


    def stat(name):
        return transfer.stats()[prefix + name]


    # Batches larger than the cap, of different sizes, then of one size.
    for sizes in ([mib, 3 * mib // 2, 2 * mib, 5 * mib // 2, 3 * mib], [mib] * 5):
        send(sizes)
        assert wait(lambda: stat("segments_waiting") == 0)
    # A batch under the cap: its segments come back and stay free until idle.
    send([mib, mib])
    report["back"] = wait(lambda: stat("segments_free") == 2 and stat("segments_waiting") == 0)
    start = time.monotonic()
    wait(lambda: stat("segments_free") == 0 and stat("free_bytes") == 0)
    report["idle_s"] = time.monotonic() - start
    report["end"] = transfer.stats()
    stop.set()
    sampler.join()
    report["worst"] = worst
    ours.send(None)
    child.join(20)
    report["exitcode"] = child.exitcode
    print(json.dumps(report))
    """
)


@pytest.mark.swap_path
def test_pool_cap_idle_trim_and_kept_mappings_follow_their_settings(strategy: str) -> None:
    base = tempfile.mkdtemp(prefix="pool-settings-", dir=os.environ["SHMREDUCE_SHM_DIR"])
    env = dict(
        os.environ,
        SHMREDUCE_SHM_DIR=base,
        SHMREDUCE_POOL_BYTES=str(4 * MIB),
        SHMREDUCE_POOL_IDLE="0.5",
        SHMREDUCE_KEPT_SEGMENTS="2",
    )
    try:
        done = subprocess.run([sys.executable, "-c", _SETTINGS_SCRIPT, strategy], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert report["settings"] == [4 * MIB, 0.5, 2]
        assert report["exitcode"] == 0
        prefix = "fd_" if strategy == "file_descriptor" else "fs_"
        for ok, kept, mapped, descriptors in report["child"]:
            assert ok, "a tensor arrived with wrong values"
            # The receiver keeps its 2 latest mappings once their storages died, no more.
            assert kept <= 2 and mapped <= 2, report["child"]
            assert descriptors <= (2 if strategy == "file_descriptor" else 0), report["child"]
        largest, seen = report["worst"]
        assert 0 < largest <= 4 * MIB, f"free bytes above the 4 MiB cap: {largest}"
        assert seen > 0
        assert report["end"][prefix + "segments_reused"] > 0, report["end"]
        # The last batch came back free; idle for POOL_IDLE (0.5 s), it was closed by
        # a collector pass (every 0.5 s), never before.
        assert report["back"], report["end"]
        assert 0.3 <= report["idle_s"] < 3.0, report
        assert report["end"][prefix + "segments_free"] == 0 and report["end"][prefix + "free_bytes"] == 0, report["end"]
        # Its broker exits once its clients are gone and removes its directory.
        assert wait_for(lambda: not os.listdir(base), 10.0), os.listdir(base)
    finally:
        for root, dirs, files in os.walk(base, topdown=False):
            for name in files:
                os.unlink(os.path.join(root, name))
            for name in dirs:
                os.rmdir(os.path.join(root, name))
        os.rmdir(base)


def test_over_the_cap_a_pool_closes_its_oldest_free_segments_not_all(monkeypatch: pytest.MonkeyPatch) -> None:
    # In process, no broker: segments a pool made, given back one by one. Room for 3
    # of them under the cap: a 4th closes the oldest, the newest 3 stay reusable.
    size = pool.class_size(MIB)
    monkeypatch.setattr(pool, "POOL_BYTES", 3 * size + size // 2)
    fds = pool.FdPool(lambda: "", lambda seg: None)
    try:
        segs = [fds.take(size) for _ in range(5)]
        for i, seg in enumerate(segs):
            fds.give_back(seg)
            stats = fds.stats()
            assert stats["free_bytes"] <= pool.POOL_BYTES
            assert stats["segments_free"] == min(i + 1, 3), f"after giving back {i + 1}: {stats}"
        assert [s for segs_ in fds.free.values() for s in segs_] == segs[2:], "not the newest kept"
        del segs
        for _ in range(3):
            fds.take(size)
        assert fds.stats()["segments_reused"] == 3
    finally:
        fds.deactivate()


# -- sizes and bounds ---------------------------------------------------------------------


def test_class_size() -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    sizes = [1, 63, 64, 4096 - segments.HEADER, 4096, 65536, 65537, 100_000, MIB - segments.HEADER, MIB]
    sizes += [3 * MIB + 1, 1 << 30, (1 << 34) + 12345]
    sizes += [int(1.07**k) for k in range(10, 400)]
    for n in sizes:
        size = pool.class_size(n)
        need = n + segments.HEADER
        assert size >= need, n  # the header included
        assert size % page == 0, n
        if need >= 8 * page:
            assert size - need <= need // 8, f"{n}: {size} wastes more than 1/8"
        else:
            assert size - need < page, n
        assert pool.class_size(size - segments.HEADER) == size, n  # a class is its own class
    assert pool.class_size(MIB) == MIB + MIB // 8
    assert pool.class_size(pool.SLAB_SIZE - segments.HEADER) == pool.SLAB_SIZE
    # Eight classes per doubling, sizes never shrinking as storages grow.
    for k in (16, 20, 27):
        classes = [pool.class_size(n - segments.HEADER) for n in range((1 << k) + 1, (1 << (k + 1)) + 1, 1 << (k - 6))]
        assert classes == sorted(classes)
        assert len(set(classes)) == 8, (k, sorted(set(classes)))


@pytest.mark.swap_path
def test_a_segment_view_out_of_bounds_is_a_sharing_error(strategy: str) -> None:
    t = torch.arange(1000, dtype=torch.int32)
    t.share_memory_()
    place = cache.place_of(t.untyped_storage())
    assert place is not None
    seg, number, offset, nbytes = place
    assert number and offset >= segments.HEADER and nbytes == 4000
    gen = seg.live_gen(number)
    assert gen is not None
    view = gen.storage(offset, nbytes)
    assert torch.equal(torch.frombuffer(bytearray(bytes(view)), dtype=torch.int32), t)
    for bad_offset, bad_nbytes in [
        (seg.size - 8, 16),
        (seg.size, 1),
        (0, 8),  # the header is no storage's
        (segments.HEADER - 1, 8),
        (offset, 0),
        (offset, -1),
        (-8, 16),
        (offset, seg.size),
        (1 << 62, 1 << 62),
    ]:
        with pytest.raises(shmreduce.SharingError, match="out of bounds"):
            gen.storage(bad_offset, bad_nbytes)
    inner = gen.storage(offset + 4, 8)  # any offset a storage can lie at: the bounds are what counts
    assert bytes(inner) == t[1:3].numpy().tobytes()
    for bad in [(1 << 64, 8), (offset, 1 << 64), ("64", 8), (offset, 8.0)]:
        with pytest.raises(shmreduce.SharingError):
            gen.storage(*bad)
    assert gen.storage(seg.size - 64, 64).nbytes() == 64  # the last bytes are fine


def test_opening_a_missing_segment_file_is_a_sharing_error() -> None:
    with shmreduce.registered(strategy="file_system"):
        t = torch.ones(10)
        t.share_memory_()  # the program directory and its broker exist
        directory = program.current().directory
        with pytest.raises(shmreduce.SharingError, match="is gone"):
            segments.open_file(directory, "seg-" + "0" * 24)
        with pytest.raises(shmreduce.SharingError, match="not a shmreduce segment"):
            segments.open_file(directory, "../" + "seg-" + "0" * 24)
        del t


def test_a_memfd_is_known_by_its_device_and_inode() -> None:
    # A pooled memfd and a /dev/shm file (a storage torch shared before register(),
    # sent as a generation-0 segment) can have the same inode number on two devices:
    # the receiver must not map the other one. Refs, deposits, fetches,
    # ledgers and the mapping check name a memfd by both.
    from shmreduce.broker import protocol as P

    memfd = os.memfd_create("shmreduce-test", os.MFD_CLOEXEC)
    path = os.path.join(program.shm_base(), "shmreduce-test-identity")
    shm = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(memfd, 4096)
        os.ftruncate(shm, 4096)
        m, f = os.fstat(memfd), os.fstat(shm)
        assert m.st_dev != f.st_dev, "a memfd and a /dev/shm file on one device: nothing to tell apart"
        assert P.identity(m) == m.st_dev << 64 | m.st_ino
        # The file's inode number under the memfd's device: what an inode-only check took for it.
        confusable = m.st_dev << 64 | f.st_ino
        with pytest.raises(shmreduce.SharingError, match="does not match its handle"):
            segments.open_fd(os.dup(shm), confusable)
        seg = segments.open_fd(os.dup(shm), P.identity(f))  # its own identity maps (no descriptor kept)
        assert seg.key == P.identity(f) and seg.fd is None
        del seg
    finally:
        os.close(memfd)
        os.close(shm)
        os.unlink(path)


@pytest.fixture
def quiet_collector() -> Iterator[None]:
    """The collector thread out of the way: its passes out of the test's count."""
    with transfer.collect_every(3600.0):
        yield


@pytest.mark.usefixtures("quiet_collector")
@pytest.mark.swap_path
def test_a_take_looks_at_a_bounded_number_of_waiting_segments(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay buffer: every segment a receiver keeps waits in its owner's pool. A
    take() of a new one looks at REAP_PER_TAKE of them, not at all of them (which
    made a sender's CPU per message grow with what was kept: n^2/2 calls), and each
    in turn: the longest waiting first, to the back of the line if it still waits."""
    monkeypatch.setattr(pool, "IDLE_SEGMENTS", 64)  # all 40 wait (the cap is the next test's)
    numel = pool.ARENA_ITEM_MAX // 4 + 1024
    p = transfer._current_pool()
    blobs = []
    for i in range(40):  # in flight, never loaded yet: each segment waits
        t = torch.full((numel,), float(i))
        blobs.append(shmreduce.dumps(t))
        del t
    gc.collect()
    transfer._settle(wait=True)
    assert len(p.waiting) >= 40
    order = list(p.waiting)
    calls: list[int] = []
    real = _native.hdr_end

    def counted(addr: int, gen: int) -> int:
        calls.append(gen)
        return real(addr, gen)

    monkeypatch.setattr(_native, "hdr_end", counted)
    kept = torch.full((numel,), -1.0)
    transfer.share_in_place(kept.untyped_storage())  # a take() of a new segment
    assert 0 < len(calls) <= pool.REAP_PER_TAKE
    assert list(p.waiting)[-len(calls) :] == order[: len(calls)], "the ones looked at go to the back of the line"
    monkeypatch.setattr(_native, "hdr_end", real)
    for i, blob in enumerate(blobs):
        assert float(shmreduce.loads(blob)[0]) == float(i)
    del kept, blobs
    let_go_now()
    assert wait_for(lambda: not p.waiting, 10)


@pytest.mark.swap_path
def test_past_its_cap_the_longest_waiting_segments_are_retired_and_still_load(strategy: str) -> None:
    """40 segments wait for refs in flight (blobs never loaded yet): the pool keeps
    IDLE_SEGMENTS of them waiting; the longest waiting are retired (never reused), each
    keeping its descriptor only until its refs are loaded (a broker restart meanwhile
    gets it back): every blob loads its own bytes, the retired ones are closed once
    loaded, and every segment goes once loaded and dropped."""
    numel = pool.ARENA_ITEM_MAX // 4 + 1024
    p = transfer._current_pool()
    before = shmreduce.stats()["descriptors"]
    blobs = []
    for i in range(40):
        t = torch.full((numel,), float(i))
        blobs.append(shmreduce.dumps(t))
        del t
    gc.collect()
    transfer._settle(wait=True)
    assert len(p.waiting) == pool.IDLE_SEGMENTS, len(p.waiting)
    assert len(p.leaving) == 40 - pool.IDLE_SEGMENTS, len(p.leaving)
    fresh = [torch.full((numel,), -float(i)) for i in range(8)]  # made now: never in a retired segment
    for t in fresh:
        transfer.share_in_place(t.untyped_storage())
    for i, blob in enumerate(blobs):
        assert bool((shmreduce.loads(blob) == float(i)).all()), f"blob {i} lost its bytes"
    assert all(bool((t == -float(i)).all()) for i, t in enumerate(fresh))
    let_go_now()
    assert not p.leaving, len(p.leaving)

    most = before + pool.IDLE_SEGMENTS + len(fresh) + 2

    def closed_once_loaded() -> bool:
        # The collector thread may be settling the same dead Gens meanwhile: their
        # descriptors close when its pass ends, not necessarily before let_go_now's.
        let_go_now()
        return shmreduce.stats()["descriptors"] <= most

    assert wait_for(closed_once_loaded, 10), shmreduce.stats()
    del blobs, fresh
    let_go_now()
    assert wait_for(lambda: not p.waiting, 10)


def test_a_pool_keeps_at_most_its_cap_of_free_segments() -> None:
    # In process, no broker: 2 * IDLE_SEGMENTS segments given back one by one; the
    # newest IDLE_SEGMENTS stay free, the older are closed (their descriptors with them).
    size = pool.class_size(MIB)
    fds = pool.FdPool(lambda: "", lambda seg: None)
    try:
        segs = [fds.take(size) for _ in range(2 * pool.IDLE_SEGMENTS)]
        for seg in segs:
            fds.give_back(seg)
            assert fds.stats()["segments_free"] <= pool.IDLE_SEGMENTS
        assert [s for segs_ in fds.free.values() for s in segs_] == segs[pool.IDLE_SEGMENTS :], "not the newest kept"
    finally:
        fds.deactivate()
