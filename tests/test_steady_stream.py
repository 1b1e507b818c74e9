"""A steady stream costs the broker nothing per message.

Refs are counted sent and loaded in their segments' shared headers: the broker
hears once per segment (a memfd deposited, fetched by a receiver that does not map
it yet) and once per generation a receiver holds, never once per message. Counted
with the broker's own tally of the records it read (``ping()["records"]``), over a
stream of dicts of 64 small tensors through an ``mp.Queue``, both strategies. Then
the books balance: every ref sent was loaded, nothing is left in flight.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as tmp

from shmreduce import _native, program, transfer
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


@pytest.mark.swap_path
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


def _one_slab(conn) -> None:
    # Pickled in this thread (a pipe, not a queue's feeder thread): six messages in
    # one slab, each after the receiver dropped the one before.
    for i in range(6):
        conn.send({"t": torch.full((256,), float(i))})
        conn.recv()
    conn.close()


@pytest.mark.swap_path
def test_a_slabs_generation_is_held_once_and_let_go_of_with_its_last_storage(strategy):
    # A receiver that drops each message before the next: the next message's storage
    # revives its Gen of the slab's generation (one hold, no new Gen), and once
    # its last storage here dies, the generation is let go of at the next settle:
    # the header's holders go back to 0, and its ledger entry is cleared.
    ctx = tmp.get_context("fork")
    here, there = ctx.Pipe()
    loads = []
    real = transfer.receive_tensor

    def counted(*args):
        loads.append(args[0])
        return real(*args)

    with running(ctx.Process(target=_one_slab, args=(there,)), TIMEOUT):
        transfer.receive_tensor = counted  # the general path, taken once per new Gen
        try:
            for i in range(6):
                assert here.poll(TIMEOUT)
                msg = here.recv()
                assert float(msg["t"][0]) == float(i)
                place = cache.place_of(msg["t"].untyped_storage())
                assert place is not None
                seg = place.segment
                assert _native.hdr_read(seg.addr)[3] == 1  # held once, by this process
                del msg, place
                here.send("next")
        finally:
            transfer.receive_tensor = real
        # Then _native.rebuild, through the revived Gen; a new one only where the
        # collector thread (every 0.5 s) settled it between two messages.
        assert len(loads) <= 3, loads

        def released() -> bool:
            transfer.collect()
            return _native.hdr_read(seg.addr)[3] == 0  # no holder left

        assert wait_for(released, 10), _native.hdr_read(seg.addr)  # type: ignore[possibly-undefined]  # the loop above ran six times
