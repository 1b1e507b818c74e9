"""Hogwild-style shared-parameter training and an actor-learner loop, in real processes."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as tmp
from torch import nn

import shmreduce

TIMEOUT = 60


# -- hogwild -------------------------------------------------------------------------


def mark_rows(rank: int, model: nn.Linear, steps: int) -> None:
    # Disjoint writes: each worker owns row `rank` of the weight, so the result is exact.
    with torch.no_grad():
        for _ in range(steps):
            model.weight[rank] += 1.0


def sgd_worker(rank: int, model: nn.Module, steps: int) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(128, 2, generator=g)
    y = x @ torch.tensor([[1.5], [-2.0]]) + 0.5
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_hogwild_spawn_workers_update_parent_parameters(strategy):
    model = nn.Linear(3, 2, bias=False)
    nn.init.zeros_(model.weight)
    model.share_memory()
    tmp.spawn(mark_rows, args=(model, 5), nprocs=2, join=True)
    assert torch.equal(model.weight, torch.tensor([[5.0] * 3, [5.0] * 3]))
    assert isinstance(model.weight, nn.Parameter) and model.weight.requires_grad


@pytest.mark.parametrize("method", ["fork"])  # spawn: covered by the torch.multiprocessing.spawn test
def test_hogwild_process_sgd_converges(strategy, method):
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    model.share_memory()
    ctx = mp.get_context(method)
    procs = [ctx.Process(target=sgd_worker, args=(r, model, 100)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT)
    assert [p.exitcode for p in procs] == [0, 0]
    assert torch.allclose(model.weight, torch.tensor([[1.5, -2.0]]), atol=1e-3)
    assert torch.allclose(model.bias, torch.tensor([0.5]), atol=1e-3)


# -- actor-learner -------------------------------------------------------------------

N_ACTORS, STEPS = 2, 6


def actor(rank: int, weights_q, traj_q) -> None:
    for step in range(STEPS):
        weights = weights_q.get(timeout=TIMEOUT)
        assert weights["w"].is_shared()
        traj_q.put(
            {
                "rank": rank,
                "step": step,
                "version": int(weights["version"]),
                "obs": torch.full((16, 4), float(rank * 100 + step)),
                "act": weights["w"].sum(0).expand(16, 2).clone(),
            }
        )


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_actor_learner_fixed_steps(strategy, method):
    ctx = mp.get_context(method)
    traj_q = ctx.Queue()
    weights_qs = [ctx.Queue() for _ in range(N_ACTORS)]
    procs = [ctx.Process(target=actor, args=(r, weights_qs[r], traj_q)) for r in range(N_ACTORS)]
    for p in procs:
        p.start()
    try:
        w, version = torch.zeros(4, 2), 0
        before = shmreduce.stats()
        for q in weights_qs:
            q.put({"w": w.clone(), "version": torch.tensor(version)})
        sent_version = {r: 0 for r in range(N_ACTORS)}
        steps = {r: 0 for r in range(N_ACTORS)}
        for _ in range(N_ACTORS * STEPS):
            traj = traj_q.get(timeout=TIMEOUT)
            r = traj["rank"]
            assert traj["step"] == steps[r] and traj["version"] == sent_version[r]
            assert torch.equal(traj["obs"], torch.full((16, 4), float(r * 100 + traj["step"])))
            assert torch.equal(traj["act"][0], w.sum(0)) or traj["version"] != version
            steps[r] += 1
            w += 1.0
            version += 1
            if steps[r] < STEPS:
                sent_version[r] = version
                weights_qs[r].put({"w": w.clone(), "version": torch.tensor(version)})
        after = shmreduce.stats()
    finally:
        for p in procs:
            p.join(TIMEOUT)
    assert [p.exitcode for p in procs] == [0] * N_ACTORS
    assert steps == {r: STEPS for r in range(N_ACTORS)}
    assert after["messages_received"] - before["messages_received"] >= N_ACTORS * STEPS
    for q in [traj_q, *weights_qs]:
        q.close()
        q.join_thread()
    gc.collect()


_SHARE_UNDER_FS = r"""
import os, sys, torch, shmreduce
from shmreduce import _torch
from shmreduce.broker import client
from shmreduce.cache import cache
def sockets():
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out.add(link)
    return out
torch_files = lambda: {f for f in os.listdir("/dev/shm") if f.startswith("torch_")}
shmreduce.register(strategy="file_system")
socks, files = sockets(), torch_files()
model = torch.nn.Linear(4, 4)
model.share_memory()
assert model.weight.is_shared() and model.bias.is_shared()
place = cache.place_of(model.weight.untyped_storage())
if _torch.path() == "swap":
    assert place is not None and place.segment.kind == "fs", place
    assert os.path.exists(os.path.join(place.segment.directory, place.segment.name)), place
else:  # torch moves it, by descriptor under either strategy, and shmreduce adopts it
    assert place is not None and place.segment.kind == "fd", place
ours = {os.readlink(f"/proc/self/fd/{s.fileno()}") for c in client.existing_clients() for s in c.sockets()}
new_files = torch_files() - files
new_socks = sockets() - socks - ours
shmreduce.unregister()
print("torch_files", len(new_files), "sockets", len(new_socks))
sys.exit(1 if new_files or new_socks else 0)
"""


def test_share_memory_under_file_system_stays_in_shmreduce():
    # Run in a fresh interpreter: libshm's socket and torch_shm_manager would otherwise
    # stay with the test process.
    proc = subprocess.run([sys.executable, "-c", _SHARE_UNDER_FS], capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
