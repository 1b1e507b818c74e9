"""A failure reaches the user where they wait.

A message put on an ``mp.Queue`` is pickled later, by the queue's feeder thread: a
sharing failure there was printed by multiprocessing (a traceback per message) or, as
the sender exited, dropped silently with every message buffered after it, and the
consumer's ``get()`` waited for ever. Now each such message arrives as bytes whose
load raises ``SharingError`` naming the sender's cause and pid, and the sender logs
it once.

Each case runs as a fresh program (its own interpreter and broker), as a user runs
it: a fork producer puts and exits at once; the consumer gets every message, each
either a tensor or that ``SharingError``, none waiting past its timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import wait_for

PROGRAM = textwrap.dedent(
    """
    import json, multiprocessing as mp, os, queue, resource, sys, time
    import torch, shmreduce

    def items(cause):
        if cause == "descriptors":
            return [torch.full(((1 << 16) + 16,), float(i)) for i in range(200)]  # over 256 KiB: a segment each
        if cause == "non_leaf":
            return [torch.ones(3), torch.ones(3, requires_grad=True) * 2, torch.ones(3)]
        return [torch.full(((1 << 16) + 16,), float(i)) for i in range(40)]  # 10 MiB into a 2 MiB mount

    SENT = []

    def produce(q, cause):
        if cause == "descriptors":  # ulimit -n, low: hard too, as register() raises soft to hard
            n = len(os.listdir("/proc/self/fd")) + 24
            resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
        # It keeps what it sends while the feeder thread pickles it (a segment in use
        # here keeps its descriptor; one a receiver keeps, this pool lets go of).
        SENT.extend(items(cause))
        for t in SENT:
            q.put(t)
        # and exits right after its last put(), which README says is fine

    if __name__ == "__main__":
        strategy, cause = sys.argv[1:]
        shmreduce.register(strategy=strategy)
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=produce, args=(q, cause))
        p.start()
        kept, errors, waited = [], [], 0.0
        for _ in range(len(items(cause))):
            t0 = time.monotonic()
            try:
                kept.append(q.get(timeout=15))
            except shmreduce.SharingError as exc:
                errors.append(str(exc))
            except queue.Empty:
                break
            finally:
                waited = max(waited, time.monotonic() - t0)
        p.join(60)
        print(json.dumps({"kept": len(kept), "errors": errors, "waited": waited, "pid": p.pid, "exitcode": p.exitcode}))
    """
)


def _run(strategy: str, cause: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, strategy, cause],
        env=dict(os.environ, **(env or {})),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _check(result: dict, stderr: str, total: int, cause: str, most_wait: float = 10) -> None:
    assert result["kept"] + len(result["errors"]) == total, f"messages vanished: {result}, {stderr[-2000:]}"
    assert result["errors"], f"no failure heard: {result}"
    assert result["waited"] < most_wait, result  # within seconds, never a get() timeout
    first = result["errors"][0]
    assert f"process {result['pid']}" in first and cause in first, first
    assert result["exitcode"] == 0, result
    # The sender logged it once (logging's last resort: stderr), no traceback per message.
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.count("could not be shared") == 1, stderr[-3000:]


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_descriptors_run_out_in_the_feeder_thread(strategy):
    result, stderr = _run(strategy, "descriptors")
    _check(result, stderr, 200, "descriptor")
    # Advice that fits the strategy in use: not "switch to the one you are on".
    other = "file_system" if strategy == "file_descriptor" else "file_descriptor"
    assert f"set_sharing_strategy('{strategy}')" not in result["errors"][0], result["errors"][0]
    assert f"the '{other}' strategy keeps" not in result["errors"][0], result["errors"][0]


FULL_BROKER = textwrap.dedent(
    """
    import json, multiprocessing as mp, os, queue, resource, sys, time
    import torch, shmreduce

    def produce(q, sent, done):
        n = len(os.listdir("/proc/self/fd")) + 24  # the broker, started here, inherits it
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
        for i in range(40):
            q.put(torch.full(((1 << 16) + 16,), float(i)))  # over 256 KiB: a segment each
        deadline = time.monotonic() + 60
        while q._buffer and time.monotonic() < deadline:  # every message pickled: the broker is full
            time.sleep(0.01)
        sent.set()
        done.wait(120)  # lives on, holding what it sent, until all is read

    if __name__ == "__main__":
        shmreduce.register(strategy="file_descriptor")
        ctx = mp.get_context("fork")
        q, sent, done = ctx.Queue(), ctx.Event(), ctx.Event()
        p = ctx.Process(target=produce, args=(q, sent, done))
        p.start()
        assert sent.wait(90)
        kept, errors, waited = [], [], 0.0
        for _ in range(40):
            t0 = time.monotonic()
            try:
                kept.append(q.get(timeout=90))
            except shmreduce.SharingError as exc:
                errors.append(str(exc))
            finally:
                waited = max(waited, time.monotonic() - t0)
        done.set()
        p.join(60)
        print(json.dumps({"kept": len(kept), "errors": errors, "waited": waited, "pid": p.pid, "exitcode": p.exitcode}))
    """
)


def test_a_full_broker_still_hears_the_consumer_of_its_segments():
    # The broker inherits the producer's descriptor limit (it shares first) and fills
    # up with its segments while the producer lives on: the consumer that would load
    # and let them go must still connect. It waited for its connection's IO timeout
    # (10 s; 60 here), deposits having taken every descriptor (CI, stop 41): the
    # broker keeps spare descriptors for connections now, and refuses a segment instead.
    done = subprocess.run(
        [sys.executable, "-c", FULL_BROKER],
        env=dict(os.environ, SHMREDUCE_IO_TIMEOUT="60"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    _check(result, done.stderr, 40, "descriptor", most_wait=30)
    assert done.stderr.count("out of file descriptors") <= 1, done.stderr[-3000:]  # once, not per segment


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_a_non_leaf_tensor_in_the_feeder_thread(strategy):
    result, stderr = _run(strategy, "non_leaf")
    _check(result, stderr, 3, "detach()")
    assert result["kept"] == 2  # the messages after it still arrive


@pytest.fixture
def tiny_mount(tmp_path):
    mnt = tmp_path / "shm"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=1777", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield str(mnt)
    finally:
        assert wait_for(lambda: not os.listdir(mnt), 15), os.listdir(mnt)
        subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.swap_path
def test_a_full_shm_mount_in_the_feeder_thread(tiny_mount):
    # file_system only: file_descriptor's memfds are not in that mount.
    result, stderr = _run("file_system", "shm_full", {"SHMREDUCE_SHM_DIR": tiny_mount})
    _check(result, stderr, 40, "SHMREDUCE_SHM_DIR")
    assert result["kept"] >= 3


def _size(t):
    return t.numel()


def test_a_queue_with_its_own_error_hook_hears_its_errors_as_before(registered_fd):
    # ProcessPoolExecutor's call queue overrides _on_queue_feeder_error to fail the
    # future: a failure is still the future's, and the pool is not broken.
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    import torch

    import shmreduce

    with ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as ex:
        with pytest.raises(shmreduce.SharingError, match="detach"):
            ex.submit(_size, torch.ones(3, requires_grad=True) * 2).result(timeout=30)
        assert ex.submit(_size, torch.ones(4)).result(timeout=30) == 4
