"""file_system files go within about a second of the last process letting go of
their storages, whether or not anything else is shared (issue 12: they used to wait
for a purge that only a later share triggered; 30 files were still there 10 s after
the loop that made them)."""

from __future__ import annotations

import multiprocessing as mp
import os

import torch

import shmreduce
from shmreduce import program

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


def test_files_go_within_a_second_of_the_last_user_without_further_shares():
    with shmreduce.registered(strategy="file_system"):
        ours, theirs = CTX.Pipe()
        proc = CTX.Process(target=_receive_and_drop, args=(theirs, 30))
        proc.start()
        try:
            for i in range(30):
                ours.send(torch.full((1024,), float(i)))  # dropped here at once
            assert ours.poll(30) and ours.recv() == "dropped"
            directory = program.current().directory
            # Nothing is shared from here on: both processes are quiet.
            assert wait_for(lambda: not _files(directory), 3.0), _files(directory)
        finally:
            ours.send("done")
            proc.join(30)
        assert proc.exitcode == 0
