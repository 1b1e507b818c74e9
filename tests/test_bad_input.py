"""Bad input on the receiving side: stale handles, forged segments, tags and
generations, wrong sizes, names outside the program directory, truncated pickles.

Each raises SharingError with a message that says what happened, within seconds, and
damages nothing: the intact message still loads, the next message works and no
descriptor is left open.

A handle names a segment (a memfd by its inode, which a receiver that does not map it
yet fetches from the broker; a file by its name, with a keyed tag over directory,
name and generation) and a generation of it, which the receiver holds (counted in the
segment's shared header) before it trusts the bytes. So the same bytes load again, in
any process of the program, while their generation lives; once it is over (the owner
reused the segment: its header holds another generation; or closed it: the broker no
longer keeps the memfd, the file is gone) they are stale: SharingError, never other
bytes.

Every ref a test pickles is loaded before the test ends (``_nothing_in_flight``): a
ref pickled and never loaded is in flight, which keeps its segment from reuse and the
broker, draining it, from exiting while this (root) process lives. A load refused, or
that failed part way, is followed by a load of the intact message.

Truncated pickles: the bytes themselves are broken, which is not a sharing failure,
so pickle's own error surfaces (``pickle.UnpicklingError`` or ``EOFError``, as for
any truncated pickle). The refs before the cut were loaded, and what they made is let
go of with the failed load; the whole bytes still load, in this process or another.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import shmreduce
from shmreduce import _native, pool, program, reductions, segments, transfer
from shmreduce.broker import protocol as P
from shmreduce.cache import cache

from helpers import (
    SegmentRef,
    broker_pids,
    forget_mappings,
    let_go_now,
    open_fds,
    run_in_child,
    shm_base,
    wait_for,
    what_brokers_hold,
)

TIMEOUT = 20.0
LARGE = pool.ARENA_ITEM_MAX // 4 + 1024  # float32 elements: a storage with a segment of its own


@pytest.fixture(autouse=True)
def _nothing_in_flight():
    """After each test (which unregisters on its way out: every fixture and context
    here does), the broker exits: nothing it keeps is in flight. A test that left a
    ref unloaded fails here, not at the module's leak check."""
    yield
    gc.collect()
    transfer.collect()
    assert wait_for(lambda: not broker_pids(), 10), f"refs left in flight: {what_brokers_hold()}"


def _rebuild_sum(ref):
    # a fork child: no OpenMP (the parent's pool did not come along), and none of the
    # parent's mappings (and cache): a receiver that has never seen the segment
    torch.set_num_threads(1)
    forget_mappings()
    t = torch.empty(0).set_(reductions.rebuild_storage(ref))
    return float(t.sum()) if t.dtype.is_floating_point else t.numel()


def _load_sum_as_stranger(data: bytes) -> float:
    torch.set_num_threads(1)
    forget_mappings()
    return float(shmreduce.loads(data).sum())


def _load_sum(data: bytes) -> float:
    return float(shmreduce.loads(data).sum())


def _load_twice(data: bytes) -> tuple[float, float, bool]:
    a, b = shmreduce.loads(data), shmreduce.loads(data)
    return float(a.sum()), float(b.sum()), a.data_ptr() == b.data_ptr()


def _shared_ref(t):
    """A real handle for t's storage, counted sent as its own message."""
    with transfer.sending():
        ref = SegmentRef(*transfer.share(t.untyped_storage()))
    return ref


def _load_here(ref) -> float:
    """Load *ref* in this process, its owner (which maps it): the message is
    delivered, nothing of it is left in flight."""
    with transfer.receiving():
        return float(torch.empty(0).set_(reductions.rebuild_storage(ref)).sum())


def _next_message_works():
    """A new message reaches a process that never saw this one's segments."""
    t = torch.arange(10.0)
    assert run_in_child(_load_sum_as_stranger, shmreduce.dumps(t)) == ("ok", 45.0)


def _assert_sharing_error(result, *words):
    status, message = result
    assert status == "SharingError", result
    for w in words:
        assert w in message, (w, message)


def _serve(conn) -> None:
    torch.set_num_threads(1)
    forget_mappings()
    while (call := conn.recv()) is not None:
        fn, args = call
        try:
            result = ("ok", fn(*args))
        except BaseException as exc:  # noqa: BLE001  reported to the test
            result = (type(exc).__name__, str(exc))
        # Let go now of what the call received (the collector thread would, within a
        # second): its generations are no longer held by this process.
        gc.collect()
        transfer.collect()
        conn.send(result)


class _Receiver:
    """A receiving process, forked before the segments a test then sends exist, that
    runs calls on request. (A fork while a storage is shared retires its segment in
    the sender, which then never reuses it: the child could use the storage unseen.)"""

    def __init__(self) -> None:
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def __call__(self, fn, *args):
        t0 = time.monotonic()
        self.conn.send((fn, args))
        assert self.conn.poll(TIMEOUT), "receiver hung"
        result = self.conn.recv()
        assert time.monotonic() - t0 < 10
        return result

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(TIMEOUT)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


@contextmanager
def _receiver() -> Iterator[_Receiver]:
    receiver = _Receiver()
    try:
        yield receiver
    finally:
        receiver.close()


@pytest.fixture(params=["file_descriptor", "file_system"])
def strat(request):
    with shmreduce.registered(strategy=request.param):
        yield request.param


# -- forged handles ------------------------------------------------------------------


def _memfd_inode_nobody_sent() -> int:
    fd = os.memfd_create("shmreduce-test-not-sent", os.MFD_CLOEXEC)
    try:
        return P.identity(os.fstat(fd))
    finally:
        os.close(fd)


@pytest.mark.swap_path
def test_forged_segment_inode_is_stale(registered_fd):
    ref = _shared_ref(torch.ones(16))
    other = torch.full((LARGE,), 7.0)
    other_ref = _shared_ref(other)
    assert other_ref.segment != ref.segment
    t0 = time.monotonic()
    # the broker keeps no memfd of that inode
    unknown = run_in_child(_rebuild_sum, ref._replace(segment=_memfd_inode_nobody_sent()))
    took = time.monotonic() - t0
    # another segment the broker does keep, under this handle's generation: stale,
    # never that segment's bytes
    mixed = run_in_child(_rebuild_sum, ref._replace(segment=other_ref.segment))
    # a generation this segment never had
    other_gen = run_in_child(_rebuild_sum, ref._replace(gen=ref.gen ^ 1))
    # the intact handles still load (first: a failed check below leaves nothing in flight)
    intact = run_in_child(_rebuild_sum, ref), run_in_child(_rebuild_sum, other_ref)
    _assert_sharing_error(unknown, "cannot receive segment")
    assert took < 10
    _assert_sharing_error(mixed, "generation")
    _assert_sharing_error(other_gen, "generation")
    assert intact == (("ok", 16.0), ("ok", 7.0 * LARGE))
    _next_message_works()


@pytest.mark.parametrize("inode", [-1, 0, 1 << 64, 10**20 - 1, 1 << 70, 1 << 128])
def test_inode_out_of_range_is_refused_and_the_connection_kept(registered_fd, inode):
    # An inode no file can have: refused as a handle (or as unknown to the broker),
    # never taken for a broker that went away.
    ref = _shared_ref(torch.ones(16))
    status, message = run_in_child(_rebuild_sum, ref._replace(segment=inode))
    assert run_in_child(_rebuild_sum, ref) == ("ok", 16.0)  # first: a failed check below leaves nothing in flight
    assert status == "SharingError", (status, message)
    assert "not a shmreduce segment handle" in message or "cannot receive segment" in message, message
    assert "not reachable" not in message, message
    _next_message_works()


@pytest.mark.swap_path
def test_forged_file_system_handles_are_refused():
    with shmreduce.registered(strategy="file_system"):
        ref = _shared_ref(torch.ones(16))
        other = torch.full((LARGE,), 7.0)
        other_ref = _shared_ref(other)  # a file of its own
        assert other_ref.segment != ref.segment
        forged = [
            ref._replace(tag=ref.tag ^ 1),  # a corrupted tag
            ref._replace(gen=ref.gen ^ 1),  # another generation under this one's tag
            ref._replace(segment=other_ref.segment),  # another file under this one's tag
            ref._replace(segment=other_ref.segment, gen=other_ref.gen),  # another file and its generation, this tag
        ]
        results = []
        for bad in forged:
            t0 = time.monotonic()
            results.append((run_in_child(_rebuild_sum, bad), time.monotonic() - t0))
        # first: a failed check below leaves nothing in flight
        intact = run_in_child(_rebuild_sum, ref), run_in_child(_rebuild_sum, other_ref)
        for result, took in results:
            _assert_sharing_error(result, "forged")
            assert took < 10
        assert intact == (("ok", 16.0), ("ok", 7.0 * LARGE))
        _next_message_works()


def test_wrong_size_refused(strat):
    t = torch.ones(16)
    ref = _shared_ref(t)
    result = run_in_child(_rebuild_sum, ref._replace(nbytes=pool.SLAB_SIZE + 4))  # beyond its segment
    intact = run_in_child(_rebuild_sum, ref)  # first: a failed check below leaves nothing in flight
    _assert_sharing_error(result, "does not match")
    assert intact == ("ok", 16.0)
    _next_message_works()


@pytest.mark.parametrize("corrupt", ["nbytes", "offset"])
def test_refused_handle_does_not_count_as_loaded(strat, corrupt):
    # A corrupted copy of a handle is refused; the intact message is still in flight,
    # and stays deliverable after its sender dropped the storage: the owner
    # must not take the refused load for the message's, and free the segment under it.
    with _receiver() as recv:
        t = torch.full((LARGE,), 3.0)
        ref = _shared_ref(t)
        bad = ref._replace(nbytes=ref.nbytes + (1 << 20)) if corrupt == "nbytes" else ref._replace(offset=1 << 30)
        _assert_sharing_error(recv(_rebuild_sum, bad), "does not match")
        del t
        gc.collect()
        transfer.collect()
        assert recv(_rebuild_sum, ref) == ("ok", 3.0 * LARGE)
    _next_message_works()


@pytest.mark.parametrize(
    "name",
    ["../../../etc/passwd", "seg-../../etc/shadowxxxxxxxxxx", "seg-ZZZZZZZZZZZZZZZZZZZZZZZZ", "broker.sock", "seg-" + "0" * 24],
)
def test_names_outside_program_dir_refused(name):
    with shmreduce.registered(strategy="file_system"):
        ref = _shared_ref(torch.ones(4))
        result = run_in_child(_rebuild_sum, ref._replace(segment=name))
        intact = run_in_child(_rebuild_sum, ref)  # first: a failed check below leaves nothing in flight
        status, message = result
        assert status == "SharingError", result
        assert "forged" in message or "gone" in message or "stale" in message, message
        assert intact == ("ok", 4.0)
        _next_message_works()


@pytest.mark.parametrize("directory", ["/tmp/evil", "/etc", "/tmp/shmreduce-evil", "shmreduce-relative"])
def test_program_dir_outside_base_refused(strat, directory, tmp_path):
    before = set(os.listdir("/tmp"))
    ref = _shared_ref(torch.ones(4))
    if directory.startswith("/tmp/shmreduce"):
        directory = str(tmp_path / "shmreduce-evil")
    existed = os.path.exists(directory)
    result = run_in_child(_rebuild_sum, ref._replace(program=directory))
    intact = run_in_child(_rebuild_sum, ref)  # first: a failed check below leaves nothing in flight
    assert result[0] == "SharingError", result
    assert existed or not os.path.exists(directory), "a forged handle made a directory"
    # (other test sessions may make files in /tmp meanwhile: only shmreduce's names count)
    assert not {n for n in set(os.listdir("/tmp")) - before if "shmreduce" in n}
    assert intact == ("ok", 4.0)
    _next_message_works()


# -- stale handles -------------------------------------------------------------------

_DUMPER = """
import sys, torch, shmreduce
shmreduce.register(strategy=sys.argv[1])
sys.stdout.write(shmreduce.dumps(torch.full((32,), 3.0)).hex())
"""


def test_stale_handle_program_gone(strat):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _DUMPER, strat], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    data = bytes.fromhex(out.stdout)
    # the dumping program is gone: its broker leaves (root dead) and takes the directory
    assert wait_for(lambda: not [d for d in os.listdir(shm_base()) if d != os.path.basename(program.current().directory)], 10)
    fds = len(open_fds())
    t0 = time.monotonic()
    result = run_in_child(lambda b: float(shmreduce.loads(b).sum()), data)
    assert time.monotonic() - t0 < 10
    _assert_sharing_error(result)
    assert "send it again" in result[1] or "gone" in result[1], result
    with pytest.raises(shmreduce.SharingError):
        shmreduce.loads(data)  # and in this process too
    assert len(open_fds()) <= fds
    _next_message_works()


@pytest.mark.swap_path
def test_second_load_works_while_the_generation_lives(strat):
    want = 2.0 * LARGE
    with _receiver() as recv:
        t = torch.full((LARGE,), 2.0)
        data = shmreduce.dumps(t)
        assert recv(_load_sum, data) == ("ok", want)
        # again, in the process that loaded it and let go since ...
        assert recv(_load_sum, data) == ("ok", want)
        # ... twice at once: one storage over one mapping, as torch
        assert recv(_load_twice, data) == ("ok", (want, want, True))
        # ... and in a process that never saw it
        assert run_in_child(_load_sum_as_stranger, data) == ("ok", want)
        # The owner closes the segment (let_go: nothing kept for reuse) and the broker
        # lets go of it (nothing in flight): the generation is over.
        del t
        transfer.let_go()
        let_go_now()  # the broker has read the close
        t0 = time.monotonic()
        result = run_in_child(_load_sum_as_stranger, data)
        assert time.monotonic() - t0 < 10
        _assert_sharing_error(result)
        assert "cannot receive segment" in result[1] or "gone" in result[1], result
        # A process that still maps the segment: the bytes (nobody can reuse a closed
        # segment) or stale; never other bytes.
        status, value = recv(_load_sum, data)
        assert (status, value) == ("ok", want) or status == "SharingError", (status, value)
    _next_message_works()


@pytest.mark.swap_path
def test_stale_once_the_owner_reuses_the_segment(strat):
    transfer.let_go()  # no free segment kept from earlier tests: the next one freed is the one reused
    with _receiver() as recv:
        t = torch.full((LARGE,), 2.0)
        data = shmreduce.dumps(t)
        place = cache.place_of(t.untyped_storage())
        assert place is not None
        seg, gen = place.segment, place.gen & (1 << 64) - 1  # as its header holds it
        del place
        # loaded once and let go of: nothing in flight, nobody holds the generation
        assert recv(_load_sum, data) == ("ok", 2.0 * LARGE)
        del t

        def freed() -> bool:
            gc.collect()
            transfer.collect()
            return _native.hdr_read(seg.addr)[0] != gen

        assert wait_for(freed, 10), f"the owner never freed its segment: header {_native.hdr_read(seg.addr)}"
        t2 = torch.full((LARGE,), 5.0)
        data2 = shmreduce.dumps(t2)
        place = cache.place_of(t2.untyped_storage())
        assert place is not None and place.segment is seg and _native.hdr_read(seg.addr)[0] not in (0, gen), (
            "the owner did not reuse its free segment"
        )
        del place
        # the old bytes: stale, never the new message's data, in the receiver that
        # maps the segment and in a process that never saw it
        t0 = time.monotonic()
        _assert_sharing_error(recv(_load_sum, data), "generation")
        _assert_sharing_error(run_in_child(_load_sum_as_stranger, data), "generation")
        assert time.monotonic() - t0 < 10
        assert recv(_load_sum, data2) == ("ok", 5.0 * LARGE)
    _next_message_works()


def test_truncated_pickle(strat):
    data = shmreduce.dumps({"a": torch.ones(100), "b": torch.zeros(100), "c": list(range(50))})
    fds = len(open_fds())
    for cut in (1, len(data) // 3, len(data) // 2, len(data) - 1):
        with pytest.raises((pickle.UnpicklingError, EOFError, shmreduce.SharingError)):
            shmreduce.loads(data[:cut])
    gc.collect()
    transfer.collect()
    assert len(open_fds()) <= fds
    # the whole bytes still load: a truncated copy took nothing away
    assert float(shmreduce.loads(data)["a"].sum()) == 100.0

    # in another process, which never saw the segments: pickle's error, nothing
    # hangs, and the whole bytes load there after it
    def truncated_then_whole(b: bytes) -> tuple[str, float]:
        torch.set_num_threads(1)
        forget_mappings()
        try:
            shmreduce.loads(b[: len(b) - 2])
            error = "none"
        except Exception as exc:  # noqa: BLE001  reported
            error = type(exc).__name__
        return error, float(sum(t.sum() for t in shmreduce.loads(b)))

    data = shmreduce.dumps([torch.ones(100), torch.ones(100)])
    status, (error, total) = run_in_child(truncated_then_whole, data)
    assert status == "ok" and error in ("UnpicklingError", "EOFError"), (status, error)
    assert total == 200.0
    _next_message_works()


def test_broker_gone_is_sharing_error(registered_fd):
    """A handle whose broker was killed, in a process that does not map its segment
    yet: SharingError within seconds."""
    import signal

    from shmreduce.broker import client

    data = shmreduce.dumps(torch.ones(8))
    prog = program.current()
    c = client.client_for(prog.directory, prog.root_pid)
    pid = c.broker_pid
    os.kill(pid, signal.SIGKILL)
    # Gone means gone: its janitor removes the program directory.
    assert wait_for(lambda: not os.path.isdir(prog.directory), 10.0)
    t0 = time.monotonic()
    result = run_in_child(_load_sum_as_stranger, data)
    assert time.monotonic() - t0 < 10
    _assert_sharing_error(result)
    # A process that maps the segment needs no broker: its generation lives.
    assert float(shmreduce.loads(data).sum()) == 8.0
    _next_message_works()


def test_missing_file_is_gone_and_never_created():
    # torch's from_file would create a missing path full of zeros: segments.open_file must not
    # let it (a file released a moment ago is an error, never silent zeros).
    with shmreduce.registered(strategy="file_system"):
        shmreduce.loads(shmreduce.dumps(torch.ones(4)))  # the program directory exists
        directory = program.current().directory
        name = "seg-" + "ab" * 12
        with pytest.raises(shmreduce.SharingError, match="gone"):
            segments.open_file(directory, name)
        assert not os.path.exists(os.path.join(directory, name))


_CORRUPTIONS: dict[str, list[object]] = {
    "kind": [None, b"fd", 0, "evil"],
    "program": [None, b"/dev/shm", "", "\x00"],
    "segment": [None, b"seg-", 2.5, "seg-\x00", "", 1 << 70, -1],
    "gen": [None, -1, 1 << 64, "1", 2.5, 12345],
    "offset": [None, -1, 1 << 62, 2.5, 3],
    "nbytes": [None, -1, 0, 1 << 62, 2.5],
    "tag": [None, "0", 2.5, b"\x00"],
}


@pytest.mark.parametrize("field", sorted(_CORRUPTIONS))
def test_corrupted_handle_fields_are_sharing_errors(strat, field):
    # Each field of a real handle replaced by a value of the wrong type or range: a
    # SharingError every time (never TypeError, ValueError or a crash), and the
    # uncorrupted handle still loads afterwards.
    for value in _CORRUPTIONS[field]:
        ref = _shared_ref(torch.ones(4))
        result = run_in_child(_rebuild_sum, ref._replace(**{field: value}))
        assert _load_here(ref) == 4.0  # first: a failed check below leaves nothing in flight
        assert result[0] == "SharingError", (field, value, result)
    _next_message_works()


def test_handle_naming_a_folder_shmreduce_did_not_make_is_refused(strat):
    # A user's own folder that happens to be named like a program directory, under
    # the shm base: refused; no broker is started there and nothing in it is touched.
    folder = os.path.join(shm_base(), "shmreduce-0.1.0")
    os.mkdir(folder, 0o700)
    try:
        with open(os.path.join(folder, "notes.txt"), "w") as f:
            f.write("mine")
        ref = _shared_ref(torch.ones(4))
        result = run_in_child(_rebuild_sum, ref._replace(program=folder))
        assert _load_here(ref) == 4.0  # first: a failed check below leaves nothing in flight
        _assert_sharing_error(result, "not a shmreduce program directory")
        assert os.listdir(folder) == ["notes.txt"]
        _next_message_works()
    finally:
        import shutil

        shutil.rmtree(folder)


@pytest.mark.parametrize(
    "meta",
    [None, (), ("float32", (4,), (1,), 0, None), (torch.float32, (1 << 40,), (1,), 0, None), (torch.float32, (4,), (1,), -3, None)],
)
def test_corrupted_tensor_metadata_is_a_sharing_error(strat, meta):
    # A tensor's metadata that does not fit its storage (wrong types, beyond its end)
    # is refused like a corrupted handle, never a TypeError or ValueError.
    t = torch.ones(4)
    with transfer.sending():
        ref = transfer.share(t.untyped_storage())
    with pytest.raises(shmreduce.SharingError, match="forged or corrupted"):
        reductions.rebuild_tensor(ref, meta)
    assert torch.equal(reductions.rebuild_tensor(ref, (torch.float32, (4,), (1,), 0, None)), t)
