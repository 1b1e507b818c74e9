"""``unregister()`` while a queue's feeder thread is still pickling what was put.

``mp.Queue.put`` only buffers: the feeder thread pickles each message later, and may
be inside shmreduce's ``ForkingPickler.dumps`` when the main thread unregisters. What
it shares must not open again what ``unregister()`` closes (a broker connection, a
pool kept active): the program would keep its broker, its directory and their
descriptors for its life. Each case runs as a fresh program (its own broker), whose
state it reports once its consumer is done.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from helpers import run_program

TIMEOUT = 120.0  # the whole program, on a loaded machine

_PUT_THEN_UNREGISTER = textwrap.dedent(
    """
    import json
    import multiprocessing as mp
    import multiprocessing.resource_sharer as resource_sharer
    import os
    import sys
    import time

    import torch

    import shmreduce
    from shmreduce import program, transfer
    from shmreduce.broker import client as broker_client

    from helpers import broker_procs, open_fds

    N = 40
    NUMEL = 300 * 1024 // 4  # 300 KiB: a segment of its own each


    def consume(q, conn):
        torch.set_num_threads(1)
        wrong = []
        for i in range(N):
            t = q.get(timeout=60)
            if t.numel() != NUMEL or not bool(t.eq(float(i)).all()):
                wrong.append(i)
        conn.send(wrong)


    def torchs_listener():
        # What torch's file_descriptor path starts for the messages it sends
        # (multiprocessing's resource_sharer, for the process's life): not shmreduce's.
        listener = getattr(resource_sharer._resource_sharer, "_listener", None)
        return set() if listener is None else {f"{listener._listener._socket.fileno()}->"}


    def state(directory, baseline):
        listener = torchs_listener()
        return {
            "clients": len(broker_client.existing_clients()),
            "pools_active": [p.active for p in (transfer._fd_pool, transfer._fs_pool)],
            "brokers": sorted(broker_procs(directory)),
            "directory": os.path.isdir(directory),
            "descriptors": sorted(
                fd for fd in open_fds() - baseline if not any(fd.startswith(prefix) for prefix in listener)
            ),
        }


    def clean(s):
        return not (s["clients"] or any(s["pools_active"]) or s["brokers"] or s["directory"] or s["descriptors"])


    if __name__ == "__main__":
        torch.set_num_threads(1)
        shmreduce.register(strategy=sys.argv[1])
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        ours, theirs = ctx.Pipe()
        consumer = ctx.Process(target=consume, args=(q, theirs))
        consumer.start()
        directory = program.current().directory
        baseline = open_fds()  # nothing shared yet: no broker, no segment
        for i in range(N):
            q.put(torch.full((NUMEL,), float(i)))
        shmreduce.unregister()  # at once: the feeder thread is pickling
        wrong = ours.recv() if ours.poll(60) else "no answer"
        consumer.join(60)
        deadline = time.monotonic() + 10
        while not clean(s := state(directory, baseline)) and time.monotonic() < deadline:
            time.sleep(0.1)
        print("RESULT", json.dumps({"wrong": wrong, "exitcode": consumer.exitcode, **s}), flush=True)
    """
)


@pytest.mark.parametrize("strategy_name", ["file_descriptor", "file_system"])
def test_unregister_while_the_feeder_pickles_leaves_nothing_running(strategy_name: str) -> None:
    """40 messages of 300 KiB put, then ``unregister()`` at once: every one arrives with
    its bytes, and once the consumer is done the producer holds no broker client, its
    pools are inactive, its broker and program directory are gone and its descriptors
    are back to what it held before it shared (before: a client made again behind
    ``unregister()``, the broker's processes, the directory and 5 descriptors kept)."""
    out = run_program(_PUT_THEN_UNREGISTER, strategy_name, timeout=TIMEOUT)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, f"exit status {out.returncode}: {out.stdout[-2000:]}{out.stderr[-3000:]}"
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["wrong"] == [] and result["exitcode"] == 0, result
    assert result["clients"] == 0, result
    assert result["pools_active"] == [False, False], result
    assert result["brokers"] == [] and not result["directory"], result
    assert result["descriptors"] == [], result


_UNREGISTER_WHILE_PICKLING = textwrap.dedent(
    """
    import json
    import multiprocessing as mp
    import sys
    import time
    from multiprocessing.reduction import ForkingPickler

    import torch

    import shmreduce
    from shmreduce import transfer
    from shmreduce.broker import client as broker_client


    class UnregistersWhenPickled:
        def __reduce__(self):
            shmreduce.unregister()  # as a finalizer or a reducer may, on the pickling thread
            return (int, (0,))


    if __name__ == "__main__":
        shmreduce.register(strategy=sys.argv[1])
        t0 = time.monotonic()
        data = ForkingPickler.dumps([torch.ones(300 * 1024), UnregistersWhenPickled(), torch.zeros(10)])
        took = time.monotonic() - t0
        deadline = time.monotonic() + 10
        while broker_client.existing_clients() and time.monotonic() < deadline:
            time.sleep(0.1)
        print("RESULT", json.dumps({
            "took": took,
            "registered": shmreduce.is_registered(),
            "clients": len(broker_client.existing_clients()),
            "pools_active": [p.active for p in (transfer._fd_pool, transfer._fs_pool)],
        }), flush=True)
    """
)


@pytest.mark.parametrize("strategy_name", ["file_descriptor", "file_system"])
def test_unregister_from_inside_a_dumps_of_the_same_thread_returns_at_once(strategy_name: str) -> None:
    """A reducer (or a finalizer the collector runs while pickling) that calls
    ``unregister()`` does not wait for the dumps it runs inside, which cannot end
    before it returns: the dumps closes what ``unregister()`` left open as it finishes."""
    out = run_program(_UNREGISTER_WHILE_PICKLING, strategy_name, timeout=TIMEOUT)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, f"exit status {out.returncode}: {out.stdout[-2000:]}{out.stderr[-3000:]}"
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["took"] < 10, result  # UNREGISTER_WAIT is 40 s
    assert not result["registered"] and result["clients"] == 0, result
    assert result["pools_active"] == [False, False], result  # its broker stays: the message was never loaded
