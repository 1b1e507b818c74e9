"""DataLoader with pin_memory=True and persistent_workers=True over many epochs.

Persistent workers live across epochs and keep sending batches through shmreduce, so
whatever a batch costs must be given back by the time the next epoch ends. Measured
after every epoch, under each strategy, once things settle (see ``_settled``):

* descriptors open in the main process (``/proc/self/fd``);
* entries under the shm base (the program directory, its socket, lock and marker, and
  the ``file_system`` segment files);
* broker state, seen from outside as shmreduce offers nothing public for it
  (``stats()`` counts this process only, ``python -m shmreduce doctor`` checks the
  machine with a throwaway broker of its own): the number of broker processes of
  this program and the descriptors they hold (their sockets, and under
  ``file_descriptor`` the memfds of messages not yet received);
* ``stats()["live_segments"]`` (shmreduce's segments alive in this process).

After the last epoch none may exceed its value after epoch 1 by more than a small
fixed slack (explained at ``SLACK``). Batch contents are checked on every epoch.

pin_memory on this CPU-only torch: ``DataLoader`` warns ("no accelerator is found")
and does not pin (``_pin_memory`` is false, no pin thread), so the batches come
straight from the worker queue; the test runs with ``pin_memory=True`` all the same,
checks the warning, and checks ``is_pinned()`` where an accelerator exists.
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Dataset

import shmreduce
from shmreduce import program
from shmreduce.broker.client import connected_client

from helpers import broker_pids, open_fds, shm_entries, wait_for

N = 32
BATCH = 4
EPOCHS = 5
IMAGE = (3, 48, 48)  # float32: 27 KiB a sample, 108 KiB a batch, above the 64 KiB of a small storage

# What may legitimately differ between epoch 1 and epoch 5, per measure:
# - main descriptors: under file_descriptor a receiver keeps a few slabs it received
#   mapped after their last storage died (SHMREDUCE_KEPT_SEGMENTS, default 8, README
#   "Limits"), since their senders go on filling them; which ones are kept when an
#   epoch ends depends on which worker's batch came last, so the count can move by a
#   couple between epochs, never grow with them. 4 is far below what one epoch
#   sends (8 batches, each with a slab of its own for its image).
# - shm entries: file_system files of storages that died are released within about
#   a second (a purge every 0.5 s in each process), and a process may keep a bounded
#   few for reuse; _settled waits for quiet, but which batch a worker had last, or a
#   purge between two reads, can leave one or two more at one epoch's end: 2
#   (measured: 4 at every epoch's end with nothing kept; with files kept for reuse,
#   13 after epoch 1, 14 from epoch 5 on, flat over 14 epochs).
# - broker descriptors: a message's memfds stay at the broker until its receiver's
#   claim (fire-and-forget) arrives: 2 for one in flight while the measure settles.
# - live segments: none may grow; 1 for a batch whose storage dies during the read.
SLACK = {"main_fds": 4, "shm_entries": 2, "broker_procs": 0, "broker_fds": 2, "live_segments": 1}


class Records(Dataset):
    """Sample i: an image full of i, a row of 8 values i*8 .. i*8+7, its index."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "image": torch.full(IMAGE, float(i)),
            "row": torch.arange(i * 8, i * 8 + 8, dtype=torch.int64),
            "idx": torch.tensor(i),
        }


def _broker_fds() -> int:
    """The broker's descriptors, as it counts them (it is not dumpable: its
    /proc/<pid>/fd is closed to other processes of the user); 0 if not connected."""
    client = connected_client(program.current().directory)
    return client.ping(full=True)["descriptors"] if client is not None else 0


def _measure() -> dict[str, int]:
    return {
        "main_fds": len(open_fds()),
        "shm_entries": len(shm_entries()),
        "broker_procs": len(broker_pids()),
        "broker_fds": _broker_fds(),
        "live_segments": shmreduce.stats()["live_segments"],
    }


def _settled(measure: Callable[[], dict[str, int]], quiet: float = 0.6, timeout: float = 6.0) -> dict[str, int]:
    """The measure once it has not changed for *quiet* seconds (longer than the 0.5 s
    file_system purge and the broker's batched reads), or its last value at *timeout*."""
    gc.collect()
    last, since = measure(), time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = measure()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return last


def _epoch(loader: DataLoader, pinning: bool) -> None:
    seen = []
    for batch in loader:
        assert set(batch) == {"image", "row", "idx"}
        for b, i in enumerate(batch["idx"].tolist()):
            assert torch.equal(batch["image"][b], torch.full(IMAGE, float(i)))
            assert torch.equal(batch["row"][b], torch.arange(i * 8, i * 8 + 8))
        if pinning:
            assert batch["image"].is_pinned()
        else:
            assert batch["image"].untyped_storage().is_shared()  # came through shmreduce
        seen += batch["idx"].tolist()
    del batch
    assert sorted(seen) == list(range(N))


def test_persistent_pinned_loader_does_not_grow_across_epochs(strategy):
    pinning = torch.accelerator.is_available()
    before = shmreduce.stats()
    history = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = DataLoader(
            Records(), batch_size=BATCH, num_workers=2, pin_memory=True, persistent_workers=True, multiprocessing_context="fork", timeout=30
        )
        for _ in range(EPOCHS):
            _epoch(loader, pinning)
            history.append(_settled(_measure))
    if not pinning:
        # torch 2.13 CPU: pin_memory=True is accepted, warned about and skipped
        assert any("pin_memory" in str(w.message) and "accelerator" in str(w.message) for w in caught), caught
    print(f"\n{strategy}: per epoch {history}")

    after = shmreduce.stats()
    # every batch of every epoch came through shmreduce, one message each
    assert after["messages_received"] - before["messages_received"] >= EPOCHS * N // BATCH
    assert history[0]["broker_procs"] >= 1  # the program's broker served them
    first, last = history[0], history[-1]
    grown = {k: (first[k], last[k]) for k in first if last[k] > first[k] + SLACK[k]}
    assert not grown, f"{strategy}: grew from epoch 1 to epoch {EPOCHS} (more than {SLACK}): {grown}; all: {history}"

    # and once the workers are gone, the epochs left nothing behind at all
    del loader
    gc.collect()
    assert wait_for(lambda: len(open_fds()) <= first["main_fds"], 10), (len(open_fds()), first)
    assert wait_for(lambda: len(shm_entries()) <= first["shm_entries"], 10), (sorted(shm_entries()), first)
