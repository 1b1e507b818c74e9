"""The GPU check: what a GPU machine as it comes runs (``make gpu-check``, or
``python3 -m pytest tests/gpu`` from the repository root), with only python3, torch,
pytest, hypothesis and cloudpickle installed and the extension built in place
(``python3 setup.py build_ext --inplace``): no other install, no package index.

Under both strategies: CPU and CUDA tensors in one message through a spawn queue; a
CUDA storage refused; CUDA tensors through torch's IPC while the producer lives;
pinned CPU tensors; a DataLoader with ``pin_memory=True`` and workers under fork, spawn
and forkserver; ``broadcast_local`` over an NCCL group. The suite's module leak check
(``tests/conftest.py``) then finds nothing left in shared memory. Without CUDA every test
skips, saying so (``make test`` collects them there).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.multiprocessing as tmp

import shmreduce

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine (the GPU check needs one)")

TIMEOUT = 120.0


@contextmanager
def _spawned(target: Callable[..., None]) -> Iterator[tuple]:
    """A spawn child running *target(q_in, q_out)*; the block's end sends it None and
    wants it gone with 0. Killed if it still lives, whatever happened."""
    ctx = tmp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=target, args=(q_in, q_out))
    proc.start()
    try:
        yield q_in, q_out
        q_in.put(None)
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def _sums(q_in, q_out) -> None:
    shmreduce.register()
    while (msg := q_in.get(timeout=TIMEOUT)) is not None:
        q_out.put([float(t.sum()) for t in msg] + [[t.device.type for t in msg]])


def test_cpu_and_cuda_tensors_in_one_message_through_a_spawn_queue(strategy):
    with _spawned(_sums) as (q_in, q_out):
        for i in range(20):
            cpu, cuda = torch.full((1000,), float(i)), torch.full((1000,), float(i), device="cuda")
            q_in.put([cpu, cuda, cpu[10:20]])  # the producer keeps them alive until answered
            assert q_out.get(timeout=TIMEOUT) == [1000.0 * i, 1000.0 * i, 10.0 * i, ["cpu", "cuda", "cpu"]]


def test_a_cuda_storage_on_its_own_is_refused(strategy):
    with pytest.raises(shmreduce.SharingError):
        shmreduce.dumps(torch.ones(3, device="cuda").untyped_storage())


def _add_one(q_in, q_out) -> None:
    shmreduce.register()
    t = q_in.get(timeout=TIMEOUT)
    t += 1  # torch's IPC: the producer's memory
    torch.cuda.synchronize()
    q_out.put(True)
    q_in.get(timeout=TIMEOUT)  # the producer read it: its memory may go


def test_cuda_tensors_go_through_torchs_ipc_while_the_producer_lives(strategy):
    with _spawned(_add_one) as (q_in, q_out):
        t = torch.zeros(1 << 16, device="cuda")
        q_in.put(t)
        assert q_out.get(timeout=TIMEOUT)
        assert float(t.sum()) == float(1 << 16)  # one memory: the consumer's write is seen


def test_pinned_cpu_tensors_arrive_whole(strategy):
    with _spawned(_sums) as (q_in, q_out):
        pinned = torch.arange(4096.0).pin_memory()
        q_in.put([pinned, pinned[:16]])
        assert q_out.get(timeout=TIMEOUT) == [float(sum(range(4096))), float(sum(range(16))), ["cpu", "cpu"]]


class _Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((256,), float(i))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_dataloader_pins_batches_its_workers_shared(strategy, method):
    before = shmreduce.stats()["storages_received"]
    loader = torch.utils.data.DataLoader(_Squares(), batch_size=8, num_workers=2, pin_memory=True, multiprocessing_context=method)
    total = 0.0
    for batch in loader:
        assert batch.is_pinned()
        total += float(batch.sum())
    assert total == 256.0 * sum(range(64))
    assert shmreduce.stats()["storages_received"] >= before + 8  # every batch came through shmreduce
    del loader


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, strategy: str, q) -> None:
    import torch.distributed as dist

    from shmreduce.distributed import broadcast_local

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank % torch.cuda.device_count()))
    try:
        shmreduce.set_sharing_strategy(strategy)
        data = {"w": torch.arange(1 << 16, dtype=torch.float32)} if rank == 0 else None
        got = broadcast_local(data, src=0)
        q.put((rank, float(got["w"].sum()), got["w"].is_shared()))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_broadcast_local_over_an_nccl_group(strategy):
    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    world, port = 2, _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, shmreduce.get_sharing_strategy(), q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = sorted(q.get(timeout=TIMEOUT) for _ in range(world))
        want = float(sum(range(1 << 16)))
        assert got == [(r, want, True) for r in range(world)]
        for p in procs:
            p.join(TIMEOUT)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
