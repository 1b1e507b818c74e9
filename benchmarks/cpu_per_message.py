"""Where the CPU goes per message, by process: producer, consumer and broker.

``make bench`` reports throughput; on a machine with as few cores as processes, what
limits it is the CPU every process spends per message, the broker's included. This
runs bench.py's throughput scenarios (1, 2 or 3) for each implementation asked, and
reads each process's time on the CPU from ``/proc/<pid>/task/*/schedstat`` over the timed
messages: microseconds of CPU per message for the producer (its main thread and its
queue feeder thread, which pickles), the consumer, and this program's broker (rows
with shmreduce registered). The producer's main thread (which makes and puts each
message) is also shown on its own: the rest is its feeder thread's pickling.

Run: ``python benchmarks/cpu_per_message.py [--scenario 1] [--impls by-value,shmreduce-fd] [--rounds 1]``.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any

import harness

MAKERS = {"1": harness.one_small, "2": harness.dict_small, "3": harness.one_large}


def producer(impl: str, make: Any, q: Any, stop: Any) -> None:
    seq = 0
    while not stop.is_set():
        msg = harness.encode(impl, make(seq), seq)
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
    harness.decode(q.get(timeout=harness.GET_TIMEOUT))  # warm-up: first share, broker start
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
        q, stop, report = harness.CTX.Queue(64), harness.CTX.Event(), harness.CTX.Queue()
        procs = [
            harness.CTX.Process(target=producer, args=(impl, make, q, stop), daemon=True),
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
            main_before = harness.cpu_seconds(ppid, ppid)
            count, elapsed = report.get(timeout=seconds + 60)
            after = {name: harness.cpu_seconds(pid) for name, pid in pids.items() if pid is not None}
            main_after = harness.cpu_seconds(ppid, ppid)
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
        return row
    finally:
        harness.deconfigure()


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
            cpu = {k: v for k, v in row.items() if k != "msg_per_s"}
            parts = "  ".join(f"{k} {v:8.1f}" for k, v in cpu.items())
            split = f" (main thread {main:.1f}, the rest its feeder thread's pickling)" if main is not None else ""
            print(f"{impl:<22} {row['msg_per_s']:9.0f} msg/s   CPU us/msg: {parts}   total {sum(cpu.values()):8.1f}{split}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
