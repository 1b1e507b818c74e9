"""A steady stream costs the broker nothing per message (issue 20, item 3).

Refs are counted sent and loaded in their segments' shared headers: the broker
hears once per segment (a memfd deposited, fetched by a receiver that does not map
it yet) and once per generation a receiver holds, never once per message. Counted
with the broker's own tally of the records it read (``ping()["records"]``), over a
stream of dicts of 64 small tensors through an ``mp.Queue``, both strategies. Then
the books balance: every ref sent was loaded, nothing is left in flight.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as tmp

from shmreduce import _native, pool, program, transfer
from shmreduce.broker import client as broker_client
from shmreduce.cache import cache

from helpers import running, wait_for

MESSAGES = 600
MEASURED = 400  # the last ones: the stream is steady by then
TIMEOUT = 60.0


def _produce(q, n: int) -> None:
    for i in range(n):
        q.put({f"t{j}": torch.full((256,), float(i * 64 + j)) for j in range(64)})
    q.put(None)
    q.close()
    q.join_thread()


def _records(counters: dict) -> int:
    return sum(n for op, n in counters["records"].items() if op != "P")


def test_a_steady_stream_costs_no_broker_record_per_message(strategy):
    client = broker_client.client_for(program.current().directory, program.current().root_pid)
    ctx = tmp.get_context("fork")
    q = ctx.Queue(maxsize=8)
    with running(ctx.Process(target=_produce, args=(q, MESSAGES)), TIMEOUT):
        before = None
        received = 0
        last = None
        while True:
            msg = q.get(timeout=TIMEOUT)
            if msg is None:
                break
            assert [float(msg[f"t{j}"][0]) for j in (0, 63)] == [received * 64.0, received * 64.0 + 63], received
            received += 1
            if received == MESSAGES - MEASURED:
                before = client.ping()
            last = msg
    assert received == MESSAGES and before is not None and last is not None
    after = client.ping()
    records = _records(after) - _records(before)
    # One message a record would be 400; per slab generation (16 messages of 64 KiB
    # each in a 1 MiB slab) a few: a hold, a release, now and then a fetch.
    assert records < MEASURED // 4, (records, before["records"], after["records"])

    # The last message's refs: all loaded, and this process holds their generation.
    place = cache.place_of(last["t0"].untyped_storage())
    assert place is not None
    gen, sent, loaded, holders = _native.hdr_read(place.segment.addr)
    assert gen == place.gen & (1 << 64) - 1
    assert sent == loaded and holders >= 1, (sent, loaded, holders)


def _two_slabs(conn) -> None:
    # Pickled in this thread (a pipe, not a queue's feeder thread): two messages in
    # one slab, then the slab is finished, then one message in the next.
    for i in range(2):
        conn.send({"t": torch.full((256,), float(i))})
    conn.recv()  # the receiver parked the slab's generation
    transfer.let_go_slabs()
    conn.send({"t": torch.full((256,), 9.0)})
    conn.recv()  # until the receiver is done
    conn.close()


def test_a_receiver_lets_go_of_a_finished_slab_at_once(strategy, monkeypatch):
    # Its owner marks a slab finished when it moves on: the receiver lets go of the
    # generation it kept parked as soon as its storages here die, not LINGER after
    # its last use (made an hour here).
    monkeypatch.setattr(pool, "LINGER", 3600.0)
    ctx = tmp.get_context("fork")
    here, there = ctx.Pipe()
    with running(ctx.Process(target=_two_slabs, args=(there,)), TIMEOUT):
        assert here.poll(TIMEOUT)
        first = here.recv()
        place = cache.place_of(first["t"].untyped_storage())
        assert place is not None
        seg, gen = place.segment, place.gen
        del first, place
        transfer.collect(linger=3600.0)  # its last storage died: let go of (a new token next time)
        assert here.poll(TIMEOUT)
        second = here.recv()  # the same generation in a second message: held again, and parked
        assert (seg.kind, seg.key) in pool._parked
        assert not _native.hdr_finished(seg.addr, gen)
        del second
        here.send("parked")
        assert here.poll(TIMEOUT)
        third = here.recv()  # another slab's: the first one is finished, and let go of
        assert float(third["t"][0]) == 9.0
        assert (seg.kind, seg.key) not in pool._parked

        def released() -> bool:
            transfer.collect(linger=3600.0)
            return _native.hdr_read(seg.addr)[3] == 0  # no holder left

        assert wait_for(released, 10), _native.hdr_read(seg.addr)
        here.send("done")
