"""``stats()``: a plain dict of this process's sharing counters."""

from __future__ import annotations

from typing import Any

from shmreduce import _platform, _torch, pool, transfer
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
    segments_mapped / bytes_mapped / segments_kept: the shared segments this process
    maps, their bytes, those kept mapped for reuse after their last storage died;
    descriptors: the descriptors shmreduce's segments keep open here: one per segment
    this process made to send from (a memfd, or a file under 'file_system'); a
    received segment keeps none once mapped. What grows with what you keep;
    fds_held: every descriptor open in this process (``/proc/self/fd``): those above,
    the broker connections and their ledger, and everyone else's (stdio, torch, your
    files and sockets). What ``RLIMIT_NOFILE`` limits: ``descriptors`` is the part of
    it shmreduce's memory holds;
    {fd,fs}_segments_made / _reused / _free / _waiting, {fd,fs}_free_bytes: this
    process's pools (see ``shmreduce.pool``): segments made, reused, free for reuse,
    waiting until their generation is free, and the bytes of the free ones;
    {fd,fs}_pinned_bytes: the bytes of this process's pool's segments that are not
    free: in use here, kept by receivers, or waiting for refs in flight (past
    ``pool.IDLE_SEGMENTS`` waiting, the longest waiting leave the pool, and this no
    longer counts them). A storage kept anywhere keeps its whole segment: its slab
    (1 MiB) or arena (16 MiB) if it was placed in one (``shmreduce.pool``);
    a receiver's ``bytes_mapped`` over the bytes it keeps is the memory a partly
    kept slab or arena costs.
    move_path: how a storage sent from here moves into shared memory on this torch:
    "swap" (into shmreduce's pool, in place: torch 2.12 and up) or "adopt" (torch
    moves it into a memfd of its own, which shmreduce sends from: older torch, see
    docs/compatibility.md).
    """
    result: dict[str, Any] = transfer.counters()
    result["move_path"] = _torch.path()
    result.update(transfer.stats())
    clients = broker.existing_clients()
    result["round_trips"] = sum(c.round_trips for c in clients)
    result["live_segments"] = segments.live_segments()
    result["fds_held"] = _platform.open_fd_count()
    return result
