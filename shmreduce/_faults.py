"""Fault points for tests: ``SHMREDUCE_FAULT_AT=<point>`` makes this process SIGKILL
itself when it reaches the named point, so a test kills a process at an exact step of
a protocol instead of by timing luck. Read once at import (a child started with the
variable set has it; nothing else changes).

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

AT = os.environ.get("SHMREDUCE_FAULT_AT", "")


def point(name: str) -> None:
    """Die here if this is the point the environment names."""
    if AT == name:
        os.kill(os.getpid(), signal.SIGKILL)
