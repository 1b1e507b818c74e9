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
* Peers, in the same rounds: ``shm-recipe`` (scenarios 1-3), the
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
* Goals are evaluated on the medians: a ratio goal divides a row's median by
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
import datetime
import json
import sys
import time
from pathlib import Path

import mechanism
import torch
import torch.multiprocessing  # noqa: F401  (installs torch's reducers into ForkingPickler)
from harness import RESULTS, TENSORDICT_ROWS, Budget, machine, tensordict_missing
from report import goal_line, holding_table, markdown_table, render
from scenarios import evaluate_goals, run_rounds, summarize

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
    # The mechanism's own cost: dumps + loads CPU per message, lock step.
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
