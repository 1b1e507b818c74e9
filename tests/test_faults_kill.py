"""SIGKILL of producer, consumer and broker at several phases, both strategies, fork and spawn.

Each (strategy, start method) runs as its own *program*: a driver subprocess
(``python tests/test_faults_kill.py ...``) that is the program's root. That matters:
the broker keeps undelivered messages while the root lives (SPEC 7), and a message
whose pickle a killed consumer had already taken off its pipe can never be fetched, so
only the root's exit lets the broker go. The driver plays the survivor: it checks, after
every kill, that survivors get their data or a SharingError within seconds (never a
hang), that a new message between survivors works, that no orphan broker remains and
that the program directory holds no file nobody maps. The pytest process then checks
from outside that the driver's program left nothing behind (SPEC 6 "Both").

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
    q.join_thread()  # every put is on the pipe (and its deposit at the broker)
    flushed.set()
    time.sleep(hold_s)  # "between deposit and fetch": killed here, or exits


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


def _consumer(conn, results, go):
    """Receive on *conn* until None; report each item (or the error).

    Holds tensors tagged "held" (and ints); "read-held" reports their sums. Waits for
    *go* between seeing a message and unpickling it, so the driver can act in between.
    """
    import shmreduce

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
        from shmreduce import program

        self.torch = torch
        self.shmreduce = shmreduce
        self.FP = ForkingPickler
        self.ctx = mp.get_context(method)
        self.rng = random.Random(seed)
        self.rounds = rounds
        shmreduce.register(strategy=strategy)
        self.program = program.current()
        self.log = []
        self.errors = []
        self.orphans = set()  # files of messages a killed sender deposited but never sent
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

    def start_consumer(self):
        a, b = self.ctx.Pipe()
        results = self.ctx.Queue()
        go = self.ctx.Event()
        go.set()
        p = self.ctx.Process(target=_consumer, args=(b, results, go), daemon=True)
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
        pending = None
        if phase == "holding":
            for k, t in enumerate(ts):
                conn.send((k, t))
                status, info = self.get(results, "consumer holding")
                self.check(status == "ok", f"consumer holding: {status} {info}")
        else:  # "before-fetch": the message is on its pipe, the consumer never loads it
            go.clear()
            pending = bytes(self.FP.dumps(("never", ts[0])))
            conn.send_bytes(pending)
        self.kill(p)
        for t in ts:
            t.add_(1)  # the sender's tensors are intact and writable
            self.check(bool((t == 1).all()), "consumer killed: sender tensor corrupt")
        if pending is not None:
            # the dead consumer never fetched: the deposit is still there for the bytes
            tag, back = self.FP.loads(pending)
            self.check(tag == "never" and bool((back == 1).all()), "consumer killed before fetch: redelivery failed")
            del back
        conn.close()
        results.close()
        results.join_thread()
        del t
        ts.clear()
        self.no_files(f"consumer {phase}")  # the dead consumer's holds went with its connection
        self.no_orphans()
        self.survivors_work(f"consumer {phase}")
        self.log.append(f"consumer-{phase}")

    def broker_killed(self, phase):
        _p, conn, results, go = self.witness
        held = self.torch.zeros(512)
        conn.send(("held", held))
        self.check(self.get(results, "broker: first")[0] == "ok", "broker: first message failed")
        lost = None
        if phase == "between-deposit-and-fetch":
            go.clear()
            lost = self.torch.ones(333)
            conn.send(("lost", lost))
        elif phase == "before-share":
            pass
        pid = self.broker_pid()
        os.kill(pid, signal.SIGKILL)
        self.no_orphans(dead_broker=pid)
        if lost is not None:
            t0 = time.monotonic()
            go.set()
            status, info = self.get(results, "broker: lost message")
            # Its descriptors went with the broker: SharingError, unless the
            # receiver maps the slab already (file_descriptor: it received earlier
            # storages of the same slab), which needs no broker: then the data.
            delivered = status == "ok" and info is not None and tuple(info)[1:] == (333.0, 333)
            self.check(status == "SharingError" or delivered, f"broker killed before fetch: receiver got {status} {info}")
            self.check(time.monotonic() - t0 < 8, "broker killed: SharingError took too long")
        # the receiver still maps what it held, and the memory is still shared
        held.fill_(7)
        conn.send(("read-held", self.torch.zeros(1)))
        status, ack = self.get(results, "broker: read-held ack")
        status2, sums = self.get(results, "broker: read-held")
        held_ok = status == "ok" and status2 == "held" and sums and sums[-1] == 7 * 512
        self.check(held_ok, f"broker killed: held tensor {status} {ack} {status2} {sums}")
        # a new message between the same survivors works (a new broker serves it)
        self.survivors_work(f"broker {phase}")
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
        while True:  # drain what the dead producer had sent: all intact (SPEC 7)
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
        # A kill between the producer's deposit and its write to the pipe leaves one
        # message no process can name: the broker keeps it until the program's root
        # exits (it cannot tell it from a slow message). At most that one message.
        _purge()
        if self.wait(lambda: len(_seg_files(self.program.directory) - self.orphans) <= 2, 2):
            self.orphans |= _seg_files(self.program.directory)
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
