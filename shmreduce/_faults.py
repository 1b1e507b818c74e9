"""Fault points for tests: ``SHMREDUCE_FAULT_AT=<point>`` makes this process SIGKILL
itself when it reaches the named point, so a test kills a process at an exact step of
a protocol instead of by timing luck. Read at each point (a test's fork child sets it
in its own environment); unset, nothing changes.

Points (``broker/protocol.py``, "Lifetimes", says what each step does):
``load.ledger``   a first load's ledger entry written (taking), the header not counted yet
``load.hold``     the header's holders counted, the ledger entry not yet held
``load.counted``  the ref counted loaded
``letgo.ledger``  a let-go's ledger entry marked (dropping), holders not counted out yet
``letgo.unhold``  holders counted out, the ledger entry not cleared yet
"""

from __future__ import annotations

import os
import signal

_environ = os.environ


def point(name: str) -> None:
    """Die here if this is the point the environment names (read at each call: the
    points are on per-generation paths, and a test's child sets it after its fork)."""
    if _environ.get("SHMREDUCE_FAULT_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
