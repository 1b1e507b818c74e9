"""Where a storage lies (shmreduce/cache.py): found by its address inside a mapped
segment, with no record per storage; a receiver's identity map per Gen,
holding no strong reference; torch's own shared storages remembered apart."""

from __future__ import annotations

import gc

import pytest
import torch

import shmreduce
from shmreduce import segments, transfer
from shmreduce.cache import Place, StorageCache, cache

from helpers import SegmentRef


@pytest.mark.swap_path
def test_a_shared_storage_is_found_by_its_address(strategy: str) -> None:
    t = torch.arange(1000.0)
    assert cache.place_of(t.untyped_storage()) is None, "private memory lies in no segment"
    ref = SegmentRef(*transfer.share(t.untyped_storage()))
    place = cache.place_of(t.untyped_storage())
    assert place is not None
    assert (place.segment.key, place.gen, place.offset, place.nbytes) == (ref.segment, ref.gen, ref.offset, ref.nbytes)
    assert place.segment.addr + place.offset == t.untyped_storage().data_ptr()
    # A slice of the storage lies in the same segment, further in: sent from there.
    part = t.untyped_storage()[400:800]
    inner = cache.place_of(part)
    assert inner is not None and inner.segment is place.segment and inner.gen == place.gen
    assert (inner.offset, inner.nbytes) == (place.offset + 400, 400)
    # Sent again: the same ref, no second move.
    again = SegmentRef(*transfer.share(t.untyped_storage()))
    assert again[:7] == ref[:7] and again.ticket != ref.ticket  # a ref of its own (its ticket), to the same place
    # Loaded here, each gives this process its own storage back (and counts loaded:
    # nothing is left in flight).
    with transfer.receiving():
        assert transfer.receive(ref)._cdata == transfer.receive(again)._cdata == t.untyped_storage()._cdata


@pytest.mark.swap_path
def test_a_sealed_segment_is_not_a_place(strategy: str) -> None:
    # Its file went with a broker that died: a storage in it is shared anew.
    t = torch.ones(100)
    assert shmreduce.loads(shmreduce.dumps(t)).untyped_storage()._cdata == t.untyped_storage()._cdata
    place = cache.place_of(t.untyped_storage())
    assert place is not None
    segments.seal_where(lambda seg: seg is place.segment)
    try:
        assert cache.place_of(t.untyped_storage()) is None
    finally:
        place.segment.sealed = False
    assert cache.place_of(t.untyped_storage()) == place


@pytest.mark.swap_path
def test_received_storages_are_one_per_place_and_held_weakly(strategy: str) -> None:
    t = torch.arange(64.0)
    data = shmreduce.dumps([t, t[8:], t.untyped_storage()])
    a, b, s = shmreduce.loads(data)
    assert a.untyped_storage()._cdata == b.untyped_storage()._cdata == s._cdata
    again = shmreduce.loads(data)  # a later message: the same storage again
    assert again[0].untyped_storage()._cdata == a.untyped_storage()._cdata
    place = cache.place_of(a.untyped_storage())
    assert place is not None
    gen = place.segment.live_gen(place.gen)
    assert gen is not None and gen.stored(place.offset) is not None
    assert a.untyped_storage()._cdata == t.untyped_storage()._cdata, "its own storage, loaded here"
    del a, b, s, again, t
    gc.collect()
    assert gen.stored(place.offset) is None, "the map keeps no storage alive"


def test_torch_shared_storages_are_remembered_weakly() -> None:
    local = StorageCache()
    t, users = torch.ones(4), torch.ones(4)
    segment, users_segment = object(), object()
    key = t.untyped_storage()._cdata
    local.remember_adopted(t.untyped_storage(), Place(segment, 0, 0, 16), key, moved=True)
    local.remember_adopted(users.untyped_storage(), Place(users_segment, 0, 0, 16), users.untyped_storage()._cdata)
    assert local.place_of(t.untyped_storage()) == Place(segment, 0, 0, 16)
    del t, users
    gc.collect()
    other = torch.ones(4)
    local.remember_adopted(other.untyped_storage(), Place(segment, 0, 0, 16), other.untyped_storage()._cdata)
    # The dead ones' entries go; the segment of the one torch moved for shmreduce is
    # handed over once (its memfd let go of), never that of one torch shared for the
    # user. A live one stays, even under a dead one's key (a StorageImpl address reused).
    assert local.take_dead_adopted() == [segment] and local.take_dead_adopted() == []
    assert len(local._adopted) == 1 and local.place_of(other.untyped_storage()) is not None


def test_an_entry_replaced_under_its_key_stays_when_the_dead_one_is_taken() -> None:
    local = StorageCache()
    a, b = torch.ones(4), torch.ones(4)
    first, second = object(), object()
    local.remember_adopted(a.untyped_storage(), Place(first, 0, 0, 16), 7, moved=True)
    del a
    gc.collect()
    # A new StorageImpl at the dead one's address, remembered before the dead one is taken.
    local.remember_adopted(b.untyped_storage(), Place(second, 0, 0, 16), 7)
    assert local.take_dead_adopted() == [first]
    assert local.place_of(b.untyped_storage(), 7) == Place(second, 0, 0, 16)
