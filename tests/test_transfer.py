"""Refs and their counts (shmreduce/transfer.py), unit by unit and in-process: refs of
a sending() scope (counted sent when it closes), a scope that raises (counts
nothing), receive() of this process's own refs (counted loaded), the file_system
tag, malformed refs, share_in_place / new_shared, letting go, and collect() giving a
dead segment back to its pool."""

from __future__ import annotations

import gc
import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import shmreduce
from shmreduce import _native, pool, program, reductions, segments, transfer

from helpers import SegmentRef, forget_mappings, let_go_now, run_in_child, wait_for, without_dlpack_exchange_api

MIB = 1 << 20
SMALL_SIZES = (100, 4000, pool.SLAB_ITEM_MAX)  # packed in the thread's slab
MID_SIZES = (pool.SLAB_ITEM_MAX + 1, 128 << 10, pool.ARENA_ITEM_MAX)  # packed in the thread's arena
LARGE_SIZE = 2 * pool.ARENA_ITEM_MAX  # a segment of its own


def _storage(nbytes: int, value: int) -> torch.UntypedStorage:
    return torch.full((nbytes,), value, dtype=torch.uint8).untyped_storage()


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _pool_stats(strategy: str) -> dict[str, int]:
    """This process's pool for *strategy*, its counters without their prefix."""
    prefix = "fd_" if strategy == "file_descriptor" else "fs_"
    return {k[len(prefix) :]: v for k, v in transfer.stats().items() if k.startswith(prefix)}


def _free_after_let_go(strategy: str, expected: int) -> dict[str, int]:
    """let_go_now(), then the pool's stats once it has *expected* free segments (2 s
    at most). Not at once: the collector thread's collect() may have taken the dead
    generation off the queue and be giving its segment back (pool.give_back's pwrite
    lets the GIL go) when ours runs, finds the queue empty and returns before the
    segment is free. Measured: test_let_go_slabs_ends_the_slab_with_its_last_storage
    failed 1 run in 10 without this wait; 5 of 250 rounds of new_shared / let go /
    count, and none of 250 with transfer's queue check made under its lock."""
    let_go_now()
    wait_for(lambda: _pool_stats(strategy)["segments_free"] == expected, 2.0)
    return _pool_stats(strategy)


def _delta(before: dict[str, int], *names: str) -> dict[str, int]:
    now = transfer.counters()
    return {name: now[name] - before[name] for name in names}


def _counts(ref: SegmentRef) -> tuple[int, int]:
    """(sent, loaded) in the header of the segment *ref* lies in, this process's mapping."""
    seg = segments.lookup(ref.kind, ref.segment)
    assert seg is not None
    gen, sent, loaded, _holders = _native.hdr_read(seg.addr)
    assert gen == ref.gen & (1 << 64) - 1
    return sent, loaded


def _receive_here(refs: list[tuple]) -> list[torch.UntypedStorage]:
    """Receive *refs* in this process, in one receiving() scope."""
    with transfer.receiving():
        return [transfer.receive(ref) for ref in refs]


def _connected() -> None:
    """Connect to the broker before a test makes the segments it counts: a connection
    made afresh retires the segments alive at that moment (see test_pool), this
    thread's slab among them: the test's small storages start a new one, and the
    old one is settled (free or closed) before the test counts."""
    assert bool(shmreduce.loads(shmreduce.dumps(torch.ones(1)))[0] == 1.0)
    transfer.let_go_slabs()
    let_go_now()


@pytest.fixture
def fresh_slab() -> Iterator[None]:
    """The test's small storages start a new slab of this thread; dropped after."""
    transfer.let_go_slabs()
    yield
    transfer.let_go_slabs()


# -- sending ---------------------------------------------------------------------------


@pytest.mark.swap_path
def test_one_scope_is_one_message_small_storages_share_a_slab(strategy: str, fresh_slab: None) -> None:
    smalls = [_storage(n, i + 1) for i, n in enumerate(SMALL_SIZES)]
    mids = [_storage(n, i + 5) for i, n in enumerate(MID_SIZES)]
    large = _storage(LARGE_SIZE, 9)
    before = transfer.counters()
    with transfer.sending():
        mid_refs = [SegmentRef(*transfer.share(s)) for s in mids]
        refs = [SegmentRef(*transfer.share(s)) for s in [*smalls, large]]
        assert _delta(before, "storages_reused") == {"storages_reused": 0}
        with transfer.sending():  # a nested scope joins the outer message
            again = SegmentRef(*transfer.share(smalls[1]))
            assert again[:7] == refs[1][:7], "a storage sent twice in one message has the same ref, but its ticket"
            assert again.ticket != refs[1].ticket
        assert _delta(before, "messages_sent") == {"messages_sent": 0}, "sent before the scope closed"
        assert _counts(refs[0]) == (0, 0), "counted sent before the scope closed"
    assert _delta(before, "storages_shared", "bytes_shared", "messages_sent", "storages_reused") == {
        "storages_shared": 7,
        "bytes_shared": sum(SMALL_SIZES) + sum(MID_SIZES) + LARGE_SIZE,
        "messages_sent": 1,
        "storages_reused": 1,
    }
    kind = "fd" if strategy == "file_descriptor" else "fs"
    assert {r.kind for r in refs} == {kind}
    assert {r.program for r in refs} == {program.current().directory}
    assert [r.nbytes for r in refs] == [*SMALL_SIZES, LARGE_SIZE]

    *small_refs, large_ref = refs
    assert len({(r.segment, r.gen) for r in small_refs}) == 1, f"small storages not in one slab: {small_refs}"
    offsets = [r.offset for r in small_refs]
    assert offsets[0] == segments.HEADER, "a fresh slab starts right after its header"
    for prev, ref in zip(small_refs, small_refs[1:], strict=False):
        assert ref.offset % segments.ALIGN == 0, offsets
        assert ref.offset >= prev.offset + prev.nbytes, f"overlapping offsets {offsets}"
    assert large_ref.segment != small_refs[0].segment
    assert large_ref.gen not in (0, small_refs[0].gen)
    # Mid-size storages share the thread's arena, as small ones its slab.
    assert len({(r.segment, r.gen) for r in mid_refs}) == 1, f"mid-size storages not in one arena: {mid_refs}"
    assert mid_refs[0].segment not in (large_ref.segment, small_refs[0].segment)
    assert [r.offset for r in mid_refs][0] == segments.HEADER
    for prev, ref in zip(mid_refs, mid_refs[1:], strict=False):
        assert ref.offset % segments.ALIGN == 0 and ref.offset >= prev.offset + prev.nbytes, mid_refs
    assert large_ref.offset == segments.HEADER
    for r in refs:
        assert r.tag == (transfer.fs_tag(r.program, str(r.segment), r.gen) if kind == "fs" else 0)
    # Every ref counted sent once, the one shared twice twice: 4 in the slab, 1 in the large segment.
    assert _counts(small_refs[0]) == (4, 0) and _counts(large_ref) == (1, 0)
    assert len({r.ticket for r in small_refs} | {again.ticket}) == 4, "each ref its own ticket"

    # Each storage now lies where its ref says, its values kept.
    got = _receive_here(list(refs))
    for s, g in zip([*smalls, large], got, strict=True):
        assert g.data_ptr() == s.data_ptr()
    assert _counts(mid_refs[0]) == (3, 0)
    for s, g in zip(mids, _receive_here(list(mid_refs)), strict=True):
        assert g.data_ptr() == s.data_ptr() and bool((_bytes_of(g) == _bytes_of(s)).all())
    assert _counts(mid_refs[0]) == (3, 3)
    assert [int(_bytes_of(s)[0]) for s in smalls] == [1, 2, 3]
    assert _counts(small_refs[0]) == (4, 3) and _counts(large_ref) == (1, 1)
    assert _receive_here([refs[1]])[0].data_ptr() == smalls[1].data_ptr()
    assert _counts(small_refs[0]) == (4, 3), "a ref loaded again counts nothing"
    assert _receive_here([again])[0].data_ptr() == smalls[1].data_ptr()
    assert _counts(small_refs[0]) == (4, 4), "every ref loaded, none in flight"


@pytest.mark.swap_path
def test_a_scope_that_raises_delivers_nothing(strategy: str) -> None:
    s = _storage(2000, 7)
    before = transfer.counters()
    with transfer.sending():
        pass  # a scope that shares nothing counts nothing
    assert _delta(before, "messages_sent") == {"messages_sent": 0}
    with pytest.raises(RuntimeError, match="mid-pickle"):
        with transfer.sending():
            dropped = SegmentRef(*transfer.share(s))
            raise RuntimeError("mid-pickle")
    assert _delta(before, "messages_sent", "storages_shared") == {"messages_sent": 0, "storages_shared": 1}
    sent, loaded = _counts(dropped)

    # The next message works, and carries the storage from where it now lies.
    with transfer.sending():
        ref = SegmentRef(*transfer.share(s))
    assert _delta(before, "messages_sent", "storages_shared", "storages_reused") == {
        "messages_sent": 1,
        "storages_shared": 1,
        "storages_reused": 1,
    }
    assert ref[:7] == dropped[:7] and ref.ticket != dropped.ticket
    assert _counts(ref) == (sent + 1, loaded), "only the message pickled whole is counted sent"
    (got,) = _receive_here([ref])
    assert got.data_ptr() == s.data_ptr()
    assert _counts(ref) == (sent + 1, loaded + 1)
    t = torch.arange(10.0)
    assert torch.equal(shmreduce.loads(shmreduce.dumps(t)), t)


# -- receiving -------------------------------------------------------------------------


def test_receiving_a_ref_of_this_process_gives_the_very_storage(strategy: str) -> None:
    for nbytes in (256, LARGE_SIZE):
        s = _storage(nbytes, 3)
        with transfer.sending():
            ref = transfer.share(s)
        received = transfer.counters()["messages_received"]
        with transfer.receiving():
            got = transfer.receive(ref)
            again = transfer.receive(SegmentRef(*ref))  # a SegmentRef is its tuple
        assert transfer.counters()["messages_received"] == received + 1
        assert got.data_ptr() == again.data_ptr() == s.data_ptr()
        assert got.nbytes() == nbytes
        assert bool((_bytes_of(got) == 3).all())
        if SegmentRef(*ref).gen:  # a pooled generation; torch's memfd (the adopt path) has no header
            sent, loaded = _counts(SegmentRef(*ref))
            assert loaded == sent, "a ref loaded twice counts once: its ticket"


@pytest.mark.swap_path
def test_reduce_sends_a_shared_storage_from_where_it_lies_and_never_moves_it_again(strategy: str) -> None:
    # _native.reduce sends a storage from where it lies when its generation is
    # indexed, and leaves one lying in any other mapped segment to the general path
    # (as after a new broker, or before share() indexed it: a race in CI once moved a
    # storage twice, and a receiver's in-place writes went to the first copy).
    meta = (torch.float32, (64,), (1,), 0, None)
    t = torch.arange(64.0)
    with transfer.sending():
        first = reductions.reduce_tensor(t)[1][0]
    sent = [(first, t)]
    ptr = t.untyped_storage().data_ptr()
    for unindexed in (False, True):
        if unindexed:
            _native.unindex_all()
        with transfer.sending():
            rebuild, args = _native.reduce(t)
        # Indexed: C's compact form (load); else the general one (rebuild): one ref either way.
        assert rebuild is (_native.rebuild if unindexed else _native.load), unindexed
        ref, got = args if unindexed else _native.unpack(*args)
        assert got == meta
        assert t.untyped_storage().data_ptr() == ptr and ref[:7] == first[:7], unindexed
        sent.append((ref, t))
    # Fresh storages fill this thread's slab in C once it is indexed (the first went through Python).
    shared = _native.shared()[0]
    fresh = [torch.full((64,), float(i)) for i in range(4)]
    with transfer.sending():
        refs = [_native.unpack(*_native.reduce(f)[1])[0] for f in fresh]
    assert _native.shared()[0] >= shared + 3
    assert [r[4] for r in refs] == sorted(r[4] for r in refs) and len({r[2] for r in refs}) <= 2
    sent += zip(refs, fresh, strict=True)
    with transfer.receiving():  # every ref sent is loaded: nothing stays in flight
        assert all(torch.equal(_native.rebuild(ref, meta), t) for ref, t in sent)


def _views() -> list[torch.Tensor]:
    base = torch.arange(48.0).view(4, 12)
    return [
        base[1:, 2:7],  # starts inside its storage
        base.t(),  # transposed
        base[:, ::3],  # strided
        torch.tensor(3.5),  # 0-d
        torch.ones(5, dtype=torch.bfloat16),
        torch.tensor([True, False]),
        torch.zeros(2, 3, dtype=torch.complex64)[1],
        torch.arange(6).expand(2, 6),  # a zero stride
    ]


@pytest.mark.swap_path
def test_reduce_describes_each_layout_as_the_general_path_does(strategy: str) -> None:
    # _native.reduce reads dtype, sizes, strides and where the tensor starts through
    # torch's DLPack exchange API: what it packs unpacks to the general path's meta.
    views = _views()
    with transfer.sending():
        first = [reductions.reduce_tensor(t) for t in views]  # shares each storage (the first starts the slab)
        reduced = [_native.reduce(t) for t in views]
    with transfer.receiving():  # every ref loaded: nothing stays in flight
        assert all(torch.equal(rebuild(*args), t) for t, (rebuild, args) in zip(views, first, strict=True))
        for t, (rebuild, args) in zip(views, reduced, strict=True):
            assert rebuild is _native.load, t
            ref, meta = _native.unpack(*args)
            assert meta == reductions._meta(t), t
            got = rebuild(*args)
            assert torch.equal(got, t) and got.stride() == t.stride() and got.storage_offset() == t.storage_offset()


@pytest.mark.swap_path
def test_without_the_exchange_api_reduce_hands_every_tensor_to_the_general_path(strategy: str) -> None:
    # A torch whose Tensor type has no DLPack exchange API (before 2.10): the same
    # pickles as reductions.reduce_tensor makes, slower.
    t = torch.arange(8.0)
    with transfer.sending():
        sent = [reductions.reduce_tensor(t)]
        with without_dlpack_exchange_api() as no_api:
            sent.append(_native.reduce(t.as_subclass(no_api)))
        sent.append(_native.reduce(t))
    (_, general), (rebuild, (ref, meta)), (again, _) = sent
    assert rebuild is _native.rebuild and ref[:7] == general[0][:7] and meta[:4] == general[1][:4]
    assert again is _native.load  # the API bound again
    with transfer.receiving():  # every ref loaded: nothing stays in flight
        assert all(torch.equal(fn(*args), t) for fn, args in sent)


# -- the file_system tag ---------------------------------------------------------------


def test_fs_tag_is_deterministic_and_covers_every_field() -> None:
    # Offsets and sizes are not in it: the mapped segment bounds them (_native).
    args = ("/dev/shm/shmreduce-x", "seg-1", 5)
    tag = transfer.fs_tag(*args)
    assert isinstance(tag, int) and 0 <= tag < 1 << 64
    assert transfer.fs_tag(*args) == tag
    changed = [
        ("/dev/shm/shmreduce-y", *args[1:]),
        (args[0], "seg-2", args[2]),
        (*args[:2], 6),
    ]
    tags = [transfer.fs_tag(*c) for c in changed]
    assert tag not in tags, tags
    assert len(set(tags)) == len(tags), tags


# -- malformed refs --------------------------------------------------------------------

_NOWHERE = "/nonexistent/shmreduce-test-dir"
_VALID = ("fd", _NOWHERE, 12345, 7, 64, 8, 0, 0)  # well formed, names nothing

_MALFORMED: dict[str, object] = {
    "None": None,
    "an int": 5,
    "6 fields": _VALID[:6],
    "9 fields": (*_VALID, 0),
    "7 characters": "fdxxxxx",
    "kind unknown": ("xx", *_VALID[1:]),
    "kind bytes": (b"fd", *_VALID[1:]),
    "program bytes": (_VALID[0], _NOWHERE.encode(), *_VALID[2:]),
    "program None": (_VALID[0], None, *_VALID[2:]),
    "fd segment str": (*_VALID[:2], "seg-1", *_VALID[3:]),
    "fs segment int": ("fs", _VALID[1], 12345, *_VALID[3:]),
    "gen negative": (*_VALID[:3], -1, *_VALID[4:]),
    "gen too large": (*_VALID[:3], 1 << 64, *_VALID[4:]),
    "gen float": (*_VALID[:3], 7.0, *_VALID[4:]),
    "gen bool": (*_VALID[:3], True, *_VALID[4:]),
    "offset negative": (*_VALID[:4], -1, *_VALID[5:]),
    "offset str": (*_VALID[:4], "64", *_VALID[5:]),
    "nbytes zero": (*_VALID[:5], 0, *_VALID[6:]),
    "nbytes negative": (*_VALID[:5], -8, *_VALID[6:]),
    "nbytes float": (*_VALID[:5], 8.0, *_VALID[6:]),
    "tag str": (*_VALID[:6], "0", _VALID[7]),
    "tag None": (*_VALID[:6], None, _VALID[7]),
    "ticket negative": (*_VALID[:7], -1),
    "ticket too large": (*_VALID[:7], 1 << 64),
    "ticket str": (*_VALID[:7], "0"),
}


@pytest.mark.parametrize("case", sorted(_MALFORMED))
def test_a_malformed_ref_is_a_sharing_error(case: str) -> None:
    with pytest.raises(shmreduce.SharingError, match="not a shmreduce segment handle"):
        transfer.receive(_MALFORMED[case])  # type: ignore[arg-type]  # malformed on purpose


def test_the_well_formed_ref_the_malformed_ones_come_from_passes_the_check() -> None:
    # What the malformed refs are refused for is their one change: _VALID itself is
    # refused later, for naming no program directory.
    for kind, segment in (("fd", 12345), ("fs", "seg-1")):
        with pytest.raises(shmreduce.SharingError, match="no such program directory"):
            transfer.receive((kind, _VALID[1], segment, *_VALID[3:]))


# -- shared storages outside a message -------------------------------------------------


def test_share_in_place_moves_a_storage_once(strategy: str) -> None:
    for numel in (1000, LARGE_SIZE):
        t = torch.arange(numel, dtype=torch.float32)
        s = t.untyped_storage()
        ptr = s.data_ptr()
        before = transfer.counters()
        transfer.share_in_place(s)
        moved = s.data_ptr()
        assert moved != ptr
        assert t.untyped_storage().data_ptr() == moved, "the tensor sees the shared memory"
        assert torch.equal(t, torch.arange(numel, dtype=torch.float32))
        assert s.is_shared()
        assert _delta(before, "storages_shared", "bytes_shared") == {"storages_shared": 1, "bytes_shared": 4 * numel}
        transfer.share_in_place(s)
        assert s.data_ptr() == moved
        assert _delta(before, "storages_shared", "messages_sent") == {"storages_shared": 1, "messages_sent": 0}


def test_new_shared_in_fresh_memory_is_zeros_and_shared(strategy: str) -> None:
    _connected()
    transfer.let_go()  # an empty pool: every segment below is new (the kernel's zero pages)
    for nbytes in (1, 1000, LARGE_SIZE):
        s = transfer.new_shared(nbytes)
        assert s.nbytes() == nbytes
        assert s.is_shared()
        assert bool((_bytes_of(s) == 0).all()), nbytes
    empty = transfer.new_shared(0)
    assert isinstance(empty, torch.UntypedStorage) and empty.nbytes() == 0
    transfer.let_go_slabs()


@pytest.mark.swap_path
def test_a_reused_segment_holds_exactly_each_new_storages_bytes(strategy: str) -> None:
    # A reused segment is copied into through its mapping where an earlier generation
    # allocated its pages, and through its descriptor beyond them: a larger storage of
    # the same size class spans both, a smaller one lies within.
    first, larger, smaller = 300_000, 323_584, 296_000
    assert len({pool.class_size(n) for n in (first, larger, smaller)}) == 1, "the test needs one size class"
    _connected()
    transfer.let_go()  # from an empty pool: every storage below reuses the first one's segment
    for i, nbytes in enumerate((first, larger, smaller, larger)):
        before = _pool_stats(strategy)
        s = _storage(nbytes, 11 + i)
        transfer.share_in_place(s)
        if i:
            assert _pool_stats(strategy)["segments_reused"] == before["segments_reused"] + 1, "the test needs reuse"
        wrong = int((_bytes_of(s) != 11 + i).sum())
        assert wrong == 0, f"storage {i} ({nbytes} bytes) in a reused segment: {wrong} bytes wrong"
        del s
        _free_after_let_go(strategy, 1)


@pytest.mark.parametrize("nbytes", [1000, MIB])
def test_new_shared_in_reused_memory_is_not_zero_filled_and_is_this_programs(strategy: str, nbytes: int) -> None:
    # torch's _new_shared promises no contents, and collate overwrites every byte: a
    # segment this process's pool reused is not zero-filled first (that would cost a
    # worker much of its CPU per batch). What lies there is this process's own
    # earlier bytes: a pool reuses only segments this process made.
    _connected()
    transfer.let_go()  # from an empty pool: the segment reused below is this one
    s = transfer.new_shared(nbytes)
    _bytes_of(s).fill_(0xAB)
    first = segments.segment_at(s.data_ptr(), nbytes)
    transfer.let_go_slabs()  # a small one's slab ends with its storage
    del s
    before = _free_after_let_go(strategy, 1)
    s = transfer.new_shared(nbytes)
    assert _pool_stats(strategy)["segments_reused"] == before["segments_reused"] + 1, "the test needs reuse"
    seg = segments.segment_at(s.data_ptr(), nbytes)
    assert seg is not None and seg is first and seg.pool is transfer._current_pool(), (
        "new_shared() handed out memory this process did not make"
    )
    old = int((_bytes_of(s) == 0xAB).sum())
    transfer.let_go_slabs()
    del s
    assert old == nbytes, f"new_shared({nbytes}) zero-filled {nbytes - old} bytes of a reused segment"


# -- letting go ------------------------------------------------------------------------


def test_let_go_slabs_ends_the_slab_with_its_last_storage(strategy: str, fresh_slab: None) -> None:
    s = transfer.new_shared(1000)  # never sent: free here as soon as it dies
    let_go_now()  # what died before this test (the pool active again) is counted now
    before = _pool_stats(strategy)
    del s
    let_go_now()
    now = _pool_stats(strategy)
    assert now["segments_free"] == before["segments_free"], ("the slab is still current", before, now)
    transfer.let_go_slabs()
    now = _free_after_let_go(strategy, before["segments_free"] + 1)
    assert now["segments_free"] == before["segments_free"] + 1, (before, now)


def _kept_then_let_go(data: bytes) -> tuple[int, dict[str, int]]:
    """In a fork child, a stranger to the segment: receive, drop, and let go."""
    forget_mappings()
    t = shmreduce.loads(data)
    del t
    let_go_now()
    kept = transfer.stats()["segments_kept"]
    transfer.let_go()
    return kept, transfer.stats()


def test_let_go_keeps_nothing_for_later(strategy: str) -> None:
    _connected()
    transfer.let_go()  # from an empty pool
    for n in (1000, MIB):  # a slab and a segment of its own, free once dead
        s = transfer.new_shared(n)
        del s
    transfer.let_go_slabs()
    assert _free_after_let_go(strategy, 2)["segments_free"] == 2
    transfer.let_go()
    stats = transfer.stats()
    assert (stats["fd_segments_free"], stats["fs_segments_free"], stats["segments_kept"]) == (0, 0, 0), stats
    assert (stats["fd_free_bytes"], stats["fs_free_bytes"]) == (0, 0), stats

    # A receiver keeps the segments it mapped after their storages die, until let_go().
    status, value = run_in_child(_kept_then_let_go, shmreduce.dumps(torch.ones(MIB // 4)))
    assert status == "ok", value
    kept, child = value
    assert kept >= 1, "the child kept no mapping: the test proves nothing"
    assert (child["fd_segments_free"], child["fs_segments_free"], child["segments_kept"]) == (0, 0, 0), child


# -- collect ---------------------------------------------------------------------------


def _kept_in_a_child(keep: int, conn: Any) -> None:
    got = shmreduce.loads(conn.recv_bytes())
    kept = got[keep]
    del got
    gc.collect()
    conn.send(float(kept[0]))
    conn.recv()  # until the parent has counted
    del kept


@pytest.mark.swap_path
def test_a_partly_kept_arena_pins_its_size_and_no_more(strategy: str) -> None:
    # 64 mid-size storages fill most of one arena; a receiver (another process) keeps
    # one and drops the rest, as does this process: the arena stays whole, pinned, and
    # is the only memory pinned (pool.ARENA_SIZE per storage kept, at most: the bound
    # pool.py documents). Once the kept one goes, the arena is free for reuse. The
    # receiver is forked before the arena is made: a fork retires what is in use.
    _connected()
    transfer.let_go()
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_kept_in_a_child, args=(17, theirs))
    child.start()
    try:
        tensors = [torch.full(((128 << 10) // 4,), float(i)) for i in range(64)]
        arena = {segments.segment_at(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors}
        assert len(arena) == 1, "64 storages of 128 KiB not in one arena"
        ours.send_bytes(shmreduce.dumps(tensors))
        del tensors
        assert ours.poll(20) and ours.recv() == 17.0
        transfer.let_go_slabs()  # the arena is no longer this thread's current one
        let_go_now()
        stats = _pool_stats(strategy)
        assert stats["pinned_bytes"] == pool.ARENA_SIZE, stats  # one storage kept: its arena, nothing else
        assert stats["segments_waiting"] == 1 and stats["segments_free"] == 0, stats
        ours.send("drop")
        child.join(20)
        assert child.exitcode == 0
        after = _free_after_let_go(strategy, 1)
        assert after["segments_free"] == 1 and after["pinned_bytes"] == 0, after
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        ours.close()
        theirs.close()


@pytest.mark.swap_path
def test_collect_returns_a_dead_segment_to_the_pool(strategy: str) -> None:
    _connected()
    transfer.let_go()  # from an empty pool: what turns up free below is this test's
    t = torch.ones(MIB // 4)
    u = shmreduce.loads(shmreduce.dumps(t))
    assert u.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    before = _pool_stats(strategy)
    del t, u
    after = _free_after_let_go(strategy, before["segments_free"] + 1)  # gc.collect(), collect(), the free notice
    assert after["segments_free"] == before["segments_free"] + 1, (before, after)
    assert after["segments_waiting"] == 0, after

    t = torch.full((MIB // 4,), 2.0)
    u = shmreduce.loads(shmreduce.dumps(t))
    again = _pool_stats(strategy)
    assert again["segments_reused"] == after["segments_reused"] + 1, (after, again)
    assert again["segments_made"] == after["segments_made"], (after, again)
    assert again["segments_free"] == after["segments_free"] - 1, (after, again)
    assert bool((u == 2.0).all())
