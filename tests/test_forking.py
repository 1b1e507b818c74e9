"""What a process does at a fork runs in the order ``shmreduce/forking.py`` writes down,
whatever order the package's modules were imported in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from shmreduce import forking

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 60

# A fresh interpreter: imports the parts in the order given on its command line, wraps
# every handler they handed over so that it notes its part, forks once and prints the
# order each side saw.
_PROGRAM = textwrap.dedent(
    """
    import importlib, os, sys
    for name in sys.argv[1:]:
        importlib.import_module(name)
    from shmreduce import forking
    seen = []
    for part, handlers in forking._handlers.items():
        for when, handler in list(handlers.items()):
            def noted(part=part, when=when, handler=handler):
                seen.append((when, part))
                handler()
            handlers[when] = noted
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, repr(seen).encode())
        os._exit(0)
    os.close(w)
    child = b""
    while chunk := os.read(r, 65536):
        child += chunk
    os.waitpid(pid, 0)
    print(repr({p: sorted(h) for p, h in forking._handlers.items()}))
    print(repr(seen))
    print(child.decode())
    """
)


def _fork_order(imports: list[str]) -> tuple[dict, list, list]:
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM, *imports],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert out.returncode == 0, out.stderr
    handed, parent, child = (eval(line) for line in out.stdout.splitlines()[-3:])  # noqa: S307  our own repr
    return handed, parent, child


def _of(seen: list, when: str) -> list[str]:
    return [part for w, part in seen if w == when]


def test_every_part_hands_over_its_handlers_at_its_import():
    handed, _, _ = _fork_order(["shmreduce.registry", "shmreduce.transfer"])
    assert all(handed[name] for name in forking.PARTS), handed
    assert set(handed) == set(forking.PARTS)


def test_the_handlers_run_in_the_written_order_whatever_the_import_order():
    for imports in (["shmreduce.transfer", "shmreduce.registry"], ["shmreduce.registry", "shmreduce.segments"]):
        handed, parent, child = _fork_order(imports)
        written = list(forking.PARTS)
        assert _of(parent, "before") == [p for p in reversed(written) if "before" in handed[p]], imports
        assert _of(parent, "after_in_parent") == [p for p in written if "after_in_parent" in handed[p]], imports
        # The child inherits the parent's "before" notes, then adds its own.
        assert _of(child, "after_in_child") == [p for p in written if "after_in_child" in handed[p]], imports
        assert _of(parent, "after_in_child") == []
