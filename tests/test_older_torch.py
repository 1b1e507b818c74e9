"""shmreduce on a torch older than its newest private API: the floor (torch 2.8) and
the path a sender's storage takes without ``UntypedStorage._swap_data_ptr_`` (torch
2.8 to 2.11: torch moves it into a memfd, shmreduce adopts it). On a torch with the
swap, that path is taken by hiding the swap (``helpers.without_swap``); on 2.8 to
2.11 the whole suite takes it (docs/compatibility.md)."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import shmreduce
from shmreduce import _torch, program, segments, transfer
from shmreduce.broker import client as broker_client
from shmreduce.broker import protocol as P

from helpers import broker_pids, let_go_now, open_fds, pipe_echo, run_in_child, running, wait_for, without_swap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="module")
def _short_orphan_ttl():
    """The brokers of this module keep what a dead sender sent, and a memfd torch shared
    for the user (nothing counts its refs in flight), 0.5 s, not 60: the module's leak
    check finds them gone, and a message that waits longer than that shows it is not
    what keeps it."""
    broker_client.close_all()
    assert wait_for(lambda: not broker_pids(), 15)
    before = os.environ.get("SHMREDUCE_ORPHAN_TTL")
    os.environ["SHMREDUCE_ORPHAN_TTL"] = "0.5"
    yield
    if before is None:
        del os.environ["SHMREDUCE_ORPHAN_TTL"]
    else:
        os.environ["SHMREDUCE_ORPHAN_TTL"] = before


def _fake_torch(tmp_path, version: str) -> str:
    """A directory holding a 'torch' package that says it is *version* and has what
    shmreduce's modules touch before they check the floor."""
    pkg = tmp_path / "torch"
    (pkg / "multiprocessing").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (pkg / "multiprocessing" / "__init__.py").write_text("")
    return str(tmp_path)


@pytest.mark.parametrize("version", ["2.7.1+cu126", "1.13.1"])
def test_register_under_a_torch_below_the_floor_says_which_torch_and_what_to_do(tmp_path, version):
    code = textwrap.dedent(
        """
        import shmreduce  # needs no torch: nothing to check yet
        try:
            shmreduce.register()
        except ImportError as exc:
            print("ERROR", exc)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_fake_torch(tmp_path, version), ROOT]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERROR"), out.stdout
    assert f"torch {version}" in out.stdout and "torch>=2.8" in out.stdout and "pip install" in out.stdout


def test_the_floor_reads_the_versions_torch_gives_itself():
    assert _torch._release("2.11.0+cu130") == (2, 11) and _torch._release("2.8.0") == (2, 8)
    assert _torch._release("2.13.0.dev20260101+cpu") == (2, 13) and _torch._release("main") == ()
    _torch.check_floor("2.8.0")
    _torch.check_floor("2.16.0a0+git1234")
    with pytest.raises(ImportError, match="torch 2.7.0"):
        _torch.check_floor("2.7.0")


def test_without_the_swap_a_storage_sent_moves_through_torch_in_place_and_receivers_alias_it(strategy):
    with without_swap(), pipe_echo(mp.get_context("spawn")) as echo:
        before = shmreduce.stats()
        t = torch.arange(100.0)
        view = t[10:20]
        big = torch.ones(1 << 18)  # past the slab: the general path in any case
        tiny = torch.tensor(7, dtype=torch.int32), torch.tensor(True)  # torch's memfds of 4 bytes, of 1
        got, got_big, got_tiny = echo((view, big, tiny))
        t[10] = -1.0
        assert got[0].item() == -1.0 and got.tolist()[1:] == list(range(11, 20))  # one memory, both ways
        assert t.is_shared() and torch.equal(got_big, big)
        assert [x.item() for x in got_tiny] == [7, True]
        stats = shmreduce.stats()
        assert stats["move_path"] == "adopt"
        # Nothing was claimed in a pool: the native core hands the tensor over untouched.
        assert stats["fd_segments_made"] == before["fd_segments_made"] and stats["fs_segments_made"] == before["fs_segments_made"]
        assert stats["storages_shared"] == before["storages_shared"] + 4
        del got, got_big, got_tiny


@pytest.mark.parametrize("how", ["torch moved it for shmreduce", "torch shared it for the user"])
def test_a_storage_torch_shared_loads_in_its_own_process_as_the_very_storage(strategy, how):
    # As a pooled one does, and as torch gives a process its own shared storage back.
    with without_swap():
        t = torch.arange(16.0)
        if how == "torch shared it for the user":
            t.untyped_storage()._share_fd_cpu_()
        out = shmreduce.loads(shmreduce.dumps(t[4:]))
        assert out.untyped_storage()._cdata == t.untyped_storage()._cdata and out.data_ptr() == t[4:].data_ptr()
        out[0] = -1.0
        assert t[4].item() == -1.0


def _rebuild_past_the_end(meta) -> str:
    from shmreduce import reductions, transfer

    with without_swap():
        t = torch.ones(4)
        with transfer.sending():
            ref = transfer.share(t.untyped_storage())
        try:
            reductions.rebuild_tensor(ref, meta)
        except shmreduce.SharingError as exc:
            return str(exc)
        return "rebuilt"


@pytest.mark.parametrize("meta", [(torch.float32, (1 << 40,), (1,), 0, None), (torch.float32, (2, 3), (3, 1), 1, None)])
def test_metadata_past_the_end_of_a_storage_loaded_in_its_own_process_is_refused(strategy, meta):
    # The very storage comes back (torch's, which set_ would grow over its mapping:
    # SIGSEGV), so the view is checked against it first. In a child: a crash is a result.
    status, said = run_in_child(_rebuild_past_the_end, meta)
    assert status == "ok" and "forged or corrupted" in said, (status, said)


def _sum_each(conn) -> None:
    while (t := conn.recv()) is not None:
        conn.send(float(t.sum()))


def _segments_at_the_broker() -> dict:
    client = broker_client.connected_client(program.current().directory)
    assert client is not None
    return client.ping()


def test_a_storage_torch_moved_is_let_go_of_at_the_broker_once_it_died():
    # A stream of fresh tensors must not keep a memfd each at the broker until the sender
    # exits: each is let go of once its storage died here, its ref was loaded and its
    # receiver let go of it (the receiver holds the last one until the next arrives).
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    with without_swap(), shmreduce.registered(strategy="file_descriptor"):
        proc = ctx.Process(target=_sum_each, args=(child,))
        with running(proc):
            child.close()
            for i in range(6):
                t = torch.full((1000,), float(i))
                parent.send(t)  # torch moves it, shmreduce adopts it
                assert parent.poll(60) and parent.recv() == 1000.0 * i
                del t
            let_go_now()
            assert wait_for(lambda: _segments_at_the_broker()["segments"] <= 1, 15), _segments_at_the_broker()
            parent.send(None)
        assert wait_for(lambda: _segments_at_the_broker()["segments"] == 0, 15), _segments_at_the_broker()
    parent.close()


def _load_when_told(conn, go) -> None:
    assert go.wait(60)
    while (blob := conn.recv()) is not None:
        loads = [shmreduce.loads(blob) for _ in range(2)]  # the same bytes twice: one ref loaded
        conn.send([float(t.sum()) for t in loads])
        del loads  # not held while it waits for the next


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_a_message_keeps_a_storage_torch_moved_while_it_waits_past_its_senders_drop(strategy):
    # Its sender dropped the tensor and let go of its memfd; the message waits in a pipe
    # far past ORPHAN_TTL (0.5 s here), its sender alive: it still loads, as a pooled
    # segment's message does, and once loaded (twice, the same bytes) nothing is kept.
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    go = ctx.Event()
    with without_swap(), shmreduce.registered(strategy=strategy):
        proc = ctx.Process(target=_load_when_told, args=(child, go))
        with running(proc):
            child.close()
            for i in range(3):
                parent.send(shmreduce.dumps(torch.full((1000,), float(i + 1))))  # the tensor dies at once
            let_go_now()  # each memfd let go of here: the broker decides when it goes
            counters = _segments_at_the_broker()
            assert counters["segments"] == 3, counters
            time.sleep(4 * float(os.environ["SHMREDUCE_ORPHAN_TTL"]))  # past it: not what keeps them
            go.set()
            for i in range(3):
                assert parent.poll(60) and parent.recv() == [1000.0 * (i + 1)] * 2
            assert wait_for(lambda: _segments_at_the_broker()["segments"] == 0, 15), _segments_at_the_broker()
            parent.send(None)
    parent.close()


def _round_trips() -> int:
    return sum(client.round_trips for client in list(broker_client._clients.values()))


def _load_and_count(conn) -> None:
    # Per message: the round trips its load cost, its first elements, and the memfds this
    # process maps while it holds the message (none mapped ahead for nothing).
    while (blob := conn.recv_bytes()) != b"":
        before = _round_trips()
        msg = shmreduce.loads(blob)
        trips = _round_trips() - before
        conn.send((trips, [float(t[0]) for t in msg], sum(1 for kind, _key in list(segments._mapped) if kind == "fd")))
        del msg


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
@pytest.mark.parametrize("count", [64, 300])
def test_the_storages_torch_moved_for_one_message_cost_one_deposit_and_one_fetch(strategy, count):
    # torch moves each fresh storage into a memfd of its own: they go to the broker in one
    # record once the message is whole, and its receiver fetches them in one round trip,
    # not one each (up to P.MAX_FDS descriptors a deposit, P.FETCHED_FDS a fetch). A later
    # message that names one of them maps that one only.
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    records = -(-count // P.MAX_FDS)  # deposits; and fetches of each record's storages:
    batches = [min(P.MAX_FDS, count - start) for start in range(0, count, P.MAX_FDS)]
    fetches_needed = sum(-(-n // P.FETCHED_FDS) for n in batches)
    with without_swap(), shmreduce.registered(strategy=strategy):
        shmreduce.loads(shmreduce.dumps(torch.ones(4)))  # the broker and this process's connections first
        proc = ctx.Process(target=_load_and_count, args=(child,))
        with running(proc):
            child.close()
            tensors = [torch.full((256,), float(i)) for i in range(count)]
            before = _round_trips()
            whole = shmreduce.dumps(tensors)
            deposits = _round_trips() - before
            one = shmreduce.dumps(tensors[:1])  # deposited already: no round trip
            assert _round_trips() - before == records
            parent.send_bytes(one)  # loaded first: the next ones come with it, and are unmapped after
            assert parent.poll(60)
            assert parent.recv() == (1, [0.0], 1)
            parent.send_bytes(whole)
            assert parent.poll(60)
            fetches, firsts, mapped = parent.recv()
            parent.send_bytes(b"")
    parent.close()
    assert deposits == records, f"{count} fresh storages cost the sender {deposits} round trips"
    assert firsts == [float(i) for i in range(count)]
    assert (fetches, mapped) == (fetches_needed, count), f"{count} fresh storages: {fetches} fetches, {mapped} memfds mapped"


def _load_near_the_descriptor_limit(conn) -> None:
    import resource

    blob = conn.recv_bytes()
    shmreduce.loads(shmreduce.dumps(torch.ones(2)))  # its connections and ledger first
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(open_fds()) + 6, hard))
    conn.send([float(t[0]) for t in shmreduce.loads(blob)])


def test_a_receiver_near_its_descriptor_limit_fetches_the_storages_torch_moved_one_at_a_time():
    # A fetch brings up to P.FETCHED_FDS descriptors at once; a process with fewer free
    # loads the message all the same, taking the one descriptor each ref needs.
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    with without_swap(), shmreduce.registered(strategy="file_descriptor"):
        proc = ctx.Process(target=_load_near_the_descriptor_limit, args=(child,))
        with running(proc):
            child.close()
            tensors = [torch.full((256,), float(i)) for i in range(P.FETCHED_FDS)]
            parent.send_bytes(shmreduce.dumps(tensors))
            assert parent.poll(60)
            assert parent.recv() == [float(i) for i in range(P.FETCHED_FDS)]
    parent.close()


def _relay_twice(conn, go) -> None:
    t = conn.recv()
    conn.send(t)  # sent on while its maker dropped it
    assert go.wait(60)
    conn.send_bytes(shmreduce.dumps(t))  # again, once the first was loaded and dropped, and ORPHAN_TTL passed
    conn.recv()


def _sum_of_message(conn) -> None:
    conn.send(float(shmreduce.loads(conn.recv_bytes()).sum()))


def test_a_process_that_sends_on_a_storage_torch_moved_keeps_it_while_it_holds_it():
    # No holder count keeps it at the broker for a relay (generation 0): the relay uses it
    # while its storage lives, as its maker did, and what it sends later still loads in a
    # process that never mapped it.
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    go = ctx.Event()
    with without_swap(), shmreduce.registered(strategy="file_descriptor"):
        proc = ctx.Process(target=_relay_twice, args=(child, go))
        with running(proc):
            child.close()
            parent.send(torch.full((1000,), 5.0))  # dropped here at once
            assert parent.poll(60) and float(parent.recv().sum()) == 5000.0
            let_go_now()  # loaded and dropped here: every ref sent so far is loaded
            time.sleep(4 * float(os.environ["SHMREDUCE_ORPHAN_TTL"]))
            go.set()
            assert parent.poll(60)
            blob = parent.recv_bytes()
            there, here = ctx.Pipe()
            sink = ctx.Process(target=_sum_of_message, args=(there,))
            with running(sink):
                here.send_bytes(blob)
                assert here.poll(60) and here.recv() == 5000.0
            parent.send(None)
        assert wait_for(lambda: _segments_at_the_broker()["segments"] == 0, 15), _segments_at_the_broker()
    parent.close()


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_a_sender_holds_no_descriptor_for_the_storages_torch_moved_once_they_died(strategy):
    # torch closes its memfd's descriptor as the storage dies; shmreduce keeps none of its
    # own (the broker has one for the messages in flight): a burst of fresh tensors costs
    # the sender no descriptors, between two passes of its collector or not.
    with without_swap(), shmreduce.registered(strategy=strategy), transfer.collect_every(3600):
        shmreduce.loads(shmreduce.dumps(torch.ones(4)))  # the broker and its connections first
        before = len(open_fds())
        blobs = [shmreduce.dumps(torch.full((256,), float(i))) for i in range(300)]
        grown = len(open_fds()) - before
        assert [shmreduce.loads(blob)[0].item() for blob in blobs] == [float(i) for i in range(300)]
    assert grown <= 4, f"the sender holds {grown} more descriptors after a burst of 300 tensors"


def test_a_storage_torch_shared_for_the_user_keeps_its_memfd_at_the_broker_while_its_sender_lives():
    # shmreduce did not make it: nothing bounds its refs in flight but its sender's life,
    # as for a pooled segment's messages; only what torch moved for shmreduce is let go of.
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    with shmreduce.registered(strategy="file_descriptor"):
        proc = ctx.Process(target=_sum_each, args=(child,))
        with running(proc):
            child.close()
            t = torch.full((1000,), 2.0)
            t.untyped_storage()._share_fd_cpu_()  # torch shares it itself: shmreduce adopts it
            parent.send(t)
            assert parent.poll(60) and parent.recv() == 2000.0
            del t
            let_go_now()  # a barrier: a drop posted before it is read
            counters = _segments_at_the_broker()
            assert counters["segments"] == 1 and counters["draining"] == 0, counters
            parent.send(None)
    parent.close()
