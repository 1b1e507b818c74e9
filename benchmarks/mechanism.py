"""The mechanism's own cost: CPU of ``ForkingPickler.dumps`` + ``loads`` per message.

A producer and a consumer (fork) exchange messages over an ``mp.Pipe`` in lock step
(send, wait for the ack), so neither side's work overlaps the other's. Each side reads
its own process's CPU time (``time.process_time_ns``: every thread, the collector's
included) around its call only: ``dumps`` of the message for the producer, ``loads`` of
the bytes for the consumer. Making the message and consuming it are left out: they are
the same for every row, and the whole-program rows of ``bench.py`` include them.

Rows: ``by-value`` (``tensor.numpy()`` pickled, ``torch.from_numpy`` on load: both
inside the timed calls), ``shmreduce-fd``, ``shmreduce-fs``. Rounds interleave the rows,
and each row's figure is its median round. Issue 30's goals, per message and both
strategies: dict of 64 x 1 KiB <= 0.67x by value, one 1 KiB tensor <= 0.8x.

Run: ``python benchmarks/mechanism.py [--rounds 5] [--scenarios 1,2]``; ``bench.py``
runs it for ``make bench``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

ROWS = ["by-value", "shmreduce-fd", "shmreduce-fs"]
SCENARIOS = {"1": (bench.one_small, 3000, 1), "2": (bench.dict_small, 300, 64)}  # maker, messages a round, tensors a message
GOALS = {"1": 0.8, "2": 0.67}  # the most CPU a row may spend, as a multiple of by value's


def _wait(link: Any) -> None:
    if not link.poll(60):
        raise TimeoutError("the other side did not answer in 60 s")


def _producer(impl: str, make: Any, msgs: int, link: Any, report: Any) -> None:
    cpu = 0
    for seq in range(msgs + 1):
        msg = make(seq)
        t0 = time.process_time_ns()
        data = ForkingPickler.dumps(bench.encode(impl, msg, seq))
        if seq:  # the first message starts the broker and the pools: not counted
            cpu += time.process_time_ns() - t0
        link.send_bytes(data)
        del msg, data
        _wait(link)
        link.recv_bytes()
    report.send(cpu / msgs / 1e3)


def _consumer(msgs: int, link: Any, report: Any) -> None:
    cpu = 0
    for seq in range(msgs + 1):
        _wait(link)
        data = link.recv_bytes()
        t0 = time.process_time_ns()
        obj = bench.decode(ForkingPickler.loads(data))
        if seq:
            cpu += time.process_time_ns() - t0
        del obj, data
        link.send_bytes(b"k")
    report.send(cpu / msgs / 1e3)


def trial(impl: str, scenario: str) -> tuple[float, float]:
    """(dumps, loads): CPU microseconds per message, lock step."""
    make, msgs, _ = SCENARIOS[scenario]
    bench.configure(impl)
    try:
        link = bench.CTX.Pipe()  # the messages
        sender, receiver = bench.CTX.Pipe(), bench.CTX.Pipe()  # each side's result
        procs = [
            bench.CTX.Process(target=_producer, args=(impl, make, msgs, link[0], sender[1]), daemon=True),
            bench.CTX.Process(target=_consumer, args=(msgs, link[1], receiver[1]), daemon=True),
        ]
        bench.run_children(*procs)
        try:
            if not (sender[0].poll(120) and receiver[0].poll(120)):
                raise TimeoutError(f"{impl}, scenario {scenario}: no result in 120 s")
            return sender[0].recv(), receiver[0].recv()
        finally:
            bench.join_all(procs)
    finally:
        bench.deconfigure()


def measure(rounds: int, scenarios: list[str]) -> dict[str, dict[str, tuple[float, float]]]:
    """scenario -> row -> (dumps, loads) microseconds per message, each the row's median round."""
    results: dict[str, dict[str, tuple[float, float]]] = {}
    for scenario in scenarios:
        seen: dict[str, list[tuple[float, float]]] = {row: [] for row in ROWS}
        for _ in range(rounds):
            for row in ROWS:
                seen[row].append(trial(row, scenario))
        results[scenario] = {row: min(runs, key=lambda r: abs(sum(r) - statistics.median(map(sum, runs)))) for row, runs in seen.items()}
    return results


def table(results: dict[str, dict[str, tuple[float, float]]]) -> list[str]:
    """Markdown rows: per scenario and row, the CPU per message and per tensor, and the ratio to by value."""
    lines = [
        "| message | row | dumps + loads, us/msg | dumps, us/tensor | loads, us/tensor | CPU vs by value | goal |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for scenario, rows in results.items():
        make, _, tensors = SCENARIOS[scenario]
        base = sum(rows["by-value"])
        for row, (dumps, loads) in rows.items():
            ratio = (dumps + loads) / base
            goal = "" if row == "by-value" else f"<= {GOALS[scenario]}x: {'met' if ratio <= GOALS[scenario] else 'not met'}"
            lines.append(
                f"| {make.__name__} | {row} | {dumps + loads:.1f} | {dumps / tensors:.2f} | {loads / tensors:.2f} | {ratio:.2f}x | {goal} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scenarios", default="1,2")
    args = parser.parse_args(argv)
    print("\n".join(table(measure(args.rounds, args.scenarios.split(",")))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
