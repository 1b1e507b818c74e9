"""A sender SIGKILLed in the middle of pickling a message leaves nothing behind.

Nothing of that message was sent: its refs are counted sent only when its pickling
scope closes, so none is in flight. file_system files are held at the broker (their
names, a batch at a time) before they exist, and the memfds the sender gave the broker
are kept by it for that sender: when the dead sender's connections close, the broker
unlinks the files and closes the memfds at once, with no draining."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch

import shmreduce
from shmreduce import pool, program
from shmreduce.broker.client import client_for

from helpers import wait_for

CTX = mp.get_context("fork")
LARGE = pool.ARENA_ITEM_MAX // 4 + 1024  # float32 elements: a storage with a segment of its own


class _DieHere:
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)  # after the storages before it made their segments


def _pickle_then_die(count):
    torch.set_num_threads(1)  # a fork child must not use the parent's OpenMP pool
    small = [torch.full((256,), float(i)) for i in range(count)]  # one slab
    large = [torch.full((LARGE,), float(i)) for i in range(min(count, 5))]  # a segment each
    shmreduce.dumps(small + large + [_DieHere()])


def _segment_files(directory):
    try:
        return sorted(n for n in os.listdir(directory) if n.startswith("seg-"))
    except FileNotFoundError:
        return []


@pytest.mark.swap_path  # counts the pool's slabs, segments and files a dying sender made
@pytest.mark.parametrize("strategy", ["file_system", "file_descriptor"])
def test_a_sender_killed_mid_pickle_leaves_nothing(strategy):
    with shmreduce.registered(strategy=strategy):
        kept = torch.ones(8)
        kept.share_memory_()  # this process's own segment: it must stay
        prog = program.current()
        directory = prog.directory
        client = client_for(directory, prog.root_pid)
        before = client.ping()  # a barrier: what this process sent is counted
        files = _segment_files(directory)
        assert len(files) == (1 if strategy == "file_system" else 0)

        def settled() -> bool:
            now = client.ping()
            return (now["segments"], now["segment_files"], now["draining"]) == (before["segments"], before["segment_files"], 0)

        op = "S" if strategy == "file_descriptor" else "H"  # memfds given to the broker / file names held
        for count in (1, 10, 100):
            records = client.ping()["records"].get(op, 0)
            proc = CTX.Process(target=_pickle_then_die, args=(count,))
            proc.start()
            proc.join(30)
            assert proc.exitcode == -signal.SIGKILL
            assert client.ping()["records"].get(op, 0) > records, "the sender gave the broker nothing before it died"
            # its files unlinked, its memfds closed, its names let go of: nothing kept for it
            assert wait_for(lambda: _segment_files(directory) == files, 10), _segment_files(directory)
            assert wait_for(settled, 10), (before, client.ping())
        assert kept.sum().item() == 8.0
