"""The threads of one process are actors too.

Each test pauses one thread exactly where another thread of the same process can act
(``_faults.pauses``, as ``SHMREDUCE_FAULT_AT`` stops a process at a step), lets the
other act, and checks that nothing it holds, and nothing in flight, lost its data:

- a reaper that snapshot the waiting segments, resumed after another thread ended,
  gave back and reused one of them, ends nothing of the new generation;
- a tensor made while pickling (kept only by the pickler's memo) keeps its generation
  until its ref is counted sent, even if the collector settles in between;
- a copy into shared memory reads its source where the source lies at that moment
  (never memory another thread's move freed);
- two threads loading the first storage of one generation make one Gen, one hold;
- a pool never posts to the broker while it holds its lock (a reconnection hook takes
  that lock under the broker client's);
- smaller windows of the same kind.

A pause that is never reached fails the test (the window's hook is missing): each
test proves the window is there and harmless, not that it was missed.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import shmreduce
from shmreduce import _faults, _native, pool, segments, transfer

from helpers import gone, let_go_now, run_in_child, wait_for

NUMEL = pool.ARENA_ITEM_MAX // 4 + 1024  # float32: a segment of its own, not a slab
PAUSE = 5.0  # the longest a paused thread waits for the other (never reached when all is well)


class _Window:
    """Pause the thread *who* at fault point *name* until ``go()``; ``reached`` is set
    once it stands there. Other threads pass through."""

    def __init__(self, name: str, who=None) -> None:
        self.name, self.who = name, who
        self.reached, self._go = threading.Event(), threading.Event()

    def __enter__(self) -> _Window:
        _faults.pauses[self.name] = self._hook
        return self

    def __exit__(self, *_: object) -> None:
        self._go.set()
        _faults.pauses.pop(self.name, None)

    def _hook(self) -> None:
        if self.reached.is_set() or (self.who is not None and threading.current_thread() is not self.who()):
            return
        self.reached.set()
        self._go.wait(PAUSE)

    def go(self) -> None:
        self._go.set()


@pytest.fixture
def quiet_collector():
    """The collector thread out of the way: the test's threads are the only actors."""
    with transfer.collect_every(3600.0):
        yield


def _seg_of(t: torch.Tensor) -> segments.Segment:
    s = t.untyped_storage()
    seg = segments.segment_at(s.data_ptr(), s.nbytes())
    assert seg is not None
    return seg


# -- 1. a stale reaper ----------------------------------------------------------------


def _load_and_sum(blob: bytes) -> float:
    return float(shmreduce.loads(blob).sum())


@pytest.mark.swap_path
def test_a_stale_reaper_ends_nothing_of_the_next_generation(strategy, quiet_collector):
    p = transfer._current_pool()
    t = torch.full((NUMEL,), 1.0)
    blob = shmreduce.dumps(t)
    seg, first = _seg_of(t), _seg_of(t).gen
    del t
    gc.collect()
    transfer._settle(wait=True)
    assert seg.key in p.waiting, "its ref is in flight: the segment waits"
    got = shmreduce.loads(blob)  # loaded here: sent == loaded, and let go of
    assert float(got[0]) == 1.0
    del got
    gc.collect()
    transfer._settle(wait=True)

    reaper: threading.Thread | None = None
    with _Window("reap.end", who=lambda: reaper) as window:
        reaper = threading.Thread(target=p.reap_waiting)
        reaper.start()
        assert window.reached.wait(PAUSE), "Pool.reap_waiting has no reap.end point"
        p.reap_waiting()  # this thread ends the generation and gives the segment back
        t2 = torch.full((NUMEL,), 2.0)
        transfer.share_in_place(t2.untyped_storage())
        assert _seg_of(t2) is seg, "the free segment was not reused"
        second = seg.gen
        assert second != first
        window.go()
        reaper.join(PAUSE)
    assert _native.hdr_read(seg.addr)[0] == second, "the stale reaper ended the live generation"
    blob2 = shmreduce.dumps(t2)
    assert run_in_child(_load_and_sum, blob2) == ("ok", 2.0 * NUMEL)
    del t2, blob2
    let_go_now()


# -- 2. a ref counted sent after its generation was freed --------------------------------


def _same(x):
    return x


class _MadeWhilePickling:
    """A tensor made by ``__reduce__``: alive only in the pickler's memo."""

    def __reduce__(self):
        return (_same, (torch.full((NUMEL,), 7.0),))


_settled: list[bool] = []


def _settle_everything() -> None:
    """What the collector does, in the window: what died is let go of, waiting segments reaped."""
    _settled.append(True)
    gc.collect()
    transfer.collect()


@pytest.mark.swap_path
def test_a_tensor_made_while_pickling_keeps_its_generation_until_counted(strategy, quiet_collector):
    _settled.clear()
    _faults.pauses["send.counted"] = _settle_everything
    try:
        blob = shmreduce.dumps(_MadeWhilePickling())
    finally:
        _faults.pauses.pop("send.counted", None)
    assert _settled, "sending.__exit__ has no send.counted point"
    got = shmreduce.loads(blob)
    assert float(got.sum()) == 7.0 * NUMEL
    del got, blob
    let_go_now()


def _pickle_made_with_the_pool_off() -> float:
    pool.POOL_BYTES = 0  # a segment given back is closed at once: unmapped
    _faults.pauses["send.counted"] = _settle_everything
    blob = shmreduce.dumps(_MadeWhilePickling())
    _faults.pauses.clear()
    return float(shmreduce.loads(blob).sum())


def test_a_tensor_made_while_pickling_with_the_pool_off_never_crashes(strategy, quiet_collector):
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()

    def target():
        b.send(_pickle_made_with_the_pool_off())

    proc = ctx.Process(target=target)
    proc.start()
    try:
        proc.join(20)
        assert proc.exitcode == 0, f"the sender died (exit code {proc.exitcode}; -11 is SIGSEGV)"
        assert a.recv() == 7.0 * NUMEL
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        a.close()
        b.close()


# -- 3. a copy from memory another thread's move freed ----------------------------------

_COPY_RACE = textwrap.dedent(
    """
    import ctypes, mmap, sys, threading, torch, shmreduce
    from shmreduce import transfer
    shmreduce.register(strategy=sys.argv[1])
    NBYTES = 65536  # the largest a slab takes: reduce() moves it
    storage = torch.full((NBYTES // 4,), 5.0).untyped_storage()
    old = storage.data_ptr()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.PAGESIZE
    fence = ((old + NBYTES) // page - 8) * page  # 8 pages at the end of the old memory, its own
    at_put, moved = threading.Event(), threading.Event()
    fenced = []

    def pause(frame, event, arg):
        # The Python move path is about to call into C for its copy: another thread moves
        # the storage now; the memory it lay in is freed (fenced here: a read of it faults).
        if event == "c_call" and getattr(arg, "__name__", "") == "put" and frame.f_code.co_name == "place" and not at_put.is_set():
            at_put.set()
            moved.wait(5)

    def mover():
        sys.setprofile(pause)
        transfer.share_in_place(storage)
        sys.setprofile(None)

    def sender():
        shmreduce.dumps(torch.ones(4))  # this thread's slab, indexed: reduce() moves into it
        assert at_put.wait(5), "the mover never reached its copy"
        blob = shmreduce.dumps(torch.tensor([], dtype=torch.float32).set_(storage))
        assert storage.data_ptr() != old, "reduce() did not move it"
        if libc.mprotect(fence, 8 * page, 0) == 0:
            fenced.append(fence)
        moved.set()
        assert float(shmreduce.loads(blob).sum()) == 5.0 * (NBYTES // 4)

    threads = [threading.Thread(target=mover), threading.Thread(target=sender)]
    for t in threads: t.start()
    for t in threads: t.join(10)
    for f in fenced: libc.mprotect(f, 8 * page, 3)
    assert fenced, "the freed memory could not be fenced"
    assert float(torch.tensor([], dtype=torch.float32).set_(storage).sum()) == 5.0 * (NBYTES // 4)
    print("ok")
    """
)


@pytest.mark.swap_path
def test_a_copy_reads_its_source_where_it_lies_now(strategy):
    # A child of its own: a fault there is a failure here, and the fence stays its own.
    run = subprocess.run([sys.executable, "-c", _COPY_RACE, strategy], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (
        f"exit code {run.returncode} (-11: SIGSEGV, a copy from freed memory)\n{run.stderr[-3000:]}"
    )


# -- 5. two threads load the first storage of one generation ------------------------------


def _send_twice(conn) -> None:
    t = torch.full((NUMEL,), 3.0)
    conn.send_bytes(shmreduce.dumps(t))
    conn.send_bytes(shmreduce.dumps(t))
    conn.recv()  # keep it until told


def _retired_after_fork() -> bool:
    return True


@pytest.mark.swap_path
def test_two_threads_loading_one_generation_make_one_gen(strategy, quiet_collector):
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    sender = ctx.Process(target=_send_twice, args=(there,))
    sender.start()
    try:
        blobs = [here.recv_bytes(), here.recv_bytes()]
        got: dict[str, torch.Tensor] = {}
        first: threading.Thread | None = None
        with _Window("load.gen", who=lambda: first) as window:
            first = threading.Thread(target=lambda: got.__setitem__("a", shmreduce.loads(blobs[0])))
            second = threading.Thread(target=lambda: got.__setitem__("b", shmreduce.loads(blobs[1])))
            first.start()
            assert window.reached.wait(PAUSE), "receive_tensor has no load.gen point"
            second.start()
            second.join(PAUSE)
            window.go()
            first.join(PAUSE)
        a, b = got["a"], got["b"]
        assert float(a.sum()) == float(b.sum()) == 3.0 * NUMEL
        assert a.untyped_storage()._cdata == b.untyped_storage()._cdata, "one storage, loaded twice, is two here"
        seg = _seg_of(b)
        assert _native.hdr_read(seg.addr)[3] == 1, "one process, two holds"
        # The process keeps one of them and forks: the generation it keeps is retired
        # (the child's copy is never overwritten), whichever thread loaded it.
        del a
        gc.collect()
        transfer._settle(wait=True)
        assert run_in_child(_retired_after_fork) == ("ok", True)
        assert _native.hdr_flags(seg.addr) & _native.RETIRED, "a fork left a kept generation reusable"
        del b
        got.clear()
    finally:
        here.send(None)
        sender.join(20)
        if sender.is_alive():
            sender.kill()
            sender.join()
        here.close()
        there.close()
    assert sender.exitcode == 0
    let_go_now()


# -- 11. the pool never posts under its lock ----------------------------------------------


def _trim_while_reconnecting() -> bool:
    shmreduce.register(strategy="file_system")
    p = transfer._fs_pool
    t = torch.full((NUMEL,), 1.0)
    transfer.share_in_place(t.untyped_storage())
    first = shmreduce.dumps(torch.ones(4))  # connected once: the next connection is a reconnection
    assert float(shmreduce.loads(first).sum()) == 4.0  # loaded: nothing left in flight
    del t
    let_go_now()
    assert p.free_bytes, "no free segment to trim"
    trimmer: threading.Thread | None = None
    with _Window("pool.closing", who=lambda: trimmer) as window:
        trimmer = threading.Thread(target=p.trim, kwargs={"idle": -1.0})
        trimmer.start()
        assert window.reached.wait(PAUSE), "Pool._trim_locked has no pool.closing point"
        pid = broker_pids_of_this_program()
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: gone(pid), 10)
        blob = shmreduce.dumps(torch.full((8,), 4.0))  # reconnects: the hook takes the pool's lock
        window.go()
        trimmer.join(PAUSE)
    return float(shmreduce.loads(blob).sum()) == 32.0


def broker_pids_of_this_program() -> int:
    from shmreduce import program
    from shmreduce.broker import client as broker

    return broker.client_for(program.current().directory).broker_pid


@pytest.mark.swap_path
def test_a_pool_trims_while_its_broker_is_replaced():
    status, value = run_in_child(_trim_while_reconnecting, timeout=30)
    assert (status, value) == ("ok", True)


# -- 4. the small items ----------------------------------------------------------------------


@pytest.mark.parametrize("args", [(), (("fd", "", 1, 2, 0),), (("fd", "", 1, 2, 0), b"", None)])
def test_load_with_the_wrong_number_of_arguments_is_a_sharing_error(args):
    with pytest.raises(shmreduce.SharingError):
        _native.load(*args)


@pytest.mark.parametrize("args", [(), ((),), ((), (), None, None)])
def test_rebuild_with_the_wrong_number_of_arguments_is_a_sharing_error(args):
    with pytest.raises(shmreduce.SharingError):
        _native.rebuild(*args)


def test_a_gen_never_starts_inside_its_header():
    buf = bytearray(2 * _native.HEADER_BYTES)
    addr = (torch.frombuffer(buf, dtype=torch.uint8)).data_ptr()
    for low in (8, 64, _native.HEADER_BYTES - 8):
        with pytest.raises(ValueError):
            _native.Gen(None, addr, len(buf), 1, low)
    gen = _native.Gen(None, addr, len(buf), 1, _native.HEADER_BYTES)
    gen.info = (None, -1)  # nobody's to settle
    gen.release()


_FOREIGN_SIGBUS = textwrap.dedent(
    """
    import ctypes, faulthandler, mmap, os, tempfile
    from shmreduce import _native
    faulthandler.enable()
    _native.guard_faults()
    fd, path = tempfile.mkstemp()
    os.ftruncate(fd, mmap.PAGESIZE)
    m = mmap.mmap(fd, mmap.PAGESIZE)
    os.ftruncate(fd, 0)
    os.unlink(path)
    ctypes.string_at(ctypes.addressof(ctypes.c_char.from_buffer(m)), 1)  # SIGBUS: not the broker's
    """
)


def test_a_sigbus_the_guard_does_not_own_reaches_the_handler_it_replaced():
    # Under `make asan` AddressSanitizer would take the SIGBUS itself (and abort): left to
    # the handlers this test is about.
    asan = ":".join(filter(None, [os.environ.get("ASAN_OPTIONS", ""), "handle_sigbus=0"]))
    env = dict(os.environ, ASAN_OPTIONS=asan)
    run = subprocess.run([sys.executable, "-c", _FOREIGN_SIGBUS], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == -signal.SIGBUS
    assert "Bus error" in run.stderr, f"faulthandler never saw the fault:\n{run.stderr[-2000:]}"
