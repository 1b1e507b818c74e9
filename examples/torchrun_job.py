"""A torchrun job in which every rank shares through shmreduce on its own.

Run it (CPU, gloo)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/torchrun_job.py

Every rank calls ``shmreduce.register()`` and runs a DataLoader with 2 workers over its
half of a synthetic dataset (``DistributedSampler``), under each strategy in turn. The
batches reach the rank from its workers through shmreduce (one message per batch); the
rank adds them into a checksum, and the ranks ``all_reduce`` their checksums and a
histogram of the sample indices through gloo. Rank 0 checks the total and prints it.

What this shows about a multi-node job (each host is like one rank here):

* each rank is a shmreduce program of its own: its own broker process and its own
  program directory ``shmreduce-<id>/`` under the shm base, found here the way
  ``python -m shmreduce cleanup`` finds brokers (the broker's command line names its
  directory and the pid of the program's root; shmreduce has no API that returns them);
* nothing of shmreduce crosses between ranks: tensors that go from rank to rank travel
  through the engine (``torch.distributed``: gloo here, NCCL on GPUs), which pickles
  them by value, never through a shmreduce handle (``stats()["messages_sent"]`` does not
  move);
* nothing is left behind: when a rank exits, its broker exits and its directory goes
  (``tests/test_torchrun.py`` checks the shm base is empty after the job).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import shmreduce

N = 96  # samples in the dataset, split between the ranks
WIDTH = 16
IMAGE = (3, 48, 48)  # a batch of 8 is 54 KiB of uint8: with x and idx, one slab a batch
BATCH = 8


class Synthetic(Dataset):
    """Sample i: a row of WIDTH consecutive int64s, an image full of i % 251, and i."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "x": torch.arange(i * WIDTH, (i + 1) * WIDTH, dtype=torch.int64),
            "image": torch.full(IMAGE, i % 251, dtype=torch.uint8),
            "idx": torch.tensor(i),
        }


def expected_checksum() -> int:
    """What all ranks' batches add up to, computed without any loader."""
    xs = (N * WIDTH) * (N * WIDTH - 1) // 2
    images = sum(i % 251 for i in range(N)) * IMAGE[0] * IMAGE[1] * IMAGE[2]
    return xs + images


def own_program() -> tuple[str, list[int]]:
    """This rank's program directory and broker pids, read from the process table.

    A broker runs as ``python -m shmreduce.broker.server DIR ROOT_PID`` (its janitor
    parent with the same command line); ROOT_PID is the process that registered: this
    rank. shmreduce has no public call that returns them, so look as ``cleanup`` does.
    """
    directories, pids = set(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [a.decode() for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if "shmreduce.broker.server" not in argv:
            continue
        i = argv.index("shmreduce.broker.server")
        if argv[i + 2 : i + 3] == [str(os.getpid())]:
            directories.add(argv[i + 1])
            pids.append(int(entry))
    assert len(directories) == 1, f"rank {os.getpid()}: expected one program directory, found {directories}"
    return directories.pop(), sorted(pids)


def run_strategy(rank: int, world: int, strategy: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    shmreduce.set_sharing_strategy(strategy)
    dataset = Synthetic()
    loader = DataLoader(
        dataset,
        batch_size=BATCH,
        num_workers=2,
        timeout=60,
        sampler=DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False),
    )
    before = shmreduce.stats()
    checksum = torch.zeros((), dtype=torch.int64)
    histogram = torch.zeros(N, dtype=torch.int64)
    batches = 0
    for batch in loader:
        checksum += batch["x"].sum() + batch["image"].sum(dtype=torch.int64)
        histogram += torch.bincount(batch["idx"], minlength=N)
        batches += 1
    del loader, batch
    received = shmreduce.stats()["messages_received"] - before["messages_received"]
    # one shmreduce message per batch, from this rank's own workers
    assert received >= batches > 0, (strategy, received, batches)
    return checksum, histogram, batches


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shmreduce.register()  # each rank: its own program, broker and directory
    try:
        results: dict[str, tuple[int, torch.Tensor, int]] = {}
        for strategy in ("file_descriptor", "file_system"):
            checksum, histogram, batches = run_strategy(rank, world, strategy)
            dist.all_reduce(checksum)
            dist.all_reduce(histogram)
            results[strategy] = (int(checksum), histogram, batches)

        # Each rank has its own broker and directory, and they are all different.
        directory, brokers = own_program()
        base = os.path.abspath(os.environ.get("SHMREDUCE_SHM_DIR") or "/dev/shm")
        assert os.path.dirname(directory) == base and os.path.basename(directory).startswith("shmreduce-")
        programs: list[Any] = [None] * world
        # Tensors between ranks go through the engine, pickled by value: no shmreduce
        # message is made for them, and what arrives is not shmreduce's memory.
        sent = shmreduce.stats()["messages_sent"]
        dist.all_gather_object(programs, (os.getpid(), directory, brokers, torch.full((4,), float(rank))))
        assert shmreduce.stats()["messages_sent"] == sent
        for r, (_pid, _directory, _brokers, tensor) in enumerate(programs):
            assert torch.equal(tensor, torch.full((4,), float(r)))
            assert not tensor.untyped_storage().is_shared()
        assert len({p[1] for p in programs}) == world, f"ranks share a program directory: {programs}"
        assert len({b for p in programs for b in p[2]}) == sum(len(p[2]) for p in programs), programs

        if rank == 0:
            expected = expected_checksum()
            for strategy, (total, counts, batches) in results.items():
                assert total == expected, (strategy, total, expected)
                assert torch.equal(counts, torch.ones(N, dtype=torch.int64)), (strategy, counts)
                print(f"{strategy}: world {world}, checksum {total} == expected {expected}, every sample once, {batches} batches on rank 0")
            for r, (pid, rank_directory, rank_brokers, _tensor) in enumerate(programs):
                print(f"rank {r}: pid {pid}, program directory {os.path.basename(rank_directory)}, broker pids {rank_brokers}")
            print(f"{world} ranks, {world} program directories and brokers, none shared")
            print("torchrun_job: OK")
        dist.barrier()
    finally:
        shmreduce.unregister()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
