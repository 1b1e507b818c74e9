"""SIGKILL of producer, consumer and broker at several phases, both strategies, fork and spawn.

Each (strategy, start method) runs as its own *program*: a driver subprocess
(``python tests/test_faults_kill.py ...``) that is the program's root. That matters:
the broker keeps a segment whose sender died while refs sent in it are in flight
(pickled, not all loaded) while the root lives, and a message pickled by a
producer killed before it reached the pipe can never be loaded, so only the root's
exit (or SHMREDUCE_ORPHAN_TTL) lets the broker go. The driver plays the survivor: it
checks, after every kill, that survivors get their data or a SharingError within
seconds (never a hang), that a new message between survivors works, and to a process
that never saw the segments (after a broker kill too), that a killed receiver's holds
are counted out of the segment headers (the sender reuses the memory), that no orphan
broker remains, that the program directory holds no file nobody maps and that the
broker keeps nothing in flight (but those orphans). The pytest process then checks
from outside that the driver's program left nothing behind, under both strategies.

Phases are chosen by a seeded RNG (SHMREDUCE_FAULT_SEED, default fixed) and repeated;
SHMREDUCE_SOAK=1 runs many more rounds.
"""

from __future__ import annotations

import gc
import json
import os
import queue as queue_mod
import random
import signal
import subprocess
import sys
import time
import zlib

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SOAK = os.environ.get("SHMREDUCE_SOAK") == "1"
SEED = int(os.environ.get("SHMREDUCE_FAULT_SEED", "20261122"))
TIMEOUT = 10.0  # any single wait in the driver
STARTUP_TIMEOUT = 120.0  # the witness's start-up, before the first scenario


# -- children (module level: spawn imports this file) --------------------------------


def _producer(q, ready, flushed, n, value_base, pre_s, hold_s):
    import torch

    ready.set()
    time.sleep(pre_s)  # phase "before pickling": the driver kills us here
    for i in range(n):
        q.put((i, torch.full((1024 + 37 * i,), float(value_base + i))))
    q.close()
    q.join_thread()  # every put is on the pipe: its refs counted sent, its memfds at the broker
    flushed.set()
    time.sleep(hold_s)  # "after put, before the load": killed here, or exits


def _stream_producer(conn, go, n):
    import torch

    go.wait(TIMEOUT)
    for i in range(n):
        conn.send((i, torch.full((256 + i % 7,), float(i)), torch.arange(i % 5 + 1)))
        time.sleep(0.001 * (i % 3))
    time.sleep(60)


def _purge():
    """Release this process's dropped file_system segments now (the cache does it lazily)."""
    from shmreduce import transfer

    gc.collect()
    transfer.collect()


def _consumer(conn, results, go, stranger=False):
    """Receive on *conn* until None; report each item (or the error).

    Holds tensors tagged "held" (and ints); "read-held" reports their sums. Waits for
    *go* between seeing a message and unpickling it, so the driver can act in between.
    *stranger*: first forget the segments a fork inherited from the driver, to receive
    like a process that never saw them (it fetches or opens each anew).
    """
    import shmreduce

    if stranger:
        from helpers import forget_mappings

        forget_mappings()
    held = []
    while True:
        try:
            if not conn.poll(TIMEOUT):
                continue
            go.wait(TIMEOUT)
            item = conn.recv()
        except shmreduce.SharingError as exc:
            results.put(("SharingError", str(exc)[:300]))
            continue
        except EOFError:
            return
        except Exception as exc:  # noqa: BLE001  reported to the driver, which fails
            results.put((type(exc).__name__, str(exc)[:300]))
            continue
        if item is None:
            return
        tag, t = item
        if tag == "held" or isinstance(tag, int):
            held.append(t)
        results.put(("ok", (tag, float(t.sum()), t.numel())))
        if tag == "read-held":
            results.put(("held", [float(h.sum()) for h in held]))
        del item, t
        _purge()


# -- the driver (one program) --------------------------------------------------------


def _seg_files(directory):
    try:
        return {n for n in os.listdir(directory) if n.startswith("seg-")}
    except FileNotFoundError:
        return set()


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Driver:
    def __init__(self, strategy, method, seed, rounds):
        import multiprocessing as mp
        from multiprocessing.reduction import ForkingPickler

        import torch

        import shmreduce
        from shmreduce import _native, program
        from shmreduce.cache import cache
        from shmreduce.pool import ARENA_ITEM_MAX

        self.torch = torch
        self.native = _native
        self.cache = cache
        self.large = ARENA_ITEM_MAX // 4 + 1024  # float32 elements: a storage with a segment of its own
        self.shmreduce = shmreduce
        self.FP = ForkingPickler
        self.ctx = mp.get_context(method)
        self.rng = random.Random(seed)
        self.rounds = rounds
        shmreduce.register(strategy=strategy)
        self.program = program.current()
        self.log = []
        self.errors = []
        self.orphans = set()  # files of messages a killed producer pickled but never put on the pipe
        self.orphan_segments = 0  # how many segments the broker may keep draining for those
        # one long-lived survivor: it lives through every kill and must keep working
        self.witness = self.start_consumer()
        # Its start-up (under spawn a fresh interpreter importing this module, pytest
        # and torch: many seconds on a loaded machine) is no scenario's: one round
        # trip with a generous limit before the first, whose TIMEOUT it would eat.
        _p, conn, results, _go = self.witness
        conn.send(("warm-up", torch.zeros(1)))
        try:
            status, _info = results.get(timeout=STARTUP_TIMEOUT)
        except queue_mod.Empty:
            status = "timeout"
        self.check(status == "ok", f"witness not answering {STARTUP_TIMEOUT}s after its start: {status}")

    # helpers ---------------------------------------------------------------------

    def broker_pid(self):
        from shmreduce.broker import client

        c = client.client_for(self.program.directory, self.program.root_pid)
        c.connect()
        return c.broker_pid

    def draining(self):
        """How many segments the broker keeps for no live process, refs in them in flight
        (not those it keeps because a live receiver holds them: it may forward them)."""
        from shmreduce.broker import client

        c = client.client_for(self.program.directory, self.program.root_pid)
        c.connect()
        counters = c.ping()
        return counters["draining"] - counters["draining_held"]

    def check(self, cond, what):
        if not cond:
            self.errors.append(what)

    def wait(self, cond, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return True
            time.sleep(0.02)
        return cond()

    def kill(self, proc):
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(TIMEOUT)
        self.check(not proc.is_alive(), f"child {proc.pid} survived SIGKILL")

    def reap(self, *procs):
        for p in procs:
            p.join(TIMEOUT)
            if p.is_alive():
                self.errors.append(f"child {p.pid} did not exit")
                p.kill()
                p.join(TIMEOUT)

    def no_orphans(self, dead_broker=None):
        import helpers

        if dead_broker is not None:
            self.check(self.wait(lambda: not _alive(dead_broker)), f"killed broker {dead_broker} still alive")
        # at most one server + its janitor for this program, and no other program dir
        self.check(self.wait(lambda: len(helpers.broker_pids()) <= 2), f"orphan brokers: {helpers.broker_pids()}")
        base = os.path.dirname(self.program.directory)
        mine = {os.path.basename(self.program.directory)}
        self.check(self.wait(lambda: set(os.listdir(base)) <= mine), f"other program dirs in {base}: {os.listdir(base)}")

    def no_files(self, why):
        _purge()
        from shmreduce import transfer

        transfer.let_go()  # this process's pool keeps free files for reuse: not a leak, but let go to check
        ok = self.wait(lambda: not (_seg_files(self.program.directory) - self.orphans))
        self.check(ok, f"{why}: segment files left {sorted(_seg_files(self.program.directory) - self.orphans)}")
        # nothing in flight that a live process could still load: the broker keeps no
        # segment for the dead (but the stream's orphans)
        ok = self.wait(lambda: self.draining() <= self.orphan_segments)
        self.check(ok, f"{why}: the broker keeps {self.draining()} segment(s) in flight, {self.orphan_segments} orphaned")

    def start_consumer(self, stranger=False):
        a, b = self.ctx.Pipe()
        results = self.ctx.Queue()
        go = self.ctx.Event()
        go.set()
        p = self.ctx.Process(target=_consumer, args=(b, results, go, stranger), daemon=True)
        p.start()
        b.close()
        return p, a, results, go

    def stop_consumer(self, consumer):
        p, conn, results, _go = consumer
        try:
            conn.send(None)
        except OSError:
            pass
        conn.close()
        self.reap(p)
        results.close()
        results.join_thread()

    def get(self, q, what):
        try:
            return q.get(timeout=TIMEOUT)
        except queue_mod.Empty:
            self.errors.append(f"{what}: no answer within {TIMEOUT}s (hang)")
            return ("timeout", None)

    def survivors_work(self, why):
        """A new message from the driver to the surviving witness round-trips."""
        _p, conn, results, _go = self.witness
        t = self.torch.arange(1000, dtype=self.torch.float64)
        conn.send(("fresh", t))
        status, info = self.get(results, f"{why}: fresh message")
        self.check(status == "ok" and tuple(info) == ("fresh", float(t.sum()), 1000), f"{why}: fresh message gave {status} {info}")

    def stranger_works(self, why):
        """A new message from the driver reaches a new process that maps none of its
        segments (so needs the broker, or the files, as they are now)."""
        consumer = self.start_consumer(stranger=True)
        _p, conn, results, _go = consumer
        t = self.torch.arange(1000, dtype=self.torch.float64)
        data = bytes(self.FP.dumps(("fresh", t)))
        conn.send_bytes(data)
        # its start-up (spawn: a fresh interpreter) is not the message's: a generous limit
        try:
            status, info = results.get(timeout=STARTUP_TIMEOUT)
        except queue_mod.Empty:
            status, info = "timeout", None
        delivered = status == "ok" and tuple(info) == ("fresh", float(t.sum()), 1000)
        self.check(delivered, f"{why}: new receiver got {status} {info}")
        self.stop_consumer(consumer)
        if not delivered:
            self.FP.loads(data)  # the driver maps it: loaded here, nothing of it is left in flight

    # scenarios -------------------------------------------------------------------

    def producer_killed(self, phase):
        q = self.ctx.Queue()
        ready, flushed = self.ctx.Event(), self.ctx.Event()
        n = self.rng.randint(1, 6)
        hold = 60 if phase != "exit" else 0
        pre = 60 if phase == "before-pickle" else 0
        p = self.ctx.Process(target=_producer, args=(q, ready, flushed, n, 100, pre, hold), daemon=True)
        p.start()
        got = []
        if phase == "before-pickle":
            self.check(ready.wait(TIMEOUT + 20), "producer never ready")
            self.kill(p)
        else:
            self.check(flushed.wait(TIMEOUT + 20), "producer never flushed")
            if phase == "after-put":
                self.kill(p)
            else:
                self.reap(p)  # "exit": the producer returned right after put(); we read later
            for _ in range(n):
                try:
                    i, t = q.get(timeout=TIMEOUT)
                except queue_mod.Empty:
                    self.errors.append(f"producer {phase}: message missing")
                    break
                except self.shmreduce.SharingError as exc:
                    self.errors.append(f"producer {phase}: {exc}")
                    break
                got.append(i)
                self.check(t.numel() == 1024 + 37 * i and bool((t == 100 + i).all()), f"producer {phase}: corrupt {i}")
                del t
            self.check(got == list(range(n)), f"producer {phase}: got {got} of {n}")
        if phase == "before-pickle":
            self.reap(p)
        q.close()
        q.join_thread()
        self.no_files(f"producer {phase}")
        self.no_orphans()
        self.survivors_work(f"producer {phase}")
        self.log.append(f"producer-{phase}:{n}")

    def consumer_killed(self, phase):
        consumer = self.start_consumer()
        p, conn, results, go = consumer
        ts = [self.torch.zeros(64 * (k + 1)) for k in range(self.rng.randint(1, 4))]
        # a segment of its own: its generation ends once the driver drops it, and its
        # header says who still holds it and whether a ref sent in it is in flight
        big = self.torch.zeros(self.large)
        pending = None
        if phase == "holding":
            for k, t in enumerate([*ts, big]):
                conn.send((k, t))
                status, info = self.get(results, "consumer holding")
                self.check(status == "ok", f"consumer holding: {status} {info}")
        else:  # "before-fetch": the message is on its pipe, the consumer never loads it
            go.clear()
            pending = bytes(self.FP.dumps(("never", big)))
            conn.send_bytes(pending)
        place = self.cache.place_of(big.untyped_storage())
        assert place is not None
        seg, gen = place.segment, place.gen & (1 << 64) - 1  # as its header holds it
        self.kill(p)
        for t in [*ts, big]:
            t.add_(1)  # the sender's tensors are intact and writable
            self.check(bool((t == 1).all()), "consumer killed: sender tensor corrupt")
        conn.close()
        results.close()
        results.join_thread()
        del t, place
        ts.clear()
        big = None  # the driver lets go: the generation ends here
        _purge()
        if pending is not None:
            # The dead consumer never loaded it: in flight, so the driver keeps the
            # segment as it is, and another receiver gets the message.
            _p, wconn, wresults, _go = self.witness
            wconn.send_bytes(pending)
            status, info = self.get(wresults, "consumer killed before fetch: redelivery")
            delivered = status == "ok" and tuple(info) == ("never", float(self.large), self.large)
            self.check(delivered, f"consumer killed before fetch: redelivery gave {status} {info}")

        # Nobody holds the generation now (the dead consumer's hold counted out by the
        # broker) and every ref sent in it was loaded: the driver frees the segment.
        def freed():
            _purge()
            return self.native.hdr_read(seg.addr)[0] != gen

        self.check(self.wait(freed), f"consumer {phase}: segment never freed, header {self.native.hdr_read(seg.addr)}")
        seg = None  # unmapped once the pool lets go of it too (no_files)
        self.no_files(f"consumer {phase}")  # the dead consumer's holds went with its connection
        self.no_orphans()
        self.survivors_work(f"consumer {phase}")
        self.log.append(f"consumer-{phase}")

    def broker_killed(self, phase):
        _p, conn, results, go = self.witness
        held = self.torch.zeros(512)
        conn.send(("held", held))
        self.check(self.get(results, "broker: first")[0] == "ok", "broker: first message failed")
        lost = lost_bytes = None
        if phase == "between-deposit-and-fetch":
            go.clear()
            lost = self.torch.ones(333)
            lost_bytes = bytes(self.FP.dumps(("lost", lost)))
            conn.send_bytes(lost_bytes)
        elif phase == "before-share":
            pass
        pid = self.broker_pid()
        os.kill(pid, signal.SIGKILL)
        self.no_orphans(dead_broker=pid)
        if lost is not None:
            t0 = time.monotonic()
            go.set()
            status, info = self.get(results, "broker: lost message")
            # Its memfd went with the broker (file_descriptor), its file with the
            # directory (file_system): SharingError, unless the receiver maps the
            # slab already (it received "held", in the same slab), which needs no
            # broker: then the data.
            delivered = status == "ok" and info is not None and tuple(info)[1:] == (333.0, 333)
            self.check(status == "SharingError" or delivered, f"broker killed before fetch: receiver got {status} {info}")
            self.check(time.monotonic() - t0 < 8, "broker killed: SharingError took too long")
            if not delivered:
                # The driver maps the segment: the bytes load here, which leaves
                # nothing of them in flight.
                assert lost_bytes is not None
                tag, back = self.FP.loads(lost_bytes)
                self.check(tag == "lost" and bool((back == 1).all()), "broker killed: the sender cannot load its own message")
                del back
        # the receiver still maps what it held, and the memory is still shared
        held.fill_(7)
        conn.send(("read-held", self.torch.zeros(1)))
        status, ack = self.get(results, "broker: read-held ack")
        status2, sums = self.get(results, "broker: read-held")
        held_ok = status == "ok" and status2 == "held" and sums and sums[-1] == 7 * 512
        self.check(held_ok, f"broker killed: held tensor {status} {ack} {status2} {sums}")
        # a new message between the same survivors works, and to a new receiver, which
        # needs a broker (a new one serves it)
        self.survivors_work(f"broker {phase}")
        self.stranger_works(f"broker {phase}")
        del held, lost
        self.log.append(f"broker-{phase}")

    def stream_killed(self):
        a, b = self.ctx.Pipe(duplex=False)
        go = self.ctx.Event()
        n = 400
        p = self.ctx.Process(target=_stream_producer, args=(b, go, n), daemon=True)
        p.start()
        b.close()
        go.set()
        received = []
        t_end = time.monotonic() + self.rng.uniform(0.0, 0.3)
        while time.monotonic() < t_end and a.poll(0.01):
            i, t, r = a.recv()
            received.append(i)
        self.kill(p)
        while True:  # drain what the dead producer had sent: all intact
            try:
                if not a.poll(1.0):
                    break
                i, t, r = a.recv()
            except EOFError:
                break
            except self.shmreduce.SharingError as exc:
                self.errors.append(f"stream: {exc}")
                break
            self.check(bool((t == float(i)).all()) and r.numel() == i % 5 + 1, f"stream: corrupt {i}")
            received.append(i)
        t = r = None
        # A kill between pickling a message (its refs counted sent) and writing it to
        # the pipe leaves one message no process can name: the broker keeps its
        # segments, draining, until the program's root exits (it cannot tell it from a
        # slow message). At most that one message: its slab (and, at a slab's end,
        # the one before).
        _purge()
        if self.wait(lambda: len(_seg_files(self.program.directory) - self.orphans) <= 2, 2):
            self.orphans |= _seg_files(self.program.directory)
        if self.wait(lambda: self.draining() <= self.orphan_segments + 2, 2):
            self.orphan_segments = max(self.orphan_segments, self.draining())
        self.check(received == list(range(len(received))), f"stream: out of order or lost {received[:10]}...")
        a.close()
        self.no_files("stream")
        self.no_orphans()
        self.survivors_work("stream")
        self.log.append(f"stream:{len(received)}")

    def run(self, names):
        scenarios = {
            "producer-before-pickle": lambda: self.producer_killed("before-pickle"),
            "producer-after-put": lambda: self.producer_killed("after-put"),
            "producer-exit": lambda: self.producer_killed("exit"),
            "consumer-holding": lambda: self.consumer_killed("holding"),
            "consumer-before-fetch": lambda: self.consumer_killed("before-fetch"),
            "broker-holding": lambda: self.broker_killed("holding"),
            "broker-between-deposit-and-fetch": lambda: self.broker_killed("between-deposit-and-fetch"),
            "stream": self.stream_killed,
        }
        names = names or list(scenarios)
        order = []
        for _ in range(self.rounds):
            order += self.rng.sample(names, len(names))
        for name in order:
            try:
                scenarios[name]()
            except Exception as exc:  # noqa: BLE001
                self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
        self.stop_consumer(self.witness)
        self.no_files("end")
        return {"log": self.log, "errors": self.errors, "dir": self.program.directory}


def _drive(argv):
    strategy, method, seed, rounds = argv[0], argv[1], int(argv[2]), int(argv[3])
    names = argv[4].split(",") if len(argv) > 4 and argv[4] else []
    sys.path.insert(0, HERE)
    result = Driver(strategy, method, seed, rounds).run(names)
    print("RESULT " + json.dumps(result), flush=True)


# -- the tests -------------------------------------------------------------------------

import helpers  # noqa: E402


@pytest.mark.timeout(200 if not SOAK else 3600)
@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_sigkill_phases(strategy, method):
    before = helpers.shm_entries()
    rounds = (1 if method == "spawn" else 2) * (10 if SOAK else 1)
    seed = SEED + zlib.crc32(f"{strategy}/{method}".encode()) % 1000  # not hash(): PYTHONHASHSEED varies it
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), strategy, method, str(seed), str(rounds)],
        capture_output=True,
        text=True,
        timeout=170 if not SOAK else 3500,
        cwd=os.path.dirname(HERE),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"driver failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1][len("RESULT ") :])
    assert not result["errors"], f"seed {seed}: {result['errors']}\nlog: {result['log']}"
    # after the program's last process exits, nothing is left: no broker, no files
    assert helpers.wait_for(lambda: not helpers.broker_pids(), 10), helpers.broker_pids()
    assert helpers.wait_for(lambda: helpers.shm_entries() <= before, 10), sorted(helpers.shm_entries() - before)


if __name__ == "__main__":
    _drive(sys.argv[1:])
