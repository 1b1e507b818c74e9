"""Quickstart: register once, then any multiprocessing pipeline shares tensors.

Run: python examples/quickstart.py
"""

import multiprocessing as mp

import torch

import shmreduce


def producer(queue: "mp.Queue", n: int) -> None:
    for i in range(n):
        # Fresh tensors each message; no copy of their bytes goes through the pipe.
        queue.put({"step": i, "obs": torch.full((4, 84, 84), float(i)), "reward": torch.tensor(i * 0.5)})
    queue.put(None)


def main() -> None:
    shmreduce.register()  # once, at program start; children run registered too
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=producer, args=(queue, 8))
    proc.start()
    total = 0.0
    while (msg := queue.get(timeout=60)) is not None:
        assert msg["obs"].is_shared()
        total += msg["obs"][0, 0, 0].item() + msg["reward"].item()
    proc.join(30)
    stats = shmreduce.stats()
    print(
        f"received {stats['storages_received']} storages in {stats['messages_received']} messages, "
        f"{stats['round_trips']} broker round trips; checksum {total}"
    )
    shmreduce.unregister()


if __name__ == "__main__":
    main()
