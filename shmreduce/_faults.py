"""Fault points for tests: ``SHMREDUCE_FAULT_AT=<point>`` makes this process SIGKILL
itself when it reaches the named point, so a test kills a process at an exact step of
a protocol instead of by timing luck. Read at each point (a test's fork child sets it
in its own environment); unset, nothing changes.

``pauses[<point>] = hook`` runs *hook* (no arguments) in whatever thread reaches the
point: a test pauses one thread exactly where another can act (the threads of one
process are actors too, as its processes are). ``pause(<point>)`` marks a point only
threads are paused at (on a per-message path: empty, it costs one truth test).

Points (``broker/protocol.py``, "Lifetimes", says what each step does):
``load.ledger``   a first load's ledger entry written (taking), the header not counted yet
``load.hold``     the header's holders counted, the ledger entry not yet held
``load.counted``  the ref counted loaded
``letgo.ledger``  a let-go's ledger entry marked (dropping), holders not counted out yet
``letgo.unhold``  holders counted out, the ledger entry not cleared yet

Pause points (``pause``):
``load.gen``    a load found no live Gen of its generation here, before it makes one
``send.counted``  a sending scope closes, its refs not yet counted sent
``reap.end``      ``Pool.reap_waiting`` took its snapshot of the waiting segments, before it ends one
``pool.closing``  a pool closes a free segment it trimmed (its memfd dropped, its file released)
``pool.new_current``  a thread's next slab or arena is made, not its current one yet
``broker.launch``  the broker's launcher is started, its answer not read yet
``prepare.torch``  ``reductions.prepare`` holds its lock, the dtype table not built yet
``registry.locked``  ``register()`` holds the registry's lock
``fork.waits``  a fork's before-hook is about to wait for one of those two locks
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

_environ = os.environ
pauses: dict[str, Callable[[], None]] = {}


def point(name: str) -> None:
    """Die here if this is the point the environment names (read at each call: the
    points are on per-generation paths, and a test's child sets it after its fork);
    run the hook a test set for it."""
    if pauses:
        hook = pauses.get(name)
        if hook is not None:
            hook()
    if _environ.get("SHMREDUCE_FAULT_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def pause(name: str) -> None:
    """Run the hook a test set for *name*, if any (a point no process is killed at)."""
    if pauses:
        hook = pauses.get(name)
        if hook is not None:
            hook()
