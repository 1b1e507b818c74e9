"""``stats()``: a plain dict of this process's sharing counters."""

from __future__ import annotations

from typing import Any

from shmreduce import _platform, transfer
from shmreduce.broker import client as broker
from shmreduce.cache import cache


def stats() -> dict[str, Any]:
    """Counters for this process.

    storages_shared / bytes_shared: storages moved into new shared segments here;
    storages_reused: sends that found the storage already shared (no copy);
    storages_received / bytes_received: segments mapped here;
    messages_sent / messages_received: deposits made / fetched;
    round_trips: request-reply exchanges with a broker (a file_descriptor message
    costs one only if it uses a slab this process does not map yet);
    live_segments: cached segments whose storage is alive here;
    fds_held: descriptors open in this process.
    """
    result: dict[str, Any] = transfer.counters()
    clients = broker.existing_clients()
    result["round_trips"] = sum(c.round_trips for c in clients)
    result["live_segments"] = cache.live_count()
    result["fds_held"] = _platform.open_fd_count()
    return result
