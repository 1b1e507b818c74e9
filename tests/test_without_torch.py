"""What shmreduce does with no torch in sight: importing it, its broker, and the C
extension's checks that form no tensor (headers, handles, generations).

Nothing here imports torch, so ``make pythons`` runs this module (with
test_protocol.py, test_cli.py and test_package.py) in a venv of each declared
Python that has no torch installed; ``make test`` runs it beside the rest.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import struct
import subprocess
import sys
from typing import Any

import pytest

from shmreduce import _native
from shmreduce.broker import client as broker_client
from shmreduce.broker import protocol as P

from helpers import broker_pids, run_in_child, shm_base, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = 1 << 16
LOW = _native.HEADER_BYTES  # a pooled generation's storages start past its header


def test_importing_shmreduce_imports_nothing_heavy():
    # What the broker process and `shmreduce doctor` import, in a fresh interpreter.
    code = (
        "import sys, shmreduce, shmreduce._native, shmreduce._platform, shmreduce.errors, shmreduce.program, "
        "shmreduce.doctor, shmreduce.broker.client, shmreduce.broker.server; "
        "heavy = sorted({'torch', 'numpy', 'cloudpickle'} & set(sys.modules)); assert not heavy, heavy"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert out.returncode == 0, out.stderr


def test_a_broker_keeps_a_memfd_and_hands_it_back(monkeypatch):
    # A sender deposits a memfd, a second client fetches it by inode (a descriptor of
    # the same file), the sender drops it and the broker lets go of it: one without a
    # header (a storage torch shared) SHMREDUCE_ORPHAN_TTL later, for refs in flight.
    monkeypatch.setenv("SHMREDUCE_ORPHAN_TTL", "0.5")  # the broker started below reads it
    directory = os.path.join(shm_base(), f"{P.DIR_PREFIX}{secrets.token_hex(8)}")
    sender = broker_client.BrokerClient(directory, os.getpid())
    receiver = broker_client.BrokerClient(directory, None)
    fd = os.memfd_create("shmreduce-test-without-torch", os.MFD_CLOEXEC)
    got = None
    try:
        os.write(fd, b"no torch here")
        ino = P.identity(os.fstat(fd))
        sender.segment(fd, header="")
        assert sender.ping()["pid"] == sender.broker_pid  # a barrier: the segment is in
        got = receiver.fetch(ino)
        assert got is not None and P.identity(os.fstat(got)) == ino
        assert os.pread(got, 13, 0) == b"no torch here"
        sender.drop([ino])
        assert sender.ping()["draining"] == 1
        assert wait_for(lambda: sender.ping()["segments"] == 0, 10)
        assert receiver.fetch(ino) is None
    finally:
        for d in (fd, got):
            if d is not None:
                os.close(d)
        sender.close()
        receiver.close()
    assert wait_for(lambda: not os.path.exists(directory), 10)  # it exits once unused
    assert wait_for(lambda: not broker_pids(), 10)


@pytest.fixture
def header() -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, _native.HEADER_BYTES)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def _count_sent(addr: int, refs: int = 1, sent: bool = True) -> None:
    """What a sending scope does for *refs* refs it pickled from the generation at
    *addr*: each held (a Gen of its own here) until counted sent, or not (*sent*)."""
    gen = _native.Gen(None, addr, _native.HEADER_BYTES, 1, _native.HEADER_BYTES)
    gen.info = (None, -1)  # nobody's to settle
    for _ in range(refs):
        gen.acquire()
    _native.count_sent([gen] * refs, sent)
    gen.release()  # its maker's hold


def test_header_counts_holds_and_frees_one_generation(header) -> None:
    m, addr = header
    struct.pack_into("Q", m, 0, 5)  # generation 5
    first, second = _native.hdr_issue(addr), _native.hdr_issue(addr)
    assert (first, second) == (0, 1)
    _count_sent(addr, 2)
    _native.hdr_loaded(addr, first)
    assert _native.hdr_read(addr) == (5, 2, 1, 0)
    assert _native.hdr_hold(addr, 5) and _native.hdr_read(addr)[3] == 1
    assert not _native.hdr_hold(addr, 6) and _native.hdr_read(addr)[3] == 1  # another generation: nothing held
    assert _native.hdr_end(addr, 5) == _native.END_WAIT  # held
    assert _native.hdr_unhold(addr, 5) and not _native.hdr_unhold(addr, 5)
    assert _native.hdr_end(addr, 5) == _native.END_WAIT  # a ref sent is not loaded yet
    _native.hdr_loaded(addr, second)
    assert _native.hdr_end(addr, 5) == _native.END_FREED and _native.hdr_read(addr) == (0, 0, 0, 0)
    assert _native.hdr_end(addr, 5) == _native.END_STALE  # ended: a second caller does nothing
    assert not _native.hdr_hold(addr, 5)  # a stale ref finds the generation over
    struct.pack_into("Q", m, 0, 6)
    assert _native.hdr_issue(addr) == 0  # the tickets start again with the generation, their bits cleared
    _count_sent(addr)
    _native.hdr_loaded(addr, 0)
    assert _native.hdr_read(addr)[1:3] == (1, 1)


def test_a_repeated_load_counts_nothing(header) -> None:
    """Bytes loaded again (one dumps() blob, loaded twice) never let the generation
    end while another message in it waits for its first load."""
    m, addr = header
    struct.pack_into("Q", m, 0, 5)
    blob, queued = _native.hdr_issue(addr), _native.hdr_issue(addr)
    _count_sent(addr, 2)
    for _ in range(20):
        _native.hdr_loaded(addr, blob)
    assert _native.hdr_read(addr)[1:3] == (2, 1)
    assert _native.hdr_end(addr, 5) == _native.END_WAIT, "the queued message's generation ended under it"
    _native.hdr_loaded(addr, 99)  # a ticket never issued (forged) counts nothing
    _native.hdr_loaded(addr, 1 << 70)
    assert _native.hdr_read(addr)[1:3] == (2, 1)
    _native.hdr_loaded(addr, queued)
    assert _native.hdr_end(addr, 5) == _native.END_FREED


def test_a_retired_generation_is_never_freed(header) -> None:
    m, addr = header
    struct.pack_into("Q", m, 0, 5)
    assert not _native.hdr_retire(addr, 4)  # another generation: nothing done
    assert _native.hdr_flags(addr) == 0
    assert _native.hdr_retire(addr, 5)
    assert _native.hdr_flags(addr) == _native.RETIRED
    assert _native.hdr_end(addr, 5) == _native.END_RETIRED  # its close, claimed once
    assert _native.hdr_end(addr, 5) == _native.END_STALE
    assert _native.hdr_read(addr)[0] == 5  # still its generation: receivers holding it keep reading it


def test_tickets_past_the_bitmap_retire_the_generation(header) -> None:
    m, addr = header
    struct.pack_into("Q", m, 0, 5)
    struct.pack_into("Q", m, 32, _native.TICKETS - 1)  # tickets issued so far
    assert _native.hdr_issue(addr) == _native.TICKETS - 1 and _native.hdr_flags(addr) == 0
    assert _native.hdr_issue(addr) == _native.TICKETS
    assert _native.hdr_flags(addr) == _native.RETIRED | _native.UNCOUNTED
    _count_sent(addr)
    _native.hdr_loaded(addr, _native.TICKETS)
    assert _native.hdr_read(addr)[1:3] == (1, 1) and _native.hdr_end(addr, 5) == _native.END_RETIRED


def test_header_refuses_bad_addresses_and_arguments(header) -> None:
    _m, addr = header
    with pytest.raises(ValueError, match="unaligned"):
        _native.hdr_read(addr + 4)
    with pytest.raises(ValueError, match="null"):
        _native.hdr_read(0)
    with pytest.raises(TypeError, match="not a held Gen"):
        _native.count_sent([addr], True)
    with pytest.raises(TypeError):
        _native.hdr_hold(addr)  # type: ignore[call-arg]
    with pytest.raises(OverflowError):
        _native.hdr_hold(addr, (1 << 64) + 5)  # a header holds 64 bits: never compared by its low ones
    assert _native.hdr_read(addr)[3] == 0


def _gen(addr: int) -> _native.Gen:
    return _gen_of(addr, SIZE, 7, LOW)


def _gen_of(addr: int, size: int, number: int = 0, low: int = 0) -> _native.Gen:
    gen = _native.Gen(object(), addr, size, number, low)
    gen.info = (None, -1)  # a test's Gen, as pool's are (ledger entry, owner pid): transfer.settle_dead skips it
    return gen


def test_handles_are_checked_before_any_tensor_is_formed() -> None:
    # Before init() handles raise RuntimeError; after it (torch's importer bound) the
    # SharingError subclass of it: either way, never a pointer out of the segment.
    m = mmap.mmap(-1, SIZE)
    gen = _gen(ctypes.addressof(ctypes.c_char.from_buffer(m)))
    try:
        for offset, nbytes in [(0, 64), (LOW - 1, 64), (LOW, 0), (LOW, -1), (SIZE - 64, 128), (SIZE, 1), (1 << 62, 1 << 62)]:
            with pytest.raises(RuntimeError, match="out of bounds"):
                gen.storage(offset, nbytes)
        with pytest.raises(RuntimeError, match="out of range"):
            gen.storage(1 << 70, 64)
        malformed: list[tuple[Any, Any]] = [("64", 64), (64, 64.0), (None, 1), (True, 64)]
        for offset, nbytes in malformed:
            with pytest.raises(RuntimeError, match="must be ints"):
                gen.storage(offset, nbytes)
        with pytest.raises(TypeError):
            gen.storage(64)  # type: ignore[call-arg]
    finally:
        gen.release()
    for size, low in [(0, 0), (SIZE, -1), (SIZE, SIZE + 1), (SIZE, 64), (SIZE, LOW - 8)]:
        with pytest.raises(ValueError, match="segment from byte"):
            _native.Gen(object(), 4096, size, 7, low)
    small = _gen_of(4096, 4)  # not pooled (a storage torch shared): as small as its storage
    small.release()
    with pytest.raises(ValueError, match="null"):
        _native.Gen(object(), 0, SIZE, 7, LOW)


def _generation_lifetime() -> str:
    # In a fork child: no collector thread there takes what dead() reports.
    m = mmap.mmap(-1, SIZE)
    gen = _gen(ctypes.addressof(ctypes.c_char.from_buffer(m)))
    assert gen.live == 1 and not gen.ended  # its maker's hold
    assert gen.acquire() and gen.live == 2
    gen.release()
    gen.release()
    assert gen.live == 0 and _native.pending()
    assert gen in _native.dead() and gen.ended  # with whatever else died here (an earlier test's)
    assert gen not in _native.dead()  # reported once
    assert not gen.acquire()  # over: no hold, no storage
    with pytest.raises(RuntimeError, match="is over"):
        gen.storage(LOW, 64)
    with pytest.raises(RuntimeError, match="nobody holds"):
        gen.release()
    return "ok"


def test_a_generation_is_reported_dead_once_its_holds_are_released() -> None:
    result = run_in_child(_generation_lifetime)
    assert result == ("ok", "ok"), result


def test_a_freeing_bit_left_set_stalls_no_other_thread(header) -> None:
    """An owner killed between its check's compare-and-swap and its store leaves
    FREEING set for good: a load waits for it without the GIL, a bounded time, then
    refuses the ref as stale (never spinning with the GIL held)."""
    import threading
    import time

    m, addr = header
    struct.pack_into("Q", m, 0, 5)
    struct.pack_into("Q", m, 24, 1 << 63)  # holders: FREEING, by an owner now dead
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(_native.hdr_hold(addr, 5)))
    started = time.monotonic()
    thread.start()
    ticks = 0
    while thread.is_alive() and time.monotonic() - started < 10:
        ticks += 1  # this thread runs while the other waits
        time.sleep(0.001)
    thread.join(10)
    took = time.monotonic() - started
    assert result == [False], "a hold taken under a FREEING bit"
    assert took < 5, f"waited {took:.1f} s"
    assert ticks >= 100, f"the waiting thread held the GIL ({ticks} ticks of 1 ms in {took:.2f} s)"
    assert _native.hdr_read(addr)[3] == 1 << 63  # nothing changed
