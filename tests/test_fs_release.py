"""file_system files go within about a second of the last process letting go of
their storages, whether or not anything else is shared (not waiting
for a purge that only a later share triggers)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

import shmreduce
from shmreduce import program, transfer

from helpers import wait_for

CTX = mp.get_context("fork")


def _receive_and_drop(conn, count):
    for _ in range(count):
        t = conn.recv()
        assert t[0].item() >= 0
        del t
    conn.send("dropped")
    conn.recv()  # stay alive (and quiet) until the parent is done


def _files(directory):
    return [n for n in os.listdir(directory) if n.startswith("seg-")]


@pytest.mark.swap_path
def test_files_are_reusable_within_a_second_of_the_last_user_without_further_shares():
    with shmreduce.registered(strategy="file_system"):
        ours, theirs = CTX.Pipe()
        proc = CTX.Process(target=_receive_and_drop, args=(theirs, 30))
        proc.start()
        try:
            for i in range(30):
                ours.send(torch.full((1024,), float(i)))  # dropped here at once
            assert ours.poll(30) and ours.recv() == "dropped"
            directory = program.current().directory
            assert len(_files(directory)) == 1  # 30 small storages: one slab file
            transfer.let_go_slabs()  # this thread's current slab ends its generation
            # Nothing is shared from here on: both processes are quiet, and their
            # collector threads let go: reusable within a second.
            free = lambda: transfer.stats()["fs_segments_free"] == 1 and not transfer.stats()["fs_segments_waiting"]  # noqa: E731
            assert wait_for(free, 3.0), transfer.stats()
            transfer.let_go()  # the pool's free files go with unregister() (or after SHMREDUCE_POOL_IDLE)
            assert wait_for(lambda: not _files(directory), 3.0), _files(directory)
        finally:
            ours.send("done")
            proc.join(30)
        assert proc.exitcode == 0
