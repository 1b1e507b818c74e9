"""Every attribute shmreduce sets on torch or multiprocessing, installed and removed together.

Owns, while installed (between ``register()`` and ``unregister()``):

* ``ForkingPickler.dumps`` / ``loads`` (the pair ``registry`` builds) and the entries
  of ``ForkingPickler._extra_reducers`` that shmreduce sets;
* ``torch.UntypedStorage.share_memory_``, ``_new_shared`` and ``is_shared``;
* the marker in multiprocessing's process config that registers spawn/forkserver
  children (``registry._Inherit``);
* ``torch.set_num_threads``: torch's, then the setting told to the native core, whose
  large copies obey it from any thread (torch's own is per thread: a DataLoader
  worker's queue feeder would see every core where its main thread set one);
* ``torch.multiprocessing.set_sharing_strategy``: torch's, after shmreduce's check of
  the name, so that the one toggle has one error (a ``ValueError`` naming the valid
  strategies; torch's own raises ``AssertionError``). A reference to torch's function
  taken before ``register()`` still raises torch's.

``install`` records exactly what each one replaces and ``remove`` puts it back, so
afterwards torch and multiprocessing hold their own objects again. Nothing else in
shmreduce sets an attribute on either library: importing shmreduce, or a bare
``dumps``/``loads``, patches nothing.

Invariant: **``is_shared()`` is true => ``share_memory_()`` keeps the memory.**
While installed, ``is_shared()`` is also true for a storage the storage cache knows
(a shmreduce segment: torch cannot tell a slab's ``frombuffer`` view from private
memory), and ``share_memory_()`` leaves every such storage where it is. After
``remove()`` torch answers both again: a slab storage reports ``False`` and torch's
``share_memory_()`` moves it into torch's own shared memory, consistently.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as _tmp

from shmreduce import _native, strategy, transfer
from shmreduce.cache import cache

# ForkingPickler.register's table (exact classes), and the process config that
# multiprocessing hands to every child: both private, so absent from typeshed.
EXTRA_REDUCERS: dict[type, Any] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
CONFIG_KEY = "shmreduce"
_MISSING = object()

_saved_attrs: dict[tuple[Any, str], Any] = {}  # (owner, name) -> what its __dict__ held
_saved_reducers: dict[type, Any] = {}  # class -> the _extra_reducers entry before ours


class _TorchOwn:
    """torch's own functions that the patches call through: saved by ``install``,
    forgotten by ``remove``."""

    is_shared: Callable[[torch.UntypedStorage], bool]
    share_memory_: Callable[..., torch.UntypedStorage]
    set_sharing_strategy: Callable[[str], None]
    set_num_threads: Callable[[int], None]


_torch_own = _TorchOwn()


def process_config() -> dict[str, Any]:
    """The config multiprocessing copies into every child it starts."""
    return multiprocessing.current_process()._config  # type: ignore[attr-defined]


def install(dumps: Callable[..., Any], loads: Callable[..., Any], reducers: dict[type, Any], marker: Any) -> None:
    """Install everything at once (the caller holds the registry's lock)."""
    _torch_own.is_shared = torch.UntypedStorage.is_shared
    _torch_own.share_memory_ = torch.UntypedStorage.share_memory_
    for cls, reduce in reducers.items():
        set_reducer(cls, reduce)
    _set(ForkingPickler, "dumps", classmethod(dumps))
    _set(ForkingPickler, "loads", staticmethod(loads))
    _set(torch.UntypedStorage, "is_shared", _is_shared)
    _set(torch.UntypedStorage, "share_memory_", _share_memory_)
    _set(torch.UntypedStorage, "_new_shared", classmethod(_new_shared))
    _torch_own.set_sharing_strategy = _tmp.set_sharing_strategy
    _set(_tmp, "set_sharing_strategy", _set_sharing_strategy)
    _torch_own.set_num_threads = torch.set_num_threads
    _set(torch, "set_num_threads", _set_num_threads)
    _native.set_intra_op_threads(torch.get_num_threads())
    process_config()[CONFIG_KEY] = marker


def remove() -> None:
    """Put back exactly what ``install`` (and ``set_reducer``) replaced."""
    process_config().pop(CONFIG_KEY, None)
    for (owner, name), previous in _saved_attrs.items():
        if previous is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, previous)
    _saved_attrs.clear()
    for cls in list(_saved_reducers):
        restore_reducer(cls)
    vars(_torch_own).clear()
    _native.set_intra_op_threads(0)


def set_reducer(cls: type, reduce: Any) -> None:
    """Set ForkingPickler's reducer for exactly *cls*, remembering the first one replaced."""
    _saved_reducers.setdefault(cls, EXTRA_REDUCERS.get(cls, _MISSING))
    ForkingPickler.register(cls, reduce)


def restore_reducer(cls: type) -> None:
    """Put back ForkingPickler's reducer for *cls* as it was before ``set_reducer``."""
    previous = _saved_reducers.pop(cls, _MISSING)
    if previous is _MISSING:
        EXTRA_REDUCERS.pop(cls, None)
    else:
        EXTRA_REDUCERS[cls] = previous


def _set(owner: Any, name: str, value: Any) -> None:
    _saved_attrs[(owner, name)] = owner.__dict__.get(name, _MISSING)
    setattr(owner, name, value)


# -- the torch storage patches (the invariant above) --------------------------------


def _is_shared(self: torch.UntypedStorage) -> bool:
    return bool(_torch_own.is_shared(self)) or cache.place_of(self) is not None


def _share_memory_(self: torch.UntypedStorage, *args: Any, **kwargs: Any) -> torch.UntypedStorage:
    # CPU storages move into shmreduce's own segments for the current strategy
    # (torch's file_system path would start torch_shm_manager and leave
    # /dev/shm/torch_* files to it). A storage that is_shared() is left alone: torch
    # moves it again when its mechanism differs from the strategy (e.g. a from_file
    # mapping under file_system), which breaks aliasing; its own docs call
    # share_memory_ a no-op for shared storages.
    if self.device.type == "cpu":
        if not self.is_shared() and self.nbytes():
            transfer.share_in_place(self)
        return self
    return _torch_own.share_memory_(self, *args, **kwargs)


def _new_shared(cls: type, size: int, *, device: Any = "cpu") -> torch.UntypedStorage:
    # torch's classmethod behind TypedStorage._new_shared, which DataLoader workers'
    # collate uses for each batch: under file_system it would go through libshm
    # (torch_shm_manager), under file_descriptor through /dev/shm; either way the
    # batch would then be copied again into a shmreduce segment to be sent.
    if torch.device(device).type == "cpu":
        return transfer.new_shared(size)
    return cls(size, device=device)


# -- the strategy toggle -------------------------------------------------------------


def _set_sharing_strategy(new_strategy: str) -> None:
    """``torch.multiprocessing.set_sharing_strategy`` while installed: the name checked
    as ``shmreduce.set_sharing_strategy`` checks it, then set by torch's own."""
    strategy.check(new_strategy)
    _torch_own.set_sharing_strategy(new_strategy)


# -- the intra-op setting ------------------------------------------------------------


def _set_num_threads(n: int) -> None:
    """``torch.set_num_threads`` while installed: torch's, then the process's setting
    for the native core's copies (which run on any thread)."""
    _torch_own.set_num_threads(n)
    _native.set_intra_op_threads(torch.get_num_threads())
