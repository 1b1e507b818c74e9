"""Where the microseconds go in shmreduce's hot path (scenarios 1 and 2 of bench.py).

A producer and a consumer (fork) exchange messages over an ``mp.Pipe`` in lock step
(send, wait for the ack), so each side's cost is measured without overlap:
* sender: ``ForkingPickler.dumps(msg)`` (reduce, segment creation, copy, deposit);
* receiver: ``ForkingPickler.loads(data)`` on bytes already received (fetch, map, rebuild).
First a plain pass (wall-clock µs per message, median), then a pass under cProfile on
both sides; the top functions by own time are written, in µs per message, to
``benchmarks/results/profile_<scenario>_<strategy>.txt``.

Run: ``python benchmarks/profile_hotpath.py [--msgs N] [--strategy file_descriptor]``.
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import pstats
import statistics
import sys
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.multiprocessing  # noqa: F401
from harness import RESULTS, dict_small, join_all, one_small

import shmreduce

CTX = mp.get_context("fork")
MAKERS = {"1": one_small, "2": dict_small}


def profiled(enabled: bool) -> cProfile.Profile | None:
    if not enabled:
        return None
    prof = cProfile.Profile()
    prof.enable()
    return prof


def report(prof: cProfile.Profile | None, msgs: int, top: int = 25) -> str:
    if prof is None:
        return ""
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    lines = [f"{'own us/msg':>10} {'cum us/msg':>10} {'calls/msg':>9}  function"]
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in rows:
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
        lines.append(f"{tottime / msgs * 1e6:10.1f} {cumtime / msgs * 1e6:10.1f} {ncalls / msgs:9.1f}  {name} ({where})")
    return "\n".join(lines)


def producer(make, conn, msgs: int, profile: bool, out) -> None:
    times = []
    prof = profiled(profile)
    for seq in range(msgs + 1):
        msg = make(seq)
        t0 = time.perf_counter()
        data = ForkingPickler.dumps(msg)
        times.append(time.perf_counter() - t0)
        conn.send_bytes(data)
        del msg, data
        conn.recv_bytes()  # ack
    out.put(("sender", statistics.median(times[1:]) * 1e6, report(prof, msgs + 1)))


def consumer(conn, msgs: int, profile: bool, out) -> None:
    times = []
    prof = profiled(profile)
    for _ in range(msgs + 1):
        data = conn.recv_bytes()
        t0 = time.perf_counter()
        obj = ForkingPickler.loads(data)
        times.append(time.perf_counter() - t0)
        del obj
        conn.send_bytes(b"k")
    out.put(("receiver", statistics.median(times[1:]) * 1e6, report(prof, msgs + 1)))


def run(make, msgs: int, profile: bool) -> dict:
    a, b = CTX.Pipe()
    out = CTX.Queue()
    procs = [
        CTX.Process(target=producer, args=(make, a, msgs, profile, out), daemon=True),
        CTX.Process(target=consumer, args=(b, msgs, profile, out), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        return {side: (us, text) for side, us, text in (out.get(timeout=60) for _ in procs)}
    finally:
        join_all(procs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--msgs", type=int, default=2000)
    parser.add_argument("--strategy", default="file_descriptor")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    shmreduce.register(strategy=args.strategy)
    try:
        for key, make in MAKERS.items():
            msgs = args.msgs if key == "1" else max(50, args.msgs // 20)
            plain = run(make, msgs, profile=False)
            prof = run(make, msgs, profile=True)
            text = [f"scenario {key} ({make.__name__}), strategy {args.strategy}, {msgs} msgs, lock step"]
            for side in ("sender", "receiver"):
                text.append(
                    f"\n== {side}: {plain[side][0]:.1f} us/msg unprofiled "
                    f"(dumps for sender, loads for receiver); under cProfile:\n{prof[side][1]}"
                )
            body = "\n".join(text)
            print(body + "\n")
            (RESULTS / f"profile_{key}_{args.strategy}.txt").write_text(body + "\n")
    finally:
        shmreduce.unregister()
    return 0


if __name__ == "__main__":
    sys.exit(main())
