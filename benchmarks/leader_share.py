"""The leader's share and the first reads of ``broadcast_local``, against torch mapping it once.

``make bench-ddp`` times a whole 4-rank job; this takes one ``broadcast_local`` of one large
tensor apart, on 2 ranks of this host (gloo, started as torchrun starts them, with its
``OMP_NUM_THREADS=1``):

* Leader (rank 0), from the same tensor built again each time (every page written):
  ``map once``, torch's ``share_memory_()`` before shmreduce is registered (a copy into
  fresh shared memory: what any sharing of it must do once); ``one pwrite``, the same
  bytes written into a fresh memfd by one ``pwrite`` (the cheapest way for one core to fill
  fresh shared memory); the same into a fresh memfd mapped here, each of 3 threads or
  more allocating its part's pages and copying through the mapping (``_native.write``);
  then ``broadcast_local`` under each strategy (after a first call, which starts the
  program's broker, timed on its own), split into the
  leader's ``_offer`` and its ``registry.dumps`` (the move into a segment; the rest is the
  broker's start and the key file), with the leader's CPU seconds (every thread) for each.
* The other rank: its load (``registry.loads``: the mapping) and first full read
  (``x.view(torch.int64).sum()``) of the received tensor, with the segment mapped as
  ``pool`` maps it today (a page fault per 64 KiB: the kernel maps a fault's neighbours
  with it), with ``MAP_POPULATE``, and with ``MADV_POPULATE_READ`` after the mapping,
  each against the same read of a private copy (pages already there).

``--compare-with DIR``: run the same measurement with the shmreduce tree at *DIR* too (a
``git archive`` of another commit, its extension built in place), printed side by side:
before and after a change, in one run. Prints a table; writes nothing.

``--shm-dir DIR``: the tmpfs mount the job's shm base (and so the file_system segments) goes
in, to compare its ``huge=`` options; memfds follow ``shmem_enabled`` (docs/benchmarks.md).

Run: ``python benchmarks/leader_share.py [--mib 1024] [--compare-with /tmp/base] [--shm-dir
/dev/shm]``. Needs 3x the size free in the shm dir and about 4x in memory.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import bench_ddp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORLD = 2
READS = ("today", "MAP_POPULATE", "MADV_POPULATE_READ")
MAP_POPULATE = 0x8000
MADV_POPULATE_READ = 22


def _build(nbytes: int) -> Any:
    import torch

    x = torch.empty(nbytes, dtype=torch.uint8)
    x.view(-1, 1024)[:] = torch.arange(1024, dtype=torch.uint8)  # every page written
    return x


def _timed(fn: Any) -> tuple[Any, float, float]:
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def _one_pwrite(x: Any) -> None:
    fd = os.memfd_create("leader-share")
    try:
        view, done = memoryview(x.numpy()), 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], done)
    finally:
        os.close(fd)


def _mapped_write(x: Any, threads: int) -> None:
    """The bytes of *x* into a fresh memfd mapped here, on *threads* threads, each
    allocating its part's pages (``MADV_POPULATE_WRITE``) and copying through the mapping:
    ``_native.write`` with a mapping. TypeError in a tree whose ``write`` takes none."""
    from shmreduce import _native, _platform

    fd = os.memfd_create("leader-share")
    try:
        os.ftruncate(fd, x.nbytes())
        addr = _platform.map_shared(fd, x.nbytes())
        try:
            _native.write(fd, x.data_ptr(), x.nbytes(), 0, addr, threads)
        finally:
            _platform.unmap(addr, x.nbytes())
    finally:
        os.close(fd)


def _map_variant(how: str) -> None:
    """Map received segments as *how* says, in this rank (``pool`` maps through
    ``_platform.map_shared``)."""
    from shmreduce import _platform

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    today = _platform.__dict__.setdefault("_today_map_shared", _platform.map_shared)

    def map_shared(fd: int, size: int) -> int:
        if size < 1 << 20 or how == "today":
            return today(fd, size)
        if how == "MAP_POPULATE":
            addr = libc.mmap(None, size, 0x3, 0x01 | MAP_POPULATE, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), "mmap")
            return int(addr)
        addr = today(fd, size)
        libc.madvise(addr, size, MADV_POPULATE_READ)
        return addr

    _platform.map_shared = map_shared


def _leader_floors(nbytes: int) -> dict[str, Any]:
    """On the leader, before shmreduce is registered: torch mapping the tensor once, one
    pwrite of it, and the populated copy on several threads."""
    out: dict[str, Any] = {}
    x = _build(nbytes)
    _, out["map_once_s"], out["map_once_cpu"] = _timed(x.share_memory_)
    x = _build(nbytes)
    _, out["pwrite_s"], out["pwrite_cpu"] = _timed(lambda: _one_pwrite(x))
    out["mapped_threads"] = max(3, len(os.sched_getaffinity(0)))
    try:
        _, out["mapped_s"], out["mapped_cpu"] = _timed(lambda: _mapped_write(x, out["mapped_threads"]))
    except TypeError:
        pass  # a tree without it
    return out


@contextmanager
def _phases_timed(phases: dict[str, float]) -> Iterator[None]:
    """The leader's ``_offer`` and ``registry.dumps``, a rank's ``registry.loads``, timed
    into *phases* (wall and CPU seconds) while inside."""
    from shmreduce import distributed, registry

    places = {"offer": (distributed, "_offer"), "dumps": (registry, "dumps"), "loads": (registry, "loads")}
    saved = {key: getattr(owner, name) for key, (owner, name) in places.items()}

    def timed(key: str) -> Any:
        def call(*args: Any) -> Any:
            got, phases[f"{key}_s"], phases[f"{key}_cpu"] = _timed(lambda: saved[key](*args))
            return got

        return call

    for key, (owner, name) in places.items():
        setattr(owner, name, timed(key))
    try:
        yield
    finally:
        for key, (owner, name) in places.items():
            setattr(owner, name, saved[key])


def rank_main(nbytes: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import shmreduce
    from shmreduce import distributed, transfer

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    out = _leader_floors(nbytes) if rank == 0 else {}
    for strategy in ("file_descriptor", "file_system"):
        shmreduce.register(strategy=strategy)
        # A first call starts the program's broker (once per program): its own row.
        _, out[f"{strategy}/first_call_s"], _ = _timed(lambda: distributed.broadcast_local(torch.ones(4), src=0))
        for how in READS:
            if rank != 0:
                _map_variant(how)
            x = _build(nbytes) if rank == 0 else None
            phases: dict[str, float] = {}
            with _phases_timed(phases):
                dist.barrier()
                t0 = time.perf_counter()
                x = distributed.broadcast_local(x, src=0)
                dist.barrier()
                phases["hold_s"] = time.perf_counter() - t0
            if rank != 0:
                # Every byte read, 8 at a time (a uint8 sum costs torch 10x more than the
                # faults, and would hide them).
                _, phases["first_read_s"], _ = _timed(x.view(torch.int64).sum)
                private = x.clone()
                private.view(torch.int64).sum()
                _, phases["private_read_s"], _ = _timed(private.view(torch.int64).sum)
                del private
            got: list[Any] = [None] * WORLD
            dist.all_gather_object(got, phases)
            if rank == 0:
                out[f"{strategy}/{how}"] = {**got[0], **got[1]}
            del x
            gc.collect()
            transfer.collect()
            dist.barrier()
        shmreduce.unregister()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _job(tree: str, nbytes: int, shm_dir: str) -> dict[str, Any]:
    base = tempfile.mkdtemp(prefix="leader-share-", dir=shm_dir)
    procs = []
    try:
        for env in bench_ddp.rank_envs(base, WORLD):
            cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(nbytes)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(env, PYTHONPATH=tree), cwd=tree))
        outs = [p.communicate(timeout=900)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"a rank failed under {tree}:\n" + "\n".join(outs))
        [line] = [ln for ln in outs[0].splitlines() if ln.startswith("RESULT ")]
        return json.loads(line[len("RESULT ") :])
    finally:
        bench_ddp.end_job(procs, base)


def _table(results: dict[str, dict[str, Any]], mib: int) -> str:
    lines = [
        f"{mib} MiB, 2 ranks, OMP_NUM_THREADS=1; times in s (CPU s of the leader's process); ratios against torch's share_memory_()",
        "",
        "| tree | row | wall | CPU | vs map once |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for tree, r in results.items():
        once = r["map_once_s"]
        lines.append(f"| {tree} | map once (share_memory_) | {once:.3f} | {r['map_once_cpu']:.3f} | 1.00x |")
        lines.append(f"| {tree} | one pwrite into a memfd | {r['pwrite_s']:.3f} | {r['pwrite_cpu']:.3f} | {r['pwrite_s'] / once:.2f}x |")
        if "mapped_s" in r:
            what = f"populated and copied on {r['mapped_threads']} threads into a memfd"
            lines.append(f"| {tree} | {what} | {r['mapped_s']:.3f} | {r['mapped_cpu']:.3f} | {r['mapped_s'] / once:.2f}x |")
        for strategy in ("file_descriptor", "file_system"):
            lines.append(f"| {tree} | {strategy}: first call (4 floats; starts the broker) | {r[f'{strategy}/first_call_s']:.3f} | | |")
            p = r[f"{strategy}/today"]
            lines.append(
                f"| {tree} | {strategy}: dumps (the move) | {p['dumps_s']:.3f} | {p['dumps_cpu']:.3f} | {p['dumps_s'] / once:.2f}x |"
            )
            lines.append(f"| {tree} | {strategy}: _offer | {p['offer_s']:.3f} | {p['offer_cpu']:.3f} | {p['offer_s'] / once:.2f}x |")
            lines.append(f"| {tree} | {strategy}: every rank holds it | {p['hold_s']:.3f} | | {p['hold_s'] / once:.2f}x |")
    lines += [
        "",
        "The other rank: its load (the mapping, populated or not) and its first read of every byte, against reading a private copy",
        "",
        "| tree | strategy | segment mapped | load | first read | load + first read vs private read |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for tree, r in results.items():
        for strategy in ("file_descriptor", "file_system"):
            for how in READS:
                p = r[f"{strategy}/{how}"]
                ratio = (p["loads_s"] + p["first_read_s"]) / p["private_read_s"]
                private = f"{ratio:.2f}x ({p['private_read_s']:.3f})"
                lines.append(f"| {tree} | {strategy} | {how} | {p['loads_s']:.3f} | {p['first_read_s']:.3f} | {private} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mib", type=int, default=1024, help="the tensor's size (default 1024)")
    parser.add_argument("--compare-with", metavar="DIR", help="another shmreduce tree, measured in the same run")
    parser.add_argument("--shm-dir", default="/dev/shm", help="the tmpfs mount file_system segments go to (its huge= option)")
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank)
        return
    nbytes = args.mib << 20
    if shutil.disk_usage(args.shm_dir).free < 3 * nbytes:
        raise SystemExit(f"{args.shm_dir} needs {3 * nbytes / 2**30:.1f} GiB free")
    trees = {"this tree": ROOT}
    if args.compare_with:
        trees = {os.path.basename(os.path.normpath(args.compare_with)): os.path.abspath(args.compare_with), **trees}
    results = {name: _job(tree, nbytes, args.shm_dir) for name, tree in trees.items()}
    print(_table(results, args.mib))


if __name__ == "__main__":
    main()
