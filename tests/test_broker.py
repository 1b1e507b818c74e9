"""The broker as a real process: private directory, stdlib only, lifetime, restart,
and what it keeps: memfds by inode (fetched once per segment by a receiver that does
not map it yet), segments whose refs are still in flight (draining)."""

import os
import stat
import time

import pytest
import torch

import shmreduce
from shmreduce import _native, program
from shmreduce.broker import client as broker_client
from shmreduce.cache import cache

from helpers import broker_pids, gone, let_go_now, open_fds, wait_for

GRACE = float(os.environ["SHMREDUCE_BROKER_GRACE"])


def _client():
    prog = program.current()
    return broker_client.client_for(prog.directory, prog.root_pid)


def _header(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(generation, sent, loaded, holders) of the segment *t* lies in, as this process maps it."""
    place = cache.place_of(t.untyped_storage())
    assert place is not None, "not a shared tensor"
    return _native.hdr_read(place.segment.addr)


def _headers(tensors) -> dict:
    """The header of each segment *tensors* lie in, by segment key."""
    found = {}
    for t in tensors:
        place = cache.place_of(t.untyped_storage())
        assert place is not None
        found[place.segment.key] = place.segment
    return {key: _native.hdr_read(seg.addr) for key, seg in found.items()}


def test_broker_is_a_private_stdlib_only_process(registered_fd):
    t = torch.ones(4)
    shmreduce.loads(shmreduce.dumps(t))
    client = _client()
    counters = client.ping(full=True)
    assert counters["pid"] == client.broker_pid and counters["clients"] >= 1
    # Read by the broker from its own maps: not dumpable, its /proc/<pid>/maps is closed
    # to the other processes of a user that is not root.
    assert counters["libtorch_mapped"] is False, "the broker must never import torch"
    directory = program.current().directory
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(directory, "broker.sock")).st_mode) == 0o600


@pytest.mark.swap_path
def test_file_system_segments_are_0600_and_unlinked_when_released():
    with shmreduce.registered(strategy="file_system"):
        t = torch.arange(100.0)
        shmreduce.loads(shmreduce.dumps(t))
        directory = program.current().directory
        segs = [n for n in os.listdir(directory) if n.startswith("seg-")]
        assert len(segs) == 1
        assert stat.S_IMODE(os.stat(os.path.join(directory, segs[0])).st_mode) == 0o600
        del t
        from shmreduce import transfer

        from helpers import let_go_now

        let_go_now()  # the file is free: kept in the pool for reuse ...
        assert [n for n in os.listdir(directory) if n.startswith("seg-")]
        transfer.let_go()  # ... until the pool lets go of it
        _client().ping()  # barrier: the release has been processed
        assert not [n for n in os.listdir(directory) if n.startswith("seg-")]


def test_broker_exits_when_clients_leave_and_restarts_on_demand(registered_fd):
    shmreduce.loads(shmreduce.dumps(torch.ones(2)))
    first = _client().broker_pid
    broker_client.close_all()
    assert wait_for(lambda: not broker_pids(), 10)
    assert not os.path.exists(program.current().directory)
    out = shmreduce.loads(shmreduce.dumps(torch.ones(2)))  # a new broker serves the next message
    assert out.sum().item() == 2 and _client().broker_pid != first


@pytest.mark.swap_path
def test_refs_in_flight_keep_a_draining_segment_and_the_broker_while_the_root_lives(registered_fd):
    t = torch.arange(5.0)
    data = shmreduce.dumps(t)  # counted sent; nobody loaded it yet
    _gen, sent, loaded, _holders = _header(t)
    assert sent == loaded + 1
    pid = _client().broker_pid
    broker_client.close_all()  # the sender's connections close: its memfd is kept for the ref in flight
    time.sleep(3 * GRACE)  # an idle broker with nothing in flight would be gone by now
    assert pid in broker_pids()
    counters = _client().ping()  # a new connection to the same broker
    assert counters["pid"] == pid and counters["draining"] == 1 and counters["segments"] == 1, counters
    assert shmreduce.loads(data).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]  # counted loaded
    assert wait_for(lambda: _client().ping()["draining"] == 0, 10), _client().ping()
    assert _client().ping()["segments"] == 0  # nothing in flight, nobody uses it: closed
    # The module's leak check: once this connection closes, the broker goes.


def test_sharing_while_the_idle_broker_exits(strategy):
    # Each round drops every connection, waits about the broker's grace period (0.3 s
    # in tests) and shares again: around the boundary the old broker is exiting (its
    # janitor renames the directory away and removes it) while the next share starts
    # a successor; every message must still arrive. (The window the load test once
    # hit, a file made in the directory just as the idle broker left, is closed by
    # transfer._live_program connecting first; it is too narrow to hit on purpose.)
    for i in range(12):
        broker_client.close_all()
        time.sleep(GRACE * (0.8 + 0.04 * i))
        out = shmreduce.loads(shmreduce.dumps(torch.full((256,), float(i))))
        assert out.sum().item() == 256.0 * i


def test_generations_and_file_names_differ_between_a_process_and_its_forked_child():
    # Generation numbers and file_system names are a per-process prefix and a counter:
    # a forked child draws a new prefix, or its generations would repeat its
    # parent's, and its files would collide with its parent's in their directory.
    from shmreduce import pool, segments
    from shmreduce.broker.protocol import is_segment_name

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, b"%d " % pool.new_gen_number() + segments.new_name().encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        child = os.read(r, 128).decode()
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    child_gen, child_name = int(child.split(" ")[0]), child.split(" ")[1]
    parent_gen, parent_name = pool.new_gen_number(), segments.new_name()
    assert child_gen >> 48 != parent_gen >> 48
    assert pool.new_gen_number() > parent_gen
    assert is_segment_name(child_name) and is_segment_name(parent_name)
    assert child_name[:16] != parent_name[:16]
    assert segments.new_name() != parent_name


def test_file_system_sharing_after_the_broker_died_and_its_directory_went():
    # A connected client checks its broker once per message (a peek at its
    # connection, no directory stat): when its broker was killed and its janitor
    # removed the directory, it connects afresh, a new broker makes the directory,
    # and the message goes through.
    import signal

    with shmreduce.registered(strategy="file_system"):
        assert shmreduce.loads(shmreduce.dumps(torch.ones(2))).sum().item() == 2
        client = _client()
        pid, directory = client.broker_pid, program.current().directory
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not os.path.exists(directory), 10)  # the janitor's work
        assert client.connected()  # it cannot know yet
        t = torch.arange(10.0)
        out = shmreduce.loads(shmreduce.dumps(t))
        assert torch.equal(out, t) and _client().broker_pid not in (None, pid)
        assert os.path.isdir(directory)


def _produce(conn, count, numel):
    for i in range(count):
        conn.send(torch.full((numel,), float(i)))
    conn.recv()  # stay connected until the test is done


def _sent_from_a_child(count, numel=4):
    """A forked sender's *count* messages as raw bytes, its memfds (S records) read
    by the broker."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_produce, args=(theirs, count, numel), daemon=True)
    proc.start()
    datas = [ours.recv_bytes() for _ in range(count)] if ours.poll(20) else []
    _client().ping()  # barrier: every record the child posted before is read
    return proc, ours, datas


def _load(data):
    from multiprocessing.reduction import ForkingPickler

    return ForkingPickler.loads(data)


def _memfds() -> int:
    return sum(1 for fd in open_fds() if "memfd:shmreduce (" in fd)  # segments, not the ledger


@pytest.mark.swap_path
def test_a_receiver_fetches_once_per_slab_and_holds_one_descriptor_per_slab(registered_fd):
    # A sender fills its slab across messages: the receiver fetches the slab's
    # descriptor with the first message, and receives the others with no round trip
    # and no new descriptor, however many it keeps (pytorch #973 / #11201).
    proc, conn, datas = _sent_from_a_child(1000, numel=256)  # 1 KiB each
    try:
        before, memfds = shmreduce.stats(), _memfds()
        kept = [_load(d) for d in datas]
        after = shmreduce.stats()
        assert [t[0].item() for t in kept] == [float(i) for i in range(1000)]
        assert after["round_trips"] - before["round_trips"] <= 2  # one per slab (1 MiB)
        assert _memfds() - memfds <= 2
        headers = _headers(kept)
        assert 1 <= len(headers) <= 2
        # Every ref the sender counted sent was counted loaded: nothing in flight.
        assert sum(h[1] for h in headers.values()) == sum(h[2] for h in headers.values()) == 1000, headers
    finally:
        conn.send("done")
        proc.join(10)


def test_large_storages_cost_a_round_trip_each(registered_fd):
    from shmreduce.pool import ARENA_ITEM_MAX

    proc, conn, datas = _sent_from_a_child(5, numel=ARENA_ITEM_MAX // 4 + 1)
    try:
        before = shmreduce.stats()
        assert [_load(d)[0].item() for d in datas] == [float(i) for i in range(5)]
        after = shmreduce.stats()
        assert after["round_trips"] - before["round_trips"] == 5  # a segment of its own each
    finally:
        conn.send("done")
        proc.join(10)


def _load_values(datas, conn):
    conn.send([_load(d)[0].item() for d in datas])


@pytest.mark.swap_path
def test_a_process_that_does_not_map_the_slab_fetches_it(registered_fd):
    import multiprocessing as mp

    from helpers import let_go_now

    proc, conn, datas = _sent_from_a_child(6)
    try:
        first = _load(datas[0])
        assert first[0].item() == 0.0 and _load(datas[1])[0].item() == 1.0
        # A spawned process maps nothing of ours (a forked one would inherit the
        # mapping): it fetches the slab's descriptor with its first message.
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        other = ctx.Process(target=_load_values, args=(datas[2:], theirs), daemon=True)
        other.start()
        assert ours.poll(60) and ours.recv() == [2.0, 3.0, 4.0, 5.0]
        other.join(10)
        assert other.exitcode == 0
        # Every ref loaded, and once this process lets go of its own hold the
        # generation has no holder left: the spawned process's went with it (let go
        # of at its exit, or counted out by the broker when its connections closed).
        _gen, sent, loaded, _holders = _header(first)
        assert sent == loaded == 6
        first_place = cache.place_of(first.untyped_storage())
        assert first_place is not None
        seg = first_place.segment  # keeps the slab mapped here
        del first
        let_go_now()
        assert wait_for(lambda: _client().ping(full=True)["generations_held"] == 0, 10), _client().ping(full=True)
        assert _native.hdr_read(seg.addr)[3] == 0, _native.hdr_read(seg.addr)
    finally:
        conn.send("done")
        proc.join(10)


@pytest.mark.swap_path
def test_a_message_in_a_mapped_slab_loads_after_its_broker_died(registered_fd):
    import signal

    proc, conn, datas = _sent_from_a_child(4)
    try:
        assert _load(datas[0])[0].item() == 0.0  # maps the slab
        client = _client()
        pid = client.broker_pid
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: gone(pid), 10)  # its sockets closed too (they close after its cmdline empties)
        # The slab is mapped here: no broker is needed to receive the others.
        assert [_load(d)[0].item() for d in datas[1:]] == [1.0, 2.0, 3.0]
    finally:
        conn.send("done")
        proc.join(10)


def _send_and_exit(conn, numel):
    conn.send_bytes(shmreduce.dumps([torch.full((numel,), 7.0), torch.arange(4.0)]))
    os._exit(0)  # at once: its S records may still be queued on its post connection


@pytest.mark.swap_path
def test_a_memfd_whose_sender_exited_right_after_pickling_is_still_fetched(registered_fd):
    # The sender's connections close with its refs in flight: the broker reads what it
    # posted before the close (its memfds), and keeps them, draining, for the receiver.
    import multiprocessing as mp

    from shmreduce.pool import ARENA_ITEM_MAX

    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    numel = ARENA_ITEM_MAX // 4 + 1  # a segment of its own, beside the slab of the small one
    proc = ctx.Process(target=_send_and_exit, args=(theirs, numel))
    proc.start()
    try:
        assert ours.poll(20)
        data = ours.recv_bytes()
        proc.join(10)
        assert proc.exitcode == 0
        before = shmreduce.stats()["round_trips"]
        big, small = shmreduce.loads(data)  # this process maps nothing of the child's: it fetches both
        assert bool((big == 7.0).all()) and small.tolist() == [0.0, 1.0, 2.0, 3.0]
        assert shmreduce.stats()["round_trips"] - before == 2
        headers = _headers([big, small])
        assert len(headers) == 2 and all(h[1] == h[2] == 1 for h in headers.values()), headers
        # Every ref loaded: the broker keeps both while this process holds them (it may
        # forward them), and lets go of both once it drops them.
        assert _client().ping()["draining"] == 2
        assert bool((big == 7.0).all())
        del big, small
        let_go_now()
        assert wait_for(lambda: _client().ping()["draining"] == 0, 10), _client().ping()
    finally:
        proc.join(10)
        ours.close()
        theirs.close()
