"""torch DataLoader workers use shmreduce once the parent is registered."""

from __future__ import annotations

import gc
import os
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

import shmreduce

N = 24
FIELDS = 6


def sample(i: int) -> dict:
    return {f"f{k}": torch.full((3,), float(i * 10 + k)) for k in range(FIELDS)} | {"idx": torch.tensor(i)}


class MapDS(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return sample(i)


class IterDS(IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, N, nw):
            yield sample(i)


def run_epochs(loader, epochs):
    seen = []
    for _ in range(epochs):
        idx = []
        for batch in loader:
            assert set(batch) == {f"f{k}" for k in range(FIELDS)} | {"idx"}
            for b, i in enumerate(batch["idx"].tolist()):
                for k in range(FIELDS):
                    assert torch.equal(batch[f"f{k}"][b], torch.full((3,), float(i * 10 + k)))
            assert batch["f0"].is_shared()
            idx += batch["idx"].tolist()
        seen.append(sorted(idx))
    return seen


@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("pin", [False, True])
def test_dataloader_workers_share_through_shmreduce(strategy, kind, pin):
    ds = MapDS() if kind == "map" else IterDS()
    before = shmreduce.stats()
    with warnings.catch_warnings():
        # CPU-only: torch warns that pin_memory has no accelerator and skips it.
        warnings.simplefilter("ignore", UserWarning)
        loader = DataLoader(
            ds, batch_size=4, num_workers=2, pin_memory=pin, persistent_workers=True, multiprocessing_context="fork", timeout=30
        )
        seen = run_epochs(loader, epochs=2)
    assert seen == [list(range(N))] * 2
    after = shmreduce.stats()
    batches = 2 * N // 4
    # Every batch came through shmreduce: one message (one round trip) per batch,
    # FIELDS+1 storages each.
    assert after["messages_received"] - before["messages_received"] >= batches
    assert after["storages_received"] - before["storages_received"] >= batches * (FIELDS + 1)
    del loader
    gc.collect()


def test_dataloader_spawn_workers_run_registered(strategy):
    _spawn_loader()


def _spawn_loader():
    before = shmreduce.stats()
    loader = DataLoader(MapDS(), batch_size=6, num_workers=2, multiprocessing_context="spawn", timeout=60)
    assert run_epochs(loader, epochs=1) == [list(range(N))]
    after = shmreduce.stats()
    assert after["messages_received"] - before["messages_received"] >= N // 6
    del loader
    gc.collect()


def test_unregistered_dataloader_does_not_use_shmreduce():
    assert not shmreduce.is_registered()
    before = shmreduce.stats()
    loader = DataLoader(MapDS(), batch_size=4, num_workers=2, multiprocessing_context="fork", timeout=30)
    assert run_epochs(loader, epochs=1) == [list(range(N))]
    assert shmreduce.stats()["messages_received"] == before["messages_received"]
    del loader
    gc.collect()


def _torch_shm_files():
    return {f for f in os.listdir("/dev/shm") if f.startswith("torch_")}


def test_worker_collate_allocates_batches_in_shmreduce_segments(strategy):
    # default_collate in a worker allocates each batch with UntypedStorage._new_shared:
    # while registered that is a shmreduce segment, so the batch is sent as it is
    # (no torch_shm_manager or /dev/shm/torch_* files, no second copy).
    from shmreduce.cache import cache

    before_files = _torch_shm_files()
    loader = DataLoader(MapDS(), batch_size=6, num_workers=2, multiprocessing_context="fork", timeout=30)
    batches = list(loader)
    assert batches and _torch_shm_files() <= before_files
    kind = {"file_descriptor": "fd", "file_system": "fs"}[strategy]
    tensors = [v for batch in batches for v in batch.values() if isinstance(v, torch.Tensor)]
    assert len(tensors) >= len(batches)
    for t in tensors:
        place = cache.place_of(t.untyped_storage())
        assert place is not None and place.segment.kind == kind
    # in this process too: a new shared storage is a shmreduce segment
    storage = torch.UntypedStorage._new_shared(64)
    place = cache.place_of(storage)
    assert storage.is_shared() and place is not None and place.segment.kind == kind
    del loader, batches, storage
    gc.collect()
