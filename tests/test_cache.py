"""The weak-ref storage cache: identity both ways, no strong references, batched purge."""

import torch

from shmreduce.cache import Segment, StorageCache


def test_remember_and_look_up_both_ways():
    cache = StorageCache()
    t = torch.arange(4.0)
    seg = Segment("fs", "/dev/shm/shmreduce-x", "seg-" + "0" * 24, 16)
    cache.remember(t.untyped_storage(), seg)
    assert cache.segment_of(t.untyped_storage()) == seg
    assert cache.storage_of(seg)._cdata == t.untyped_storage()._cdata
    assert cache.live_names("/dev/shm/shmreduce-x") == [seg.name]


def test_cache_holds_no_strong_reference_and_purge_releases_fs_names():
    cache = StorageCache()
    t = torch.arange(4.0)
    seg = Segment("fs", "/p", "seg-" + "1" * 24, 16)
    keep = torch.ones(1)
    cache.remember(t.untyped_storage(), seg)
    cache.remember(keep.untyped_storage(), Segment("fd", "", "1:2", 4))
    del t
    assert cache.storage_of(seg) is None
    assert cache.purge() == {"/p": [seg.name]}
    assert len(cache) == 1 and cache.live_count() == 1


def test_purge_runs_in_batches():
    cache = StorageCache()
    released = {}
    for i in range(300):
        t = torch.ones(1)
        got = cache.remember(t.untyped_storage(), Segment("fs", "/p", f"seg-{i:024x}", 4))
        for names in got.values():
            released.setdefault("/p", []).extend(names)
        del t
    assert len(released["/p"]) >= 128  # dead entries were purged along the way
    assert len(cache) < 300
