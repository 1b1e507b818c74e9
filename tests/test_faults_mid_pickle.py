"""A sender SIGKILLed in the middle of pickling a message leaves no file behind
(issue 11, item 17): file_system files are held at the broker before they exist, so
the broker releases them when the dead sender's connection closes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import torch

import shmreduce
from shmreduce import program

from helpers import wait_for

CTX = mp.get_context("fork")


class _DieHere:
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)  # after the storages before it made their files


def _pickle_then_die(count):
    shmreduce.dumps([torch.full((256,), float(i)) for i in range(count)] + [_DieHere()])


def _segment_files(directory):
    try:
        return [n for n in os.listdir(directory) if n.startswith("seg-")]
    except FileNotFoundError:
        return []


def test_files_of_a_sender_killed_mid_pickle_are_removed():
    with shmreduce.registered(strategy="file_system"):
        kept = torch.ones(8)
        kept.share_memory_()  # this process's own file: it must stay
        directory = program.current().directory
        assert len(_segment_files(directory)) == 1
        for count in (1, 10, 100):
            proc = CTX.Process(target=_pickle_then_die, args=(count,))
            proc.start()
            proc.join(30)
            assert proc.exitcode == -signal.SIGKILL
            assert wait_for(lambda: len(_segment_files(directory)) == 1, 10), _segment_files(directory)
        assert kept.sum().item() == 8.0
