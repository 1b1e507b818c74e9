"""The mechanism's own cost: CPU of a message's ``dumps``, ``loads`` and drop, every thread.

A producer and a consumer (fork) exchange messages over an ``mp.Pipe`` in lock step
(send, wait for the ack), so neither side's work overlaps the other's. Each side counts
its whole process's CPU (``time.process_time_ns``: every thread, the collector's
included) over the timed messages, waits aside (a blocked ``poll`` costs none): the
producer's ``dumps`` and whatever its threads do meanwhile (settling what the consumer
let go of), the consumer's ``loads``, the drop of what it loaded (the deleters, the
let-go) and its collector thread. Making each message (a fresh tensor, the same for
every row) is left out: the producer's main thread's CPU in ``make`` is taken off.

Warm-up: ``WARM`` messages, then a full collection on both sides, before the timed
ones: a forked child's first full collection touches the heap it inherited (about
10,000 copy-on-write page faults here), which would otherwise land inside the timed
window of one round and double it.

Rows: ``by-value`` (``tensor.numpy()`` pickled, ``torch.from_numpy`` on load),
``shmreduce-fd``, ``shmreduce-fs``. Rounds interleave the rows; each row's figure is its
median round, printed with the spread of its rounds (min-max). Goals, per
message and both strategies: dict of 64 x 1 KiB <= 0.9x by value, one 1 KiB tensor
<= 0.8x.

Run: ``python benchmarks/mechanism.py [--rounds 5] [--scenarios 1,2]``; ``bench.py``
runs it for ``make bench``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

import harness

ROWS = ["by-value", "shmreduce-fd", "shmreduce-fs"]
SCENARIOS = {"1": (harness.one_small, 3000, 1), "2": (harness.dict_small, 300, 64)}  # maker, messages a round, tensors a message
GOALS = {"1": 0.8, "2": 0.9}  # the most CPU a row may spend, as a multiple of by value's
WARM = 400  # messages before the timed ones


def _wait(link: Any) -> None:
    if not link.poll(60):
        raise TimeoutError("the other side did not answer in 60 s")


def _producer(impl: str, make: Any, msgs: int, link: Any, report: Any) -> None:
    making = 0
    for seq in range(WARM + msgs):
        if seq == WARM:
            gc.collect()  # the child's first full collection, before the timed window
            _wait(link)  # the consumer's, too
            link.recv_bytes()
            start, making = time.process_time_ns(), 0
        m0 = time.thread_time_ns()
        msg = make(seq)
        making += time.thread_time_ns() - m0
        link.send_bytes(ForkingPickler.dumps(harness.encode(impl, msg, seq)))
        del msg
        _wait(link)
        link.recv_bytes()
    report.send((time.process_time_ns() - start - making) / msgs / 1e3)


def _consumer(msgs: int, link: Any, report: Any) -> None:
    for seq in range(WARM + msgs):
        if seq == WARM:
            gc.collect()
            link.send_bytes(b"w")
            start = time.process_time_ns()
        _wait(link)
        obj = harness.decode(ForkingPickler.loads(link.recv_bytes()))
        del obj  # its drop counts: deleters, let-go
        link.send_bytes(b"k")
    report.send((time.process_time_ns() - start) / msgs / 1e3)


def trial(impl: str, scenario: str) -> tuple[float, float]:
    """(producer, consumer): CPU microseconds per message, lock step."""
    make, msgs, _ = SCENARIOS[scenario]
    harness.configure(impl)
    try:
        link = harness.CTX.Pipe()  # the messages
        sender, receiver = harness.CTX.Pipe(), harness.CTX.Pipe()  # each side's result
        procs = [
            harness.CTX.Process(target=_producer, args=(impl, make, msgs, link[0], sender[1]), daemon=True),
            harness.CTX.Process(target=_consumer, args=(msgs, link[1], receiver[1]), daemon=True),
        ]
        harness.run_children(*procs)
        try:
            if not (sender[0].poll(120) and receiver[0].poll(120)):
                raise TimeoutError(f"{impl}, scenario {scenario}: no result in 120 s")
            return sender[0].recv(), receiver[0].recv()
        finally:
            harness.join_all(procs)
    finally:
        harness.deconfigure()


SPREAD: dict[str, dict[str, tuple[float, float]]] = {}  # scenario -> row -> (min, max) of its rounds' totals


def measure(rounds: int, scenarios: list[str]) -> dict[str, dict[str, tuple[float, float]]]:
    """scenario -> row -> (producer, consumer) microseconds per message, each the row's
    median round (its spread in ``SPREAD``)."""
    results: dict[str, dict[str, tuple[float, float]]] = {}
    for scenario in scenarios:
        seen: dict[str, list[tuple[float, float]]] = {row: [] for row in ROWS}
        for r in range(rounds):
            for row in ROWS if r % 2 == 0 else reversed(ROWS):
                seen[row].append(trial(row, scenario))
        results[scenario] = {row: min(runs, key=lambda r: abs(sum(r) - statistics.median(map(sum, runs)))) for row, runs in seen.items()}
        SPREAD[scenario] = {row: (min(map(sum, runs)), max(map(sum, runs))) for row, runs in seen.items()}
    return results


def table(results: dict[str, dict[str, tuple[float, float]]]) -> list[str]:
    """Markdown rows: per scenario and row, the CPU per message and per tensor, and the ratio to by value."""
    lines = [
        "| message | row | CPU, us/msg (spread) | send, us/tensor | load + drop, us/tensor | CPU vs by value | goal |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for scenario, rows in results.items():
        make, _, tensors = SCENARIOS[scenario]
        base = sum(rows["by-value"])
        for row, (dumps, loads) in rows.items():
            ratio = (dumps + loads) / base
            goal = "" if row == "by-value" else f"<= {GOALS[scenario]}x: {'met' if ratio <= GOALS[scenario] else 'not met'}"
            spread = SPREAD.get(scenario, {}).get(row)  # not stored: a table drawn from results has none
            total = f"{dumps + loads:.1f}" + (f" ({spread[0]:.1f}-{spread[1]:.1f})" if spread else "")
            lines.append(f"| {make.__name__} | {row} | {total} | {dumps / tensors:.2f} | {loads / tensors:.2f} | {ratio:.2f}x | {goal} |")
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
