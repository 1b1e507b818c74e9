"""Actor-learner: actors send trajectories (dicts of tensors), the learner sends weights back.

A fixed number of steps, so it always ends: each actor waits for weights, plays one
"episode" with them, sends the trajectory, and repeats; the learner consumes
trajectories in arrival order, updates its weights and returns them to that actor.
"""

from __future__ import annotations

import multiprocessing as mp

import torch

import shmreduce

N_ACTORS = 3
STEPS = 10  # per actor
T, OBS = 32, 4
TIMEOUT = 30.0


def actor(rank: int, weights_q: mp.Queue, traj_q: mp.Queue) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    for _step in range(STEPS):
        weights = weights_q.get(timeout=TIMEOUT)  # shared, not copied
        obs = torch.randn(T, OBS, generator=g)
        logits = obs @ weights["w"]
        traj_q.put(
            {
                "actor": torch.tensor(rank),
                "version": weights["version"].clone(),
                "obs": obs,
                "actions": logits.argmax(dim=1),
                "rewards": torch.rand(T, generator=g),
                "logits": logits,
            }
        )


def main() -> None:
    shmreduce.register()
    try:
        traj_q: mp.Queue = mp.Queue()
        weights_qs = [mp.Queue() for _ in range(N_ACTORS)]
        actors = [mp.Process(target=actor, args=(r, weights_qs[r], traj_q)) for r in range(N_ACTORS)]
        for p in actors:
            p.start()
        w = torch.zeros(OBS, 2)
        version = 0
        for q in weights_qs:
            q.put({"w": w.clone(), "version": torch.tensor(version)})
        seen = [0] * N_ACTORS
        for _ in range(N_ACTORS * STEPS):
            traj = traj_q.get(timeout=TIMEOUT)
            rank = int(traj["actor"])
            assert traj["obs"].shape == (T, OBS) and traj["obs"].is_shared()
            # "learn": a tiny policy-gradient-flavoured update
            w += 0.01 * traj["obs"].T @ torch.nn.functional.one_hot(traj["actions"], 2).float() * traj["rewards"].mean()
            version += 1
            seen[rank] += 1
            if seen[rank] < STEPS:
                weights_qs[rank].put({"w": w.clone(), "version": torch.tensor(version)})
        for p in actors:
            p.join(TIMEOUT)
            assert p.exitcode == 0, p.exitcode
        s = shmreduce.stats()
        print(
            f"learner: {sum(seen)} trajectories from {N_ACTORS} actors, final version {version}, "
            f"{s['messages_received']} messages / {s['storages_received']} storages received"
        )
        assert seen == [STEPS] * N_ACTORS
    finally:
        shmreduce.unregister()
    print("actor_learner: OK")


if __name__ == "__main__":
    main()
