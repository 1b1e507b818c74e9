"""shmreduce benchmark: shmreduce against torch.multiprocessing, its other peers and a floor.

Method
------
* Start method: ``fork`` everywhere (producer, consumer and DataLoader workers). A forked
  child inherits the parent's registration state and sharing strategy directly.
* Implementations (rows): ``shmreduce-fd`` / ``shmreduce-fs`` (``shmreduce.register(strategy=...)``
  before the processes are created, ``shmreduce.unregister()`` after they are joined);
  ``torch-fd`` / ``torch-fs`` (shmreduce unregistered,
  ``torch.multiprocessing.set_sharing_strategy``); ``by-value`` (the producer sends
  ``tensor.numpy()``, which ForkingPickler pickles by value: every byte goes through the
  pipe, the consumer turns it back into a tensor with ``torch.from_numpy``); ``floor``
  (a bare int through the same queue: the cost of the transport itself).
* Peers of issue 12, in the same rounds: ``shm-recipe`` (scenarios 1-3), the
  ``multiprocessing.shared_memory`` recipe: per message the producer creates one
  ``SharedMemory`` block, copies all the message's tensors into it at 64-byte aligned offsets
  and puts the block's name with each tensor's offset, dtype and shape on the same queue; the
  consumer maps the block, copies the tensors out (``clone``), closes and unlinks it. The
  stdlib's resource tracker is started in the parent for this row only (so producer and
  consumer share one, as the recipe needs: the producer's create registers the name, the
  consumer's unlink unregisters it) and stopped after the trial; its registrations are part of
  the recipe's cost. ``tensordict-torch`` / ``tensordict-shmreduce`` (scenario 2): the dict
  as ``TensorDict(msg, batch_size=[]).consolidate()`` (built per message by the producer,
  one uint8 storage holding all 64 tensors), sent through torch's reducers (file_descriptor,
  shmreduce unregistered) or through shmreduce's (registered, file_descriptor); left out, with
  the reason printed, if ``tensordict`` does not import. ``memcpy`` (scenario 3): a child
  process copies a 64 MiB buffer into another, both written beforehand so every page is
  faulted in, with ``ctypes.memmove`` (glibc ``memcpy``, single-threaded, independent of
  torch's intra-op thread pool) for the same timed wall time: the copy bandwidth of one core,
  against which the 64 MiB goal ("at least half of memcpy") is set. ``make-only`` (scenario 3):
  the producer builds every message as the other rows' producers do (a fresh 64 MiB tensor,
  filled) and puts only its sequence number: the most any row can move in this harness, since
  every row's producer pays for its fresh tensor (its page faults and its fill) before sharing it.
* Every trial is a fresh producer and a fresh consumer process over an ``mp.Queue``
  (bounded, so a fast producer cannot pile up shared memory). The producer builds fresh
  tensors for every message until the consumer says stop; the consumer times the messages
  after the first one (warm-up) for a fixed wall time. Both are joined with timeouts
  (then terminated, then killed) so nothing is left running.
* Rounds alternate the implementations (A B C ... A B C ..., the order reversed every other
  round) so machine noise hits all rows alike; the table reports the median over rounds
  and the ratio of that median against torch with the same strategy.
* Scenario 4 (busy sender) uses an ``mp.Pipe`` instead of a queue so that the consumer can
  separate waiting from unpickling: it takes the message bytes with ``recv_bytes()``
  (the message is already there) and times only ``ForkingPickler.loads`` of them, which
  is where a receiver fetches descriptors (torch: from the sender's resource_sharer
  thread; shmreduce: from its broker). The producer spins 2 ms in pure Python after
  each ``send``. The message is one 1 KiB tensor.
* Scenario 5 times ``next()`` on a ``DataLoader`` iterator (2 workers, batch 16) after the
  first batch; "stock" is torch's default strategy (file_descriptor).
* Scenario 6: the consumer receives and keeps 1,000 1 KiB tensors, then both processes
  report ``/proc/self/fd`` entries and memfd mappings in ``/proc/self/maps`` (distinct
  segments and bytes); ``/dev/shm`` growth and the descriptors held by the shmreduce
  broker (if one runs) are measured from outside while the tensors are still held.
* Round trips per message (rows with shmreduce registered): delta of
  ``shmreduce.stats()["round_trips"]`` on the consumer (receiver) side over the timed
  messages, divided by their count.
* Goals (issue 20) are evaluated on the medians: a ratio goal divides a row's median by
  another row's of the same scenario (oriented so that > 1 is better); "ahead of" a row means
  a ratio of at least 1. Each goal prints PASS/FAIL with its number.

Run: ``python benchmarks/bench.py [--quick] [--rounds N] [--update-readme]``.
Writes ``benchmarks/results/results.json`` and ``benchmarks/results/chart.png``; with
``--update-readme``, README.md's summary table (one row per scenario) and the full table in
docs/benchmarks.md, each between the bench markers. ``--from-results results.json`` measures
nothing: it draws the chart and the tables again from stored results (``make bench-chart``).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import multiprocessing as mp
import os
import platform
import queue
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.reduction import ForkingPickler
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
README = HERE.parent / "README.md"
BENCH_DOC = HERE.parent / "docs" / "benchmarks.md"  # the full table; README has the summary
MARK_START, MARK_END = "<!-- bench:start -->", "<!-- bench:end -->"
JOIN_TIMEOUT = 10.0  # joining a trial's processes
GET_TIMEOUT = 5.0  # one message; a row that stalls this long fails, and is skipped in later rounds
KIB, MIB = 1024, 1024 * 1024

# -- implementations ------------------------------------------------------------------

IMPLS = ["shmreduce-fd", "torch-fd", "shmreduce-fs", "torch-fs", "by-value", "floor"]
PEERS = ["shm-recipe", "tensordict-torch", "tensordict-shmreduce", "memcpy", "make-only"]  # issue 12
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
BASELINE_OF = {"7": "by-value"}  # scenarios whose ratio column is against another row than torch
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


# -- scenarios 1-3: throughput over mp.Queue --------------------------------------------


def queue_producer(impl: str, make: Callable[[int], Any], q: Any, stop: Any, done: Any) -> None:
    seq = 0
    while not stop.is_set():
        msg = seq if impl == "floor" else encode(impl, make(seq), seq)
        sent = False
        while not stop.is_set():
            try:
                q.put(msg, timeout=0.05)
                sent = True
                break
            except queue.Full:
                continue
        if not sent:
            discard(msg)
        del msg
        seq += 1
    q.put(None)
    q.close()
    q.join_thread()
    done.wait(JOIN_TIMEOUT)  # torch-fd serves descriptors from this process until drained


def queue_consumer(q: Any, stop: Any, done: Any, results: Any, seconds: float, nbytes: int) -> None:
    try:
        results.put(consume(q, stop, seconds, nbytes))
    except Exception as exc:
        stop.set()
        results.put({"error": f"consumer: {type(exc).__name__}: {exc}"})
    finally:
        done.set()


def consume(q: Any, stop: Any, seconds: float, nbytes: int) -> dict:
    decode(q.get(timeout=GET_TIMEOUT))  # warm-up: first share, broker start, ...
    rt0 = shmreduce_stat("round_trips")
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        obj = decode(q.get(timeout=GET_TIMEOUT))
        del obj
        count += 1
    elapsed = time.perf_counter() - t0
    rt = shmreduce_stat("round_trips") - rt0
    stop.set()
    while decode(q.get(timeout=GET_TIMEOUT)) is not None:  # drain until the producer's sentinel
        pass  # (decoded: shm-recipe's consumer unlinks each block)
    return {
        "msgs": count,
        "seconds": elapsed,
        "msg_per_s": count / elapsed,
        "gb_per_s": count * nbytes / elapsed / 1e9,
        "round_trips_per_msg": rt / count,
    }


def throughput_trial(impl: str, make: Callable[[int], Any], seconds: float, maxsize: int) -> dict:
    q, stop, done, results = CTX.Queue(maxsize), CTX.Event(), CTX.Event(), CTX.Queue()
    nbytes = MSG_BYTES[make]
    procs = [
        CTX.Process(target=queue_producer, args=(impl, make, q, stop, done), daemon=True),
        CTX.Process(target=queue_consumer, args=(q, stop, done, results, seconds, nbytes), daemon=True),
    ]
    run_children(*procs)
    return get_result(results, procs, seconds + JOIN_TIMEOUT)


def memcpy_worker(seconds: float, nbytes: int, results: Any) -> None:
    src, dst = (ctypes.c_char * nbytes)(), (ctypes.c_char * nbytes)()
    ctypes.memset(src, 1, nbytes)  # every page of both buffers faulted in before timing
    ctypes.memset(dst, 0, nbytes)
    ctypes.memmove(dst, src, nbytes)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        ctypes.memmove(dst, src, nbytes)
        count += 1
    elapsed = time.perf_counter() - t0
    results.put({"copies": count, "seconds": elapsed, "gb_per_s": count * nbytes / elapsed / 1e9})


def memcpy_trial(seconds: float, nbytes: int) -> dict:
    """Single-threaded memcpy bandwidth between two faulted-in buffers, in a fresh child."""
    results = CTX.Queue()
    procs = [CTX.Process(target=memcpy_worker, args=(seconds, nbytes, results), daemon=True)]
    run_children(*procs)
    return get_result(results, procs, seconds + JOIN_TIMEOUT)


def large_trial(impl: str, seconds: float) -> dict:
    if impl == "memcpy":
        return memcpy_trial(seconds, MSG_BYTES[one_large])
    return throughput_trial(impl, one_large, seconds, 3)


# -- scenario 4: busy sender, consumer unpickle latency ----------------------------------


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def busy_producer(impl: str, conn: Any, count: int) -> None:
    for seq in range(count + 1):
        conn.send(seq if impl == "floor" else encode(impl, one_small(seq), seq))
        spin(0.002)
    conn.send(None)
    conn.poll(JOIN_TIMEOUT)  # wait until the consumer is done: torch-fd serves fds from this process
    conn.close()


def busy_consumer(conn: Any, results: Any) -> None:
    try:
        results.put(measure_unpickle(conn))
    except Exception as exc:
        results.put({"error": f"consumer: {type(exc).__name__}: {exc}"})


def measure_unpickle(conn: Any) -> dict:
    latencies = []
    rt0 = None
    while True:
        if not conn.poll(GET_TIMEOUT):
            raise TimeoutError(f"no message for {GET_TIMEOUT} s")
        data = conn.recv_bytes()
        t0 = time.perf_counter()
        obj = decode(ForkingPickler.loads(data))
        latencies.append(time.perf_counter() - t0)
        if obj is None:
            break
        if rt0 is None:
            rt0 = shmreduce_stat("round_trips")
            latencies.clear()  # first message is warm-up
        del obj
    latencies.pop()  # the sentinel
    count = len(latencies)
    rt = shmreduce_stat("round_trips") - (rt0 or 0)
    conn.send("done")
    ms = np.array(latencies) * 1e3
    return {
        "msgs": count,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "round_trips_per_msg": rt / max(count, 1),
    }


def busy_trial(impl: str, count: int) -> dict:
    a, b = CTX.Pipe()
    results = CTX.Queue()
    procs = [
        CTX.Process(target=busy_producer, args=(impl, a, count), daemon=True),
        CTX.Process(target=busy_consumer, args=(b, results), daemon=True),
    ]
    run_children(*procs)
    return get_result(results, procs, count * 0.01 + JOIN_TIMEOUT)


# -- scenario 5: DataLoader --------------------------------------------------------------


class DictSamples(torch.utils.data.Dataset):
    """Samples that are dicts of 32 small tensors."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {f"f{k}": torch.full((16,), float(i + k)) for k in range(32)}


class ImageSamples(torch.utils.data.Dataset):
    """Image-like samples: 3x224x224 uint8."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 224, 224), i % 251, dtype=torch.uint8)


def loader_trial(dataset_cls: type, seconds: float, max_batches: int) -> dict:
    loader = torch.utils.data.DataLoader(
        dataset_cls(16 * (max_batches + 1)), batch_size=16, num_workers=2, multiprocessing_context=CTX, timeout=GET_TIMEOUT
    )
    it = iter(loader)
    next(it)  # warm-up: workers started
    rt0 = shmreduce_stat("round_trips")
    count, t0 = 0, time.perf_counter()
    for _ in it:
        count += 1
        if time.perf_counter() - t0 >= seconds:
            break
    elapsed = time.perf_counter() - t0
    rt = shmreduce_stat("round_trips") - rt0
    it._shutdown_workers()  # joins the workers (with torch's own timeouts)
    del it, loader
    return {"batches": count, "batches_per_s": count / elapsed, "round_trips_per_msg": rt / max(count, 1)}


# -- scenario 6: what keeping 1,000 tensors holds --------------------------------------


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


def holding_producer(impl: str, q: Any, ctl: Any, count: int) -> None:
    for seq in range(count):
        q.put(encode(impl, one_small(seq), seq))
    if ctl.poll(JOIN_TIMEOUT + count * 0.02):  # consumer holds everything now
        ctl.recv()
        ctl.send(process_report())
        ctl.poll(JOIN_TIMEOUT)
    q.close()
    q.join_thread()


def holding_consumer(q: Any, ctl: Any, count: int) -> None:
    kept = [decode(q.get(timeout=GET_TIMEOUT)) for _ in range(count)]
    ctl.send(process_report())
    ctl.poll(JOIN_TIMEOUT)
    del kept


def keeping_reports(impl: str, cons_ctl: Any, prod_ctl: Any, timeout: float) -> tuple[dict, dict]:
    """What the consumer reports once it keeps everything, then the producer's."""
    if not cons_ctl.poll(timeout):
        raise RuntimeError(f"{impl}: the consumer did not receive everything in {timeout:.0f} s")
    consumer = cons_ctl.recv()
    prod_ctl.send("report")
    return consumer, (prod_ctl.recv() if prod_ctl.poll(JOIN_TIMEOUT) else {})


def holding_trial(impl: str, count: int) -> dict:
    q = CTX.Queue()
    prod_ctl, prod_end = CTX.Pipe()
    cons_ctl, cons_end = CTX.Pipe()
    shm0, brokers0 = dev_shm_bytes(), set(broker_pids())
    procs = [
        CTX.Process(target=holding_producer, args=(impl, q, prod_end, count), daemon=True),
        CTX.Process(target=holding_consumer, args=(q, cons_end, count), daemon=True),
    ]
    run_children(*procs)
    try:
        consumer, producer = keeping_reports(impl, cons_ctl, prod_ctl, JOIN_TIMEOUT + count * 0.02)
        brokers = [p for p in broker_pids() if p not in brokers0]
        result = {
            "consumer": consumer,
            "producer": producer,
            "dev_shm_bytes": dev_shm_bytes() - shm0,
            "broker_fds": sum(fd_count(p) for p in brokers),
        }
        prod_ctl.send("exit")
        cons_ctl.send("exit")
        return result
    finally:
        join_all(procs)


# -- scenario 7: a consumer that keeps every message (a replay buffer) -----------------------

KEEP_WARM = 200  # messages before the first window: the broker started, the first segments made
KEEP_WINDOW = 600  # messages per timed window (the first after warm-up, and the last)


def keeper_message(seq: int) -> dict[str, torch.Tensor]:
    """128 KiB of observations and 1 KiB of the rest, fresh each message."""
    return {"obs": torch.full((32 * KIB,), float(seq)), "meta": torch.full((256,), float(seq))}


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


def keeper_producer(impl: str, q: Any, count: int, ctl: Any) -> None:
    for seq in range(count):
        q.put(encode(impl, keeper_message(seq), seq))
    if ctl.poll(JOIN_TIMEOUT + count * 0.05):  # the consumer keeps everything now
        ctl.recv()
        ctl.send(process_report())
        ctl.poll(JOIN_TIMEOUT)
    q.close()
    q.join_thread()


def keeper_consumer(q: Any, count: int, marks: list[int], producer: int, ctl: Any) -> None:
    """Keep every message; at each mark, the CPU the whole program spent so far (this
    process, the producer, the program's broker: every thread)."""
    kept, cpu = [], {}
    for seq in range(count):
        kept.append(decode(q.get(timeout=GET_TIMEOUT)))
        if seq + 1 in marks:
            cpu[seq + 1] = program_cpu([os.getpid(), producer, *broker_pids(root=os.getppid())])
    assert float(kept[-1]["obs"][0]) == count - 1 and float(kept[0]["meta"][-1]) == 0
    report = process_report()
    report["cpu"] = cpu
    if shmreduce.is_registered():
        # what the kept set pins: every segment a kept storage lies in is mapped here (the
        # producer's pool lets go of those past its cap: its stats() no longer count them)
        report["mapped_bytes"] = shmreduce.stats()["bytes_mapped"]
    report["broker_fds"] = max([fd_count(b) for b in broker_pids(root=os.getppid())] or [0])
    ctl.send(report)
    ctl.poll(JOIN_TIMEOUT)
    del kept


def keeper_trial(impl: str, count: int) -> dict:
    """Whole-program CPU per message over the first KEEP_WINDOW messages after warm-up
    and over the last KEEP_WINDOW, while the consumer keeps all *count*."""
    q = CTX.Queue(8)
    prod_ctl, prod_end = CTX.Pipe()
    cons_ctl, cons_end = CTX.Pipe()
    marks = [KEEP_WARM, KEEP_WARM + KEEP_WINDOW, count - KEEP_WINDOW, count]
    producer = CTX.Process(target=keeper_producer, args=(impl, q, count, prod_end), daemon=True)
    producer.start()
    consumer = CTX.Process(target=keeper_consumer, args=(q, count, marks, producer.pid, cons_end), daemon=True)
    consumer.start()
    try:
        cons, prod = keeping_reports(impl, cons_ctl, prod_ctl, JOIN_TIMEOUT + count * 0.05)
        cpu = cons["cpu"]
        first = (cpu[marks[1]] - cpu[marks[0]]) / KEEP_WINDOW * 1e6
        last = (cpu[marks[3]] - cpu[marks[2]]) / KEEP_WINDOW * 1e6
        kept_bytes = count * sum(t.nbytes for t in keeper_message(0).values())
        result = {
            "max_fds": max(prod.get("fds", -1), cons["fds"], cons["broker_fds"]),
            "first_us": first,
            "last_us": last,
            "growth": last / first,
            "producer_fds": prod.get("fds", -1),
            "consumer_fds": cons["fds"],
            "broker_fds": cons["broker_fds"],
        }
        if "mapped_bytes" in cons:
            result["mapped_per_kept"] = cons["mapped_bytes"] / kept_bytes
        prod_ctl.send("exit")
        cons_ctl.send("exit")
        return result
    finally:
        join_all([producer, consumer])


# -- scenarios table ----------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    metric: str  # key in the trial result
    unit: str
    higher_is_better: bool
    impls: tuple[str, ...]
    run: Callable[[str, Budget], dict]


@dataclass(frozen=True)
class Budget:
    seconds: float  # timed wall time per throughput trial
    busy_msgs: int  # messages per busy-sender trial
    held: int  # tensors kept in scenario 6
    keep: int = 3000  # messages kept in scenario 7


ALL = tuple(IMPLS)
SHARED = ("shmreduce-fd", "torch-fd", "shmreduce-fs", "torch-fs")
SCENARIOS = [
    Scenario(
        "1",
        "one 1 KiB tensor",
        "msg_per_s",
        "msg/s",
        True,
        ALL[:-1] + ("shm-recipe", "floor"),
        lambda impl, b: throughput_trial(impl, one_small, b.seconds, 64),
    ),
    Scenario(
        "2",
        "dict of 64 x 1 KiB tensors",
        "msg_per_s",
        "msg/s",
        True,
        ALL[:-1] + ("shm-recipe", "tensordict-torch", "tensordict-shmreduce", "floor"),
        lambda impl, b: throughput_trial(impl, dict_small, b.seconds * 1.5, 8),
    ),
    Scenario(
        "3",
        "one 64 MiB tensor",
        "gb_per_s",
        "GB/s",
        True,
        ALL[:-1] + ("shm-recipe", "memcpy", "make-only"),
        lambda impl, b: large_trial(impl, b.seconds * 1.5),
    ),
    Scenario("4", "busy sender (2 ms spin), unpickle p99", "p99_ms", "ms", False, ALL, lambda impl, b: busy_trial(impl, b.busy_msgs)),
    Scenario(
        "5a",
        "DataLoader: dicts of 32 small tensors",
        "batches_per_s",
        "batch/s",
        True,
        SHARED,
        lambda impl, b: loader_trial(DictSamples, b.seconds * 1.5, 2000),
    ),
    Scenario(
        "5b",
        "DataLoader: 3x224x224 uint8 images",
        "batches_per_s",
        "batch/s",
        True,
        SHARED,
        lambda impl, b: loader_trial(ImageSamples, b.seconds * 1.5, 2000),
    ),
    Scenario(
        "6",
        "keep 1,000 x 1 KiB tensors: consumer fds",
        "consumer_fds",
        "fds",
        False,
        ALL[:-1],
        lambda impl, b: flatten_holding(holding_trial(impl, b.held)),
    ),
    Scenario(
        "7",
        "keep 3,000 x (128 KiB + 1 KiB): CPU/msg, last 600",
        "last_us",
        "us/msg",
        False,
        ("shmreduce-fd", "shmreduce-fs", "by-value"),
        lambda impl, b: keeper_trial(impl, b.keep),
    ),
]


def flatten_holding(r: dict) -> dict:
    return {
        "consumer_fds": r["consumer"]["fds"],
        "producer_fds": r["producer"].get("fds", -1),
        "consumer_memfd_segments": r["consumer"]["memfd_segments"],
        "consumer_memfd_bytes": r["consumer"]["memfd_bytes"],
        "producer_memfd_segments": r["producer"].get("memfd_segments", -1),
        "dev_shm_bytes": r["dev_shm_bytes"],
        "broker_fds": r["broker_fds"],
    }


@dataclass(frozen=True)
class Goal:
    """Issue 20's goals (the native core). With ``versus``: the ratio of ``impl``'s median to that row's (> 1 is
    better, whichever the metric's direction) must be >= ``bound``; without: ``impl``'s median
    (a lower-is-better metric) must be <= ``bound``."""

    scenario: str
    impl: str
    versus: str | None
    bound: float
    text: str
    metric: str = "median"  # a row's figure other than its scenario's metric (lower is better)


GOALS = [  # scenarios 1 and 2 against by value: issue 30's restated goals (the mechanism's own are mechanism.GOALS)
    Goal("1", "shmreduce-fd", "by-value", 1.3, ">= 1.3x by-value"),
    Goal("1", "shmreduce-fs", "by-value", 1.3, ">= 1.3x by-value"),
    Goal("2", "shmreduce-fd", "by-value", 1.2, ">= 1.2x by-value"),
    Goal("2", "shmreduce-fs", "by-value", 1.2, ">= 1.2x by-value"),
    Goal("2", "shmreduce-fd", "torch-fd", 40, ">= 40x torch fd"),
    Goal("2", "shmreduce-fd", "shm-recipe", 1.0, "ahead of shm-recipe"),
    Goal("2", "shmreduce-fd", "tensordict-torch", 1.0, "ahead of tensordict-torch"),
    Goal("2", "shmreduce-fd", "tensordict-shmreduce", 1.0, "ahead of tensordict-shmreduce"),
    Goal("3", "shmreduce-fd", "make-only", 0.9, ">= 0.9x make-only"),
    Goal("3", "shmreduce-fs", "make-only", 0.9, ">= 0.9x make-only"),
    Goal("4", "shmreduce-fd", None, 0.5, "p99 <= 0.5 ms"),
    Goal("5a", "shmreduce-fd", "torch-fd", 5, ">= 5x stock"),
    Goal("5b", "shmreduce-fd", "torch-fd", 1.8, ">= 1.8x stock"),
    Goal("6", "shmreduce-fd", None, 64, "<= 64 consumer fds"),
    # Issue 37: keeping costs less than copying, and no more the more is kept.
    Goal("7", "shmreduce-fd", "by-value", 1 / 0.7, "CPU <= 0.7x by-value (>= 1.43x)"),
    Goal("7", "shmreduce-fs", "by-value", 1 / 0.7, "CPU <= 0.7x by-value (>= 1.43x)"),
    Goal("7", "shmreduce-fd", None, 1.1, "last 600 <= 1.1x first 600", "growth"),
    Goal("7", "shmreduce-fs", None, 1.1, "last 600 <= 1.1x first 600", "growth"),
    Goal("7", "shmreduce-fd", None, 64, "<= 64 fds, each process", "max_fds"),
    Goal("7", "shmreduce-fs", None, 64, "<= 64 fds, each process", "max_fds"),
]


# -- driver ------------------------------------------------------------------------------


def run_trial(scenario: Scenario, impl: str, budget: Budget) -> dict:
    configure(impl)
    try:
        return scenario.run(impl, budget)
    except Exception as exc:  # a failing row is a result, not the end of the run
        print(f"  ! scenario {scenario.key} {impl}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        deconfigure()
        gc.collect()


def run_rounds(
    rounds: int, budget: Budget, only: set[str] | None, absent: frozenset[str] = frozenset()
) -> dict[str, dict[str, list[dict]]]:
    """Every (scenario, row) once a round, rows alternating; ``absent`` rows are left out."""
    raw: dict[str, dict[str, list[dict]]] = {s.key: {i: [] for i in s.impls if i not in absent} for s in SCENARIOS}
    failed: set[tuple[str, str]] = set()
    for r in range(rounds):
        for scenario in SCENARIOS:
            if only and scenario.key not in only:
                continue
            impls = tuple(raw[scenario.key])
            order = impls if r % 2 == 0 else tuple(reversed(impls))
            for impl in order:
                if (scenario.key, impl) in failed:
                    continue
                t = time.perf_counter()
                result = run_trial(scenario, impl, budget)
                raw[scenario.key][impl].append(result)
                if "error" in result:
                    failed.add((scenario.key, impl))
                    print(f"  ! scenario {scenario.key} {impl}: {result['error']} (skipped from now on)", file=sys.stderr)
                value = result.get(scenario.metric, float("nan"))
                print(
                    f"round {r + 1}/{rounds} scenario {scenario.key:>2} {impl:<20} "
                    f"{value:10.3f} {scenario.unit:<7} ({time.perf_counter() - t:.1f}s)",
                    flush=True,
                )
    return raw


def median_of(trials: list[dict], key: str) -> float:
    values = [t[key] for t in trials if key in t]
    return statistics.median(values) if values else float("nan")


def summarize(raw: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, dict]]:
    summary: dict[str, dict[str, dict]] = {}
    for scenario in SCENARIOS:
        rows = {}
        for impl in raw[scenario.key]:
            trials = raw[scenario.key][impl]
            if not trials:
                continue
            row = {
                "median": median_of(trials, scenario.metric),
                "round_trips_per_msg": median_of(trials, "round_trips_per_msg"),
                "errors": [t["error"] for t in trials if "error" in t],
            }
            for extra in (
                "p50_ms",
                "max_ms",
                "producer_fds",
                "consumer_memfd_segments",
                "consumer_memfd_bytes",
                "dev_shm_bytes",
                "broker_fds",
                "consumer_fds",
                "first_us",
                "growth",
                "mapped_per_kept",
                "max_fds",
            ):
                if any(extra in t for t in trials):
                    row[extra] = median_of(trials, extra)
            rows[impl] = row
        for impl, row in rows.items():
            base = rows.get(BASELINE_OF.get(scenario.key) or BASELINE.get(impl, "torch-fd"))
            row["ratio"] = ratio(row["median"], base["median"] if base else float("nan"), scenario.higher_is_better)
        if rows:
            summary[scenario.key] = rows
    return summary


def ratio(value: float, base: float, higher_is_better: bool) -> float:
    """How many times better than the baseline (> 1 is better, whichever the direction)."""
    if not base or not value or base != base or value != value:
        return float("nan")
    return value / base if higher_is_better else base / value


def evaluate_goals(summary: dict, only: set[str] | None = None, absent: frozenset[str] = frozenset()) -> list[dict]:
    """Each goal's verdict and number; goals of scenarios left out by ``--only`` are left out
    too. A goal against a row left out of the run (``absent``) has no verdict (pass None)."""
    higher = {s.key: s.higher_is_better for s in SCENARIOS}
    units = {s.key: s.unit for s in SCENARIOS}
    goals = []
    for g in GOALS:
        if only is not None and g.scenario not in only:
            continue
        rows = summary.get(g.scenario, {})
        row = rows.get(g.impl)
        value = row.get(g.metric, float("nan")) if row else float("nan")
        if g.versus is None:
            achieved, unit = value, (units[g.scenario] if g.metric == "median" else g.metric)
            ok: bool | None = achieved <= g.bound
        else:
            other = rows.get(g.versus)
            achieved = ratio(value, other["median"] if other else float("nan"), higher[g.scenario])
            unit = "x " + g.versus
            ok = achieved >= g.bound
        if g.versus in absent:
            ok = None
        goals.append(
            {
                "scenario": g.scenario,
                "impl": g.impl,
                "goal": g.text,
                "versus": g.versus,
                "bound": g.bound,
                "achieved": achieved,
                "unit": unit,
                "value": value,
                "pass": ok,
            }
        )
    return goals


def verdict(goal: dict) -> str:
    return {True: "PASS", False: "FAIL", None: "n/a"}[goal["pass"]]


def goal_line(goal: dict) -> str:
    number = f"{fmt(goal['achieved'])}{'' if goal['versus'] else ' '}{goal['unit']}"
    if goal["pass"] is None:
        number = f"{goal['versus']} not measured"
    return f"goal {goal['scenario']:>2} {goal['impl']:<13} {goal['goal']:<30} {number:<34} {verdict(goal)}"


# -- output --------------------------------------------------------------------------------


def fmt(value: float) -> str:
    if value != value:
        return "—"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def markdown_table(summary: dict, goals: list[dict]) -> str:
    verdicts: dict[tuple[str, str], list[str]] = {}
    for g in goals:
        number = "" if g["pass"] is None or g["versus"] is None else f"{fmt(g['achieved'])}x: "
        verdicts.setdefault((g["scenario"], g["impl"]), []).append(f"{verdict(g)} ({number}{g['goal']})")
    lines = [
        "| scenario | implementation | median | unit | vs torch (same strategy) | round trips/msg | goal |",
        "| --- | --- | ---: | --- | ---: | ---: | --- |",
    ]
    for scenario in SCENARIOS:
        for impl, row in summary.get(scenario.key, {}).items():
            rt = fmt(row["round_trips_per_msg"]) if impl in REGISTERED else ""
            extra = f" (p50 {fmt(row['p50_ms'])})" if "p50_ms" in row else ""
            err = f" ⚠ {len(row['errors'])} failed" if row["errors"] else ""
            goal = "; ".join(verdicts.get((scenario.key, impl), []))
            lines.append(
                f"| {scenario.key} {scenario.title} | {impl} | {fmt(row['median'])}{extra}{err} | "
                f"{scenario.unit} | {fmt(row['ratio'])}x | {rt} | {goal} |"
            )
    return "\n".join(lines)


def holding_table(summary: dict) -> str:
    rows = summary.get("6")
    if not rows:
        return ""
    lines = [
        "| scenario 6 (1,000 kept) | consumer fds | producer fds | consumer memfd segments / MiB | /dev/shm growth MiB | broker fds |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for impl, r in rows.items():
        lines.append(
            f"| {impl} | {fmt(r['median'])} | {fmt(r.get('producer_fds', float('nan')))} | "
            f"{fmt(r.get('consumer_memfd_segments', float('nan')))} / "
            f"{fmt(r.get('consumer_memfd_bytes', float('nan')) / MIB)} | "
            f"{fmt(r.get('dev_shm_bytes', float('nan')) / MIB)} | {fmt(r.get('broker_fds', float('nan')))} |"
        )
    return "\n".join(lines)


COLORS = {
    "shmreduce-fd": "#1f77b4",
    "shmreduce-fs": "#6baed6",
    "torch-fd": "#d62728",
    "torch-fs": "#ff9896",
    "by-value": "#7f7f7f",
    "floor": "#c7c7c7",
    "shm-recipe": "#2ca02c",
    "tensordict-torch": "#ff7f0e",
    "tensordict-shmreduce": "#9467bd",
    "memcpy": "#000000",
    "make-only": "#8c564b",
}


def bar_label(row: dict, impl: str, unit: str) -> str:
    """What is written on a bar: the median, and its ratio to torch with the same strategy."""
    value = f"{fmt(row['median'])} {unit}"
    base = BASELINE.get(impl, "torch-fd")
    if impl == base or row["ratio"] != row["ratio"]:
        return value
    return f"{value}   {fmt(row['ratio'])}x {base}"


def draw_chart(summary: dict, path: Path, meta: dict | None = None, date: str = "") -> None:
    """One panel per scenario in a grid two wide (readable at README width), horizontal bars
    named on the left, each with its median and its ratio to torch written on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [s for s in SCENARIOS if s.key in summary]
    cols = 2
    rows_n = (len(shown) + 1 + cols - 1) // cols  # one more cell: the key
    heights = [
        max(len(summary[s.key]) for s in shown[i * cols : (i + 1) * cols]) if shown[i * cols : (i + 1) * cols] else 4 for i in range(rows_n)
    ]
    fig, axes = plt.subplots(
        rows_n, cols, figsize=(12, sum(0.4 * h + 1.2 for h in heights)), gridspec_kw={"height_ratios": [max(h, 4) for h in heights]}
    )
    cells = list(axes.flat)
    for ax, scenario in zip(cells, shown, strict=False):
        rows = summary[scenario.key]
        names = list(rows)
        values = [rows[n]["median"] for n in names]
        finite = [v for v in values if v == v and v > 0]
        spread = max(finite) / min(finite) if finite else 1.0
        ys = range(len(names))
        ax.barh(ys, [v if v == v else 0 for v in values], color=[COLORS.get(n, "#999999") for n in names], height=0.7)
        ax.set_yticks(list(ys), names, fontsize=11)
        for label in ax.get_yticklabels():
            if label.get_text() in REGISTERED:
                label.set_fontweight("bold")
        ax.invert_yaxis()
        if spread > 30:
            ax.set_xscale("log")
            low = min(finite) / 2
            ax.set_xlim(low, max(finite) * (max(finite) / low) ** 1.5)  # the longest bar 2/5 wide: its text fits right of it
        elif finite:
            ax.set_xlim(0, max(finite) * 2.6)
        for y, name, v in zip(ys, names, values, strict=True):
            if v == v:
                ax.text(v, y, "  " + bar_label(rows[name], name, scenario.unit), va="center", fontsize=10)
        better = "higher is better" if scenario.higher_is_better else "lower is better"
        ax.set_title(f"{scenario.key}: {scenario.title}\n{scenario.unit}, {better}", fontsize=12, loc="left")
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    key = cells[len(shown)]
    key.axis("off")
    lines = [
        "Each bar: the median over rounds.",
        "Written on it: the median, then how many times",
        "better than torch with the same strategy",
        "(torch-fd / torch-fs; > 1 is better, either direction).",
        "Bold: shmreduce registered. Log scale where",
        "a panel spans more than 30x.",
    ]
    if meta:
        lines += [
            "",
            f"{date}: {meta['nproc']} cores, Python {meta['python']},",
            f"torch {meta['torch']}, start method {meta['start_method']}",
        ]
    key.text(0.0, 1.0, "\n".join(lines), va="top", fontsize=11, transform=key.transAxes)
    for ax in cells[len(shown) + 1 :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def summary_line(summary: dict) -> str:
    """README's one line: shmreduce against torch with the same strategy, per scenario
    (``file_descriptor``, then ``file_system`` where it has a row)."""
    parts = []
    for scenario in SCENARIOS:
        rows = summary.get(scenario.key) or {}
        ratios = [rows[impl]["ratio"] for impl in ("shmreduce-fd", "shmreduce-fs") if impl in rows]
        ratios = [r for r in ratios if r == r]
        if ratios:
            peer = "" if any(impl.startswith("torch") for impl in rows) else " (against by value)"
            parts.append(f"{scenario.title} **{' / '.join(fmt(r) + 'x' for r in ratios)}**{peer}")
    return "How many times better than torch with the same strategy (fd / fs): " + "; ".join(parts) + "."


def machine() -> dict:
    return {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "start_method": "fork",
    }


def replace_marked(path: Path, body: str) -> None:
    """Rewrite *path* between the bench markers; a file without them is left as it is."""
    text = path.read_text() if path.exists() else ""
    if MARK_START not in text or MARK_END not in text:
        print(f"warning: {path} has no {MARK_START} / {MARK_END} markers; left unchanged", file=sys.stderr)
        return
    pattern = re.compile(re.escape(MARK_START) + ".*?" + re.escape(MARK_END), re.S)
    path.write_text(pattern.sub(lambda _: MARK_START + body + MARK_END, text, count=1))
    print(f"updated {path}")


def update_readme(summary: str, table: str, holding: str, command: str, meta: dict, date: str, mechanism: str = "") -> None:
    """README.md gets one line and the chart; docs/benchmarks.md the full tables."""
    where = (
        f"`{command}` on {date}; {meta['nproc']} cores, Python {meta['python']}, torch {meta['torch']}, "
        f"start method {meta['start_method']}.\n"
    )
    cost = f"\nThe mechanism's own cost, CPU per message (`benchmarks/mechanism.py`):\n\n{mechanism}\n" if mechanism else ""
    replace_marked(README, f"\n{summary}\n\n![benchmark chart](benchmarks/results/chart.png)\n\n{where}")
    replace_marked(BENCH_DOC, f"\n{table}\n\n{holding}\n{cost}\n![benchmark chart](../benchmarks/results/chart.png)\n\n{where}")


def render(stored: dict, out: Path, update: bool) -> None:
    """The chart and the tables from results as main() stores them (results.json)."""
    summary, goals, meta, date = stored["summary"], stored["goals"], stored["machine"], stored["date"]
    draw_chart(summary, out / "chart.png", meta, date)
    print(f"wrote {out / 'chart.png'}")
    if update:
        import mechanism  # the mechanism's rows; it imports this module

        cost = "\n".join(mechanism.table(stored["mechanism"])) if stored.get("mechanism") else ""
        update_readme(summary_line(summary), markdown_table(summary, goals), holding_table(summary), stored["command"], meta, date, cost)


# -- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (a few minutes)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 3, quick 1)")
    parser.add_argument("--only", help="comma-separated scenario keys, e.g. 1,2,5a; m: the mechanism's CPU per message")
    parser.add_argument("--update-readme", action="store_true", help="rewrite README.md and docs/benchmarks.md between the bench markers")
    parser.add_argument(
        "--from-results", type=Path, metavar="JSON", help="measure nothing: draw the chart and tables again from stored results"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_results:
        render(json.loads(args.from_results.read_text()), args.out, args.update_readme)
        return 0
    rounds = args.rounds or (1 if args.quick else 3)
    budget = Budget(0.25, 60, 200, 1400) if args.quick else Budget(1.0, 250, 1000)
    only = set(args.only.split(",")) if args.only else None
    command = " ".join(["python", "benchmarks/bench.py"] + (sys.argv[1:] if argv is None else argv))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta = machine()
    print(f"shmreduce bench: {rounds} round(s), start method fork, {meta}", flush=True)
    started = time.perf_counter()
    absent: frozenset[str] = frozenset()
    if only is None or "2" in only:
        why = tensordict_missing()
        if why:
            absent = frozenset(TENSORDICT_ROWS)
            print(f"tensordict rows left out: tensordict does not import ({why})", flush=True)
    raw = run_rounds(rounds, budget, only, absent)
    # The mechanism's own cost (issue 30): dumps + loads CPU per message, lock step.
    import mechanism  # it imports this module

    cost = mechanism.measure(1 if args.quick else 5, list(mechanism.SCENARIOS)) if only is None or "m" in only else None
    if cost:
        print("\n".join(mechanism.table(cost)), flush=True)
    summary = summarize(raw)
    goals = evaluate_goals(summary, only, absent)
    table, holding = markdown_table(summary, goals), holding_table(summary)
    print("\n" + table + "\n\n" + holding + "\n")
    for g in goals:
        print(goal_line(g))
    args.out.mkdir(parents=True, exist_ok=True)
    stored = {
        "command": command,
        "date": date,
        "machine": meta,
        "rounds": rounds,
        "budget": budget.__dict__,
        "seconds": time.perf_counter() - started,
        "summary": summary,
        "goals": goals,
        "raw": raw,
        "mechanism": cost,
    }
    (args.out / "results.json").write_text(json.dumps(stored, indent=1, default=str))
    print(f"wrote {args.out / 'results.json'} in {time.perf_counter() - started:.0f}s")
    render(stored, args.out, args.update_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
