"""The lifetime rules driven through real processes by a stateful property test.

``tests/test_lifetime_model.py`` explores a model of the protocol; this drives the
real thing through random sequences of the same operations (hypothesis
``RuleBasedStateMachine``) and checks, after every step, every byte of every tensor
every live process keeps. The test process is the owner: it makes patterned tensors
and sends them (``ForkingPickler``, the bytes kept to load again), drops its own or
keeps them, and streams throw-away tensors of the same sizes through a sink so that
any segment its pool gets back is reused at once. Receivers keep what they load, load
the same bytes again, drop, fork (the child keeps everything inherited) and are
SIGKILLed. A generation reused while a process keeps a tensor of it shows as wrong
bytes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import shmreduce
from shmreduce import transfer

CTX = mp.get_context("fork")
TIMEOUT = 30.0
SIZES = [1 << 10, 100 << 10]  # in a slab; a segment of its own
RECEIVERS = 2  # and one child slot each
SOAK = os.environ.get("SHMREDUCE_SOAK") == "1"


def _pattern(nbytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def _serve(conn: Any, kept: dict[int, tuple[torch.Tensor, int]], child_conn: Any) -> None:
    """A receiver's (or a forked child's) loop: commands on *conn*, a reply to each."""
    while True:
        if not conn.poll(TIMEOUT * 2):
            os._exit(3)  # the test is gone
        cmd, *args = conn.recv()
        if cmd == "load":
            key, seed, blob = args
            try:
                kept[key] = (ForkingPickler.loads(blob), seed)
            except shmreduce.SharingError as exc:
                conn.send(f"refused: {exc}")
                continue
            conn.send("ok")
        elif cmd == "drop":
            kept.pop(args[0], None)
            transfer.collect()
            conn.send("ok")
        elif cmd == "check":
            transfer.collect()
            conn.send({key: int((t != _pattern(t.numel(), seed)).sum()) for key, (t, seed) in kept.items()})
        elif cmd == "sink":
            for blob in args[0]:
                ForkingPickler.loads(blob)  # loaded and dropped at once
            transfer.collect()
            conn.send("ok")
        elif cmd == "fork":
            pid = os.fork()
            if pid == 0:  # the child: keeps what it inherited, answers on its own pipe
                conn.close()
                torch.set_num_threads(1)
                _serve(child_conn, kept, None)
                os._exit(0)
            conn.send(pid)
        elif cmd == "exit":
            conn.send("ok")
            os._exit(0)


def _receiver(conn: Any, child_conn: Any) -> None:
    torch.set_num_threads(1)
    _serve(conn, {}, child_conn)


class Process:
    def __init__(self, conn: Any, pid: int) -> None:
        self.conn, self.pid = conn, pid
        self.kept: dict[int, int] = {}  # key -> seed, as the model says it keeps

    def ask(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        assert self.conn.poll(TIMEOUT), f"process {self.pid} did not answer {cmd[0]}"
        return self.conn.recv()


class Lifetimes(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.live: list[Process] = []
        self.child_ends: dict[int, Any] = {}  # a receiver's pid -> the test's end of its child's pipe
        self.procs: list[Any] = []
        self.pids: list[int] = []
        for _ in range(RECEIVERS + 1):  # the last one: the sink
            ours, theirs = CTX.Pipe()
            child_ours, child_theirs = CTX.Pipe()
            p = CTX.Process(target=_receiver, args=(theirs, child_theirs))
            p.start()
            theirs.close()
            child_theirs.close()
            self.procs.append(p)
            assert p.pid is not None
            proc = Process(ours, p.pid)
            self.child_ends[p.pid] = child_ours
            self.live.append(proc)
        self.sink = self.live.pop()
        self.blobs: list[tuple[int, bytes]] = []  # (seed, the bytes of a message), to load again
        self.pending: list[tuple[int, bytes]] = []  # messages sent, not loaded yet (a queue's)
        self.owned: list[tuple[int, torch.Tensor]] = []  # what the owner keeps of what it sent (seed, tensor)
        self.seed = 0
        self.key = 0

    def teardown(self) -> None:
        for proc in [*self.live, self.sink]:
            try:
                proc.ask("exit")
            except (AssertionError, OSError, EOFError):
                pass
        for pid in self.pids:
            _reap(pid)
        for p in self.procs:
            p.join(TIMEOUT)
            if p.is_alive():
                p.kill()
                p.join()
        for _seed, blob in self.pending:  # loaded here: nothing left in flight
            ForkingPickler.loads(blob)
        self.owned.clear()
        self.blobs.clear()
        self.pending.clear()
        transfer.collect()

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), nbytes=st.sampled_from(SIZES), keep=st.booleans())
    def send(self, data: st.DataObject, nbytes: int, keep: bool) -> None:
        proc = data.draw(st.sampled_from(self.live))
        self.seed += 1
        t = _pattern(nbytes, self.seed)
        blob = bytes(ForkingPickler.dumps(t))
        self.blobs.append((self.seed, blob))
        if keep:
            self.owned.append((self.seed, t))
        del t
        self.key += 1
        assert proc.ask("load", self.key, self.seed, blob) == "ok"
        proc.kept[self.key] = self.seed

    @rule(nbytes=st.sampled_from(SIZES))
    def post(self, nbytes: int) -> None:
        """A message pickled and queued, its tensor dropped by the owner: nobody has
        loaded it yet."""
        self.seed += 1
        blob = bytes(ForkingPickler.dumps(_pattern(nbytes, self.seed)))
        self.pending.append((self.seed, blob))
        transfer.collect()

    @precondition(lambda self: bool(self.live) and bool(self.pending))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """A queued message's first load: it has its data, whatever happened meanwhile
        (a repeated load of other bytes never costs it its data)."""
        proc = data.draw(st.sampled_from(self.live))
        seed, blob = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        self.blobs.append((seed, blob))
        self.key += 1
        answer = proc.ask("load", self.key, seed, blob)
        assert answer == "ok", f"a queued message lost its data: {answer}"
        proc.kept[self.key] = seed

    @precondition(lambda self: bool(self.live) and bool(self.blobs))
    @rule(data=st.data())
    def load_again(self, data: st.DataObject) -> None:
        proc = data.draw(st.sampled_from(self.live))
        seed, blob = data.draw(st.sampled_from(self.blobs))
        self.key += 1
        answer = proc.ask("load", self.key, seed, blob)
        if answer == "ok":
            proc.kept[self.key] = seed
        else:
            # Bytes load again while their memory lives at the broker: refused
            # (never wrong bytes) only once the owner let go of that tensor.
            assert seed not in {s for s, _ in self.owned}, f"a load of bytes whose owner keeps them: {answer}"
            assert answer.startswith("refused"), answer

    @precondition(lambda self: any(p.kept for p in self.live))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        proc = data.draw(st.sampled_from([p for p in self.live if p.kept]))
        key = data.draw(st.sampled_from(sorted(proc.kept)))
        assert proc.ask("drop", key) == "ok"
        del proc.kept[key]

    @precondition(lambda self: bool(self.owned))
    @rule()
    def owner_drops(self) -> None:
        self.owned.pop(0)
        transfer.collect()

    @precondition(lambda self: any(p.pid in self.child_ends for p in self.live))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        proc = data.draw(st.sampled_from([p for p in self.live if p.pid in self.child_ends]))
        pid = proc.ask("fork")
        child = Process(self.child_ends.pop(proc.pid), pid)
        child.kept = dict(proc.kept)
        self.pids.append(pid)
        self.live.append(child)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        proc = data.draw(st.sampled_from(self.live))
        os.kill(proc.pid, signal.SIGKILL)
        self.live.remove(proc)
        if proc.pid in self.pids:
            _reap(proc.pid)

    @rule(nbytes=st.sampled_from(SIZES))
    def stream(self, nbytes: int) -> None:
        """Throw-away tensors through the sink, each dropped at once: whatever segment
        the owner's pool gets back is filled anew now."""
        blobs = []
        for i in range(40 if nbytes <= 1 << 10 else 8):
            transfer.collect()
            blobs.append(bytes(ForkingPickler.dumps(torch.full((nbytes,), i % 251, dtype=torch.uint8))))
        assert self.sink.ask("sink", blobs) == "ok"
        transfer.collect()

    @invariant()
    def every_kept_tensor_keeps_its_bytes(self) -> None:
        for proc in self.live:
            wrong = proc.ask("check")
            assert set(wrong) == set(proc.kept), (proc.pid, sorted(wrong), sorted(proc.kept))
            assert not any(wrong.values()), f"process {proc.pid} kept tensors with wrong bytes: {wrong}"


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass  # a grandchild: its parent reaps it, or init


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_every_kept_tensor_keeps_its_bytes_whatever_the_processes_do(strategy: str) -> None:
    # Real processes do not replay bit for bit: no shrinking (a failure is reported as
    # the sequence that found it). SHMREDUCE_SOAK=1 runs many more sequences.
    with shmreduce.registered(strategy=strategy):
        run_state_machine_as_test(
            Lifetimes,
            settings=settings(
                max_examples=60 if SOAK else 40,
                stateful_step_count=25,
                deadline=None,
                derandomize=not SOAK,
                phases=[Phase.explicit, Phase.reuse, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            ),
        )
