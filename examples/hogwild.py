"""Hogwild!-style training: workers update one shared model without locks.

``model.share_memory()`` moves the parameters into shared memory; the workers
(started by ``torch.multiprocessing.spawn``, registered automatically) receive the
model over shmreduce and their ``optimizer.step()`` writes land in the parent's
parameters.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as tmp
from torch import nn

import shmreduce

TRUE_W = torch.tensor([[2.0, -3.0, 0.5]])
TRUE_B = torch.tensor([1.0])


def make_data(seed: int, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    return x, x @ TRUE_W.T + TRUE_B


def train(rank: int, model: nn.Module, steps: int) -> None:
    torch.set_num_threads(1)
    x, y = make_data(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()  # in-place on shared memory: the parent and the other workers see it


def main() -> None:
    torch.manual_seed(0)
    shmreduce.register()
    try:
        model = nn.Linear(3, 1)
        model.share_memory()
        x, y = make_data(seed=99)
        with torch.no_grad():
            before = nn.functional.mse_loss(model(x), y).item()
        tmp.spawn(train, args=(model, 200), nprocs=2, join=True)
        with torch.no_grad():
            after = nn.functional.mse_loss(model(x), y).item()
        print(f"loss before {before:.4f}, after hogwild training in 2 processes {after:.6f}")
        print("learned weight", [round(v, 3) for v in model.weight.flatten().tolist()], "bias", round(model.bias.item(), 3))
        assert after < before * 0.01, (before, after)
    finally:
        shmreduce.unregister()
    print("hogwild: OK")


if __name__ == "__main__":
    main()
