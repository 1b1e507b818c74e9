"""What this process does at a ``fork()``: every part's handlers, in one written order.

Each part keeps its own state and its own handlers (named functions in its module,
next to the state they reset) and hands them over here once, at its import
(``part``); this module alone registers them with ``os.register_at_fork``, one part
after the other in ``PARTS``' order, so that the order is this list, not the order in
which modules happen to be imported. As ``os.register_at_fork`` runs them, handlers
before the fork run in the reverse of that order, handlers after it in that order,
each on its own (one that raises is reported and the others still run).

Before the fork, on the forking thread, in the parent:

1. ``registry``: wait for a register(), unregister() or reducer change on another
   thread (its lock, held across the fork: the child would inherit it held by a
   thread it does not have);
2. ``reductions``: wait for a first-use preparation on another thread (its lock,
   held likewise);
3. ``transfer``: every generation with a storage alive here is retired in its header
   (``segments.retire_in_use``): the child keeps those storages without holding them;
4. ``broker.client``: wait for a broker launch on another thread (its launch lock).

After it, in the parent: the locks taken before are let go of (broker client,
reductions, registry). In the child, in this order:

1. ``segments``: a new file-name prefix; the parent's Gens and deposits are
   forgotten (the child neither revives the parent's Gens nor sends from its
   deposits);
2. ``pool``: a new generation-number prefix;
3. ``broker.client``: the parent's connections, ledgers and launch are closed, never
   written on;
4. ``cache``: a new lock;
5. ``transfer``: new locks, empty pools, no collector thread, no watched connection;
6. ``reductions``: its lock let go of;
7. ``registry``: its lock let go of, and the parent's dumps in flight forgotten.

Segments before pool before transfer: transfer's reset of the pools follows the
reset of what they are made of. This module imports nothing of shmreduce: any part
imports it without a circle.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

PARTS = ("segments", "pool", "broker.client", "cache", "transfer", "reductions", "registry")

_WHEN = ("before", "after_in_parent", "after_in_child")
_handlers: dict[str, dict[str, Callable[[], None]]] = {name: {} for name in PARTS}


def part(
    name: str,
    *,
    before: Callable[[], None] | None = None,
    after_in_parent: Callable[[], None] | None = None,
    after_in_child: Callable[[], None] | None = None,
) -> None:
    """The fork handlers of the part *name* (one of ``PARTS``), given once, at its import."""
    given = {"before": before, "after_in_parent": after_in_parent, "after_in_child": after_in_child}
    _handlers[name].update((when, handler) for when, handler in given.items() if handler is not None)


def _run(name: str, when: str) -> None:
    handler = _handlers[name].get(when)
    if handler is not None:
        handler()


for _name in PARTS:
    os.register_at_fork(**{when: functools.partial(_run, _name, when) for when in _WHEN})
