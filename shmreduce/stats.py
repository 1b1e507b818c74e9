"""``stats()``: a plain dict of this process's sharing counters."""

from __future__ import annotations

from typing import Any

from shmreduce import _platform, pool, transfer
from shmreduce.broker import client as broker


def stats() -> dict[str, Any]:
    """Counters for this process.

    storages_shared / bytes_shared: storages moved into shared segments here;
    storages_reused: sends that found the storage already shared (no copy);
    storages_received / bytes_received: storages received here;
    messages_sent / messages_received: pickled messages that shared storages / loaded ones;
    round_trips: request-reply exchanges with a broker (a file_descriptor message
    costs one per segment this process does not map yet, as a receiver, or has not
    sent from yet, as a sender: its deposit);
    live_segments: segments with a storage (or a hold) alive here;
    fds_held: descriptors open in this process;
    segments_mapped / bytes_mapped / descriptors / segments_kept: the shared
    segments this process maps, the descriptors they keep, those kept mapped for
    reuse after their last storage died;
    {fd,fs}_segments_made / _reused / _free / _waiting, {fd,fs}_free_bytes: this
    process's pools (see ``shmreduce.pool``): segments made, reused, free for reuse,
    waiting until their generation is free, and the bytes of the free ones.
    """
    result: dict[str, Any] = transfer.counters()
    result.update(transfer.stats())
    clients = broker.existing_clients()
    result["round_trips"] = sum(c.round_trips for c in clients)
    result["live_segments"] = pool.live_segments()
    result["fds_held"] = _platform.open_fd_count()
    return result
