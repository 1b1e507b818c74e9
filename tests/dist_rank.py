"""One rank of the jobs of ``tests/test_distributed_local.py`` (run as a script, one process a
rank, as torchrun starts them: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment).

``python dist_rank.py SCENARIO STRATEGY``; every rank prints one JSON line a step,
``{"rank": r, "step": ..., ...}``, which the test reads. Scenarios:

* ``share``: rank 0 broadcasts a dataset (``MIB`` MiB of int32 and a string); every rank checks
  its bytes, writes into it and reads the others' writes (aliasing), reports its PSS before
  and after, runs a 2-worker DataLoader over its DistributedSampler shard (the batches summed,
  all_reduced), rank 1 a spawn child that writes into the shared tensor; rank 0 writes the
  bytes of ``shmreduce.dumps(dataset)`` to $DIST_PAYLOAD and waits for $DIST_GO (the test loads
  them in a rank of another job meanwhile); then rank 3 exits and rank 0 (the source) SIGKILLs
  itself, and ranks 1 and 2 check their tensors once both are gone. Rank 2 never calls
  ``register()``: ``broadcast_local`` does.
* ``hosts``: ranks 0-1 and 2-3 see different shm bases (two hosts, as shmreduce tells them
  apart): a call with ranks disagreeing on src, a call too large for host B's base
  (``file_system``: a small tmpfs), one that rank 3 (sharing through a program of its own)
  cannot join, then a good one, then one in a group of ranks 1-3; each rank reports what it got.
* ``other_user``: rank 1 runs as uid 65534 (nobody): the call fails on both ranks.
* ``outsider``: one rank of another job (world 1): it loads $DIST_PAYLOAD (refused), after a
  broadcast_local of its own (its own program).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import shmreduce
from shmreduce.distributed import broadcast_local

from helpers import gone

MIB = 64
N = MIB * 2**20 // 4  # int32 elements
TIMEOUT = datetime.timedelta(seconds=60)


def pss_kib() -> dict[str, int]:
    """This process's PSS in KiB: all of it, and its memory's (anonymous and shared memory:
    the program's text, file pages that grow as code runs for the first time, left out)."""
    with open("/proc/self/smaps_rollup") as f:
        fields = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+):\s+(\d+) kB", f.read(), re.M)}
    return {"all": fields["Pss"], "memory": fields["Pss_Anon"] + fields["Pss_Shmem"]}


def say(rank: int, step: str, **fields: object) -> None:
    print(json.dumps({"rank": rank, "step": step, **fields}), flush=True)


def program_dir() -> str:
    from shmreduce import program

    prog = program.peek()
    return prog.directory if prog is not None else ""


def wide_sum(x: torch.Tensor) -> int:
    """The sum of *x*, in int64 as torch sums integers: no int64 copy of it (that would cost PSS)."""
    return int(x.sum())


def expected_sum(n: int) -> int:
    return n * (n - 1) // 2


class Rows(Dataset):
    """Rows of 1024 int32s of the shared tensor: a DataLoader's workers index it."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x.view(-1, 1024)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def spawn_child(x: torch.Tensor, q: mp.Queue) -> None:
    # A spawn child of a rank: it gets the rank's slice through shmreduce, and writes into it.
    q.put((int(x[:1024].sum(dtype=torch.int64)), shmreduce.stats()["storages_received"]))
    x[7] = -7


def share(rank: int, world: int, strategy: str) -> None:
    before = pss_kib()
    data = {"x": torch.arange(N, dtype=torch.int32), "name": "dataset"} if rank == 0 else None
    got = broadcast_local(data, src=0)
    x = got["x"]
    total = wide_sum(x)  # reads every page
    say(
        rank,
        "got",
        registered=shmreduce.is_registered(),
        strategy=shmreduce.get_sharing_strategy(),
        name=got["name"],
        sum=total,
        expected=expected_sum(N),
        shared=x.untyped_storage().is_shared(),
        directory=program_dir(),
    )
    dist.barrier()
    say(rank, "pss", before=before, after=pss_kib())
    # aliasing: each rank writes its mark, every rank reads all of them
    x[N - 1 - rank] = -(rank + 1)
    dist.barrier()
    say(rank, "marks", marks=[int(x[N - 1 - r]) for r in range(world)])
    dist.barrier()
    for r in range(world):
        x[N - 1 - r] = N - 1 - r
    dist.barrier()

    # the rank's own DataLoader workers (forked), over the shared dataset
    received = shmreduce.stats()["messages_received"]
    ds = Rows(x)
    loader = DataLoader(ds, batch_size=256, num_workers=2, timeout=60, sampler=DistributedSampler(ds, world, rank, shuffle=False))
    s = torch.zeros((), dtype=torch.int64)
    for batch in loader:
        s += batch.sum(dtype=torch.int64)
    del loader
    say(rank, "loader", messages=shmreduce.stats()["messages_received"] - received)
    dist.all_reduce(s)
    say(rank, "loader_sum", sum=int(s))

    # a spawn child of rank 1 writes into the shared tensor; rank 2 sees it
    if rank == 1:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        child = ctx.Process(target=spawn_child, args=(x[:1024], q))
        child.start()
        seen, messages = q.get(timeout=60)
        child.join(60)
        say(rank, "spawn", sum=seen, messages=messages, exitcode=child.exitcode)
    dist.barrier()
    say(rank, "spawn_write", value=int(x[7]))
    dist.barrier()

    # a rank of another job gets this job's bytes (the test runs it now)
    if rank == 0:
        with open(os.environ["DIST_PAYLOAD"] + ".tmp", "wb") as f:
            f.write(shmreduce.dumps(got))
        os.rename(os.environ["DIST_PAYLOAD"] + ".tmp", os.environ["DIST_PAYLOAD"])
        deadline = time.monotonic() + 60
        while not os.path.exists(os.environ["DIST_GO"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    pids: list[int] = [0] * world
    dist.all_gather_object(pids, os.getpid())
    # rank 3 exits (its interpreter's own exit, tensors still held), then the source is
    # killed; the others keep their tensors. Rank 3 lets go of its gloo group first, and
    # the source waits for it: gloo's teardown with a peer SIGKILLed under it can abort
    # ("terminate called without an active exception", exit -6), whatever shmreduce does.
    if rank == 3:
        dist.destroy_process_group()
        raise SystemExit(0)
    if rank == 0:
        deadline = time.monotonic() + 30
        while not gone(pids[3]) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not all(gone(pids[r]) for r in (0, 3)) and time.monotonic() < deadline:
        time.sleep(0.05)
    x[N - 1 - rank] = -(rank + 1)
    deadline = time.monotonic() + 10
    while not (int(x[N - 2]) == -2 and int(x[N - 3]) == -3) and time.monotonic() < deadline:
        time.sleep(0.02)
    say(rank, "after_kill", sum=wide_sum(x[: N // 2]), marks=[int(x[N - 2]), int(x[N - 3])])
    os._exit(0)  # the store lived in rank 0: no more collectives, nor the group's teardown


def hosts(rank: int, world: int, strategy: str) -> None:
    def attempt(step: str, obj: object, src: int, group: object = None) -> object:
        try:
            got = broadcast_local(obj, src=src, group=group)
        except shmreduce.SharingError as exc:
            say(rank, step, error=str(exc))
            return None
        say(rank, step, ok=True)
        return got

    own = shmreduce.dumps(torch.ones(4)) if rank == 3 else None  # rank 3 shares through its own program first
    attempt("disagree", torch.ones(4) if rank == 0 else None, src=rank % 2)  # ranks 1, 3 say src=1
    big = torch.ones(8 * 2**20, dtype=torch.uint8) if rank == 1 else None  # more than host B's 4 MiB
    attempt("too_large", big, src=1)
    attempt("own_program", torch.ones(4) if rank == 1 else None, src=1)  # rank 3 cannot join host B's
    if rank == 3:
        del own
        shmreduce.unregister()  # lets go of its program: the next call joins host B's
        shmreduce.register(strategy=strategy)
    got = attempt("good", {"x": torch.arange(2**17, dtype=torch.int64)} if rank == 1 else None, src=1)
    assert isinstance(got, dict)
    x = got["x"]
    say(rank, "hosts", sum=int(x.sum()), expected=expected_sum(2**17), directory=program_dir())
    dist.barrier()
    x[rank] = -1
    dist.barrier()
    say(rank, "marks", marks=[int(x[r]) for r in range(world)])
    # a group of ranks 1-3: rank 1 alone on host A keeps its object, host B gets it by value
    group = dist.new_group([1, 2, 3])
    if rank:
        mine = torch.full((4,), 5.0)
        sub = attempt("group", {"v": mine} if rank == 1 else None, src=1, group=group)
        assert isinstance(sub, dict)
        say(rank, "group_sum", sum=float(sub["v"].sum()), same=sub["v"] is mine, shared=sub["v"].untyped_storage().is_shared())


def other_user(rank: int, world: int, strategy: str) -> None:
    try:
        broadcast_local({"x": torch.ones(1024)} if rank == 0 else None, src=0)
        say(rank, "call", ok=True)
    except shmreduce.SharingError as exc:
        say(rank, "call", error=str(exc))


def outsider(rank: int, world: int, strategy: str) -> None:
    own = broadcast_local({"x": torch.zeros(16)}, src=0)
    say(rank, "own", directory=program_dir(), ok=float(own["x"].sum()) == 0.0)
    with open(os.environ["DIST_PAYLOAD"], "rb") as f:
        payload = f.read()
    try:
        shmreduce.loads(payload)
        say(rank, "load", ok=True)
    except shmreduce.SharingError as exc:
        say(rank, "load", error=str(exc))


def main() -> None:
    scenario, strategy = sys.argv[1], sys.argv[2]
    if scenario == "other_user" and os.environ["RANK"] == "1":
        os.setuid(65534)
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    if scenario == "share" and rank == 2:
        shmreduce.set_sharing_strategy(strategy)  # not registered: broadcast_local registers it
    else:
        shmreduce.register(strategy=strategy)
    globals()[scenario](rank, world, strategy)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
