"""The broker's keeper alone: real memfds and files, their headers written as the
header functions read them, no broker process and no socket. Time is handed in, so
every rule that waits (ORPHAN_TTL, the looks at held segments) is checked without
waiting."""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Iterator

import pytest

from shmreduce import _native
from shmreduce.broker import protocol as P
from shmreduce.broker.keeper import (
    FORWARDABLE,
    HELD,
    ORPHAN_TTL,
    ORPHANED,
    SENT,
    Account,
    Keeper,
    close_ledger,
)

NAME = "shmreduce-keeper-test"  # the leak check of conftest looks for "memfd:shmreduce"
WORDS = struct.Struct("=QQQQ")  # a header's first words: generation, sent, loaded, holders
LATER = 10 * ORPHAN_TTL  # seconds: longer than anything the keeper times


def _write_header(fd: int, gen: int, sent: int = 0, loaded: int = 0, holders: int = 0) -> None:
    os.pwrite(fd, WORDS.pack(gen, sent, loaded, holders), 0)


def _holders(fd: int) -> int:
    return WORDS.unpack(os.pread(fd, WORDS.size, 0))[3]


def _open_here() -> set[str]:
    """This process's descriptors on the test's memfds."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if NAME in os.readlink(f"/proc/self/fd/{fd}"):
                found.add(fd)
        except OSError:
            pass
    return found


@pytest.fixture
def memfd() -> Iterator[Callable[..., tuple[int, int, int]]]:
    """Makes a pooled memfd with a header, to be handed to the keeper: (its
    descriptor, one kept here to read its header, its identity). Checks at the end
    that none is left open (after the keeper's ``close_all``)."""
    mine: list[int] = []

    def make(gen: int = 1, sent: int = 0, loaded: int = 0, holders: int = 0) -> tuple[int, int, int]:
        fd = os.memfd_create(NAME, os.MFD_CLOEXEC)
        os.ftruncate(fd, max(_native.HEADER_BYTES, 4096))
        _write_header(fd, gen, sent, loaded, holders)
        mine.append(os.dup(fd))
        return fd, mine[-1], P.identity(os.fstat(fd))

    yield make
    for fd in mine:
        os.close(fd)
    assert not _open_here(), "the keeper left a descriptor of a memfd open"


@pytest.fixture
def keeper(tmp_path, memfd) -> Iterator[Keeper]:
    keeper = Keeper(str(tmp_path))
    yield keeper
    keeper.close_all()


def _ledger(*entries: tuple[int | str, int, int]) -> int:
    """A ledger memfd holding *entries* (segment, generation, state)."""
    fd = os.memfd_create(NAME + "-ledger", os.MFD_CLOEXEC)
    os.write(fd, b"".join(P.LEDGER_ENTRY.pack(*P.ledger_entry(key, gen, state)) for key, gen, state in entries))
    return fd


def test_a_memfd_its_depositor_lets_go_of_is_closed_once_every_ref_sent_in_it_was_loaded(keeper, memfd):
    fd, mine, ino = memfd(sent=2, loaded=2)
    maker = Account()
    keeper.deposit(maker, fd, header="lead")
    seg = keeper.memfds[ino]
    assert seg.users == 1 and maker.segs == {ino} and seg.senders == {maker}
    keeper.drop(maker, [ino])
    assert ino not in keeper.memfds and seg.fd == -1 and not keeper.draining
    assert maker.holds_nothing()


def test_refs_not_all_loaded_keep_their_memfd_while_a_sender_lives_however_long(keeper, memfd):
    fd, mine, ino = memfd(sent=2, loaded=1)
    maker = Account()
    keeper.deposit(maker, fd, header="lead")
    keeper.drop(maker, [ino])
    seg = keeper.memfds[ino]
    assert seg in keeper.draining and keeper.reach(seg) == SENT
    keeper.drain(time.monotonic() + LATER)
    assert ino in keeper.memfds, "a timer let go of refs whose sender lives"
    _write_header(mine, 1, sent=2, loaded=2)  # the last ref loaded
    keeper.drain(time.monotonic() + 2 * LATER)
    assert ino not in keeper.memfds and not keeper.draining


def test_refs_of_a_dead_sender_keep_their_memfd_orphan_ttl_then_it_goes(keeper, memfd):
    fd, mine, ino = memfd(sent=1, loaded=0)
    maker = Account()
    keeper.deposit(maker, fd, header="lead")
    keeper.forget(maker)  # it died
    seg = keeper.memfds[ino]
    assert keeper.reach(seg) == ORPHANED and seg.until > 0 and not maker.sent
    keeper.drain(seg.until - 1.0)
    assert ino in keeper.memfds
    keeper.drain(seg.until)
    assert ino not in keeper.memfds


def _trailed(memfd, sent: int, loaded: int, pages: int = 3) -> tuple[int, int, int]:
    """A memfd as a storage torch moved for shmreduce leaves it: its header on the page
    past the storage's last (segments.trail), the size its end."""
    fd, mine, ino = memfd(gen=0)
    at = pages * 4096
    os.ftruncate(mine, at + _native.HEADER_BYTES)
    os.pwrite(mine, WORDS.pack(0, sent, loaded, 0), at)
    return fd, mine, ino


@pytest.mark.parametrize("sender", ["lives", "died"])
def test_a_storage_torch_moved_keeps_its_memfd_while_refs_counted_past_it_wait(keeper, memfd, sender):
    """Its header trails it: once its depositor let go of it (its storage died there),
    its refs in flight keep it as a pooled segment's do, while their sender lives
    however long, ORPHAN_TTL after its death; the last one loaded, it goes."""
    fd, mine, ino = _trailed(memfd, sent=2, loaded=1)
    maker = Account()
    keeper.deposit(maker, fd, header="trail")
    seg = keeper.memfds[ino]
    assert seg.header and seg.at == 3 * 4096
    if sender == "lives":
        keeper.drop(maker, [ino])
        assert keeper.reach(seg) == SENT
        keeper.drain(time.monotonic() + LATER)
        assert ino in keeper.memfds, "a timer let go of refs whose sender lives"
        os.pwrite(mine, WORDS.pack(0, 2, 2, 0), seg.at)  # the last ref loaded
        keeper.drain(time.monotonic() + 2 * LATER)
    else:
        keeper.forget(maker)
        assert keeper.reach(seg) == ORPHANED and seg.until > 0
        keeper.drain(seg.until - 1.0)
        assert ino in keeper.memfds
        keeper.drain(seg.until)
    assert ino not in keeper.memfds and not keeper.draining


def test_a_trailing_header_that_does_not_end_its_memfd_on_a_page_counts_as_none(keeper, memfd):
    fd, mine, ino = memfd(gen=0)
    os.ftruncate(mine, 4096 + 100)
    maker = Account()
    keeper.deposit(maker, fd, header="trail")
    assert not keeper.memfds[ino].header


@pytest.mark.parametrize("how", ["let go of", "its depositor died"])
def test_a_storage_torch_shared_stays_orphan_ttl_once_its_depositor_lets_go(keeper, memfd, how):
    """No header counts the refs in flight of a memfd torch shared: a receiver may
    still load what was sent in it, whether its depositor let go of it (its storage
    died there) or died."""
    fd, mine, ino = memfd()
    maker = Account()
    keeper.deposit(maker, fd, header="")
    if how == "let go of":
        keeper.drop(maker, [ino])
    else:
        keeper.forget(maker)
    seg = keeper.memfds[ino]
    assert seg in keeper.draining and seg.until > 0
    keeper.drain(seg.until - 1.0)
    assert ino in keeper.memfds
    keeper.drain(seg.until)
    assert ino not in keeper.memfds


@pytest.mark.parametrize("maker", ["gone", "let go of it"])
def test_a_storage_torch_shared_that_a_process_forwards_stays_orphan_ttl_from_the_forward_not_its_life(keeper, memfd, maker):
    """A relay that received such a memfd and sends it on is no user of it (nothing
    there will let go of it): kept ORPHAN_TTL from the forward, as from a let-go,
    whether its maker is gone (its record forgotten) or let go of it a moment ago."""
    fd, mine, ino = memfd()
    relay = Account()
    if maker == "let go of it":
        depositor = Account()
        keeper.deposit(depositor, fd, header="")
        keeper.drop(depositor, [ino])
        fd = os.dup(mine)
    keeper.deposit(relay, fd, header="", forward=True)
    seg = keeper.memfds[ino]
    assert seg.users == 0 and seg in keeper.draining and seg.until > 0 and relay in seg.senders
    keeper.drain(seg.until - 1.0)
    assert ino in keeper.memfds, "refs the relay sent may be in flight"
    keeper.drain(seg.until)
    assert ino not in keeper.memfds, "kept for the relay's life"


def test_a_held_generation_keeps_its_memfd_until_its_dead_holders_ledger_counts_it_out(keeper, memfd):
    fd, mine, ino = memfd(gen=7, sent=1, loaded=1, holders=1)
    maker, holder = Account(), Account()
    keeper.deposit(maker, fd, header="lead")
    keeper.forget(maker)
    seg = keeper.memfds[ino]
    assert keeper.reach(seg) == HELD
    keeper.drain(time.monotonic() + LATER)
    assert ino in keeper.memfds, "a held generation's memfd let go of"
    holder.ledger = _ledger((ino, 7, P.HELD))
    keeper.count_out(holder)  # it died holding generation 7
    assert _holders(mine) == 0 and holder.ledger == -1
    keeper.drain(time.monotonic() + 2 * LATER)
    assert ino not in keeper.memfds


def test_a_dead_holders_entry_waits_for_its_memfd_and_is_counted_out_when_it_comes(keeper, memfd):
    fd, mine, ino = memfd(gen=3, holders=1)
    holder = Account()
    holder.ledger = _ledger((ino, 3, P.HELD))
    keeper.count_out(holder)  # the broker knows no descriptor of it yet
    assert keeper.unreached == {ino: [(3, P.HELD)]} and _holders(mine) == 1
    maker = Account()
    keeper.deposit(maker, fd, header="lead")  # its owner, back after a broker restart
    assert not keeper.unreached and _holders(mine) == 0
    keeper.forget(maker)
    assert ino not in keeper.memfds


def test_only_the_newest_forwardable_memfds_only_held_keep_their_descriptors(keeper, memfd):
    maker = Account()
    inos = []
    for _ in range(FORWARDABLE + 1):
        fd, mine, ino = memfd(holders=1)  # every ref loaded, a receiver holds it
        keeper.deposit(maker, fd, header="lead")
        keeper.drop(maker, [ino])
        inos.append(ino)
    assert all(ino in keeper.memfds for ino in inos), "a held memfd's record let go of"
    assert keeper.memfds[inos[0]].fd == -1, "the oldest one's descriptor is kept past FORWARDABLE"
    assert all(keeper.memfds[ino].fd >= 0 for ino in inos[1:])
    assert list(keeper.forwardable) == inos[1:]


def test_a_forwarded_memfd_is_kept_for_what_reaches_it_not_for_its_forwarder(keeper, memfd):
    fd, mine, ino = memfd(sent=1, loaded=0)
    relay = Account()
    keeper.deposit(relay, fd, header="lead", forward=True)
    seg = keeper.memfds[ino]
    assert seg.users == 0 and seg.forwarded and not relay.segs and seg.senders == {relay}
    assert keeper.reach(seg) == SENT
    keeper.forget(relay)
    _write_header(mine, 1, sent=1, loaded=1)
    keeper.drain(time.monotonic() + LATER)
    assert ino not in keeper.memfds


def test_a_held_file_is_read_through_room_and_unlinked_once_nothing_reaches_it(tmp_path):
    opened = []

    def room(make):
        opened.append(make)
        return make()

    name = P.SEG_PREFIX + "0123456789abcdef01234567"
    path = tmp_path / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, max(_native.HEADER_BYTES, 4096))
        _write_header(fd, 1, sent=1, loaded=0)
    finally:
        os.close(fd)
    keeper = Keeper(str(tmp_path), room=room)
    try:
        maker = Account()
        keeper.hold(maker, [name, "not-a-segment"])
        assert list(keeper.files) == [name] and maker.holds == {name}
        keeper.release(maker, [name])
        assert opened, "the header's file was opened without the server's room"
        keeper.drain(time.monotonic() + LATER)
        assert path.exists() and name in keeper.files, "a file let go of while a ref sent in it waits"
        fd = os.open(path, os.O_RDWR)
        try:
            _write_header(fd, 1, sent=1, loaded=1)
        finally:
            os.close(fd)
        keeper.drain(time.monotonic() + 2 * LATER)
        assert not path.exists() and not keeper.files
    finally:
        keeper.close_all()


def test_close_all_lets_go_of_every_descriptor_and_the_ledgers_close_on_their_own(keeper, memfd):
    maker = Account()
    for _ in range(3):
        fd, mine, ino = memfd(holders=1)
        keeper.deposit(maker, fd, header="lead")
    maker.ledger = _ledger()
    keeper.close_all()
    assert not keeper.memfds
    close_ledger(maker)
    assert maker.ledger == -1
