"""Concurrency, fork and every actor under load: 8 sender threads and 8 loader threads
at once, in one process and across two.

Senders send fresh tensors and views (slices, strided, transposed, at offsets) of bases
that several senders send at the same time, of every width of dtype, with storages of
1 KiB, just under, at and just over ``SLAB_ITEM_MAX`` (the slab's limit), 200 KiB (an arena's)
and just over ``ARENA_ITEM_MAX`` (a segment of its own).
Loaders check every element, load some messages twice (one after the other, or two
threads at once), keep some tensors for a while (checked again when dropped) and drop
the others. Every expected value follows from an identity carried beside the message
(``_fill``), so nothing depends on timing; a failure names the message, the tensor and
the first wrong element. At the end, with everything dropped, no process has a segment
live or one waiting for its generation to be free.

``SHMREDUCE_STRESS_SECONDS`` sets how long the senders send in each case (3 s by
default, so that ``make test`` stays fast; ``make stress`` runs 60 s, and
``make stress STRESS_SECONDS=600`` is the long run). ``SHMREDUCE_STRESS_SEED`` picks
the senders' choices (a failure message quotes it). ``SHMREDUCE_STRESS_START=spawn``
starts the loading process by spawn rather than fork: ``make tsan`` does, since
ThreadSanitizer stops checking in a child forked from a process with threads (and
may abort it when that child starts one, "dup thread with used id").
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing as mp
import os
import queue
import random
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

import shmreduce
from shmreduce import segments, transfer
from shmreduce.pool import ARENA_ITEM_MAX, SLAB_ITEM_MAX

from helpers import wait_for

CTX = mp.get_context("spawn") if os.environ.get("SHMREDUCE_STRESS_START") == "spawn" else mp.get_context("fork")
SECONDS = float(os.environ.get("SHMREDUCE_STRESS_SECONDS", "3"))
SEED = int(os.environ.get("SHMREDUCE_STRESS_SEED", "36"))
SENDERS = LOADERS = 8
WAIT = 60.0  # any single wait: a queue, a join, a report
QUEUE_DEPTH = 16  # per loader: senders block rather than run ahead
SLOTS = 6  # bases shared by every sender at once
BASE_SENDS = 200  # a base is replaced after about this many sends: no generation collects
# more than the header's 32,256 refs (test_concurrent_sends: its segment is then kept
# SHMREDUCE_ORPHAN_TTL seconds, longer than the end of a test waits)
KEEP = 48  # tensors a loader keeps at most
# Storage sizes in bytes (every one a multiple of 8: a whole number of elements of any dtype).
SIZES = [1 << 10] * 3 + [SLAB_ITEM_MAX - 64, SLAB_ITEM_MAX, SLAB_ITEM_MAX + 64] * 2 + [200 << 10, ARENA_ITEM_MAX + 64]
DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"]
# Values stay below each dtype's exact integer range (float16 to 2048, bfloat16 to 256).
_MODULUS = {"bool": 2, "uint8": 251, "int8": 127, "bfloat16": 251, "float16": 2039, "int16": 32749}
_BIG = (1 << 24) - 3  # float32's exact range

Desc = tuple[int, str, int, tuple]  # (identity, dtype, numel, view): what a received tensor must be


# -- expected values -----------------------------------------------------------------


def _fill(ident: int, dtype: str, numel: int) -> torch.Tensor:
    """The base tensor of identity *ident*: a different sequence for each identity."""
    i = torch.arange(numel, dtype=torch.int64)
    return ((i * 7 + ident * 1000003) % _MODULUS.get(dtype, _BIG)).to(getattr(torch, dtype))


def _view(t: torch.Tensor, spec: tuple) -> torch.Tensor:
    kind = spec[0]
    if kind == "all":
        return t
    if kind == "slice":
        return t[spec[1] : spec[2]]
    if kind == "step":
        return t[spec[1] :: spec[2]]
    start, rows = spec[1], spec[2]  # "t": a transposed 2-d view at an offset
    cols = (t.numel() - start) // rows
    return t[start : start + rows * cols].view(rows, cols).t()


def _random_view(r: random.Random, numel: int) -> tuple:
    kind = r.choice(["all", "slice", "step", "t"])
    if kind == "slice":
        start = r.randrange(numel // 2)
        return ("slice", start, r.randrange(start + 1, numel + 1))
    if kind == "step":
        return ("step", r.randrange(64), r.randrange(2, 6))
    if kind == "t":
        return ("t", r.randrange(64), r.choice([2, 4, 8]))
    return ("all",)


def _check(where: str, desc: Desc, got: Any) -> str | None:
    """What is wrong with *got*, received as *desc* says, if anything."""
    ident, dtype, numel, spec = desc
    want = _view(_fill(ident, dtype, numel), spec)
    if not isinstance(got, torch.Tensor):
        return f"{where}: {desc}: got {type(got).__name__}, not a tensor"
    layout = (got.dtype, tuple(got.shape), got.stride(), got.storage_offset(), got.untyped_storage().nbytes())
    expected = (want.dtype, tuple(want.shape), want.stride(), want.storage_offset(), want.untyped_storage().nbytes())
    if layout != expected:
        return f"{where}: {desc}: (dtype, shape, stride, offset, storage bytes) {layout}, expected {expected}"
    if torch.equal(got, want):
        return None
    wrong = (got != want).nonzero()
    first = tuple(wrong[0].tolist())
    return (
        f"{where}: {desc}: {len(wrong)} of {want.numel()} elements wrong, the first at {first}: "
        f"{got[first].item()!r}, expected {want[first].item()!r}"
    )


def _placed(t: torch.Tensor) -> str:
    """Where a received tensor's storage lies: its address and the mapping there."""
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    seg = segments.segment_at(ptr, storage.nbytes())
    if seg is None:
        return f"{ptr:#x} (in no segment)"
    return f"{ptr:#x} ({seg.kind} segment {seg.key} mapped at {seg.addr:#x} as {id(seg):#x}, generation {seg.gen:x})"


def _check_message(where: str, descs: list[Desc], got: Any) -> list[str]:
    """Every tensor of a message, and views of one base sharing one storage."""
    if not isinstance(got, list) or len(got) != len(descs):
        return [f"{where}: {descs}: got {type(got).__name__} of {len(got) if isinstance(got, list) else '?'} items"]
    problems = [p for desc, t in zip(descs, got, strict=True) if (p := _check(where, desc, t)) is not None]
    storages: dict[int, torch.Tensor] = {}
    for desc, t in zip(descs, got, strict=True):
        other = storages.setdefault(desc[0], t)
        if other.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
            problems.append(f"{where}: views of base {desc[0]} arrived in two storages: {_placed(other)} and {_placed(t)}")
    return problems


# -- senders -------------------------------------------------------------------------


class Failures:
    """What went wrong, in any thread: plain strings (a tensor kept in a traceback would stay live)."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.lock = threading.Lock()

    def add(self, what: str) -> None:
        with self.lock:
            self.items.append(what)

    def add_exception(self, where: str, exc: BaseException) -> None:
        self.add(f"{where}: {type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc)[-6:])}")


class Source:
    """The tensors senders send: a fresh one, or a view of a base that every sender may
    be sending at the same moment (*SLOTS* of them, each replaced after about
    *BASE_SENDS* sends, or by chance)."""

    def __init__(self, seed: int) -> None:
        self.lock = threading.RLock()
        self.ids = itertools.count(1)
        r = random.Random(seed)
        self.slots: list[list[Any]] = [self._new_base(r) for _ in range(SLOTS)]  # [desc base, tensor, sends]

    def _new(self, r: random.Random) -> tuple[int, str, int, torch.Tensor]:
        with self.lock:
            ident = next(self.ids)
        dtype = r.choice(DTYPES)
        numel = r.choice(SIZES) // getattr(torch, dtype).itemsize
        return ident, dtype, numel, _fill(ident, dtype, numel)

    def _new_base(self, r: random.Random) -> list[Any]:
        ident, dtype, numel, t = self._new(r)
        return [(ident, dtype, numel), t, 0]

    def drop(self) -> None:
        """Let go of the bases (the end of a test)."""
        with self.lock:
            self.slots.clear()

    def message(self, r: random.Random, copies: int) -> tuple[int, list[Desc], list[torch.Tensor]]:
        """A new message id, and its 1 to 3 tensors (sent *copies* times)."""
        with self.lock:
            mid = next(self.ids)
        descs: list[Desc] = []
        tensors: list[torch.Tensor] = []
        while len(tensors) < r.choice((1, 1, 2, 3)):
            if r.random() < 0.5:
                ident, dtype, numel, t = self._new(r)
                spec = _random_view(r, numel)
                descs.append((ident, dtype, numel, spec))
                tensors.append(_view(t, spec))
                continue
            views = 2 if r.random() < 0.3 else 1
            with self.lock:
                slot = r.randrange(SLOTS)
                base, t, sends = self.slots[slot]
                self.slots[slot][2] += views * copies
                if sends >= BASE_SENDS or r.random() < 0.02:
                    self.slots[slot] = self._new_base(r)  # the old one goes with its last sender
            for _ in range(views):
                spec = _random_view(r, base[2])
                descs.append((*base, spec))
                tensors.append(_view(t, spec))
        return mid, descs, tensors


class Pins:
    """Tensors of a ``dumps()`` blob sent to several loaders, kept by the sender until
    each loaded it: bytes load "while their memory lives", and a repeated
    load counts nothing, so a blob loaded and dropped by one loader may name reused
    memory when a second loader gets to it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: dict[int, list[Any]] = {}  # message id -> [loads to come, its tensors]

    def hold(self, mid: int, loads: int, tensors: list[torch.Tensor]) -> None:
        with self.lock:
            self.held[mid] = [loads, tensors]

    def loaded(self, mid: int) -> None:
        with self.lock:
            entry = self.held.get(mid)
            if entry is not None:
                entry[0] -= 1
                if entry[0] == 0:
                    del self.held[mid]


def _run_senders(send: Callable[[random.Random], None], failures: Failures, seed: int) -> int:
    """*SENDERS* threads calling send(rng) until the deadline; how many messages they sent."""
    deadline = time.monotonic() + SECONDS
    sent = [0] * SENDERS

    def sender(i: int) -> None:
        r = random.Random(seed * 1000 + i)
        try:
            while time.monotonic() < deadline:
                send(r)
                sent[i] += 1
        except BaseException as exc:  # noqa: BLE001  reported by the test
            failures.add_exception(f"sender {i}", exc)

    threads = [threading.Thread(target=sender, args=(i,), name=f"stress-sender-{i}", daemon=True) for i in range(SENDERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(SECONDS + WAIT)
    stuck = [th.name for th in threads if th.is_alive()]
    if stuck:
        failures.add(f"senders still running {WAIT:.0f} s after the deadline: {stuck}")
    return sum(sent)


# -- loaders -------------------------------------------------------------------------


class Keeper:
    """A loader's kept tensors: about a third of what it loads, for a while; each checked
    again when dropped (its bytes must not change while it is held)."""

    def __init__(self, r: random.Random, failures: Failures) -> None:
        self.r, self.failures = r, failures
        self.kept: deque[tuple[int, list[Desc], Any]] = deque()

    def offer(self, mid: int, descs: list[Desc], got: Any) -> None:
        if self.r.random() < 0.35:
            self.kept.append((mid, descs, got))
        while len(self.kept) > KEEP or (self.kept and self.r.random() < 0.3):
            self._drop()

    def _drop(self) -> None:
        mid, descs, got = self.kept.popleft()
        for problem in _check_message(f"message {mid}, kept, when dropped", descs, got):
            self.failures.add(problem)

    def drop_all(self) -> None:
        while self.kept:
            self._drop()


def _load_loop(get: Callable[[], Any], failures: Failures, r: random.Random, name: str, loaded: Callable[[int], None]) -> int:
    """Take messages until None; check each (twice if asked); how many were taken.

    A message is (id, descs, payload, twice): payload a list of tensors (unpickled by
    get()) or ``shmreduce.dumps`` bytes, loaded here (again if *twice*, while the first
    load's tensors live). loaded(id) once the first load is checked, whether it
    worked or not."""
    keeper = Keeper(r, failures)
    taken = 0
    last = None
    while True:
        try:
            item = get()
        except queue.Empty:
            failures.add(f"{name}: no message within {WAIT:.0f} s (after message {last})")
            break
        except Exception as exc:  # noqa: BLE001  an unpickling failure: reported, the loop goes on
            failures.add_exception(f"{name}: receiving the message after message {last}", exc)
            taken += 1
            continue
        if item is None:
            break
        taken += 1
        mid, descs, payload, twice = item
        last = mid
        first = None
        for round_ in range(2 if twice else 1):
            where = f"message {mid}, {name}, {'second ' if round_ else ''}load"
            try:
                got = shmreduce.loads(payload) if isinstance(payload, bytes) else payload
            except Exception as exc:  # noqa: BLE001  reported by the test
                failures.add_exception(where, exc)
                break
            for problem in _check_message(where, descs, got):
                failures.add(problem)
            if first is None:
                first = got
            else:
                for a, b in zip(first, got, strict=True):
                    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
                        failures.add(f"{where}: not the storage of the first load, alive (SPEC 2): {_placed(b)}, first {_placed(a)}")
            keeper.offer(mid, descs, got)
        loaded(mid)
        del item, payload, first
        got = None
    keeper.drop_all()
    return taken


def _start_loaders(
    inboxes: list[Any], failures: Failures, seed: int, loaded: Callable[[int], None] = lambda mid: None
) -> tuple[list[threading.Thread], list[int]]:
    taken = [0] * len(inboxes)

    def loader(i: int) -> None:
        name = f"loader {i} (pid {os.getpid()})"
        try:
            taken[i] = _load_loop(lambda: inboxes[i].get(timeout=WAIT), failures, random.Random(seed * 1000 + 500 + i), name, loaded)
        except BaseException as exc:  # noqa: BLE001  reported by the test
            failures.add_exception(name, exc)

    threads = [threading.Thread(target=loader, args=(i,), name=f"stress-loader-{i}", daemon=True) for i in range(len(inboxes))]
    for th in threads:
        th.start()
    return threads, taken


# -- the end -------------------------------------------------------------------------


def _nothing_live(timeout: float = 20.0) -> tuple[bool, dict[str, Any]]:
    """Whether, within *timeout*, this process has no segment live and none waiting for
    its generation to be free (collecting meanwhile, as the collector thread would)."""

    def quiet() -> bool:
        gc.collect()
        transfer.collect()
        s = shmreduce.stats()
        return s["live_segments"] == 0 and s["fd_segments_waiting"] == 0 and s["fs_segments_waiting"] == 0

    ok = wait_for(quiet, timeout, 0.1)
    s = shmreduce.stats()
    return ok, {k: s[k] for k in ("live_segments", "fd_segments_waiting", "fs_segments_waiting", "messages_sent", "messages_received")}


def _verdict(failures: Failures, case: str) -> str:
    head = "\n".join(failures.items[:10])
    return f"{case} (seed {SEED}, {SECONDS:g} s): {len(failures.items)} failures, the first ones:\n{head}"


# -- in one process ------------------------------------------------------------------


def test_threads_of_one_process_send_and_load_at_once(strategy: str) -> None:
    failures = Failures()
    source = Source(SEED)
    inboxes: list[queue.Queue[Any]] = [queue.Queue(maxsize=QUEUE_DEPTH) for _ in range(LOADERS)]
    put = [0] * LOADERS
    lock = threading.Lock()
    pins = Pins()
    loaders, taken = _start_loaders(inboxes, failures, SEED, pins.loaded)

    def send(r: random.Random) -> None:
        # One loader, or two (two threads loading the same bytes, maybe at once), once or
        # twice each.
        targets = r.sample(range(LOADERS), 2 if r.random() < 0.2 else 1)
        mid, descs, tensors = source.message(r, len(targets))
        blob = shmreduce.dumps(tensors)
        if len(targets) > 1:
            pins.hold(mid, len(targets), tensors)
        del tensors  # else the sender lets go at once: the bytes keep what they name
        for i in targets:
            inboxes[i].put((mid, descs, blob, r.random() < 0.2), timeout=WAIT)
            with lock:
                put[i] += 1

    started = time.monotonic()
    try:
        messages = _run_senders(send, failures, SEED)
    finally:
        for box in inboxes:
            box.put(None, timeout=WAIT)
        for th in loaders:
            th.join(WAIT)
    took = time.monotonic() - started
    assert not [th.name for th in loaders if th.is_alive()], "a loader is stuck"
    source.drop()
    assert not pins.held, f"messages every loader took but some did not load: {sorted(pins.held)[:10]}"
    ok, stats = _nothing_live()
    print(f"{strategy}: {messages} messages in {took:.1f} s, {len(failures.items)} failures; {stats}")
    assert not failures.items, _verdict(failures, f"one process, {strategy}, {messages} messages")
    assert taken == put, f"messages taken {taken}, put {put}"
    assert ok, f"something live or waiting after everything was dropped: {stats}"


# -- across two processes ------------------------------------------------------------


def _child_loaders(inboxes: list[Any], outbox: Any, seed: int) -> None:
    """The receiving process: a loader thread per queue; reports what it took, what went
    wrong, and whether anything was left live or waiting once it dropped everything."""
    torch.set_num_threads(1)
    failures = Failures()
    loaders, taken = _start_loaders(inboxes, failures, seed)
    for th in loaders:
        th.join(SECONDS + 2 * WAIT)
    stuck = [th.name for th in loaders if th.is_alive()]
    ok, stats = _nothing_live()
    outbox.put((taken, failures.items, stuck, ok, stats))


def _report(child: Any, outbox: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return outbox.get(timeout=1.0)
        except queue.Empty:
            assert child.is_alive(), f"the loading process exited with {child.exitcode} before it reported"
    raise AssertionError(f"no report from the loading process within {timeout:.0f} s")


def test_threads_of_two_processes_send_and_load_at_once(strategy: str) -> None:
    # The queues and the child before anything is shared: a fork retires the segments in use.
    inboxes = [CTX.Queue(maxsize=QUEUE_DEPTH) for _ in range(LOADERS)]
    outbox = CTX.Queue()
    child = CTX.Process(target=_child_loaders, args=(inboxes, outbox, SEED), daemon=True)
    failures = Failures()
    put = [0] * LOADERS
    lock = threading.Lock()
    clean = False
    started = time.monotonic()
    child.start()
    try:
        source = Source(SEED)

        def send(r: random.Random) -> None:
            # On 1 to 3 queues: their feeder threads pickle the same tensors at once;
            # or dumps() bytes on one queue, loaded once or twice in the child (on
            # two, a load after the other loader dropped them may name reused memory:
            # Pins).
            as_bytes = r.random() < 0.4
            targets = r.sample(range(LOADERS), 1 if as_bytes else r.choice((1, 1, 2, 3)))
            mid, descs, tensors = source.message(r, len(targets))
            payload: Any = shmreduce.dumps(tensors) if as_bytes else tensors
            del tensors
            for i in targets:
                inboxes[i].put((mid, descs, payload, as_bytes and r.random() < 0.3), timeout=WAIT)
                with lock:
                    put[i] += 1

        messages = _run_senders(send, failures, SEED)
        source.drop()
        for box in inboxes:
            box.put(None, timeout=WAIT)
            box.close()
        taken, child_failures, stuck, child_ok, child_stats = _report(child, outbox, SECONDS + 3 * WAIT)
        for box in inboxes:
            box.join_thread()  # every feeder thread is gone, and its slab with it
        child.join(WAIT)
        clean = True
    finally:
        if not clean:
            for box in inboxes:
                box.cancel_join_thread()
        if child.is_alive():
            child.kill()
            child.join()
    took = time.monotonic() - started
    ok, stats = _nothing_live()
    print(f"{strategy}: {messages} messages in {took:.1f} s; sender {stats}; loader {child_stats}")
    for problem in child_failures:
        failures.add(f"in the loading process: {problem}")
    assert not failures.items, _verdict(failures, f"two processes, {strategy}, {messages} messages")
    assert not stuck, f"loaders stuck in the loading process: {stuck}"
    assert child.exitcode == 0, child.exitcode
    assert taken == put, f"messages taken {taken}, put {put}"
    assert child_ok, f"something live or waiting in the loading process after it dropped everything: {child_stats}"
    assert ok, f"something live or waiting in the sending process after everything was dropped: {stats}"
