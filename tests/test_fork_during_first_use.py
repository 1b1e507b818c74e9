"""Errors, never hangs, at a program's first uses: a fork while another thread initializes what
shmreduce or torch initializes on first use never hangs the child.

torch initializes an op, an argument parser or its quantized engine in a C++ static on
first use; a child forked while another thread is inside such an initialization
inherits its guard "in progress" and waits on it for ever the first time it takes that
path. In torch's ``test_fs_sharing`` pattern (register, put ``[x, x[:, 1]]`` on a queue,
fork a Process that gets it) the queue's feeder thread, left to build the dtype table,
is inside torch's quantized engine's initialization when the main thread forks. So
``register()`` initializes all that in its caller's thread, and a fork waits for an
initialization in progress on another thread.

Two tests. A program that hung this way, unchanged, in fresh interpreters, with torch's first-use
initializations slowed on every thread but the main one and each fork made to land
inside one if any is under way (``slow_first_use.c``): a first use left to another
thread hangs the child every time, and the log names every one. And fresh programs
(``first_use_programs.py``) stopped at each first-use initialization of shmreduce's
that a thread other than the caller of ``register()`` reaches, or that such a thread
can be inside of, while the main thread forks.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import sysconfig

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROGRAMS = 50  # of each kind, per strategy
FRESH = 2  # fresh interpreters per strategy, at once

# A program that hung this way, unchanged.
ISSUE_PROGRAM = """\
import sys, torch, torch.multiprocessing as mp, shmreduce
def fill(queue, event):
    data = queue.get()
    data[0][:] = 4
    event.set()
if __name__ == "__main__":
    shmreduce.register(strategy=sys.argv[1])
    x = torch.zeros(5, 5)
    q = mp.Queue(); e = mp.Event()
    data = [x, x[:, 1]]
    q.put(data)
    p = mp.Process(target=fill, args=(q, e)); p.daemon = True; p.start()
    print("filled", e.wait(15) and bool(data[0].eq(4).all()))
"""

# Runs the program named by argv[1] with a fork that, before it is made, waits (2 s at
# most) until another thread is inside a first-use initialization of torch's.
WITH_FORKS_INSIDE = """\
import ctypes, os, runpy, sys
slow = ctypes.CDLL(os.environ["SLOW_FIRST_USE_LIB"])
os.register_at_fork(before=lambda: slow.slow_first_use_wait(2000))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


@pytest.fixture(scope="module")
def slow_first_use(tmp_path_factory: pytest.TempPathFactory) -> str:
    """slow_first_use.c, built."""
    lib = str(tmp_path_factory.mktemp("slow") / "slow_first_use.so")
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    subprocess.run([*cc, "-shared", "-fPIC", "-O1", "-o", lib, os.path.join(HERE, "slow_first_use.c"), "-ldl"], check=True, timeout=120)
    return lib


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_the_fs_sharing_pattern_never_hangs_its_child_however_slow_torchs_first_uses(strategy, slow_first_use, tmp_path):
    program = tmp_path / "fs_sharing.py"
    program.write_text(ISSUE_PROGRAM)
    logs = [tmp_path / f"first-uses-{i}.log" for i in range(FRESH)]
    # The sanitizer runtimes, if preloaded, stay first.
    preload = " ".join(p for p in (os.environ.get("LD_PRELOAD"), slow_first_use) if p)
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", WITH_FORKS_INSIDE, str(program), strategy],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(LD_PRELOAD=preload, SLOW_FIRST_USE_LIB=slow_first_use, SLOW_FIRST_USE_LOG=str(log)),
        )
        for log in logs
    ]
    outputs = [run.communicate(timeout=240) for run in runs]
    for (out, err), log in zip(outputs, logs, strict=True):
        assert out.strip() == "filled True", f"the child never filled the tensor (it hung): {out!r}\n{err}"
        first_uses = log.read_text() if log.exists() else ""
        assert not first_uses, f"a thread other than the main one initialized something in torch:\n{first_uses}"


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_a_fork_while_a_thread_is_at_a_first_use_initialization_never_hangs_the_child(strategy):
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "first_use_programs.py"), strategy, str(PROGRAMS)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=280,
    )
    assert out.returncode == 0, out.stderr
    codes = json.loads(out.stdout)
    failed = {kind: [code for code in kind_codes if code != 0] for kind, kind_codes in codes.items()}
    assert codes and not any(failed.values()), (
        f"programs that failed (first_use_programs.py says what each code means): {failed}\n{out.stderr}"
    )
