"""The broker and its client against big messages, bad peers and exhausted limits.

A broker off the per-message path, under load and misuse: a
message of thousands of storages, or of hundreds of segments, arrives whole; a fetch
finds a memfd whose S record is still queued on its sender's post connection; a
bad record or a silent connection costs only its own client; failures leave a log
line; the broker never starts for a receiver; limits are a SharingError; the broker
keeps one descriptor per memfd however many messages use it; segments an exited
sender left in flight have a bounded lifetime.
"""

from __future__ import annotations

import array
import ast
import mmap
import multiprocessing as mp
import os
import resource
import signal
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

from helpers import SegmentRef, broker_pids, forget_mappings, gone, let_go_now, run_in_child, seg_files, wait_for

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


# -- a file_system message of 3,000 new storages -----------------------------------------


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
        # The broker knew every file (its maker held it), and unlinked each once its
        # maker let go of it with nothing in flight (the receiver loaded every ref).
        assert wait_for(lambda: not seg_files(directory), 10), len(seg_files(directory))


# -- a message of more than MAX_FDS segments, under load ---------------------------------------


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


def test_message_of_300_segments_is_delivered_whole_under_load(registered_fd):
    # 300 storages above ARENA_ITEM_MAX: a segment (a memfd) each, so 300 S records on
    # the sender's post connection, which the broker reads in batches. Spinning
    # processes keep the broker late, a spinning thread slows the sender: the
    # receiver's fetches race the S records of their memfds.
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


def test_a_deposit_returns_once_the_broker_keeps_the_memfd(broker_log):
    # A deposit was a fire-and-forget record: the broker had to read every post
    # connection before it answered a fetch (the deposit might be queued there), and a
    # deposit it could not keep would be lost silently. So segment()
    # returns once the broker keeps the memfd: no ref to it exists before, so no fetch
    # can come first.
    prog = program.current()
    sender = broker_client.BrokerClient(prog.directory, prog.root_pid)
    sender.connect()
    receiver = broker_client.BrokerClient(prog.directory, None)
    fd = os.memfd_create("shmreduce-test", os.MFD_CLOEXEC)
    fetched = None
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        ino = P.identity(os.fstat(fd))
        assert receiver.fetch(ino) is None  # nobody deposited it: refused, the connection kept
        done = threading.Event()

        def deposit() -> None:
            sender.segment(fd, header="lead")
            done.set()

        pid = sender.broker_pid
        os.kill(pid, signal.SIGSTOP)
        depositor = threading.Thread(target=deposit, daemon=True)
        try:
            depositor.start()
            assert not done.wait(0.3), "a deposit returned while the broker was stopped"
        finally:
            os.kill(pid, signal.SIGCONT)
        depositor.join(TIMEOUT)
        assert done.is_set()
        fetched = receiver.fetch(ino)
        assert fetched is not None and P.identity(os.fstat(fetched)) == ino
        assert receiver.ping()["segments"] == 1
    finally:
        if fetched is not None:
            os.close(fetched)
        os.close(fd)
        receiver.close()
        sender.close()


def test_a_ref_to_a_memfd_the_broker_does_not_keep_is_stale(registered_fd):
    assert shmreduce.loads(shmreduce.dumps(torch.ones(2))).sum().item() == 2  # the broker runs
    forged = ("fd", program.current().directory, 1 << 40, 5, 64, 8, 0, 0)
    with pytest.raises(shmreduce.SharingError, match="cannot receive segment"):
        transfer.receive(forged)
    assert _client().ping()["pid"] == _client().broker_pid  # a refusal, not a dropped connection


# -- bad records, silent connections ---------------------------------------------------------


def _raw(role=P.ROLE_POST):
    """An authenticated raw connection to this program's broker."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(os.path.join(program.current().directory, P.SOCKET_NAME))
    P.client_handshake(sock, bytes(mp.current_process().authkey), role, os.urandom(P.TOKEN_LEN))
    return sock


def _broker_fds():
    """The broker's open descriptors, as it counts them (its /proc/<pid>/fd is closed
    to other processes of the user: it is not dumpable)."""
    return _client().ping(full=True)["descriptors"]


def _lowest_free_fd_of_broker():
    """The descriptor number the broker gets next: as its limit, it can open none more."""
    return _client().ping(full=True)["lowest_free_descriptor"]


def test_bad_records_drop_only_their_client_and_are_logged(registered_fd, broker_log):
    assert shmreduce.loads(shmreduce.dumps(torch.ones(2))).sum().item() == 2
    client = _client()
    pid = client.broker_pid
    client.ping()  # both connections open, every record read: the baseline
    baseline = _broker_fds()
    bad_name = b"seg-../../etc/passwd"
    garbage = [
        (P.ROLE_REQUEST, P.SEGMENT + P.NO_KEY + b"h", 0),  # a segment record without its memfd
        (P.ROLE_REQUEST, P.SEGMENT + P.NO_KEY + b"x", 1),  # ... of an unknown kind
        (P.ROLE_REQUEST, P.SEGMENT + P.NO_KEY + b"h", 2),  # ... with two descriptors for one kind
        (P.ROLE_REQUEST, P.SEGMENT + P.NO_KEY + b"ht", 1),  # ... with two kinds for one descriptor
        (P.ROLE_POST, P.SEGMENT + P.NO_KEY + b"h", 1),  # ... on a post connection: it is answered
        (P.ROLE_POST, P.DROP + P.NO_KEY + b"1\n\n2", 0),
        (P.ROLE_POST, P.LEDGER + P.NO_KEY, 0),  # a ledger record without its memfd
        (P.ROLE_POST, P.LEDGER + P.NO_KEY + b"x", 1),  # ... with a body
        (P.ROLE_POST, P.LEDGER + P.NO_KEY, 2),  # ... with two descriptors
        (P.ROLE_POST, P.HOLD + P.NO_KEY + bad_name, 0),
        (P.ROLE_POST, P.RELEASE + P.NO_KEY + b"gen-" + b"0" * 24, 0),  # generations are no names
        (P.ROLE_REQUEST, P.FETCH + P.NO_KEY + b"inode", 0),
        (P.ROLE_REQUEST, P.FETCH + P.NO_KEY + b"1", 0),  # a fetch names one memfd and how many it takes
        (P.ROLE_REQUEST, P.FETCH + P.NO_KEY + b"1\n2\n3", 0),
        (P.ROLE_REQUEST, P.FETCH + P.NO_KEY + b"1\n0", 0),
        (P.ROLE_POST, b"Z" + P.NO_KEY, 0),  # unknown op
        (P.ROLE_POST, b"D", 0),  # shorter than a header
        (P.ROLE_POST, P.HOLD + P.NO_KEY + b"x" * (P.MAX_RECORD + 100), 0),  # larger than any record
    ]
    for role, record, nfds in garbage:
        sock = _raw(role)
        fds = [os.memfd_create("shmreduce-test", os.MFD_CLOEXEC) for _ in range(nfds)]
        try:
            for fd in fds:
                os.ftruncate(fd, mmap.PAGESIZE)
            if fds:
                sock.sendmsg([record], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
            else:
                sock.send(record)
            assert sock.recv(1) == b"", f"the broker kept a client that sent {record[:40]!r}"
        finally:
            for fd in fds:
                os.close(fd)
            sock.close()
        counters = client.ping()  # the broker lives, and serves others
        assert counters["pid"] == pid and counters["segments"] == 1, counters  # this process's slab only
    # A record carrying descriptors it has no use for: they are closed, not kept, and
    # the connection goes on.
    sock = _raw()
    r, w = os.pipe()
    try:
        P.send_record(sock, P.RELEASE, P.NO_KEY, P.encode_names(["seg-" + "0" * 24]), [r, w])
        P.send_record(sock, P.DROP, P.NO_KEY, P.encode_inos([1 << 40]))
        assert client.ping()["clients"] == 2
        # A ledger that is no memfd (a pipe: the broker would block reading it) costs
        # its connection.
        P.send_record(sock, P.LEDGER, P.NO_KEY, b"", [r])
        assert sock.recv(1) == b""
    finally:
        os.close(r)
        os.close(w)
        sock.close()
    assert wait_for(lambda: client.ping()["clients"] == 1, 5)
    assert wait_for(lambda: _broker_fds() <= baseline, 5), (_broker_fds(), baseline)
    assert shmreduce.loads(shmreduce.dumps(torch.arange(3.0))).tolist() == [0.0, 1.0, 2.0]
    log = _log_text(broker_log)
    assert log.count("dropped the connection") >= len(garbage), log
    whys = ("a kind for each", "comes on the request connection", "bad inodes", "a ledger record carries", "bad segment names")
    for why in whys + ("unknown op", "truncated", "larger than"):
        assert why in log, (why, log)
    # Each is a protocol error (a WARNING line), none an error of the broker's own.
    assert "unexpected error" not in log and "Traceback" not in log, log


def _loads_values_as_a_stranger(data):
    return _loads_as_a_stranger(data).tolist()


def test_connections_that_never_handshake_do_not_stall_the_broker(registered_fd, broker_log):
    t = torch.arange(4.0)
    data = shmreduce.dumps(t)  # the broker runs, and keeps the memfd (a message loads while its tensor lives)
    path = os.path.join(program.current().directory, P.SOCKET_NAME)
    silent = []
    try:
        for _ in range(3):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect(path)
            silent.append(sock)
        # A process that maps nothing of ours connects and fetches the memfd while the
        # silent connections wait for their handshakes.
        assert run_in_child(_loads_values_as_a_stranger, data) == ("ok", [0.0, 1.0, 2.0, 3.0])
        for sock in silent:
            assert sock.recv(64, socket.MSG_DONTWAIT).startswith(P.MAGIC)  # the broker's hello...
            with pytest.raises(BlockingIOError):  # ...and the connection still open: nobody waited for it
                sock.recv(64, socket.MSG_DONTWAIT)
        # Each silent connection is closed once HANDSHAKE_TIMEOUT has passed.
        for sock in silent:
            sock.settimeout(P.HANDSHAKE_TIMEOUT + 5)
            assert sock.recv(64) == b""
    finally:
        for sock in silent:
            sock.close()
    assert "no handshake within" in _log_text(broker_log)
    assert shmreduce.loads(data).tolist() == t.tolist()  # counted loaded here too


# -- no unclosed sockets at exit; a broker restart is a warning ---------------------------------


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
    # Exited, not just out of broker_pids(): a process's cmdline reads empty from the
    # start of its memory's teardown, its sockets close after it (milliseconds, or a
    # quarter second for a large one, as under ASan). The next message checks its post
    # connection for the hang-up; seen open, it went without a reconnection, unwarned.
    assert wait_for(lambda: gone(pid), 10)
    with caplog.at_level("WARNING", logger="shmreduce"):
        assert shmreduce.loads(shmreduce.dumps(torch.ones(3))).sum().item() == 3
    assert any("restarted" in r.getMessage() and r.name.startswith("shmreduce") for r in caplog.records), caplog.text


# -- receivers never start a broker --------------------------------------------------------------


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
            ref = ("fd", directory, 12345, 1, 64, 4, 0)
            status, message = run_in_child(transfer.receive, ref)
            assert status == "SharingError", (status, message)
            assert os.listdir(directory) == [] and not _brokers_of(directory)
        finally:
            os.rmdir(directory)


# -- limits and lifetimes --------------------------------------------------------------------------


def _connect_then_load(conn):
    """A receiver that maps nothing of its parent's: connects first, then loads each
    message it is sent and answers with its values or its error."""
    forget_mappings()
    broker_client.client_for(program.current().directory).ping()  # connected before the broker's limit
    conn.send("connected")
    while (data := conn.recv_bytes()) != b"":
        try:
            conn.send([t.tolist() for t in shmreduce.loads(data)])
        except shmreduce.SharingError as exc:
            conn.send(f"SharingError: {exc}")


def test_a_deposit_the_broker_cannot_keep_fails_at_the_sender(registered_fd, broker_log):
    # At its descriptor limit the broker gets the deposits of new segments without
    # their memfds (MSG_CTRUNC): unless the sender hears of it, the message goes out
    # and its receiver's fetch is refused as stale. So the sender
    # gets a SharingError that says what to do, nothing is sent, the broker and the
    # sender's connections go on, and the same tensors are sent and received whole
    # once the limit is lifted.
    from shmreduce.pool import ARENA_ITEM_MAX

    assert shmreduce.loads(shmreduce.dumps(torch.ones(2))).sum().item() == 2
    pid = _client().broker_pid
    _client().ping()  # both connections of the sender open: it needs no new one at the limit
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_connect_then_load, args=(theirs,))
    proc.start()
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    try:
        assert ours.poll(TIMEOUT) and ours.recv() == "connected"
        before = _client().ping()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (_lowest_free_fd_of_broker(), hard))  # no descriptor more
        tensors = [torch.full((ARENA_ITEM_MAX // 4 + 16,), float(i)) for i in range(3)]  # a segment each
        with pytest.raises(shmreduce.SharingError, match="limit of open file descriptors"):
            shmreduce.dumps(tensors)
        counters = _client().ping()
        assert counters["pid"] == pid and counters["segments"] == before["segments"], counters  # nothing kept half
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        ours.send_bytes(shmreduce.dumps(tensors))  # the same tensors: deposited now
        assert ours.poll(TIMEOUT) and ours.recv() == [t.tolist() for t in tensors]
        assert [t[0].item() for t in tensors] == [0.0, 1.0, 2.0]
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        ours.send_bytes(b"")
        proc.join(TIMEOUT)
        if proc.is_alive():
            proc.kill()
            proc.join()
        ours.close()
        theirs.close()
    assert proc.exitcode == 0
    assert "out of file descriptors" in _log_text(broker_log)


def _load_each_as_a_stranger(datas):
    forget_mappings()
    return [shmreduce.loads(data).tolist() for data in datas]


@pytest.mark.swap_path
def test_a_backlog_of_messages_in_one_slab_holds_one_descriptor_at_the_broker(registered_fd):
    # A sender far ahead of its receiver: a thousand messages, none received yet, every
    # one in the same slab. The broker holds that slab's memfd once, not once per
    # message: within a limit of 16 descriptors more than it has, it takes them all.
    assert shmreduce.loads(shmreduce.dumps(torch.ones(2))).sum().item() == 2
    let_go_now()
    transfer.let_go_slabs()  # the backlog starts a slab of its own
    pid = _client().broker_pid
    before = _client().ping()["segments"]
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (_broker_fds() + 16, hard))
    try:
        datas = [shmreduce.dumps(torch.full((4,), float(i))) for i in range(1000)]
        counters = _client().ping()
        assert counters["segments"] == before + 1, counters
        assert run_in_child(_load_each_as_a_stranger, datas, timeout=60) == ("ok", [[float(i)] * 4 for i in range(1000)])
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    assert _client().ping()["segments"] == before + 1


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
    deadline = time.monotonic() + 20
    while not c.ping()["draining"] and time.monotonic() < deadline:
        time.sleep(0.05)
    drained = c.ping()["draining"]  # the exited sender's memfd, its ref in flight, waits...
    deadline = time.monotonic() + 20
    while c.ping()["draining"] and time.monotonic() < deadline:
        time.sleep(0.1)
    left = c.ping()["draining"]  # ...for SHMREDUCE_ORPHAN_TTL seconds only
    try:
        shmreduce.loads(data)
        outcome = "loaded"
    except shmreduce.SharingError as exc:
        outcome = "SharingError" if "cannot receive segment" in str(exc) else repr(exc)
    print("RESULT", drained, left, outcome, flush=True)
    """
)


@pytest.mark.swap_path
def test_draining_segments_of_an_exited_sender_expire(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT, SHMREDUCE_ORPHAN_TTL="1", SHMREDUCE_LOG_LEVEL="DEBUG")
    env.pop("SHMREDUCE_BROKER_LOG", None)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=env, cwd=ROOT)
    assert out.returncode == 0 and "RESULT 1 0 SharingError" in out.stdout, out.stdout + out.stderr
    # The broker logs to the stderr of the process that started it, at DEBUG: an
    # exited sender's refs nobody loaded expiring is the normal life of a program, not a warning.
    assert "not loaded within 1 s (SHMREDUCE_ORPHAN_TTL)" in out.stderr, out.stderr


@pytest.mark.swap_path
def test_a_pooled_memfd_cannot_be_shrunk_or_grown(registered_fd):
    # A same-user process that gets a pooled memfd (a receiver's fetch, or
    # /proc/<broker>/fd) and truncates it would kill every process mapping it with
    # SIGBUS, the broker first: its size is sealed.
    import fcntl

    t = torch.arange(1000.0)
    ref = SegmentRef(*transfer.share(t.untyped_storage()))
    fd = _client().fetch(ref.segment)
    assert fd is not None
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        size = os.fstat(fd).st_size
        for new_size in (0, size // 2, size * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, new_size)
    finally:
        os.close(fd)
    assert _client().ping()["pid"] == _client().broker_pid  # the broker lives
    with transfer.receiving():
        assert transfer.receive(ref).data_ptr() == t.untyped_storage().data_ptr()  # loaded: nothing in flight
    assert torch.equal(shmreduce.loads(shmreduce.dumps(t)), torch.arange(1000.0))


def _load_and_die(blob: bytes) -> None:
    shmreduce.loads(blob)  # held: the broker counts this process out, reading the header
    os._exit(0)


def _share_truncate_and_die(out) -> None:
    # A sender whose segment file another process of the user truncates, then dies with
    # a message of it in flight: the broker reads the header to decide how long to keep
    # the file. It mapped that header already: a receiver died holding the generation.
    t = torch.arange(50_000.0)  # a file of its own
    blob = shmreduce.dumps(t)
    shmreduce.dumps(t)  # in flight: never loaded
    r = mp.get_context("fork").Process(target=_load_and_die, args=(blob,))
    r.start()
    r.join(TIMEOUT)
    prog = program.current()
    client = broker_client.client_for(prog.directory, prog.root_pid)
    assert wait_for(lambda: client.ping(full=True)["generations_held"] == 0, TIMEOUT)  # counted out: its header mapped
    place = transfer.cache.place_of(t.untyped_storage())
    assert place is not None
    path = os.path.join(place.segment.directory, place.segment.name)
    out.send(path)
    os.truncate(path, 0)  # as `truncate -s 0 seg-...` would, from any process of the user
    os._exit(0)  # touching the mapping again would be this process's SIGBUS, not the broker's


@pytest.mark.swap_path
def test_a_truncated_segment_file_costs_the_broker_nothing():
    # A truncated file's header must not kill the broker (SIGBUS), which would remove
    # the program directory under every client: it logs, and goes on.
    with shmreduce.registered(strategy="file_system"):
        assert torch.equal(shmreduce.loads(shmreduce.dumps(torch.ones(4))), torch.ones(4))  # the broker runs
        pid = _client().ping()["pid"]
        # spawn: a fork of this many-threaded test process could inherit a lock held
        # mid-way (the child hung on a futex in some full runs)
        spawn = mp.get_context("spawn")
        a, b = spawn.Pipe()
        p = spawn.Process(target=_share_truncate_and_die, args=(b,))
        p.start()
        path = a.recv() if a.poll(TIMEOUT) else None
        p.join(TIMEOUT)
        assert path is not None and p.exitcode == 0
        assert wait_for(lambda: not os.path.exists(path), TIMEOUT), "the truncated file was never let go of"
        assert _client().ping()["pid"] == pid, "the broker died"
        assert broker_pids() and os.path.isdir(program.current().directory)
        t = torch.arange(10.0)
        assert torch.equal(shmreduce.loads(shmreduce.dumps(t)), t)
        a.close()
        b.close()


_ROOT_THAT_EXITS = textwrap.dedent(
    """
    import sys, torch, shmreduce
    from shmreduce import program
    shmreduce.register()
    assert torch.equal(shmreduce.loads(shmreduce.dumps(torch.ones(4))), torch.ones(4))
    print(program.current().directory, flush=True)
    sys.stdin.read()  # until the test says go
    """
)


def test_an_unauthenticated_connector_keeps_no_dead_programs_broker():
    # A process of the user that connects every few seconds and never answers the
    # handshake must not keep the broker (and its directory) of a program whose root
    # has exited. Only authenticated clients keep a broker once the root is gone.
    root = subprocess.Popen([sys.executable, "-c", _ROOT_THAT_EXITS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    socks: list[socket.socket] = []
    try:
        assert root.stdout is not None and root.stdin is not None
        directory = root.stdout.readline().strip()
        path = os.path.join(directory, P.SOCKET_NAME)
        assert os.path.exists(path)

        def connect() -> bool:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(path)
            except OSError:
                sock.close()
                return False
            socks.append(sock)  # says nothing: its handshake never completes
            return True

        assert connect()
        root.stdin.close()  # the root exits
        root.wait(TIMEOUT)
        deadline = time.monotonic() + 20
        while os.path.isdir(directory) and time.monotonic() < deadline:
            connect()  # one pending handshake after another
            time.sleep(0.5)
        assert not os.path.isdir(directory), "a connector that never authenticated kept a dead program's broker"
    finally:
        _close_all(socks, root)


_LIMITED_ROOT = textwrap.dedent(
    """
    import multiprocessing as mp, resource, sys, time, torch, shmreduce
    from shmreduce import program
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))  # the broker it starts inherits it
    shmreduce.register()
    assert torch.equal(shmreduce.loads(shmreduce.dumps(torch.ones(4))), torch.ones(4))
    client = shmreduce.broker.client.client_for(program.current().directory, program.current().root_pid)
    print(program.current().directory, client.broker_pid, flush=True)
    sys.stdin.readline()  # the test has filled the broker's descriptors

    def new_client(out):
        start = time.monotonic()
        try:
            t = torch.arange(100_000.0)  # a memfd of its own: a deposit and a fetch
            ok = torch.equal(shmreduce.loads(shmreduce.dumps(t)), t)
            out.put(("served", ok, time.monotonic() - start))
        except shmreduce.SharingError as exc:
            out.put(("refused", str(exc), time.monotonic() - start))

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=new_client, args=(out,))
    p.start()
    print(repr(out.get(timeout=60)), flush=True)
    p.join(30)
    sys.stdin.readline()
    """
)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_broker_at_its_descriptor_limit_sheds_load_and_stays_quiet():
    # At EMFILE a level-triggered listener would keep the broker at 100% CPU writing
    # thousands of WARNING lines a second, and a new client would time out.
    log_path = os.environ["SHMREDUCE_BROKER_LOG"]
    logged_before = open(log_path).read().count("out of file descriptors")
    root = subprocess.Popen([sys.executable, "-c", _LIMITED_ROOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    socks: list[socket.socket] = []
    try:
        assert root.stdout is not None and root.stdin is not None
        directory, pid = root.stdout.readline().split()
        path = os.path.join(directory, P.SOCKET_NAME)
        for _ in range(120):  # idle, unauthenticated: each costs the broker a descriptor
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect(path)  # the backlog takes them, whether or not the broker can
            socks.append(sock)
        time.sleep(0.5)
        cpu = _cpu_seconds(int(pid))
        time.sleep(2.0)
        assert _cpu_seconds(int(pid)) - cpu < 0.5, "the broker spins at its descriptor limit"
        root.stdin.write("go\n")
        root.stdin.flush()
        line = root.stdout.readline()
        kind, _detail, took = ast.literal_eval(line)
        assert kind in ("served", "refused") and took < 15, line
        root.stdin.write("done\n")
        root.stdin.flush()
        root.wait(TIMEOUT)
        lines = open(log_path).read().count("out of file descriptors") - logged_before
        assert lines <= 3, f"{lines} log lines about the limit"
    finally:
        _close_all(socks, root)


def _close_all(socks: list[socket.socket], root: subprocess.Popen) -> None:
    """A test's raw connections closed, and its program's root process gone."""
    for sock in socks:
        sock.close()
    if root.poll() is None:
        root.kill()
        root.wait()


# -- a ping's cost -----------------------------------------------------------------------------------


def test_a_ping_reads_no_ledger_whatever_their_size(registered_fd):
    # Every ping parsed every client's ledger: one of 64 MiB (a process that once held
    # 1.6 M generations, or one that grew its memfd) slowed a ping from 0.2 ms to 668 ms.
    # Counted in bytes, not timed: a plain ping reads nothing of a ledger, a full one
    # (a diagnostic) reads each once.
    assert shmreduce.loads(shmreduce.dumps(torch.ones(2))).sum().item() == 2  # the broker runs
    big = broker_client.Ledger()
    client = broker_client.BrokerClient(program.current().directory, None, big)
    try:
        index = big.hold("seg-" + "0" * 24, 7)
        assert index >= 0 and big.mark(index, P.HELD)
        size = 32 << 20
        os.ftruncate(big.fd, size)  # what the broker reads of it (its pages are never touched)
        client.connect()  # its ledger posted
        before = client.ping()["ledger_bytes_read"]
        for _ in range(20):
            client.ping()
        assert client.ping()["ledger_bytes_read"] == before, "a plain ping read ledgers"
        full = client.ping(full=True)
        assert full["generations_held"] >= 1 and full["ledger_bytes_read"] - before >= size, full
    finally:
        client.close(keep=True)
        big.close()


def _join_with_token(path: str, token: bytes) -> str:
    """In a fork child: connect as the identity *token* (another process's)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(TIMEOUT)
    try:
        sock.connect(path)
        P.client_handshake(sock, bytes(mp.current_process().authkey), P.ROLE_POST, token)
        return "joined"
    except (OSError, P.ProtocolError) as exc:
        return f"refused: {exc}"
    finally:
        sock.close()


def test_a_connection_with_another_processs_token_is_refused(registered_fd, broker_log):
    # Connections with the same token are merged only when their pid matches. A token
    # is one process's identity: another process presenting it (a forked child
    # reusing its parent's, or a forger with the authkey) would join its ledger and
    # holds, and its close or K would count that process out, or keep it.
    assert shmreduce.loads(shmreduce.dumps(torch.ones(2))).sum().item() == 2  # the broker runs
    client = _client()
    before = client.ping()
    status, answer = run_in_child(_join_with_token, os.path.join(program.current().directory, P.SOCKET_NAME), client.token)
    assert status == "ok" and answer.startswith("refused"), (status, answer)
    after = client.ping()
    assert (after["clients"], after["connections"]) == (before["clients"], before["connections"]), after
    assert f"its token is pid {os.getpid()}'s" in _log_text(broker_log)
