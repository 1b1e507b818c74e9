"""``register()`` that runs before multiprocessing's spawn bootstrap: from
``sitecustomize.py`` or a ``.pth`` file (a site-wide hook, a launcher). A spawn child
runs it before it knows it is a child, and the forkserver runs it too, before any
child is asked of it. Such a child must still join its parent's program: one made of
its own went with the child, and a message it put before exiting could not be
received ('no such program directory'); received at once, it kept the child's broker
(two processes) alive and a socket and a memfd in the parent for each child, for
the parent's life.

Each case is a fresh program whose hook registers every process it starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from helpers import brokers_under, shm_base, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILDREN = 4
TIMEOUT = 240

REGISTER = 'import os, shmreduce; shmreduce.register(strategy=os.environ["SHMREDUCE_EARLY_STRATEGY"])'

# sitecustomize.py, and the .pth file it makes a site directory of: a .pth file is
# read only in a site directory, which PYTHONPATH's entries are not.
HOOKS = {
    "sitecustomize": {"sitecustomize.py": REGISTER + "\n"},
    "pth": {
        "sitecustomize.py": "import os, site\nsite.addsitedir(os.path.join(os.path.dirname(__file__), 'site'))\n",
        os.path.join("site", "shmreduce_early.pth"): REGISTER + "\n",
    },
}

PROGRAM = textwrap.dedent(
    """
    import gc, json, multiprocessing as mp, os, sys, time
    import torch, shmreduce
    from shmreduce import program

    def produce(q):
        q.put(torch.arange(1000.0))  # and exit at once

    def brokers():
        # pid -> directory of every broker process under this program's shm base
        base = program.shm_base().encode() + b"/"
        found = {}
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\\0")
            except OSError:
                continue
            if b"shmreduce.broker.server" in argv:
                found.update({int(entry): a.decode() for a in argv if a.startswith(base)})
        return found

    def held():
        kinds = {"socket": 0, "memfd": 0}
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            kinds["socket"] += target.startswith("socket:")
            kinds["memfd"] += target.startswith("/memfd:")
        return kinds

    def others_gone(mine):
        deadline = time.monotonic() + 15
        while set(brokers().values()) - {mine} and time.monotonic() < deadline:
            time.sleep(0.05)

    def received(q):
        try:
            t = q.get(timeout=60)
        except shmreduce.SharingError as exc:
            return str(exc)
        return torch.equal(t, torch.arange(1000.0))

    if __name__ == "__main__":
        assert shmreduce.is_registered()  # by the hook, before this module ran
        ctx = mp.get_context(sys.argv[1])
        q = ctx.Queue()
        mine = program.current().directory

        # Received after the child exited, and after any program of its own went.
        p = ctx.Process(target=produce, args=(q,))
        p.start()
        p.join(60)
        others_gone(mine)
        late = received(q)

        # Received at once, child after child: what the parent holds stays as it was.
        rows = []
        for _ in range(int(sys.argv[2])):
            p = ctx.Process(target=produce, args=(q,))
            p.start()
            ok = received(q)
            p.join(60)
            gc.collect()
            found = brokers()
            rows.append({"ok": ok, "brokers": len(found), "directories": sorted(set(found.values())), **held()})
        torch_in = []  # brokers that imported torch (the hook runs in them too)
        for pid in brokers():
            try:
                with open(f"/proc/{pid}/maps", "rb") as f:
                    torch_in += [pid] if b"libtorch" in f.read() else []
            except OSError:
                pass
        print(json.dumps({"mine": mine, "late": late, "rows": rows, "torch_in_broker": torch_in}), flush=True)
    """
)


@pytest.fixture
def private_base():
    """A shm base of the case's own: what is left under it is the case's."""
    base = tempfile.mkdtemp(prefix="early-", dir=shm_base())
    try:
        yield base
    finally:
        wait_for(lambda: not brokers_under(base), 15)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("strategy_name", ["file_descriptor", "file_system"])
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_a_child_registered_before_its_bootstrap_joins_its_parents_program(tmp_path, private_base, hook, method, strategy_name):
    for name, text in HOOKS[hook].items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    script = tmp_path / "early_main.py"
    script.write_text(PROGRAM)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]),
        SHMREDUCE_SHM_DIR=private_base,
        SHMREDUCE_EARLY_STRATEGY=strategy_name,
    )
    done = subprocess.run([sys.executable, str(script), method, str(CHILDREN)], capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])

    rows = result["rows"]
    # Bounded: what the parent holds after the last child is what it held after the first.
    first, last = rows[0], rows[-1]
    assert (last["brokers"], last["socket"], last["memfd"]) == (first["brokers"], first["socket"], first["memfd"]), result
    assert result["late"] is True and all(row["ok"] is True for row in rows), result
    # Every broker is the parent's program's: no child started one of its own.
    assert all(row["directories"] == [result["mine"]] for row in rows), result
    # The hook's register() does nothing in the broker, which never imports torch.
    assert result["torch_in_broker"] == [], result

    # The program exited: its broker and its directory go with it.
    assert wait_for(lambda: not brokers_under(private_base), 15), brokers_under(private_base)
    assert wait_for(lambda: not os.listdir(private_base), 15), os.listdir(private_base)
