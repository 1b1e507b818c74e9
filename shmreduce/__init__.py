"""shmreduce: fast, safe sharing of PyTorch tensors between processes.

Importing shmreduce changes nothing (and does not import torch: the broker process
imports this package too); ``register()`` installs the reducers, ``unregister()``
removes them. The public names below load their modules on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "register": "shmreduce.registry",
    "unregister": "shmreduce.registry",
    "is_registered": "shmreduce.registry",
    "registered": "shmreduce.registry",
    "register_reducer": "shmreduce.registry",
    "unregister_reducer": "shmreduce.registry",
    "list_reducers": "shmreduce.registry",
    "dispatch_table": "shmreduce.registry",
    "dumps": "shmreduce.registry",
    "loads": "shmreduce.registry",
    "set_sharing_strategy": "shmreduce.strategy",
    "get_sharing_strategy": "shmreduce.strategy",
    "get_all_sharing_strategies": "shmreduce.strategy",
    "stats": "shmreduce.stats",
    "SharingError": "shmreduce.errors",
    "share_numpy": "shmreduce.numpy_support",
    "unshare_numpy": "shmreduce.numpy_support",
}

# Submodules reached as attributes, loaded on first access as the names above:
# ``shmreduce.distributed.broadcast_local`` after ``import shmreduce``, as ``torch.distributed``.
_SUBMODULES = {"distributed"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    # For type checkers and IDEs: the names __getattr__ loads lazily ("X as X" marks a re-export).
    from shmreduce import distributed as distributed
    from shmreduce.errors import SharingError as SharingError
    from shmreduce.numpy_support import share_numpy as share_numpy
    from shmreduce.numpy_support import unshare_numpy as unshare_numpy
    from shmreduce.registry import dispatch_table as dispatch_table
    from shmreduce.registry import dumps as dumps
    from shmreduce.registry import is_registered as is_registered
    from shmreduce.registry import list_reducers as list_reducers
    from shmreduce.registry import loads as loads
    from shmreduce.registry import register as register
    from shmreduce.registry import register_reducer as register_reducer
    from shmreduce.registry import registered as registered
    from shmreduce.registry import unregister as unregister
    from shmreduce.registry import unregister_reducer as unregister_reducer
    from shmreduce.stats import stats as stats
    from shmreduce.strategy import get_all_sharing_strategies as get_all_sharing_strategies
    from shmreduce.strategy import get_sharing_strategy as get_sharing_strategy
    from shmreduce.strategy import set_sharing_strategy as set_sharing_strategy


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"shmreduce.{name}")  # the import binds it here too
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shmreduce' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
