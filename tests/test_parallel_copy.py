"""Large copies into segments run on the threads the process may use, and give the bytes a
one-thread copy gives (``shmreduce/_native/copy.c``).

The suite runs torch with one intra-op thread (conftest.py); these tests raise it where
they need several, and put it back."""

from __future__ import annotations

import hashlib
import mmap
import multiprocessing as mp
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import shmreduce
from shmreduce import _native

from helpers import let_go_now, running, small_mount

MIB = 1 << 20
PAGE = mmap.PAGESIZE
# Around the parallel threshold (4 MiB), a part's page alignment, and an uneven tail.
SIZES = [4 * MIB - 1, 4 * MIB, 4 * MIB + 1, 4 * MIB + PAGE + 1, 6 * MIB + 5, 9 * MIB + PAGE - 1]


@contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def test_a_copy_takes_the_threads_torch_and_the_affinity_mask_allow():
    cpus = len(os.sched_getaffinity(0))
    with intra_op_threads(1):
        assert _native.copy_threads(64 * MIB) == 1  # a DataLoader worker's setting: one thread
    with intra_op_threads(max(cpus, 2)):
        assert _native.copy_threads(64 * MIB) == min(cpus, 32)
        assert _native.copy_threads(4 * MIB - 1) == 1  # below the threshold: one
        assert _native.copy_threads(4 * MIB) == min(cpus, 2)  # at least 2 MiB a thread
    with intra_op_threads(64):
        assert _native.copy_threads(64 * MIB) == min(cpus, 32)  # never more than the mask allows


def _in_another_thread(fn):
    out: list = []
    worker = threading.Thread(target=lambda: out.append(fn()))
    worker.start()
    worker.join(30)
    return out[0]


def _worker_like(conn) -> None:
    torch.set_num_threads(1)  # as a DataLoader worker's main thread does
    conn.send(_in_another_thread(lambda: _native.copy_threads(64 * MIB)))  # its queue's feeder thread


def test_every_thread_copies_with_the_setting_of_the_process(registered_fd):
    """torch's intra-op setting is per thread; a queue's feeder thread, which shares what
    the main thread put, copies with the main thread's (never every core where a
    DataLoader worker set one)."""
    cpus = len(os.sched_getaffinity(0))
    with intra_op_threads(2):
        assert _in_another_thread(lambda: _native.copy_threads(64 * MIB)) == min(cpus, 2)
        ctx = mp.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        with running(ctx.Process(target=_worker_like, args=(send,))):
            assert recv.poll(30)
            assert recv.recv() == 1


class _CopyThreads(torch.utils.data.Dataset):
    """Each item: the threads a 64 MiB copy takes in the process that makes it."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([_native.copy_threads(64 * MIB), torch.get_num_threads()])


def test_a_dataloader_worker_copies_on_one_thread(registered_fd):
    """DataLoader sets one intra-op thread in each worker: its copies (the batches it
    shares) take one thread, whatever its parent's setting."""
    with intra_op_threads(2):
        loader = torch.utils.data.DataLoader(_CopyThreads(), batch_size=2, num_workers=1, multiprocessing_context="fork")
        [batch] = list(loader)
        assert _native.copy_threads(64 * MIB) == min(len(os.sched_getaffinity(0)), 2)  # the parent's own
    assert batch.tolist() == [[1, 1], [1, 1]]


def _threads_pinned_to_one_cpu(conn) -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(8)
    conn.send(_native.copy_threads(64 * MIB))


def test_a_process_pinned_to_one_cpu_copies_on_one_thread():
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    with running(ctx.Process(target=_threads_pinned_to_one_cpu, args=(send,))):
        assert recv.poll(30)
        assert recv.recv() == 1


@pytest.mark.parametrize("threads", [1, 2])
def test_a_write_through_a_descriptor_gives_every_byte(threads):
    for i, nbytes in enumerate(SIZES):
        source = pattern(nbytes, i)
        fd = os.memfd_create("shmreduce-test")
        try:
            os.ftruncate(fd, nbytes + PAGE)
            with intra_op_threads(threads):
                _native.write(fd, source.data_ptr(), nbytes, PAGE)
            with mmap.mmap(fd, nbytes + PAGE) as m:
                assert m[:PAGE] == bytes(PAGE)
                assert hashlib.sha256(m[PAGE:]).hexdigest() == digest(source), nbytes
        finally:
            os.close(fd)


@pytest.mark.parametrize("populating", [True, False], ids=["populated", "refused"])
@pytest.mark.parametrize("threads", [3, 4])
def test_a_write_on_several_threads_through_the_mapping_gives_every_byte(threads, populating):
    """On 3 threads and up, each allocates its part's new pages and copies through the
    mapping; where the kernel refuses to populate (as one older than 5.14 does), the parts
    are written through the descriptor. Either way: every byte, nothing around it."""
    from shmreduce import _platform

    was = _native.set_populating(populating)
    try:
        for i, nbytes in enumerate(SIZES):
            for offset in (PAGE, _native.HEADER_BYTES + 64):
                source = pattern(nbytes, i)
                size = offset + nbytes + PAGE
                fd = os.memfd_create("shmreduce-test")
                addr = 0
                try:
                    os.ftruncate(fd, size)
                    addr = _platform.map_shared(fd, size)
                    _native.write(fd, source.data_ptr(), nbytes, offset, addr, threads)
                    with mmap.mmap(fd, size) as m:
                        assert m[:offset] == bytes(offset) and m[offset + nbytes :] == bytes(size - offset - nbytes)
                        assert hashlib.sha256(m[offset : offset + nbytes]).hexdigest() == digest(source), nbytes
                finally:
                    if addr:
                        _platform.unmap(addr, size)
                    os.close(fd)
    finally:
        _native.set_populating(was)


def test_a_write_through_the_mapping_into_a_full_mount_is_an_os_error(tmp_path):
    """Each thread allocates its part's pages before it copies: a mount too small for them
    is ENOSPC from the write, never a SIGBUS in the copy."""
    import errno

    from shmreduce import _platform

    _native.guard_faults()  # as every process that maps a segment has it
    nbytes = 9 * MIB
    source = pattern(nbytes, 0)
    with small_mount(tmp_path / "shm", "4m") as mnt:
        path = os.path.join(mnt, "segment")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        addr = 0
        try:
            os.ftruncate(fd, PAGE + nbytes)
            addr = _platform.map_shared(fd, PAGE + nbytes)
            with pytest.raises(OSError) as raised:
                _native.write(fd, source.data_ptr(), nbytes, PAGE, addr, 3)
            assert raised.value.errno == errno.ENOSPC
        finally:
            if addr:
                _platform.unmap(addr, PAGE + nbytes)
            os.close(fd)
            os.unlink(path)


def test_a_failed_write_is_an_os_error():
    source = pattern(8 * MIB, 0)
    r, w = os.pipe()
    os.close(w)
    os.close(r)
    with intra_op_threads(2), pytest.raises(OSError):
        _native.write(r, source.data_ptr(), 8 * MIB, 0)


def _digests(q, out) -> None:
    while (t := q.get(timeout=60)) is not None:
        found = digest(t)
        del t
        let_go_now()  # its segment free for the sender's next message
        out.put(found)


@pytest.mark.swap_path
@pytest.mark.timeout(180)
def test_parallel_and_plain_copies_give_equal_bytes_around_every_threshold(strategy):
    """Each size sent twice, on one thread and on two: the first into a new
    segment (a write through its descriptor), the next into a segment reused
    (a copy through the mapping); the receiver reads the bytes that were sent."""
    ctx = mp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    with running(ctx.Process(target=_digests, args=(q, out))):
        for threads in (1, 2):
            with intra_op_threads(threads):
                for i, nbytes in enumerate(SIZES):
                    for round_ in range(2):
                        t = pattern(nbytes, 100 * i + round_ + threads)
                        sent = digest(t)  # before the move: afterwards t reads the segment itself
                        q.put(t)
                        assert out.get(timeout=60) == sent, (threads, nbytes, round_)
                        del t
                        let_go_now()
        q.put(None)
    kind = "fs" if strategy == "file_system" else "fd"
    assert shmreduce.stats()[f"{kind}_segments_reused"] > 0  # the copies through a mapping ran too
