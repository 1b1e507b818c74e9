"""The benchmark harness every scenario shares: the rows (implementations) and how each
is configured, encodes and decodes a message, the messages, and the processes' bookkeeping
(joining, descriptors, CPU seconds from ``/proc``, the broker's pids)."""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (installs torch's reducers into ForkingPickler)

import shmreduce

CTX = mp.get_context("fork")
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
JOIN_TIMEOUT = 10.0  # joining a trial's processes
GET_TIMEOUT = 5.0  # one message; a row that stalls this long fails, and is skipped in later rounds
KIB, MIB = 1024, 1024 * 1024

# -- implementations ------------------------------------------------------------------

IMPLS = ["shmreduce-fd", "torch-fd", "shmreduce-fs", "torch-fs", "by-value", "floor"]
PEERS = ["shm-recipe", "tensordict-torch", "tensordict-shmreduce", "memcpy", "make-only"]  # other ways to move the bytes, and floors
STRATEGY = {
    "shmreduce-fd": "file_descriptor",
    "torch-fd": "file_descriptor",
    "shmreduce-fs": "file_system",
    "torch-fs": "file_system",
    "tensordict-shmreduce": "file_descriptor",
    "tensordict-torch": "file_descriptor",
}
REGISTERED = {"shmreduce-fd", "shmreduce-fs", "tensordict-shmreduce"}  # rows with shmreduce.register()
BASELINE = {"shmreduce-fd": "torch-fd", "shmreduce-fs": "torch-fs", "torch-fs": "torch-fs"}  # others: torch-fd
BASELINE_OF = {"7": "by-value", "8a": "by-value", "8b": "by-value"}  # scenarios whose ratio column is against another row than torch
TENSORDICT_ROWS = {"tensordict-torch", "tensordict-shmreduce"}


def configure(impl: str) -> None:
    """Put this (parent) process in the state the row needs before forking."""
    shmreduce.unregister()
    if impl in REGISTERED:
        shmreduce.register(strategy=STRATEGY[impl])
    else:
        torch.multiprocessing.set_sharing_strategy(STRATEGY.get(impl, "file_descriptor"))
    if impl == "shm-recipe":
        resource_tracker.ensure_running()  # one tracker shared by producer and consumer


def deconfigure() -> None:
    shmreduce.unregister()
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    # Stop the tracker shm-recipe started (it would warn about, and unlink, any block the
    # trial leaked), so that later rows' children do not inherit its descriptor. Private,
    # but stdlib 3.8-3.13 all have it.
    resource_tracker._resource_tracker._stop()


def encode(impl: str, msg: Any, seq: int) -> Any:
    """What the producer puts on the wire for ``msg`` under ``impl``."""
    if impl in ("floor", "make-only"):
        return seq
    if impl == "by-value":
        if isinstance(msg, dict):
            return {k: v.numpy() for k, v in msg.items()}
        return msg.numpy()
    if impl == "shm-recipe":
        return RecipeMessage.send(msg)
    if impl in TENSORDICT_ROWS:
        from tensordict import TensorDict

        return TensorDict(msg, batch_size=[]).consolidate()
    return msg


def decode(obj: Any) -> Any:
    """Consumer side of ``encode``: by-value and shm-recipe rows get tensors back."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict) and obj and isinstance(next(iter(obj.values())), np.ndarray):
        return {k: torch.from_numpy(v) for k, v in obj.items()}
    if isinstance(obj, RecipeMessage):
        return obj.receive()
    return obj


def discard(obj: Any) -> None:
    """A message the producer made but never sent: release what it holds (shm-recipe's block)."""
    if isinstance(obj, RecipeMessage):
        obj.unlink()


@dataclass(frozen=True)
class RecipeMessage:
    """The ``multiprocessing.shared_memory`` recipe: one new block per message.

    ``keys`` is None for a single tensor; ``layout`` holds each tensor's (offset, nbytes,
    dtype, shape) in the block.
    """

    name: str
    keys: tuple[str, ...] | None
    layout: tuple[tuple[int, int, torch.dtype, tuple[int, ...]], ...]

    @classmethod
    def send(cls, msg: torch.Tensor | dict[str, torch.Tensor]) -> RecipeMessage:
        keys = tuple(msg) if isinstance(msg, dict) else None
        tensors = list(msg.values()) if isinstance(msg, dict) else [msg]
        layout, end = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            layout.append((end, nbytes, t.dtype, tuple(t.shape)))
            end += -(-nbytes // 64) * 64
        shm = SharedMemory(create=True, size=max(end, 1))
        block = torch.frombuffer(shm.buf, dtype=torch.uint8)
        for t, (offset, nbytes, _, _) in zip(tensors, layout, strict=True):
            block[offset : offset + nbytes].copy_(t.reshape(-1).view(torch.uint8))
        del block  # releases the export of shm.buf, so that close() may unmap it
        shm.close()
        return cls(shm.name, keys, tuple(layout))

    def receive(self) -> torch.Tensor | dict[str, torch.Tensor]:
        shm = SharedMemory(name=self.name)
        block = torch.frombuffer(shm.buf, dtype=torch.uint8)
        tensors = [block[offset : offset + nbytes].view(dtype).view(shape).clone() for offset, nbytes, dtype, shape in self.layout]
        del block
        shm.close()
        shm.unlink()
        return tensors[0] if self.keys is None else dict(zip(self.keys, tensors, strict=True))

    def unlink(self) -> None:
        shm = SharedMemory(name=self.name)
        shm.close()
        shm.unlink()


def tensordict_missing() -> str | None:
    """Why the tensordict rows cannot run here, or None. Imported in the parent, before any fork."""
    try:
        import tensordict  # noqa: F401
    except Exception as exc:  # not installed, or built against another torch
        return f"{type(exc).__name__}: {exc}"
    return None


# -- message factories ----------------------------------------------------------------


def one_small(seq: int) -> torch.Tensor:
    return torch.full((KIB // 4,), float(seq), dtype=torch.float32)


def dict_small(seq: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((KIB // 4,), float(seq + i), dtype=torch.float32) for i in range(64)}


def one_large(seq: int) -> torch.Tensor:
    return torch.empty(64 * MIB // 4, dtype=torch.float32).fill_(float(seq))


# payload bytes per message; the parent never builds a tensor itself: a parallel fill
# in the parent starts OpenMP threads, and forked children then hang in their own fills.
MSG_BYTES = {one_small: KIB, dict_small: 64 * KIB, one_large: 64 * MIB}


# -- process plumbing -----------------------------------------------------------------


def run_children(*procs: mp.Process) -> None:
    for p in procs:
        p.start()


def join_all(procs: list[mp.Process], timeout: float = JOIN_TIMEOUT) -> None:
    """Join every process; terminate, then kill, whatever overstays."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(3)
        if p.is_alive():
            p.kill()
            p.join(3)


def get_result(results: Any, procs: list[mp.Process], timeout: float) -> dict:
    try:
        return results.get(timeout=timeout)
    finally:
        join_all(procs)


def shmreduce_stat(name: str) -> int:
    return int(shmreduce.stats().get(name, 0)) if shmreduce.is_registered() else 0


def fd_count(pid: int | str = "self") -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def memfd_mappings(pid: int | str = "self") -> tuple[int, int]:
    """Distinct memfd segments mapped by ``pid`` and their total size in bytes."""
    seen: dict[str, int] = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if "/memfd:" not in line or "/memfd:shmreduce-ledger" in line:
                continue  # not a memfd, or shmreduce's ledger (what the process holds), no segment
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            seen[fields[4]] = max(seen.get(fields[4], 0), hi - lo)  # by inode
    return len(seen), sum(seen.values())


def dev_shm_bytes() -> int:
    total = 0
    for root, _, files in os.walk("/dev/shm"):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def broker_pids(root: int | None = None) -> list[int]:
    """Every shmreduce broker process on the machine; with *root*, only those of the
    program whose root process that is (the last argument of a broker's command line)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if b"shmreduce" in cmd and b"broker" in cmd and (root is None or cmd.split(b"\0")[-2:-1] == [str(root).encode()]):
                pids.append(int(entry))
    return pids


def process_report() -> dict:
    segs, nbytes = memfd_mappings()
    return {"fds": fd_count(), "memfd_segments": segs, "memfd_bytes": nbytes}


def cpu_seconds(pid: int, tid: int | None = None) -> float | None:
    """CPU seconds *pid* ran (every thread of it), or its thread *tid*; None if it
    is gone. From ``schedstat`` (nanoseconds on the CPU), not ``stat``'s clock ticks
    (10 ms each: a broker's few milliseconds per run would be all rounding)."""
    tids = [str(tid)] if tid is not None else None
    try:
        if tids is None:
            tids = os.listdir(f"/proc/{pid}/task")
        total = 0
        for t in tids:
            try:
                with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                    total += int(f.read().split()[0])
            except FileNotFoundError:
                continue  # a thread that exited meanwhile (its time is lost to both reads)
    except OSError:
        return None
    return total / 1e9


def program_cpu(pids: list[int]) -> float:
    """CPU seconds of every thread of *pids*, those gone left out."""
    return sum(cpu_seconds(pid) or 0.0 for pid in pids)


@dataclass(frozen=True)
class Budget:
    seconds: float  # timed wall time per throughput trial
    busy_msgs: int  # messages per busy-sender trial
    held: int  # tensors kept in scenario 6
    keep: int = 3000  # messages kept in scenario 7


def machine() -> dict:
    return {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "start_method": "fork",
    }
