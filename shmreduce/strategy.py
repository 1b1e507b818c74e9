"""The sharing-strategy toggle: one switch, shared with torch.multiprocessing.

The value lives in ``torch.multiprocessing`` (its ``_sharing_strategy``), so
``shmreduce.set_sharing_strategy`` and ``torch.multiprocessing.set_sharing_strategy``
are one toggle: setting either changes what both getters return. While registered,
torch's setter is ``patches``'s, which checks the name here first: an invalid one is
the same ``ValueError`` from either (torch's own raises ``AssertionError``).
"""

from __future__ import annotations

import torch.multiprocessing as _tmp

from shmreduce._platform import HAVE_MEMFD, HAVE_SEQPACKET

_OURS = {"file_system"} | ({"file_descriptor"} if HAVE_MEMFD and HAVE_SEQPACKET else set())


def get_all_sharing_strategies() -> set[str]:
    """The strategies this system supports: on Linux {'file_descriptor', 'file_system'}."""
    return set(_tmp.get_all_sharing_strategies()) & _OURS


def get_sharing_strategy() -> str:
    """The current strategy (default 'file_descriptor' on Linux)."""
    return _tmp.get_sharing_strategy()


def check(name: str) -> None:
    """ValueError naming the valid strategies unless *name* is one: the one error of
    both toggles (``patches`` makes torch's raise it too while registered)."""
    valid = get_all_sharing_strategies()
    if name not in valid:
        raise ValueError(f"invalid sharing strategy {name!r}; choose one of {sorted(valid)}")


def set_sharing_strategy(name: str) -> None:
    """Select how new CPU storages are shared: 'file_descriptor' or 'file_system'."""
    check(name)
    _tmp.set_sharing_strategy(name)
