"""One copy per host: 4 torchrun ranks sharing a 1 GiB dataset, ``make bench-ddp``.

Method
------
* Jobs: ``torchrun --standalone --nproc-per-node 4`` (gloo, CPU) running this file with
  ``--rank MODE``, one job a mode, one after the other:

  - ``own``: every rank builds its own copy of the dataset (what each rank loading it does
    today);
  - ``shmreduce-fd`` / ``shmreduce-fs``: rank 0 builds it, ``broadcast_local`` hands it to
    every rank (``file_descriptor`` / ``file_system``).

  The dataset: ``x``, 2**20 rows of 1,024 uint8 (1 GiB, every page written), and ``y``,
  2**20 int64 labels (8 MiB).
* Memory: once every rank holds the dataset and has read every byte of it (a checksum,
  compared with rank 0's), every rank reads ``Pss`` from its ``/proc/self/smaps_rollup``; the
  table gives the sum over the 4 ranks, and the sum of what each rank's PSS grew by since
  before the dataset existed (the interpreter, torch and gloo excluded).
* Time until every rank holds it: on rank 0, from just before ``broadcast_local`` (after a
  barrier) to the barrier after every rank returned from it. Against it, the time to map
  1 GiB once: in the same job, before, rank 0 moves a private 1 GiB tensor (built as the
  dataset is) into fresh shared memory with torch's ``share_memory_()`` (a copy into new
  pages, as any sharing of it must do once); the ratio is the first over the second.
* A rank killed mid-run: not under torchrun (its agent stops every rank when one fails, by
  design), but 4 rank processes started as torchrun starts them (RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT): after ``broadcast_local``, rank 3 SIGKILLs itself; ranks 0-2
  check their checksums again once it is gone, and after they exit no broker serves the job's
  shm base and nothing is left in it.
* Each job has its own shm base (``SHMREDUCE_SHM_DIR``, a temporary directory under
  ``/dev/shm``, 6 GiB free needed: ``own`` holds 4 GiB of anonymous memory, ``shmreduce-fs``
  1 GiB of files there). One run, no rounds: the memory numbers do not move from run to run;
  the times are one sample each on a shared machine.

Results go to ``benchmarks/results/ddp.json`` and are printed as the table of
``docs/benchmarks.md`` ("One copy per host").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "ddp.json")
ROWS = int(os.environ.get("BENCH_DDP_ROWS", 2**20))  # fewer to try the harness quickly (and on less /dev/shm)
WIDTH = 1024
GIB = 2**30
WORLD = 4
TIMEOUT = 300


# -- in a rank ------------------------------------------------------------------------


def _pss_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError("no Pss line in /proc/self/smaps_rollup")


def _build():  # -> torch.Tensor, as every mode builds it
    import torch

    x = torch.empty(ROWS, WIDTH, dtype=torch.uint8)
    x[:] = torch.arange(WIDTH, dtype=torch.uint8)  # every page written
    x[:, 0] = (torch.arange(ROWS) % 251).to(torch.uint8)
    return x


def _checksum(data: dict) -> int:
    import torch

    # by blocks of rows: a sum with dtype=int64 of the whole uint8 tensor would first make
    # an int64 copy of it (8 GiB)
    return sum(int(block.sum(dtype=torch.int64)) for block in data["x"].split(4096)) + int(data["y"].sum())


def rank_main(mode: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import shmreduce
    from shmreduce.distributed import broadcast_local

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    before = _pss_kib()
    out: dict = {"mode": mode}
    if mode == "own":
        dist.barrier()
        t0 = time.perf_counter()
        data = {"x": _build(), "y": torch.arange(ROWS)}
        dist.barrier()
        out["hold_s"] = time.perf_counter() - t0
    else:
        if rank == 0:
            once = _build()
            t0 = time.perf_counter()
            once.share_memory_()  # torch's own (not registered yet): a copy into fresh shared memory
            out["map_once_s"] = time.perf_counter() - t0
            del once
        shmreduce.register(strategy="file_descriptor" if mode.endswith("fd") else "file_system")
        data = {"x": _build(), "y": torch.arange(ROWS)} if rank == 0 else None
        dist.barrier()
        t0 = time.perf_counter()
        data = broadcast_local(data, src=0)
        dist.barrier()
        out["hold_s"] = time.perf_counter() - t0
    sums: list = [None] * world
    dist.all_gather_object(sums, _checksum(data))  # every byte read, on every rank
    assert len(set(sums)) == 1, sums
    dist.barrier()
    pss: list = [None] * world
    dist.all_gather_object(pss, (before, _pss_kib()))
    if rank == 0:
        out["pss_kib"] = [after for _before, after in pss]
        out["grown_kib"] = [after - b for b, after in pss]
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def kill_main() -> None:
    """A rank of the kill job: rank 3 is SIGKILLed once every rank holds the dataset."""
    import datetime

    import torch
    import torch.distributed as dist

    import shmreduce
    from shmreduce.distributed import broadcast_local

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    shmreduce.register()
    data = broadcast_local({"x": _build(), "y": torch.arange(ROWS)} if rank == 0 else None, src=0)
    first = _checksum(data)
    pids: list = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pids[3]}") and time.monotonic() < deadline:
        time.sleep(0.05)
    print("KILL " + json.dumps({"rank": rank, "before": first, "after": _checksum(data)}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # a rank of the group is dead: no collective, nor the group's teardown, can finish


# -- the driver -------------------------------------------------------------------------


def _brokers_under(base: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read()
            except OSError:
                continue
            if b"shmreduce.broker.server" in argv and base.encode() + b"/" in argv:
                found.append(int(entry))
    return found


def _left(base: str) -> tuple[list[int], list[str]]:
    """What a job left: brokers serving its base, entries in it (waiting up to 15 s)."""
    deadline = time.monotonic() + 15
    while True:
        brokers, entries = _brokers_under(base), os.listdir(base)
        if not (brokers or entries) or time.monotonic() > deadline:
            return brokers, entries
        time.sleep(0.1)


def _job(mode: str) -> dict:
    base = tempfile.mkdtemp(prefix="bench-ddp-", dir="/dev/shm")
    try:
        env = dict(os.environ, SHMREDUCE_SHM_DIR=base, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD), __file__, "--rank", mode]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT, cwd=ROOT)
        if proc.returncode:
            raise SystemExit(f"{mode} job failed:\n{proc.stdout}\n{proc.stderr}")
        [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        result = json.loads(line[len("RESULT ") :])
        result["job_s"] = time.perf_counter() - t0
        result["left"] = _left(base)
        return result
    finally:
        shutil.rmtree(base, ignore_errors=True)


def rank_envs(base: str, world: int) -> list[dict[str, str]]:
    """The environment of each of *world* rank processes started as torchrun starts them
    (one intra-op thread each; gloo on a free port), sharing through the shm base *base*."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    common = dict(os.environ, SHMREDUCE_SHM_DIR=base, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    return [dict(common, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)) for rank in range(world)]


def _kill_job() -> dict:
    base = tempfile.mkdtemp(prefix="bench-ddp-kill-", dir="/dev/shm")
    procs = []
    try:
        for env in rank_envs(base, WORLD):
            procs.append(subprocess.Popen([sys.executable, __file__, "--kill-rank"], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT))
        ranks = []
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT)
            ranks += [json.loads(ln[len("KILL ") :]) for ln in out.splitlines() if ln.startswith("KILL ")]
        return {"codes": [p.returncode for p in procs], "ranks": ranks, "left": _left(base)}
    finally:
        end_job(procs, base)


def end_job(procs: list[subprocess.Popen], base: str) -> None:
    """Kill the ranks of a job still running, and remove its shm base."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shutil.rmtree(base, ignore_errors=True)


def _table(results: dict) -> str:
    own = results["own"]
    lines = [
        "| 4 ranks, 1 GiB dataset | sum of PSS | PSS grown by the dataset | time until every rank holds it | vs mapping 1 GiB once |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for mode in ("own", "shmreduce-fd", "shmreduce-fs"):
        r = results[mode]
        ratio = f"{r['hold_s'] / r['map_once_s']:.2f}x ({r['map_once_s']:.2f} s)" if "map_once_s" in r else "-"
        lines.append(
            f"| {mode} | {sum(r['pss_kib']) / 2**20:.2f} GiB | {sum(r['grown_kib']) / 2**20:.2f} GiB | {r['hold_s']:.2f} s | {ratio} |"
        )
    kill = results["kill"]
    intact = all(r["before"] == r["after"] for r in kill["ranks"]) and len(kill["ranks"]) == WORLD - 1
    lines.append("")
    lines.append(
        f"Rank 3 SIGKILLed after every rank held the dataset: ranks 0-2 {'kept' if intact else 'LOST'} their bytes "
        f"(exit codes {kill['codes']}); left afterwards: {len(kill['left'][0])} brokers, {len(kill['left'][1])} entries "
        f"in the job's shm base (own: {len(own['left'][1])}, fd: {len(results['shmreduce-fd']['left'][1])}, "
        f"fs: {len(results['shmreduce-fs']['left'][1])})."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    parser.add_argument("--kill-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--from-results", help="print the table of a stored results file, measuring nothing")
    args = parser.parse_args()
    if args.rank:
        rank_main(args.rank)
        return
    if args.kill_rank:
        kill_main()
        return
    if args.from_results:
        with open(args.from_results) as f:
            print(_table(json.load(f)))
        return
    free, needed = shutil.disk_usage("/dev/shm").free, 6 * ROWS * WIDTH
    if free < needed:
        raise SystemExit(f"/dev/shm has {free / GIB:.1f} GiB free; this benchmark needs {needed / GIB:.1f} GiB")
    results = {}
    for mode in ("own", "shmreduce-fd", "shmreduce-fs"):
        results[mode] = _job(mode)
        print(f"{mode}: {json.dumps(results[mode])}", flush=True)
    results["kill"] = _kill_job()
    print(f"kill: {json.dumps(results['kill'])}", flush=True)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=1)
    print(_table(results))


if __name__ == "__main__":
    main()
