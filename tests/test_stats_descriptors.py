"""``stats()``: ``descriptors`` and ``fds_held`` are two counts, each said.

``descriptors``: those shmreduce's segments keep open, one per segment this process
made to send from (a received one keeps none once mapped). ``fds_held``: every
descriptor open in the process, shmreduce's (those, its broker connections) and
everyone else's (stdio, torch, the program's files).
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

import shmreduce

from helpers import running

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _take(q, ack):
    got = q.get(timeout=60)
    ack.put([t[0].item() for t in got])


def _segment_memfds() -> int:
    """This process's descriptors on memfds of segments (its broker connection's
    ledger is a memfd too, by another name)."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:shmreduce (")
        except OSError:
            pass
    return found


@pytest.mark.swap_path
def test_descriptors_are_shmreduces_and_fds_held_are_every_one(registered_fd):
    ctx = mp.get_context("fork")
    q, ack = ctx.Queue(), ctx.Queue()
    sent = [torch.full(((1 << 16) + 16,), float(i)) for i in range(3)]  # over 256 KiB each: a memfd each, kept to send from
    with running(ctx.Process(target=_take, args=(q, ack))):
        q.put(sent)
        assert ack.get(timeout=60) == [0.0, 1.0, 2.0]
    counts = shmreduce.stats()
    assert counts["descriptors"] == _segment_memfds() >= 3, counts  # the memfds its segments keep
    assert counts["fds_held"] >= len(os.listdir("/proc/self/fd")) - 1 > counts["descriptors"], counts  # every one
    del sent


def test_readme_and_docstring_say_what_each_count_is():
    lines = [line.strip() for line in (shmreduce.stats.__doc__ or "").splitlines()]
    assert any(line.startswith("descriptors: ") for line in lines), lines  # each its own entry
    assert any(line.startswith("fds_held: every descriptor") for line in lines), lines
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    row = next(line for line in readme.splitlines() if line.startswith("| `stats()`"))
    assert "`descriptors`" in row and "`fds_held`" in row, row
