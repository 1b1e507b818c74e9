"""SPEC 8 after a broker restart: a tensor shared before its broker died (killed, or
exited idle between unregister() and register()) is shared again on its next send,
to receivers that never had it (issue 11, item 5)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import torch

import shmreduce
from shmreduce import program
from shmreduce.broker import client as broker_client

from helpers import broker_pids, wait_for

CTX = mp.get_context("fork")


def _sums(conn):
    while (t := conn.recv()) is not None:
        conn.send(float(t.sum()))


def _start_receiver():
    ours, theirs = CTX.Pipe()
    proc = CTX.Process(target=_sums, args=(theirs,))
    proc.start()  # before any tensor exists: it inherits none
    theirs.close()

    def ask(t):
        ours.send(t)
        assert ours.poll(30), "receiver did not answer"
        return ours.recv()

    return proc, ours, ask


def _stop(proc, conn):
    conn.send(None)
    proc.join(30)
    conn.close()
    assert proc.exitcode == 0


def test_resend_after_the_broker_was_killed():
    shmreduce.register(strategy="file_system")
    proc, conn, ask = _start_receiver()
    try:
        t = torch.arange(100.0)
        assert ask(t) == 4950.0
        directory = program.current().directory
        client = broker_client.client_for(directory, program.current().root_pid)
        os.kill(client.broker_pid, signal.SIGKILL)
        assert wait_for(lambda: not os.path.exists(directory), 10)
        for _ in range(3):  # the first send after the kill, and every one after it
            assert ask(t) == 4950.0
        t.add_(1)
        assert ask(t) == 5050.0
    finally:
        _stop(proc, conn)
        shmreduce.unregister()


def test_resend_after_unregister_register_once_the_idle_broker_exited():
    shmreduce.register(strategy="file_system")
    t = torch.arange(10.0)
    t.share_memory_()  # shared: a file held at this program's broker
    shmreduce.unregister()
    assert wait_for(lambda: not broker_pids(), 10)  # idle: it exited, its files went
    shmreduce.register(strategy="file_system")
    proc, conn, ask = _start_receiver()
    try:
        for _ in range(2):
            assert ask(t) == 45.0
    finally:
        _stop(proc, conn)
        shmreduce.unregister()
