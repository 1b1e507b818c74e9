"""Custom types: ``register_reducer`` for a user dataclass holding tensors.

``Rollout`` carries tensors plus things that must not (or cannot) travel: a lock and
a cache. Its reducer sends only the tensors (shared, not copied: tensors inside the
reducer's args go through shmreduce like any other) and rebuilds fresh local state
on the other side. Subclasses use the nearest registered reducer in their MRO.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from dataclasses import dataclass, field

import torch

import shmreduce


@dataclass
class Rollout:
    obs: torch.Tensor
    rewards: torch.Tensor
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # not picklable
    cache: dict = field(default_factory=dict, repr=False)  # process-local

    def total(self) -> float:
        with self.lock:
            return self.cache.setdefault("total", float(self.rewards.sum()))


@dataclass
class PrioritizedRollout(Rollout):  # a subclass: dispatched to Rollout's reducer
    pass


def rebuild_rollout(cls: type, obs: torch.Tensor, rewards: torch.Tensor) -> Rollout:
    return cls(obs=obs, rewards=rewards)


def reduce_rollout(r: Rollout) -> tuple:
    return rebuild_rollout, (type(r), r.obs, r.rewards)


def worker(q_in: mp.Queue, q_out: mp.Queue) -> None:
    r = q_in.get(timeout=30)
    r.rewards.mul_(2)  # in place, in shared memory
    q_out.put((type(r).__name__, r.total()))


def main() -> None:
    shmreduce.register()
    shmreduce.register_reducer(Rollout, reduce_rollout)
    try:
        ctx = mp.get_context("fork")
        q_in, q_out = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=worker, args=(q_in, q_out))
        proc.start()
        r = PrioritizedRollout(obs=torch.randn(100, 8), rewards=torch.ones(100))
        r.total()  # fills the local cache: it must not travel
        q_in.put(r)
        name, total = q_out.get(timeout=30)
        proc.join(30)
        assert proc.exitcode == 0
        print(f"worker got a {name} and computed total {total}")
        assert name == "PrioritizedRollout" and total == 200.0
        assert r.rewards.eq(2).all(), "worker's in-place write not seen"
        print("parent sees the worker's in-place update:", r.rewards[:3].tolist())
        print("registered reducers:", [c.__name__ for c in shmreduce.list_reducers()])
    finally:
        shmreduce.unregister_reducer(Rollout)
        shmreduce.unregister()
    print("custom_types: OK")


if __name__ == "__main__":
    main()
