"""Quickstart: register once, then any multiprocessing pipeline shares tensors.

Run: python examples/quickstart.py

A producer puts 200 messages (a 4x84x84 float tensor, 112 KiB, and a scalar) on a
bounded queue; the main process reads them and prints what it received and what it
cost the broker. The first messages each bring a segment the receiver does not map
yet (one broker round trip each: the start-up case); once the producer's pool reuses
its segments, which the receiver keeps mapped, a message costs no round trip (the
steady case). A run on 2 cores printed:

    received 400 storages in 200 messages, all through shmreduce
    broker round trips: 7 in the first 8 messages (a segment not mapped here yet, each), 0 in the 192 after
    quickstart: OK

The counts vary a little from run to run with timing: how many segments the producer
makes before the first ones come back for reuse.
"""

import multiprocessing as mp

import torch

import shmreduce

MESSAGES = 200
START = 8  # the first messages: the start-up case


def producer(queue: "mp.Queue", n: int) -> None:
    for i in range(n):
        # Fresh tensors each message; no copy of their bytes goes through the pipe.
        queue.put({"step": i, "obs": torch.full((4, 84, 84), float(i)), "reward": torch.tensor(i * 0.5)})
    queue.put(None)


def main() -> None:
    shmreduce.register()  # once, at program start; children run registered too
    ctx = mp.get_context("spawn")
    queue = ctx.Queue(maxsize=4)  # bounded: the producer stays a few messages ahead
    proc = ctx.Process(target=producer, args=(queue, MESSAGES))
    proc.start()
    total, count, at_start = 0.0, 0, 0
    while (msg := queue.get(timeout=60)) is not None:
        assert msg["obs"].is_shared()
        total += msg["obs"][0, 0, 0].item() + msg["reward"].item()
        count += 1
        if count == START:
            at_start = shmreduce.stats()["round_trips"]
        del msg
    proc.join(30)
    assert proc.exitcode == 0, proc.exitcode
    assert total == sum(i * 1.5 for i in range(MESSAGES)), total
    stats = shmreduce.stats()
    # Is it working? messages_received counts the messages loaded through shmreduce here:
    # 0 would mean they went through torch's reducers (register() called too late).
    assert stats["messages_received"] == MESSAGES, stats["messages_received"]
    print(f"received {stats['storages_received']} storages in {stats['messages_received']} messages, all through shmreduce")
    print(
        f"broker round trips: {at_start} in the first {START} messages (a segment not mapped here yet, each), "
        f"{stats['round_trips'] - at_start} in the {MESSAGES - START} after"
    )
    shmreduce.unregister()
    print("quickstart: OK")


if __name__ == "__main__":
    main()
