"""Where the CPU goes per message, by process: producer, consumer and broker.

``make bench`` reports throughput; on a machine with as few cores as processes, what
limits it is the CPU every process spends per message, the broker's included. This
runs bench.py's throughput scenarios (1, 2 or 3) for each implementation asked, and
reads each process's time on the CPU from ``/proc/<pid>/task/*/schedstat`` over the timed
messages: microseconds of CPU per message for the producer (its main thread and its
queue feeder thread, which pickles), the consumer, and this program's broker (rows
with shmreduce registered). The producer's main thread (which makes and puts each
message) is also shown on its own: the rest is its feeder thread's pickling.

``make bench`` runs it as scenarios 8a and 8b (``streaming_trial``): the whole program's
CPU per message, every process and thread and the broker's included, less the producer's
making of each message (the same for every row). Both children run a full collection
before the timed window (a forked child's first one touches the whole heap it inherited),
and the window starts after ``WARM`` messages.

Run: ``python benchmarks/cpu_per_message.py [--scenario 1] [--impls by-value,shmreduce-fd] [--rounds 1]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any

import harness

MAKERS = {"1": harness.one_small, "2": harness.dict_small, "3": harness.one_large}
WARM = 200  # messages before the timed window


def producer(impl: str, make: Any, q: Any, stop: Any, making: Any) -> None:
    gc.collect()  # this child's first full collection, before any window
    seq = 0
    while not stop.is_set():
        t0 = time.thread_time_ns()
        made = make(seq)
        making.value += (time.thread_time_ns() - t0) / 1e9  # the making, taken off the total
        msg = harness.encode(impl, made, seq)
        del made
        while not stop.is_set():
            try:
                q.put(msg, timeout=0.05)
                break
            except queue.Full:
                continue
        del msg
        seq += 1
    q.put(None)
    q.close()
    q.join_thread()


def consumer(q: Any, report: Any, seconds: float) -> None:
    gc.collect()  # this child's first full collection, before any window
    for _ in range(WARM):  # warm-up: first shares, the broker's start, the first segments
        harness.decode(q.get(timeout=harness.GET_TIMEOUT))
    report.put("start")
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        harness.decode(q.get(timeout=harness.GET_TIMEOUT))
        count += 1
    report.put((count, time.perf_counter() - t0))
    while harness.decode(q.get(timeout=harness.GET_TIMEOUT)) is not None:
        pass


def trial(impl: str, make: Any, seconds: float) -> dict[str, float]:
    harness.configure(impl)
    try:
        return measure(impl, make, seconds)
    finally:
        harness.deconfigure()


def streaming_trial(impl: str, make: Any, seconds: float) -> dict[str, float]:
    """A row of scenarios 8a / 8b (configured by the caller): ``cpu_us_per_msg``, the
    whole program's CPU per message less the making."""
    row = measure(impl, make, seconds)
    making = row.pop("making", 0.0)
    row["cpu_us_per_msg"] = sum(v for k, v in row.items() if k not in ("msg_per_s", "producer main")) - making
    return row


def measure(impl: str, make: Any, seconds: float) -> dict[str, float]:
    """CPU per message of each process (and ``making``: the producer's making of the
    messages) over *seconds* of a stream (the parent configured for *impl*)."""
    q, stop, report = harness.CTX.Queue(64), harness.CTX.Event(), harness.CTX.Queue()
    making = harness.CTX.Value("d", 0.0, lock=False)
    procs = [
        harness.CTX.Process(target=producer, args=(impl, make, q, stop, making), daemon=True),
        harness.CTX.Process(target=consumer, args=(q, report, seconds), daemon=True),
    ]
    harness.run_children(*procs)
    try:
        report.get(timeout=60)
        # This program's brokers: their command line names our pid as the root.
        mine = str(os.getpid()).encode()
        brokers = [b for b in harness.broker_pids() if Path(f"/proc/{b}/cmdline").read_bytes().split(b"\0")[-2:-1] == [mine]]
        pids = {"producer": procs[0].pid, "consumer": procs[1].pid} | {f"broker {b}": b for b in brokers}
        before = {name: harness.cpu_seconds(pid) for name, pid in pids.items() if pid is not None}
        # The producer's main thread makes and puts; its queue's feeder thread pickles.
        ppid = procs[0].pid
        assert ppid is not None
        main_before, making_before = harness.cpu_seconds(ppid, ppid), making.value
        count, elapsed = report.get(timeout=seconds + 60)
        after = {name: harness.cpu_seconds(pid) for name, pid in pids.items() if pid is not None}
        main_after, making_after = harness.cpu_seconds(ppid, ppid), making.value
    finally:
        stop.set()
        harness.join_all(procs)
    row = {"msg_per_s": count / elapsed}
    for name, start in before.items():
        end = after.get(name)
        if start is not None and end is not None and end >= start:
            row[name] = (end - start) / count * 1e6
    if main_before is not None and main_after is not None:
        row["producer main"] = (main_after - main_before) / count * 1e6
    row["making"] = (making_after - making_before) / count * 1e6
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(MAKERS), default="1")
    parser.add_argument("--impls", default="by-value,shmreduce-fd,shmreduce-fs,torch-fd")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    make = MAKERS[args.scenario]
    for _ in range(args.rounds):
        for impl in args.impls.split(","):
            row = trial(impl, make, args.seconds)
            main = row.pop("producer main", None)
            making = row.pop("making", None)
            cpu = {k: v for k, v in row.items() if k != "msg_per_s"}
            parts = "  ".join(f"{k} {v:8.1f}" for k, v in cpu.items())
            split = f" (main thread {main:.1f}, the rest its feeder thread's pickling)" if main is not None else ""
            total = sum(cpu.values())
            print(f"{impl:<22} {row['msg_per_s']:9.0f} msg/s   CPU us/msg: {parts}   total {total:8.1f}{split}", flush=True)
            if making is not None:
                print(f"{'':<22} making {making:.1f} us/msg, total less the making {total - making:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
