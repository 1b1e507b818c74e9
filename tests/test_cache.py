"""The weak-ref storage cache: identity both ways, no strong references, batched purge."""

from types import SimpleNamespace

import torch

from shmreduce.cache import PURGE_MIN_ENTRIES, Place, StorageCache


def _segment(kind: str = "fs", key: object = "seg-" + "0" * 24) -> SimpleNamespace:
    return SimpleNamespace(kind=kind, key=key, directory="/p")


def test_remember_and_look_up_both_ways():
    cache = StorageCache()
    t = torch.arange(4.0)
    place = Place(_segment(), 7, 64, 16)
    cache.remember(t.untyped_storage(), place)
    assert cache.place_of(t.untyped_storage()) == place
    got = cache.storage_at(("fs", "seg-" + "0" * 24, 7, 64))
    assert got is not None and got.data_ptr() == t.untyped_storage().data_ptr()
    assert cache.storage_at(("fs", "seg-" + "0" * 24, 8, 64)) is None  # another generation
    assert cache.live_places() == [place]


def test_cache_holds_no_strong_reference():
    cache = StorageCache()
    t, keep = torch.arange(4.0), torch.ones(1)
    cache.remember(t.untyped_storage(), Place(_segment(), 1, 64, 16))
    cache.remember(keep.untyped_storage(), Place(_segment("fd", 12), 2, 64, 4))
    del t
    assert cache.storage_at(("fs", "seg-" + "0" * 24, 1, 64)) is None
    cache.purge()
    assert len(cache) == 1 and cache.live_count() == 1


def test_purge_runs_in_batches():
    cache = StorageCache()
    n = 3 * PURGE_MIN_ENTRIES
    for i in range(n):
        t = torch.ones(1)
        cache.remember(t.untyped_storage(), Place(_segment(), i + 1, 64, 4))
        del t
    assert len(cache) < n  # dead entries were purged along the way


def test_forget_drops_places_that_are_gone():
    cache = StorageCache()
    a, b = torch.ones(1), torch.ones(1)
    gone, kept = _segment(key="seg-" + "1" * 24), _segment(key="seg-" + "2" * 24)
    cache.remember(a.untyped_storage(), Place(gone, 1, 64, 4))
    cache.remember(b.untyped_storage(), Place(kept, 1, 64, 4))
    cache.forget(lambda place: place.segment is gone)
    assert cache.place_of(a.untyped_storage()) is None
    assert cache.place_of(b.untyped_storage()) is not None
