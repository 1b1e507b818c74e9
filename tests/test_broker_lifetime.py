"""What keeps a broker alive, and that nothing a client posted is lost on its way out.

The broker stays after its last client only for messages nobody received yet (for
``SHMREDUCE_ORPHAN_TTL``, while the program's root lives). A claim is the only word
that a message was received: one the broker loses keeps it, and its program
directory, for a minute after everything closed (the CI flake of the file_system
stress test, 1 run in 4: tests/test_concurrent_sends.py).
"""

from __future__ import annotations

import os
import signal

import pytest

from shmreduce import program
from shmreduce.broker import client as broker_client
from shmreduce.broker import protocol as P

from helpers import broker_pids, wait_for

TIMEOUT = 10.0


@pytest.fixture
def broker_log(monkeypatch, tmp_path):
    """A fresh broker for this test (started on first use) that logs to a file; gone
    again at the end, which a message left behind would prevent."""
    broker_client.close_all()
    assert wait_for(lambda: not broker_pids(), TIMEOUT)
    path = tmp_path / "broker.log"
    monkeypatch.setenv("SHMREDUCE_BROKER_LOG", str(path))
    monkeypatch.setenv("SHMREDUCE_LOG_LEVEL", "DEBUG")  # "no client left" is a DEBUG line (SPEC 13)
    yield path
    broker_client.close_all()
    assert wait_for(lambda: not broker_pids(), TIMEOUT), f"broker still running: {_log_text(path)}"


def _log_text(path) -> str:
    return path.read_text() if path.exists() else ""


def _clients(count: int) -> list[broker_client.BrokerClient]:
    """*count* clients of this program's broker, each an identity of its own (as
    processes are), the first its sender (it may start the broker)."""
    prog = program.current()
    sender = broker_client.BrokerClient(prog.directory, prog.root_pid)
    sender.connect()
    return [sender] + [broker_client.BrokerClient(prog.directory, None) for _ in range(count - 1)]


def _gen() -> str:
    return P.gen_name(int.from_bytes(os.urandom(12), "little"))


def test_records_posted_before_a_close_count_though_notices_were_left_unread(broker_log):
    # A receiver that owns a segment (a process that also sends) closes with a free
    # notice unread. Linux then reports ECONNRESET on the broker's end once, before the
    # records the receiver posted and that are still queued: its claim among them.
    sender, receiver = _clients(2)
    key = os.urandom(P.KEY_LEN)
    try:
        sender.deposit(key, [], [], [_gen()])  # a message that holds a name
        assert sender.ping()["messages"] == 1
        mine = _gen()
        receiver.hold([mine])  # its first holder owns it...
        receiver.release([mine])  # ...and is told when nobody holds it any more
        receiver.ping()  # barrier: that notice waits, unread, in the receiver's post socket
        os.kill(sender.broker_pid, signal.SIGSTOP)  # so that the claim is still queued at the close
        try:
            receiver.claim(key, done=True)
            receiver.close()
        finally:
            os.kill(sender.broker_pid, signal.SIGCONT)
        counters = sender.ping()  # a barrier: the broker has read (and dropped) the receiver
        assert counters["clients"] == 1
        assert (counters["messages"], counters["kept_messages"], counters["generations"]) == (0, 0, 0), counters
    finally:
        receiver.close()
        sender.close()
    assert "no client left" not in _log_text(broker_log)


def test_a_broker_left_with_a_message_logs_what_it_holds_and_goes_once_it_is_claimed(broker_log):
    sender, receiver = _clients(2)
    key, name = os.urandom(P.KEY_LEN), _gen()
    sender.deposit(key, [], [], [name])
    sender.ping()
    pid = sender.broker_pid
    sender.close()  # the program's root (this process) lives: the message keeps the broker
    assert wait_for(lambda: "no client left" in _log_text(broker_log), TIMEOUT)
    line = next(line for line in _log_text(broker_log).splitlines() if "no client left" in line)
    assert f"message {key.hex()} of pid {os.getpid()}, undelivered, names [{name}]" in line, line
    assert f"{name} x1 held by message {key.hex()}" in line, line
    assert broker_pids()
    receiver.claim(key, done=True)  # its receiver comes after all
    assert receiver.ping()["messages"] == 0 and receiver.broker_pid == pid
    receiver.close()  # the broker_log fixture: the broker goes


def test_early_claims_of_one_receiver_add_up(broker_log):
    # Claims read before their deposit (the receiver's post connection was read first)
    # are remembered; several claims of one message by one receiver (one per storage
    # when loaded outside a receiving() scope) keep every name each of them named.
    sender, receiver = _clients(2)
    key, first, second = os.urandom(P.KEY_LEN), _gen(), _gen()
    try:
        receiver.claim(key, done=False, keep=[first])
        receiver.claim(key, done=False, keep=[second])
        receiver.ping()  # barrier: both are early claims now
        sender.deposit(key, [], [], [first, second])
        counters = sender.ping()
        assert (counters["messages"], counters["kept_messages"], counters["generations"]) == (0, 1, 2), counters
        receiver.claim(key, done=True)
        assert receiver.ping()["generations"] == 2  # kept until let go of
        receiver.release([first, second], key)
        counters = receiver.ping()
        assert (counters["kept_messages"], counters["generations"]) == (0, 0), counters
    finally:
        receiver.close()
        sender.close()


def test_a_release_before_the_last_deposit_record_undoes_the_early_claim(broker_log):
    sender, receiver = _clients(2)
    key, first, second = os.urandom(P.KEY_LEN), _gen(), _gen()
    try:
        post = sender._post_socket(start=True)
        P.send_record(post, P.DEPOSIT, key, P.encode_deposit([], [first], 0, False))
        sender.ping()  # barrier: the message is in, incomplete
        receiver.claim(key, done=True, keep=[first, second])
        receiver.release([first], key)  # its storages of *first* died meanwhile
        receiver.ping()
        P.send_record(post, P.DEPOSIT, key, P.encode_deposit([], [second], 0, True))
        counters = sender.ping()
        assert (counters["messages"], counters["kept_messages"], counters["generations"]) == (0, 1, 1), counters
    finally:
        receiver.close()
        sender.close()


def test_a_client_dropped_by_close_all_never_connects_again(broker_log, monkeypatch):
    # A message loaded outside a receiving() scope (a plain pickle.loads, or a ref
    # rebuilt directly, as test_bad_input does) leaves its entry, and with it this
    # process's client of that time, in transfer's pending table until MAX_PENDING
    # later loads evict it; the eviction claims through that client. After
    # close_all() (unregister) the client is no longer this process's: reconnected,
    # it held a connection nothing closed, and the broker never exited (the symptom
    # of issue 19, item 2; the suite has 10 such entries from test_bad_input.py on).
    from collections import OrderedDict

    import torch

    import shmreduce
    from shmreduce import reductions, transfer

    monkeypatch.setattr(transfer, "_pending", OrderedDict())  # without the entries earlier tests left
    monkeypatch.setattr(transfer, "MAX_PENDING", 2)
    meta = (torch.float32, (4,), (1,), 0, None)
    keys = []
    with shmreduce.registered(strategy="file_descriptor"):
        try:
            refs = []
            for i in range(3):
                with transfer.sending():
                    refs.append(transfer.share(torch.full((4,), float(i)).untyped_storage()))
            stale = broker_client.client_for(program.current().directory)
            for ref in refs[:2]:
                reductions.rebuild_tensor(ref, meta)  # unscoped: its entry stays pending, with *stale*
            keys = [ref[2] for ref in refs]
            broker_client.close_all()  # as unregister() does; refs[2] keeps the broker
            assert not stale.connected()
            reductions.rebuild_tensor(refs[2], meta)  # a new client; evicts refs[0]'s entry
            assert (refs[0][1], keys[0]) not in transfer._pending
            assert not stale.connected(), "a client close_all() dropped connected again"
            with pytest.raises(shmreduce.SharingError):
                stale.ping()
        finally:
            for key in keys:
                transfer._forget((program.current().directory, key))
    # broker_log: every connection closed, the broker goes
