"""In normal operation shmreduce writes nothing to the user's stderr.

Each shape runs as a fresh program, as a user runs it: its own interpreter, its own
broker, which logs to the stderr of the process that started it. Two loops of such
programs run at once, so that a rare failure at exit (a traceback at interpreter
shutdown, a broker line) shows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.multiprocessing as tmp

from shmreduce import _native, program
from shmreduce.broker import client as broker_client
from shmreduce.cache import cache

from helpers import broker_pids, let_go_now, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROGRAMS = textwrap.dedent(
    """
    import multiprocessing as mp
    import sys
    from multiprocessing.reduction import ForkingPickler
    import threading
    import time

    import torch

    import shmreduce


    class Numbers(torch.utils.data.Dataset):
        def __len__(self):
            return 10_000

        def __getitem__(self, i):
            return torch.full((256,), float(i))


    def dataloader():
        # Stopped early: the workers' prefetched batches are never loaded.
        loader = torch.utils.data.DataLoader(Numbers(), batch_size=8, num_workers=2)
        for i, batch in enumerate(loader):
            assert batch[0, 0].item() == 8 * i
            if i == 20:
                break


    def put_many(q, n):
        for i in range(n):
            q.put(torch.full((1000,), float(i)))


    def dropped_queue():
        # A queue nobody reads, and one read in part: both dropped with items in them;
        # and one put just before the program exits, its feeder thread still pickling
        # them (each a segment of its own: a round trip to the broker) as the exit begins.
        ctx = mp.get_context("fork")
        unread = ctx.Queue()
        for i in range(5):
            unread.put(torch.full((100,), float(i)))
        q = ctx.Queue()
        p = ctx.Process(target=put_many, args=(q, 10))
        p.start()
        got = [q.get(timeout=60) for _ in range(3)]
        assert [t[0].item() for t in got] == [0.0, 1.0, 2.0]
        p.join(60)
        assert p.exitcode == 0
        last = ctx.Queue()
        for i in range(5):
            last.put(torch.full((100_000,), float(i)))


    def feeder_behind_exit():
        # A queue put just before the program exits, its feeder thread taken off the CPU
        # between taking its broker client and using it (as on a loaded machine), until
        # this process closes its connections (2 s at most: none closed before the
        # feeder is done).
        from shmreduce.broker import client

        closed, exiting, taken = threading.Event(), threading.Event(), threading.Event()
        close_all, client_for = client.close_all, client.client_for

        def close_all_seen(*args, **kwargs):
            closed.set()
            close_all(*args, **kwargs)

        def client_for_behind(*args):
            found = client_for(*args)
            if exiting.is_set() and threading.current_thread() is not threading.main_thread():
                taken.set()
                closed.wait(2)
            return found

        client.close_all, client.client_for = close_all_seen, client_for_behind
        ForkingPickler.dumps(torch.zeros(100))  # this process has shared: its broker runs
        q = mp.get_context("fork").Queue()
        exiting.set()
        for i in range(5):
            q.put(torch.full((100_000,), float(i)))
        taken.wait(60)  # the exit begins with the feeder inside its first share


    def kept():
        # README's quickstart shape: a spawn child puts, the parent gets, checks,
        # joins and exits holding all it received.
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=put_many, args=(q, 10))
        p.start()
        got = [q.get(timeout=60) for _ in range(10)]
        assert [t[0].item() for t in got] == [float(i) for i in range(10)]
        p.join(60)
        assert p.exitcode == 0


    def consume(q):
        got = [q.get(timeout=60) for _ in range(10)]
        assert all(t.numel() == 4096 for t in got)


    def short_lived():
        pass


    def streaming():
        # A spawn consumer returns while its parent streams puts from a thread and
        # forks short-lived children: the consumer exits holding gens whose weakref
        # callbacks run at interpreter shutdown.
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        c = ctx.Process(target=consume, args=(q,))
        c.start()
        stop = threading.Event()

        def stream():
            # At most what the queue's pipe holds: the parent's exit flushes the rest
            # of its puts into it, and nobody reads them.
            for i in range(60):
                if stop.is_set():
                    return
                q.put(torch.full((4096,), float(i)))
                time.sleep(0.01)

        th = threading.Thread(target=stream)
        th.start()
        for _ in range(3):
            p = mp.get_context("fork").Process(target=short_lived)
            p.start()
            p.join(60)
        c.join(60)
        stop.set()
        th.join(60)
        assert c.exitcode == 0


    if __name__ == "__main__":
        shmreduce.register(strategy=sys.argv[2])
        globals()[sys.argv[1]]()
        print("ok", flush=True)
    """
)

SHAPES = ["dataloader", "dropped_queue", "kept", "streaming"]


def _run(script, shape: str, strategy: str) -> tuple[str, int, str, str]:
    """Run *shape* as a fresh program; (what it is, its exit status, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    # The broker logs to our stderr, at its default level, and keeps what a sender let
    # go of its default ORPHAN_TTL (a spawn consumer may start seconds after the puts).
    for name in ("SHMREDUCE_BROKER_LOG", "SHMREDUCE_LOG_LEVEL", "SHMREDUCE_ORPHAN_TTL"):
        env.pop(name, None)
    # stderr reaches its end only once every process holding it has exited, the
    # broker included: a broker left behind is a timeout here.
    proc = subprocess.run([sys.executable, str(script), shape, strategy], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    return f"{shape} under {strategy}", proc.returncode, proc.stdout, proc.stderr


@contextmanager
def busy_machine(processes: int = 2) -> Iterator[None]:
    """*processes* CPU burners for the block: what runs first at a program's exit (its
    queues' feeder threads, its exit hooks) is then decided as on a loaded machine."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def test_normal_programs_write_nothing_on_stderr(tmp_path):
    """Every shape under each strategy: two loops at once, one per strategy, beside
    two busy processes."""
    script = tmp_path / "programs.py"
    script.write_text(_PROGRAMS)
    results: list[tuple[str, int, str, str]] = []

    def loop(kind: str, shapes: list[str]) -> None:
        for shape in shapes:
            results.append(_run(script, shape, kind))

    loops = [
        threading.Thread(target=loop, args=("file_descriptor", SHAPES)),
        threading.Thread(target=loop, args=("file_system", SHAPES[::-1])),
    ]
    with busy_machine():
        for th in loops:
            th.start()
        for th in loops:
            th.join(600)
    assert len(results) == 2 * len(SHAPES), results
    failed = [
        f"{shape}: exit status {code}, stdout {out!r}, stderr:\n{err}" for shape, code, out, err in results if code or out != "ok\n" or err
    ]
    assert not failed, "\n\n".join(failed)


@pytest.mark.parametrize("strategy_name", ["file_descriptor", "file_system"])
def test_a_feeder_still_pickling_at_exit_writes_nothing_on_stderr(tmp_path, strategy_name):
    """The queue's feeder thread still pickles what was put when the program's exit
    begins: its messages are shared, and nothing is written on stderr (before: the exit
    closed the broker connections under it, and each failure was logged there)."""
    script = tmp_path / "programs.py"
    script.write_text(_PROGRAMS)
    shape, code, out, err = _run(script, "feeder_behind_exit", strategy_name)
    assert (code, out, err) == (0, "ok\n", ""), f"{shape}: exit status {code}, stdout {out!r}, stderr:\n{err}"


def _put_many(q, n):
    for i in range(n):
        q.put(torch.full((1000,), float(i)))


@pytest.mark.swap_path
def test_what_a_receiver_keeps_is_loaded_in_the_segments_books(strategy, tmp_path, monkeypatch):
    """README's quickstart shape, this process the receiver and the program's root
    (which lives on, so refs in flight would keep the broker for
    SHMREDUCE_ORPHAN_TTL): once it has received all 10, every ref the sender counted
    sent is counted loaded, the broker keeps nothing in flight and holds this
    process's generations, and it goes once this process lets go of them."""
    broker_client.close_all()
    assert wait_for(lambda: not broker_pids(), 10)
    log = tmp_path / "broker.log"
    monkeypatch.setenv("SHMREDUCE_BROKER_LOG", str(log))
    monkeypatch.setenv("SHMREDUCE_LOG_LEVEL", "DEBUG")
    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_put_many, args=(q, 10))
    p.start()
    got = [q.get(timeout=60) for _ in range(10)]
    p.join(60)
    assert p.exitcode == 0
    assert [t[0].item() for t in got] == [float(i) for i in range(10)]
    for t in got:
        place = cache.place_of(t.untyped_storage())
        assert place is not None
        _gen, sent, loaded, holders = _native.hdr_read(place.segment.addr)
        assert sent == loaded and holders >= 1, (sent, loaded, holders)
        del place
    client = broker_client.client_for(program.current().directory)
    counters = client.ping(full=True)  # a barrier: the broker has read our records
    # What the exited sender made stays while this process holds it (it may forward it),
    # counted as held, not as in flight.
    assert counters["clients"] == 1 and counters["generations_held"] >= 1, counters
    del got, t
    let_go_now()  # what this process held is let go of: nothing reaches the sender's segments
    broker_client.close_all()
    # Nothing undelivered: the broker goes after SHMREDUCE_BROKER_GRACE, though the
    # program's root (this process) lives.
    assert wait_for(lambda: not broker_pids(), 5), log.read_text()
