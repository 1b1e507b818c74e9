"""The broker and its client against big messages, bad peers and exhausted limits.

Issue 11, items 6, 10, 11, 12, 14 and 17: records that would overflow MAX_RECORD are
split; a message is delivered only once its last deposit record is in; a bad record
or a silent connection costs only its own client; failures leave a log line; the
broker never starts for a receiver; limits are a SharingError; messages of exited
senders have a bounded lifetime.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import shmreduce
from shmreduce import program, transfer
from shmreduce.broker import client as broker_client
from shmreduce.broker import protocol as P

from helpers import broker_pids, forget_mappings, let_go_now, run_in_child, seg_files, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 30.0


def _client():
    prog = program.current()
    return broker_client.client_for(prog.directory, prog.root_pid)


@pytest.fixture
def broker_log(monkeypatch, tmp_path):
    """A fresh broker for this test (started on first use) that logs to a file."""
    broker_client.close_all()
    assert wait_for(lambda: not broker_pids(), 10)
    path = tmp_path / "broker.log"
    monkeypatch.setenv("SHMREDUCE_BROKER_LOG", str(path))
    yield path
    broker_client.close_all()
    assert wait_for(lambda: not broker_pids(), 10)


def _log_text(path) -> str:
    return path.read_text() if path.exists() else ""


# -- item 6: a file_system message of 3,000 new storages ---------------------------------


def _check_list(q, results):
    items = q.get(timeout=TIMEOUT)
    results.put(all(bool((t == float(i)).all()) and t.numel() == 4 for i, t in enumerate(items)) and len(items))


def test_file_system_message_of_3000_storages_arrives_and_leaves_nothing():
    with shmreduce.registered(strategy="file_system"):
        ctx = mp.get_context("fork")
        q, results = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_check_list, args=(q, results))
        proc.start()
        try:
            tensors = [torch.full((4,), float(i)) for i in range(3000)]
            q.put(tensors)
            assert results.get(timeout=TIMEOUT) == 3000
        finally:
            proc.join(TIMEOUT)
            q.close()
            results.close()
        assert proc.exitcode == 0
        directory = program.current().directory
        del tensors
        let_go_now()
        transfer.let_go()
        _client().ping()  # barrier: the release has been read
        # The deposit was whole: the broker knew every file, and unlinked each once
        # neither the receiver (exited) nor the sender (released) held it.
        assert wait_for(lambda: not seg_files(directory), 10), len(seg_files(directory))


# -- item 12: a message of more than MAX_FDS slabs, under load -------------------------------


def _check_rounds(conn, rounds):
    out: list[int | str] = []
    for r in range(rounds):
        try:
            items = conn.recv()
            out.append(sum(bool((t == float(r * 1000 + i)).all()) for i, t in enumerate(items)))
            del items
        except Exception as exc:  # noqa: BLE001  reported to the parent
            out.append(f"{type(exc).__name__}: {exc}")
    conn.send(out)


def _spin(stop):
    while not stop.is_set():
        pass


def test_message_of_300_slabs_is_delivered_whole_under_load(registered_fd):
    # 300 storages above SLAB_ITEM_MAX: a slab (a descriptor) each, so the deposit is
    # two records. Spinning processes keep the broker late, a spinning thread slows
    # the sender between the records: a fetch then finds the first record read and
    # the second still queued.
    rounds, count = 4, 300
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    spinners = [ctx.Process(target=_spin, args=(stop,), daemon=True)]
    busy = threading.Thread(target=_spin, args=(stop,), daemon=True)
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_check_rounds, args=(theirs, rounds))
    proc.start()
    for p in spinners:
        p.start()
    busy.start()
    try:
        for r in range(rounds):
            ours.send([torch.full((32768,), float(r * 1000 + i)) for i in range(count)])  # 128 KiB each
        assert ours.poll(120), "receiver did not answer"
        assert ours.recv() == [count] * rounds
    finally:
        stop.set()
        busy.join(10)
        for p in spinners + [proc]:
            p.join(TIMEOUT)
            if p.is_alive():
                p.kill()
                p.join()
        ours.close()
        theirs.close()


def test_a_fetch_waits_for_the_last_deposit_record(registered_fd, monkeypatch):
    # Deterministic form of the race above: the fetch reaches the broker after it read
    # the deposit's first record (250 descriptors) and before the second arrives.
    count, numel = 300, 32768
    tensors = [torch.full((numel,), float(i)) for i in range(count)]
    keys, go = [], threading.Event()
    send_record = P.send_record

    def held_back(sock, op, key, body=b"", fds=()):
        if op == P.DEPOSIT:
            keys.append(key)
            if len(keys) == 2:  # the second record of the deposit
                assert go.wait(TIMEOUT)
        send_record(sock, op, key, body, fds)

    monkeypatch.setattr(P, "send_record", held_back)
    sender = threading.Thread(target=shmreduce.dumps, args=(tensors,))
    sender.start()
    fetched = []
    receiver = broker_client.BrokerClient(program.current().directory, None)
    try:
        assert wait_for(lambda: len(keys) == 2, TIMEOUT)
        receiver.ping()  # barrier: the broker has read the first record
        fetcher = threading.Thread(target=lambda: fetched.append(receiver.fetch(keys[0])))
        fetcher.start()
        time.sleep(0.3)  # the fetch is at the broker
        go.set()
        fetcher.join(TIMEOUT)
        sender.join(TIMEOUT)
        fds = fetched[0]
        try:
            assert fds is not None and len(fds) == count, None if fds is None else len(fds)
            from shmreduce.pool import HEADER

            for i, fd in enumerate(fds):  # a segment of its own each, after its header
                assert os.pread(fd, numel * 4, HEADER) == tensors[i].numpy().tobytes(), i
        finally:
            for fd in fds or ():
                os.close(fd)
    finally:
        go.set()
        sender.join(TIMEOUT)
        receiver.close()


# -- item 14 / 10: bad records, silent connections -------------------------------------------


def _raw(role=P.ROLE_POST):
    """An authenticated raw connection to this program's broker."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(os.path.join(program.current().directory, P.SOCKET_NAME))
    P.client_handshake(sock, bytes(mp.current_process().authkey), role, os.urandom(P.TOKEN_LEN))
    return sock


def _broker_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_bad_records_drop_only_their_client_and_are_logged(registered_fd, broker_log):
    assert shmreduce.loads(shmreduce.dumps(torch.ones(2))).sum().item() == 2
    client = _client()
    pid = client.broker_pid
    client.ping()  # both connections open, every record read: the baseline
    baseline = _broker_fds(pid)
    key = os.urandom(P.KEY_LEN)
    garbage = [
        P.DEPOSIT + key + b"||" + b"9" * 5000,  # an nbytes int() refuses (over 4300 digits)
        P.DEPOSIT + key + b"||" + b"9" * 5000 + b"|1",
        P.HOLD + P.NO_KEY + b"seg-../../etc/passwd",
        b"Z" + key,  # unknown op
        b"D",  # shorter than a header
        P.DEPOSIT + key + b"x" * (P.MAX_RECORD + 100),  # larger than any record
    ]
    for record in garbage:
        sock = _raw()
        try:
            sock.send(record)
            assert sock.recv(1) == b"", "the broker kept a client that broke the protocol"
        finally:
            sock.close()
        assert client.ping()["pid"] == pid  # the broker lives, and serves others
    # A record carrying descriptors it has no use for: they are closed, not kept.
    sock = _raw()
    r, w = os.pipe()
    try:
        P.send_record(sock, P.CLAIM, key, b"", [r, w])
    finally:
        os.close(r)
        os.close(w)
        sock.close()
    counters = client.ping()
    assert wait_for(lambda: _broker_fds(pid) <= baseline, 5), (_broker_fds(pid), baseline)
    assert counters["pid"] == pid
    assert shmreduce.loads(shmreduce.dumps(torch.arange(3.0))).tolist() == [0.0, 1.0, 2.0]
    log = _log_text(broker_log)
    assert log.count("dropped") >= len(garbage), log
    assert "deposit" in log and "unknown op" in log and "truncated" in log, log


def _loads_timed(data):
    t0 = time.monotonic()
    out = shmreduce.loads(data)
    return time.monotonic() - t0, out.tolist()


def test_connections_that_never_handshake_do_not_stall_the_broker(registered_fd, broker_log):
    data = shmreduce.dumps(torch.arange(4.0))  # the broker runs, the message waits
    path = os.path.join(program.current().directory, P.SOCKET_NAME)
    silent = []
    try:
        for _ in range(3):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect(path)
            silent.append(sock)
        t0 = time.monotonic()
        status, (took, values) = run_in_child(_loads_timed, data)
        assert status == "ok" and values == [0.0, 1.0, 2.0, 3.0]
        assert time.monotonic() - t0 < 1.5 and took < 1.0, (time.monotonic() - t0, took)
        # Each silent connection is closed once HANDSHAKE_TIMEOUT has passed.
        for sock in silent:
            sock.settimeout(P.HANDSHAKE_TIMEOUT + 5)
            assert sock.recv(64).startswith(P.MAGIC)  # the broker's hello...
            assert sock.recv(64) == b""  # ...then its close
    finally:
        for sock in silent:
            sock.close()
    assert "handshake" in _log_text(broker_log)


# -- item 10: no unclosed sockets at exit; a broker restart is a warning ------------------------


def test_a_process_that_shared_exits_without_resource_warnings():
    code = textwrap.dedent(
        """
        import torch, shmreduce
        shmreduce.register(strategy=STRATEGY)
        t = torch.arange(8.0)
        assert shmreduce.loads(shmreduce.dumps(t)).tolist() == t.tolist()
        print("done", flush=True)
        """
    )
    for strategy in ("file_descriptor", "file_system"):
        out = subprocess.run(
            [sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", code.replace("STRATEGY", repr(strategy))],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT),
        )
        assert out.returncode == 0 and "done" in out.stdout, out.stderr
        assert "ResourceWarning" not in out.stderr and "unclosed" not in out.stderr, out.stderr


def test_a_broker_restart_is_a_warning(registered_fd, caplog):
    import signal

    assert shmreduce.loads(shmreduce.dumps(torch.ones(2))).sum().item() == 2
    pid = _client().broker_pid
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: pid not in broker_pids(), 10)
    with caplog.at_level("WARNING", logger="shmreduce"):
        assert shmreduce.loads(shmreduce.dumps(torch.ones(3))).sum().item() == 3
    assert any("restarted" in r.getMessage() and r.name.startswith("shmreduce") for r in caplog.records), caplog.text


# -- item 11 / 15: receivers never start a broker ------------------------------------------------


def _brokers_of(directory):
    found = []
    for pid in broker_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if directory.encode() in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            pass
    return found


def test_a_receiver_never_starts_a_broker(registered_fd, tmp_path):
    # A handle naming an existing directory where no broker runs: in the shm base, and
    # elsewhere. Connecting fails; nothing is started or created there.
    inside = os.path.join(program.shm_base(), "shmreduce-" + "ab" * 8)
    outside = str(tmp_path / "shmreduce-0.1.0")
    for directory in (inside, outside):
        os.mkdir(directory, 0o700)
        try:
            ref = ("fd", directory, os.urandom(P.KEY_LEN), "1:2/0", 4, 0)
            status, message = run_in_child(transfer.receive, ref)
            assert status == "SharingError", (status, message)
            assert os.listdir(directory) == [] and not _brokers_of(directory)
        finally:
            os.rmdir(directory)


# -- item 17: limits and lifetimes -----------------------------------------------------------------


def test_descriptor_limit_at_the_broker_fails_the_fetch_quickly(registered_fd, broker_log):
    from shmreduce.pool import SLAB_ITEM_MAX

    assert shmreduce.loads(shmreduce.dumps(torch.ones(2))).sum().item() == 2
    pid = _client().broker_pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    # Room for a receiver's two connections and one descriptor more: a deposit of five
    # slabs arrives without its descriptors (MSG_CTRUNC at the broker).
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (_broker_fds(pid) + 3, hard))
    try:
        tensors = [torch.full((SLAB_ITEM_MAX // 4 + 16,), float(i)) for i in range(5)]
        data = shmreduce.dumps(tensors)
        t0 = time.monotonic()
        status, message = run_in_child(_loads_as_a_stranger, data)
        took = time.monotonic() - t0
        assert status == "SharingError" and "descriptor" in message, (status, message)
        assert took < 1.5, took
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    assert _client().ping()["pid"] == pid  # the sender's connection survived
    out = run_in_child(lambda: [t[0].item() for t in shmreduce.loads(shmreduce.dumps(tensors))])
    assert out == ("ok", [0.0, 1.0, 2.0, 3.0, 4.0])
    assert "descriptor" in _log_text(broker_log)


def _load_each_as_a_stranger(datas):
    forget_mappings()
    return [shmreduce.loads(data).tolist() for data in datas]


def test_a_backlog_of_messages_in_one_slab_holds_one_descriptor_at_the_broker(registered_fd):
    # A sender far ahead of its receiver: a thousand messages, none received yet, every
    # one in the same slab. The broker holds that slab's descriptor once, not once per
    # message: within a limit of 16 descriptors more than it has, it takes them all.
    assert shmreduce.loads(shmreduce.dumps(torch.ones(2))).sum().item() == 2
    let_go_now()
    pid = _client().broker_pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (_broker_fds(pid) + 16, hard))
    try:
        datas = [shmreduce.dumps(torch.full((4,), float(i))) for i in range(1000)]
        counters = _client().ping()
        assert counters["messages"] >= 1000 and counters["message_fds"] == 1, counters
        assert run_in_child(_load_each_as_a_stranger, datas, timeout=60) == ("ok", [[float(i)] * 4 for i in range(1000)])
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    counters = _client().ping()
    assert counters["messages"] == 0 and counters["message_fds"] == 0, counters


def _loads_as_a_stranger(data):
    """Load *data* in a forked child of its sender as a process that maps none of its
    slabs (a fork inherits them: it would need no descriptor at all)."""
    forget_mappings()
    return shmreduce.loads(data)


def _lowest_free_fd():
    fd = os.dup(0)  # the kernel hands out the lowest free number
    os.close(fd)
    return fd


def _loads_without_descriptors(data):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_lowest_free_fd(), hard))
    try:
        _loads_as_a_stranger(data)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_descriptor_limit_when_connecting_is_a_sharing_error(strategy):
    # A fresh process's first record opens its connections: socket() fails with EMFILE.
    data = shmreduce.dumps(torch.ones(4))
    status, message = run_in_child(_loads_without_descriptors, data)
    assert status == "SharingError" and "out of file descriptors" in message, (status, message)
    assert shmreduce.loads(data).sum().item() == 4  # the message is still there


_ORPHAN_SCRIPT = textwrap.dedent(
    """
    import multiprocessing as mp, os, time
    import torch, shmreduce
    from shmreduce import program
    from shmreduce.broker import client

    def send(conn):
        conn.send_bytes(shmreduce.dumps(torch.arange(4.0)))

    shmreduce.register()
    shmreduce.loads(shmreduce.dumps(torch.ones(1)))  # this process is the program's root
    prog = program.current()
    c = client.client_for(prog.directory, prog.root_pid)
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    p = ctx.Process(target=send, args=(b,))
    p.start()
    data = a.recv_bytes()
    p.join()
    assert c.ping()["messages"] == 1  # the exited sender's message waits...
    deadline = time.monotonic() + 20
    while c.ping()["messages"] and time.monotonic() < deadline:
        time.sleep(0.1)
    left = c.ping()["messages"]  # ...for SHMREDUCE_ORPHAN_TTL seconds only
    try:
        shmreduce.loads(data)
        outcome = "loaded"
    except shmreduce.SharingError:
        outcome = "SharingError"
    print("RESULT", left, outcome, flush=True)
    """
)


def test_undelivered_messages_of_an_exited_sender_expire(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT, SHMREDUCE_ORPHAN_TTL="1", SHMREDUCE_LOG_LEVEL="DEBUG")
    env.pop("SHMREDUCE_BROKER_LOG", None)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=env, cwd=ROOT)
    assert out.returncode == 0 and "RESULT 0 SharingError" in out.stdout, out.stdout + out.stderr
    # The broker logs to the stderr of the process that started it, at DEBUG: an
    # exited sender's messages expiring is the normal life of a program (SPEC 13).
    assert "undelivered" in out.stderr, out.stderr
