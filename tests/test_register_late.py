"""``register()`` after worker processes exist: those workers were
started with torch's reducers (a fork child inherits them; a spawn child has no
marker to register it), so what they send does not go through shmreduce. It
warns once, on ``logging.getLogger("shmreduce")``, naming the
workers and what to move. Workers started while registered (the marker in their
process config) are fine and not named.

Each case is a fresh program, as a user runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent(
    """
    import multiprocessing as mp, sys
    import torch, shmreduce

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.full((4,), float(i))

    def double(t):
        return t * 2

    if __name__ == "__main__":
        case = sys.argv[1]
        ctx = mp.get_context("fork")
        if case == "pool":
            pool = ctx.Pool(2)
            shmreduce.register()
            assert pool.map(double, [torch.ones(3)])[0].eq(2).all()
            pool.close(); pool.join()
        elif case == "dataloader":
            loader = torch.utils.data.DataLoader(Rows(), batch_size=4, num_workers=2, persistent_workers=True)
            assert len(list(loader)) == 2  # the workers start, and stay
            shmreduce.register()
            assert len(list(loader)) == 2
            del loader
        elif case == "twice":  # warned once, however often register() finds them
            pool = ctx.Pool(1)
            shmreduce.register(); shmreduce.unregister(); shmreduce.register()
            pool.close(); pool.join()
        elif case == "registered_first":  # nothing to say: the workers run registered
            shmreduce.register()
            pool = ctx.Pool(1)
            shmreduce.unregister(); shmreduce.register()  # and a re-register finds them registered
            assert pool.map(double, [torch.ones(3)])[0].eq(2).all()
            pool.close(); pool.join()
        print("done")
    """
)


def _run(case: str) -> str:
    done = subprocess.run([sys.executable, "-c", PROGRAM, case], env=dict(os.environ), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-3000:]
    return done.stderr


@pytest.mark.parametrize(("case", "named"), [("pool", "ForkPoolWorker-"), ("dataloader", "Process-")])
def test_register_after_workers_exist_warns_once_naming_them(case, named):
    stderr = _run(case)
    assert stderr.count("register() was called after") == 1, stderr[-3000:]
    assert named in stderr and "before" in stderr, stderr[-3000:]


def test_the_warning_is_given_once_per_process():
    assert _run("twice").count("register() was called after") == 1


def test_workers_started_while_registered_are_not_named():
    assert "register() was called after" not in _run("registered_first")
