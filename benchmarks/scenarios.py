"""The scenarios of ``make bench``: one trial function per scenario family (throughput, a
busy sender, DataLoader, holding, the keeper), the table of scenarios and their goals, and the
rounds that run them and summarize medians (``bench.py`` says how to read them)."""

from __future__ import annotations

import ctypes
import gc
import os
import queue
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import cpu_per_message
import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (installs torch's reducers into ForkingPickler)
from harness import (
    BASELINE,
    BASELINE_OF,
    CTX,
    GET_TIMEOUT,
    IMPLS,
    JOIN_TIMEOUT,
    KIB,
    MSG_BYTES,
    Budget,
    broker_pids,
    configure,
    decode,
    deconfigure,
    dev_shm_bytes,
    dict_small,
    discard,
    encode,
    fd_count,
    get_result,
    join_all,
    one_large,
    one_small,
    process_report,
    program_cpu,
    run_children,
    shmreduce_stat,
)

import shmreduce

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


def loader_trial(dataset_cls: type, seconds: float, max_batches: int, workers: int = 2) -> dict:
    """Batches per second a DataLoader with *workers* workers delivers, and the main
    process's CPU per batch (every thread of it: where a big machine's loader spends
    the time its workers do not)."""
    loader = torch.utils.data.DataLoader(
        dataset_cls(16 * (max_batches + 1)),
        batch_size=16,
        num_workers=workers,
        multiprocessing_context=CTX,
        timeout=GET_TIMEOUT,
    )
    it = iter(loader)
    next(it)  # warm-up: workers started
    rt0 = shmreduce_stat("round_trips")
    count, t0, cpu0 = 0, time.perf_counter(), time.process_time()
    for _ in it:
        count += 1
        if time.perf_counter() - t0 >= seconds:
            break
    elapsed = time.perf_counter() - t0
    main_cpu = time.process_time() - cpu0
    rt = shmreduce_stat("round_trips") - rt0
    it._shutdown_workers()  # joins the workers (with torch's own timeouts)
    del it, loader
    return {
        "batches": count,
        "batches_per_s": count / elapsed,
        "main_cpu_ms_per_batch": main_cpu * 1e3 / max(count, 1),
        "round_trips_per_msg": rt / max(count, 1),
    }


# -- scenario 6: what keeping 1,000 tensors holds --------------------------------------


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
        "5c",
        "DataLoader, 8 workers: dicts of 32 small tensors",
        "batches_per_s",
        "batch/s",
        True,
        SHARED,
        lambda impl, b: loader_trial(DictSamples, b.seconds * 1.5, 4000, workers=8),
    ),
    Scenario(
        "5d",
        "DataLoader, 8 workers: 3x224x224 uint8 images",
        "batches_per_s",
        "batch/s",
        True,
        SHARED,
        lambda impl, b: loader_trial(ImageSamples, b.seconds * 1.5, 4000, workers=8),
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
    Scenario(
        "8a",
        "streaming one 1 KiB tensor: program CPU/msg",
        "cpu_us_per_msg",
        "us/msg",
        False,
        ("shmreduce-fd", "shmreduce-fs", "by-value"),
        lambda impl, b: cpu_per_message.streaming_trial(impl, one_small, b.seconds * 2),
    ),
    Scenario(
        "8b",
        "streaming dict of 64 x 1 KiB: program CPU/msg",
        "cpu_us_per_msg",
        "us/msg",
        False,
        ("shmreduce-fd", "shmreduce-fs", "by-value"),
        lambda impl, b: cpu_per_message.streaming_trial(impl, dict_small, b.seconds * 2),
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
    """A goal of make bench. With ``versus``: the ratio of ``impl``'s median to that row's (> 1 is
    better, whichever the metric's direction) must be >= ``bound``; without: ``impl``'s median
    (a lower-is-better metric) must be <= ``bound``."""

    scenario: str
    impl: str
    versus: str | None
    bound: float
    text: str
    metric: str = "median"  # a row's figure other than its scenario's metric (lower is better)


MAKE_ONLY_GOAL = 0.8 if len(os.sched_getaffinity(0)) <= 2 else 0.9
GOALS = [  # scenarios 1 and 2 against by value (the mechanism's own are mechanism.GOALS)
    Goal("1", "shmreduce-fd", "by-value", 1.3, ">= 1.3x by-value"),
    Goal("1", "shmreduce-fs", "by-value", 1.3, ">= 1.3x by-value"),
    Goal("2", "shmreduce-fd", "by-value", 1.2, ">= 1.2x by-value"),
    Goal("2", "shmreduce-fs", "by-value", 1.2, ">= 1.2x by-value"),
    Goal("2", "shmreduce-fd", "torch-fd", 40, ">= 40x torch fd"),
    Goal("2", "shmreduce-fd", "shm-recipe", 1.0, "ahead of shm-recipe"),
    Goal("2", "shmreduce-fd", "tensordict-torch", 1.0, "ahead of tensordict-torch"),
    Goal("2", "shmreduce-fd", "tensordict-shmreduce", 1.0, "ahead of tensordict-shmreduce"),
    # On two cores the one copy cannot overlap a make that takes both (0.8x is that
    # floor); with more, the copy runs on the cores the producer may use.
    Goal("3", "shmreduce-fd", "make-only", MAKE_ONLY_GOAL, f">= {MAKE_ONLY_GOAL}x make-only"),
    Goal("3", "shmreduce-fs", "make-only", MAKE_ONLY_GOAL, f">= {MAKE_ONLY_GOAL}x make-only"),
    Goal("4", "shmreduce-fd", None, 0.5, "p99 <= 0.5 ms"),
    Goal("5a", "shmreduce-fd", "torch-fd", 5, ">= 5x stock"),
    Goal("5b", "shmreduce-fd", "torch-fd", 1.8, ">= 1.8x stock"),
    Goal("6", "shmreduce-fd", None, 64, "<= 64 consumer fds"),
    # Keeping costs less than copying, and no more the more is kept.
    Goal("7", "shmreduce-fd", "by-value", 1 / 0.7, "CPU <= 0.7x by-value (>= 1.43x)"),
    Goal("7", "shmreduce-fs", "by-value", 1 / 0.7, "CPU <= 0.7x by-value (>= 1.43x)"),
    Goal("7", "shmreduce-fd", None, 1.1, "last 600 <= 1.1x first 600", "growth"),
    Goal("7", "shmreduce-fs", None, 1.1, "last 600 <= 1.1x first 600", "growth"),
    Goal("7", "shmreduce-fd", None, 64, "<= 64 fds, each process", "max_fds"),
    Goal("7", "shmreduce-fs", None, 64, "<= 64 fds, each process", "max_fds"),
    # A stream's whole CPU per message, every process and the broker, the making taken off.
    Goal("8a", "shmreduce-fd", "by-value", 1.0, "CPU <= 1.0x by-value"),
    Goal("8a", "shmreduce-fs", "by-value", 1.0, "CPU <= 1.0x by-value"),
    Goal("8b", "shmreduce-fd", "by-value", 1.0, "CPU <= 1.0x by-value"),
    Goal("8b", "shmreduce-fs", "by-value", 1.0, "CPU <= 1.0x by-value"),
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
