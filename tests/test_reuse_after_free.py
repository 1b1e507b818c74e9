"""Kept tensors keep their bytes while their sender reuses its memory.

The failure a lifetime bug would show: a generation counted dead while a storage of
it lives somewhere (a receiver, or a third process it was forwarded to), its segment
reused by the sender, the kept tensor overwritten. A producer streams thousands of
fresh messages (a small tensor in its slab, a larger one in a segment of its own,
which is reused as soon as nobody holds it); the consumer keeps every 40th message
and forwards every 7th to a third process that keeps them all; at the end each kept
tensor must still hold the value it was sent with.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import torch

MESSAGES = 2000
SMALL = 256  # float32: 1 KiB, packed in the producer's slab
LARGE = 25_000  # float32: 100 KB, a pooled segment of its own
KEEP_EVERY = 40
FORWARD_EVERY = 7
TIMEOUT = 60.0

CTX = mp.get_context("fork")


def _message(i: int) -> dict[str, torch.Tensor]:
    return {"i": torch.tensor(i), "small": torch.full((SMALL,), float(i)), "large": torch.full((LARGE,), float(-i))}


def _intact(msg: dict[str, torch.Tensor]) -> bool:
    i = float(msg["i"])
    return bool((msg["small"] == i).all()) and bool((msg["large"] == -i).all())


def _producer(out: Any) -> None:
    for i in range(MESSAGES):
        out.put(_message(i), timeout=TIMEOUT)
    out.put(None, timeout=TIMEOUT)


def _consumer(inbox: Any, forward: Any, report: Any) -> None:
    kept, wrong_on_arrival = [], 0
    while (msg := inbox.get(timeout=TIMEOUT)) is not None:
        i = int(msg["i"])
        if not _intact(msg):
            wrong_on_arrival += 1
        if i % KEEP_EVERY == 0:
            kept.append(msg)
        if i % FORWARD_EVERY == 0:
            forward.put(msg, timeout=TIMEOUT)
        del msg  # the rest die here: their generations end while the producer goes on
    forward.put(None, timeout=TIMEOUT)
    report.put(("consumer", len(kept), wrong_on_arrival, sum(not _intact(m) for m in kept)))


def _keeper(inbox: Any, report: Any) -> None:
    kept = []
    while (msg := inbox.get(timeout=TIMEOUT)) is not None:
        kept.append(msg)
    report.put(("keeper", len(kept), 0, sum(not _intact(m) for m in kept)))


def test_kept_and_forwarded_tensors_keep_their_bytes(strategy: str) -> None:
    to_consumer, to_keeper, report = CTX.Queue(maxsize=64), CTX.Queue(maxsize=64), CTX.Queue()
    procs = [
        CTX.Process(target=_producer, args=(to_consumer,)),
        CTX.Process(target=_consumer, args=(to_consumer, to_keeper, report)),
        CTX.Process(target=_keeper, args=(to_keeper, report)),
    ]
    for p in procs:
        p.start()
    try:
        results = {r[0]: r[1:] for r in (report.get(timeout=TIMEOUT * 2) for _ in range(2))}
    finally:
        for p in procs:
            p.join(TIMEOUT)
            if p.is_alive():
                p.kill()
                p.join()
    assert results["consumer"] == (len(range(0, MESSAGES, KEEP_EVERY)), 0, 0), results
    assert results["keeper"] == (len(range(0, MESSAGES, FORWARD_EVERY)), 0, 0), results
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
