"""A file_system mount too small for an arena carries a stream whose live data fits it.

A receiver keeps its latest mappings after their storages die (``segments.keep``). A
kept mapping of a file its sender let go of (the broker unlinked it) would pin the
file's pages in the mount until the receiver maps other segments, which it never does
while every new file is refused: the owner punches a free segment's pages out as it
lets go of it (``Pool.discard``). And an arena of 16 MiB on an 8 MiB mount would fill
the mount while a few messages in it are in flight: an arena is at most an eighth of
its mount (``FilePool.arena_size``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import small_mount

MOUNT = "8m"

# A producer and a consumer of N tensors of 128 KiB (each in an arena) through a
# Queue(maxsize), the consumer dropping each. The producer pickles each message itself
# (shmreduce.dumps: a refused one is its OutOfSharedMemory here, and None on the
# queue), and the consumer gets message i only once message i + maxsize - 1 was
# pickled: when a message is pickled, the maxsize - 1 before it are in flight and the
# consumer may still hold the one before those, the most the queue lets live at once
# (about 1 or 2 MiB), while 37.5 MiB go through the mount. Half-way the producer
# pauses until the consumer got every message and the producer's pool closed the
# segments left idle (SHMREDUCE_POOL_IDLE): each one the consumer still keeps mapped
# was let go of as it was, the arena the first messages filled too.
STREAM = textwrap.dedent(
    """
    import sys, time
    import torch, torch.multiprocessing as mp, shmreduce

    N = 300
    HALF = N // 2

    def consume(q, go, drained, out):
        got = []
        for i in range(N):
            assert go.acquire(timeout=120)
            data = q.get(timeout=120)
            if data is not None:
                t = shmreduce.loads(data)
                got.append(int(t[0]) if bool(t.eq(t[0]).all()) else -1)
                del t
            if i == HALF - 1:
                drained.set()
        out.put(got)

    def idle_pool_closed():
        stats = shmreduce.stats()
        return stats["fs_segments_free"] == 0 and stats["fs_segments_waiting"] == 0

    if __name__ == "__main__":
        maxsize = int(sys.argv[1])
        shmreduce.register(strategy="file_system")
        ctx = mp.get_context("fork")
        q, go, drained, out = ctx.Queue(maxsize=maxsize), ctx.Semaphore(0), ctx.Event(), ctx.Queue()
        p = ctx.Process(target=consume, args=(q, go, drained, out))
        p.start()
        refused = []
        for phase in (range(HALF), range(HALF, N)):
            for i in phase:
                try:
                    q.put(shmreduce.dumps(torch.full((1 << 15,), float(i))))
                except shmreduce.SharingError as exc:
                    refused.append((i, type(exc).__name__))
                    q.put(None)
                if i - phase.start >= maxsize - 1:
                    go.release()
            for _ in range(maxsize - 1):
                go.release()
            if phase.start == 0:
                assert drained.wait(120)
                deadline = time.monotonic() + 60
                while not idle_pool_closed() and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert idle_pool_closed(), shmreduce.stats()
        got = out.get(timeout=300)
        p.join(60)
        assert p.exitcode == 0, p.exitcode
        lost = {i for i, _name in refused}
        print(len(refused), sorted({name for _i, name in refused}), got == [i for i in range(N) if i not in lost])
    """
)


def _run(mnt: str, program: str, *args: str) -> str:
    env = dict(os.environ, SHMREDUCE_SHM_DIR=mnt, SHMREDUCE_POOL_IDLE="0.2")
    done = subprocess.run([sys.executable, "-c", program, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


@pytest.mark.parametrize("maxsize", [8, 16])
def test_a_stream_whose_live_data_fits_a_small_mount_is_never_refused(tmp_path, maxsize):
    with small_mount(tmp_path / "shm", MOUNT) as mnt:
        assert _run(mnt, STREAM, str(maxsize)) == "0 [] True"


# A consumer receives a few tensors of one arena, drops them and lets go (keeping the
# arena mapped, as the latest segment it received); the producer drops its own and does
# what a sender refused for want of room does (transfer._fs_full: what is free is let
# go of, the broker unlinks it). The mount is then as empty as before, but for the
# header page the consumer's mapping keeps, while the consumer still maps it.
KEPT = textwrap.dedent(
    """
    import os
    import torch, torch.multiprocessing as mp, shmreduce
    from shmreduce import segments, transfer

    def used():
        st = os.statvfs(os.environ["SHMREDUCE_SHM_DIR"])
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def consume(conn, done, leave):
        assert conn.poll(60)
        ts = conn.recv()
        assert all(bool(t.eq(i).all()) for i, t in enumerate(ts))
        del ts
        transfer.collect()  # its hold let go of: the arena stays mapped here, kept
        assert len(segments._kept) == 1, segments._kept
        done.set()
        assert leave.wait(60)

    if __name__ == "__main__":
        shmreduce.register(strategy="file_system")
        before = used()
        ctx = mp.get_context("fork")
        (theirs, ours), done, leave = ctx.Pipe(), ctx.Event(), ctx.Event()
        p = ctx.Process(target=consume, args=(theirs, done, leave))
        p.start()
        ours.send([torch.full((1 << 15,), float(i)) for i in range(6)])  # 768 KiB in one arena
        assert done.wait(60)
        transfer.let_go_slabs()  # the arena's generation ends with its last storage
        transfer._fs_full()
        print(before, used(), p.is_alive())
        leave.set()
        p.join(60)
        assert p.exitcode == 0, p.exitcode
    """
)


@pytest.mark.swap_path
def test_a_receiver_that_keeps_a_let_go_file_mapped_pins_none_of_its_data(tmp_path):
    with small_mount(tmp_path / "shm", MOUNT) as mnt:
        assert _run(mnt, KEPT) == f"0 {os.sysconf('SC_PAGESIZE')} True"  # one header page: the kept mapping's
