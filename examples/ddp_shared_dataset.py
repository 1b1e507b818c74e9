"""A torchrun job whose ranks share one in-memory dataset: one copy per host.

Run it (CPU, gloo)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/ddp_shared_dataset.py

Rank 0 builds the dataset (think: reads it from disk into memory) and
``shmreduce.distributed.broadcast_local`` hands it to every rank: the ranks of this host map
its tensors from one copy in shared memory, instead of each holding its own (on another
host, one rank would get it by value through torch.distributed and share it with the ranks
there). Each rank then trains a small model (``DistributedDataParallel``) for a few steps on
its ``DistributedSampler`` shard, through a DataLoader with 2 workers over the shared
tensors: the workers index the shared memory, and their batches come back through
shmreduce.

What it checks and prints: every rank has the dataset's bytes, in shared memory; a write by
rank 0 into a shared tensor is seen by every rank (one copy, not copies); every sample is
trained on once an epoch; the loss went down.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import shmreduce
from shmreduce.distributed import broadcast_local

SAMPLES = 4096
FEATURES = 32
EPOCHS = 2
BATCH = 64


def load_dataset() -> dict[str, torch.Tensor]:
    """What rank 0 would read from disk: a linear problem with a little noise."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    y = x @ w + 0.01 * torch.randn(SAMPLES, 1, generator=g)
    return {"x": x, "y": y, "index": torch.arange(SAMPLES), "epochs_done": torch.zeros((), dtype=torch.int64)}


class Shared(Dataset):
    """Samples indexed out of the shared tensors (the DataLoader's workers inherit them)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.x, self.y, self.index = tensors["x"], tensors["y"], tensors["index"]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i], self.index[i]


def train(rank: int, world: int, data: dict[str, torch.Tensor]) -> tuple[float, float]:
    """A few epochs of DDP on this rank's shard, through a 2-worker DataLoader over the
    shared tensors; the mean loss of the first and last steps, over every rank."""
    dataset = Shared(data)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=2, timeout=60)
    model = DistributedDataParallel(nn.Linear(FEATURES, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = torch.zeros(SAMPLES, dtype=torch.int64)
    losses = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        seen.zero_()
        for x, y, index in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen[index] += 1
            losses.append(loss.item())
        dist.all_reduce(seen)
        assert int(seen.min()) >= 1, f"epoch {epoch}: a sample was not trained on"
        if rank == 0:
            data["epochs_done"] += 1  # a write into the shared copy ...
        dist.barrier()
        # ... seen by every rank: they map the same memory
        assert int(data["epochs_done"]) == epoch + 1, f"rank {rank} sees {int(data['epochs_done'])}"
    del loader
    both = torch.stack([torch.tensor(losses[:3]).mean(), torch.tensor(losses[-3:]).mean()])
    dist.all_reduce(both)
    return float(both[0]) / world, float(both[1]) / world


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shmreduce.register()  # the ranks' DataLoader workers send their batches through shmreduce too
    data = broadcast_local(load_dataset() if rank == 0 else None, src=0)
    assert all(t.untyped_storage().is_shared() for t in data.values())
    expected = load_dataset()  # (for the check only: the bytes every rank must see)
    assert all(torch.equal(data[k], expected[k]) for k in ("x", "y", "index")), f"rank {rank}: wrong bytes"
    del expected
    first, last = train(rank, world, data)
    assert last < first, f"the loss did not go down: {first} -> {last}"
    if rank == 0:
        print(f"{world} ranks on {SAMPLES} shared samples (rank 0: pid {os.getpid()}), each trained on once an epoch")
        print(f"a write by rank 0 seen by every rank: epochs_done == {int(data['epochs_done'])}")
        print(f"mean loss {first:.4f} -> {last:.4f}")
        print("ddp_shared_dataset: OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
