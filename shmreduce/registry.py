"""The reducer table and its installation into picklers.

One table: torch's tensor/storage classes from ``reductions`` (exact classes only)
plus user types from ``register_reducer`` (resolved by MRO, nearest class wins),
served to:

* ``multiprocessing.reduction.ForkingPickler`` while registered: exact classes via
  its public ``register``; subclasses of user types, and the one-deposit-per-message
  scope, via a ``dumps``/``loads`` pair installed on it (no public hook exists for
  either);
* ``shmreduce.dumps`` / ``loads`` (cloudpickle), registered or not;
* any user pickler, through ``dispatch_table()``.

``register()`` records exactly what it replaces; ``unregister()`` puts it back.
Children: a marker in the process config (``current_process()._config``, which
multiprocessing copies into every child it starts and pickles for spawn and
forkserver) re-registers spawn/forkserver children, with the same program and
strategy, before their arguments are unpickled; forked children inherit everything.
"""

from __future__ import annotations

import copyreg
import io
import multiprocessing
import pickle
import threading
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Iterator

import cloudpickle
import torch

from shmreduce import _platform, program, reductions, transfer
from shmreduce import strategy as _strategy
from shmreduce.broker import client as broker

Reducer = Callable[[Any], tuple]
# ForkingPickler.register's table (exact classes), and the process config that
# multiprocessing hands to every child: both private, so absent from typeshed.
_EXTRA_REDUCERS: dict[type, Any] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]


def _process_config() -> dict[str, Any]:
    return multiprocessing.current_process()._config  # type: ignore[attr-defined]
_MISSING = object()
_CONFIG_KEY = "shmreduce"

_lock = threading.RLock()
_builtin: dict[type, Reducer] = {}
_user: dict[type, Reducer] = {}
_resolved: dict[type, Reducer | None] = {}
_registered = False
_use_cloudpickle = False
_saved_reducers: dict[type, Any] = {}
_saved_attrs: dict[str, Any] = {}


def _builtins() -> dict[type, Reducer]:
    if not _builtin:
        _builtin.update(reductions.default_reducers())
    return _builtin


def _table() -> dict[type, Reducer]:
    table = dict(_builtins())
    table.update(_user)
    return table


def lookup(cls: type) -> Reducer | None:
    """The reducer for *cls*: a user reducer for it, else a built-in one for exactly
    *cls*, else the user reducer of the nearest class in its MRO.

    Built-ins match exact classes only, as in torch's ForkingPickler table: a tensor
    subclass pickles through its own ``__reduce_ex__``/``__getstate__`` (SPEC 11),
    and the storages that pickles still reach ``reductions.reduce_storage``.
    """
    try:
        return _resolved[cls]
    except KeyError:
        pass
    found = _user.get(cls) or _builtins().get(cls)
    if found is None:
        found = next((_user[base] for base in cls.__mro__[1:] if base in _user), None)
    _resolved[cls] = found
    return found


class DispatchTable(dict):
    """A pickler ``dispatch_table``: exact entries as given, then shmreduce's table by MRO."""

    def __missing__(self, cls: type) -> Reducer:
        found = lookup(cls) if isinstance(cls, type) else None
        if found is None:
            raise KeyError(cls)
        self[cls] = found
        return found


def dispatch_table(base: Any = None) -> DispatchTable:
    """A dispatch table for your own pickler: *base* (default copyreg's), then shmreduce's."""
    table = DispatchTable(copyreg.dispatch_table if base is None else base)
    table.update(_table())
    return table


# -- user reducers -----------------------------------------------------------------


def register_reducer(cls: type, reduce: Reducer) -> None:
    """Share instances of *cls* (and its subclasses) as ``reduce(obj) -> (callable, args)``."""
    if not isinstance(cls, type) or not callable(reduce):
        raise TypeError("register_reducer(cls, reduce) takes a class and a callable")
    with _lock:
        _user[cls] = reduce
        _changed()
        if _registered:
            _saved_reducers.setdefault(cls, _EXTRA_REDUCERS.get(cls, _MISSING))
            ForkingPickler.register(cls, reduce)


def unregister_reducer(cls: type) -> None:
    """Remove the reducer registered for *cls*; KeyError if there is none."""
    with _lock:
        if cls not in _user:
            raise KeyError(f"no shmreduce reducer registered for {cls!r}")
        del _user[cls]
        _changed()
        if _registered:
            builtin = _builtins().get(cls)
            if builtin is not None:
                ForkingPickler.register(cls, builtin)
            else:
                _restore_reducer(cls, _saved_reducers.pop(cls, _MISSING))


def list_reducers() -> dict[type, Reducer]:
    """The user reducers registered with ``register_reducer``."""
    return dict(_user)


def _changed() -> None:
    _resolved.clear()
    _cloud_table.clear()
    _forking_table.clear()


def _restore_reducer(cls: type, previous: Any) -> None:
    if previous is _MISSING:
        _EXTRA_REDUCERS.pop(cls, None)
    else:
        _EXTRA_REDUCERS[cls] = previous


# -- the ForkingPickler entry points while registered -------------------------------


# ForkingPickler's table (copyreg's plus its _extra_reducers) as a DispatchTable,
# with the snapshots it was built from: reused while they are unchanged, rather than
# copied for every message as ForkingPickler.__init__ does.
_forking_table: list[tuple[dict, dict, DispatchTable]] = []


def _forking_dispatch_table() -> DispatchTable:
    extra = _EXTRA_REDUCERS
    if _forking_table:
        base, extras, table = _forking_table[0]
        if base == copyreg.dispatch_table and extras == extra:
            return table
    table = DispatchTable(copyreg.dispatch_table)
    table.update(extra)
    _forking_table[:] = [(dict(copyreg.dispatch_table), dict(extra), table)]
    return table


def _forking_dumps(cls: type, obj: Any, protocol: int | None = None) -> memoryview:
    buf = io.BytesIO()
    if _use_cloudpickle:
        pickler: Any = _CloudPickler(buf, protocol)
    elif cls is ForkingPickler:
        pickler = pickle.Pickler(buf, protocol)  # what ForkingPickler adds is its table
        pickler.dispatch_table = _forking_dispatch_table()
    else:  # a subclass may set up its own table: extend whatever it made
        pickler = cls(buf, protocol)
        pickler.dispatch_table = DispatchTable(pickler.dispatch_table)
    with transfer.sending():
        pickler.dump(obj)
    return buf.getbuffer()


def _forking_loads(data: Any, /, **kwargs: Any) -> Any:
    with transfer.receiving():
        return pickle.loads(data, **kwargs)


def _share_memory_(self: torch.UntypedStorage, *args: Any, **kwargs: Any) -> torch.UntypedStorage:
    # While registered, CPU storages are moved into shmreduce's own segments for the
    # current strategy (torch's file_system path would start torch_shm_manager and
    # leave /dev/shm/torch_* files to it). A storage that is already shared is left
    # alone: torch moves it again when its mechanism differs from the strategy (e.g.
    # a from_file mapping under file_system), which breaks aliasing; its own docs call
    # share_memory_ a no-op for shared storages.
    if self.device.type == "cpu":
        if not self.is_shared() and self.nbytes():
            transfer.share_in_place(self)
        return self
    return _saved_attrs["share_memory_"](self, *args, **kwargs)


def _new_shared(cls: type, size: int, *, device: Any = "cpu") -> torch.UntypedStorage:
    # torch's classmethod behind TypedStorage._new_shared, which DataLoader workers'
    # collate uses for each batch: under file_system it would go through libshm
    # (torch_shm_manager), under file_descriptor through /dev/shm; either way the
    # batch would then be copied again into a shmreduce segment to be sent.
    if torch.device(device).type == "cpu":
        return transfer.new_shared(size)
    return cls(size, device=device)


# -- children ----------------------------------------------------------------------


class _Inherit:
    """Process-config marker: unpickled in a spawn/forkserver child, it registers it."""

    def __reduce__(self) -> tuple:
        return _inherit, (program.current(), _strategy.get_sharing_strategy(), _use_cloudpickle)


def _inherit(prog: program.Program, strategy_name: str, use_cloudpickle: bool = False) -> _Inherit:
    if program.peek() is None:
        program.adopt(prog)
    register(strategy=strategy_name, cloudpickle=use_cloudpickle)
    return _Inherit()


# -- register / unregister ---------------------------------------------------------


def register(*, strategy: str | None = None, cloudpickle: bool | None = None) -> None:
    """Install shmreduce's reducers into multiprocessing's ForkingPickler. Idempotent.

    *strategy*, if given, is set as by ``set_sharing_strategy``. *cloudpickle=True*
    makes queues and pipes pickle with cloudpickle (lambdas, closures, local
    classes), the way loky lets users choose its pickler; ``unregister()`` undoes it.
    """
    global _registered, _use_cloudpickle
    if strategy is not None:
        _set_strategy(strategy)
    if cloudpickle is not None:
        _use_cloudpickle = bool(cloudpickle)
    with _lock:
        if _registered:
            return
        import torch.multiprocessing  # noqa: F401  torch's reducers first, so we record them

        for cls, reduce in _table().items():
            _saved_reducers[cls] = _EXTRA_REDUCERS.get(cls, _MISSING)
            ForkingPickler.register(cls, reduce)
        _saved_attrs["dumps"] = ForkingPickler.__dict__["dumps"]
        _saved_attrs["loads"] = ForkingPickler.__dict__["loads"]
        _saved_attrs["share_memory_"] = torch.UntypedStorage.__dict__["share_memory_"]
        ForkingPickler.dumps = classmethod(_forking_dumps)  # type: ignore[method-assign,assignment]
        ForkingPickler.loads = staticmethod(_forking_loads)
        torch.UntypedStorage.share_memory_ = _share_memory_  # type: ignore[method-assign]
        _saved_attrs["_new_shared"] = torch.UntypedStorage.__dict__.get("_new_shared", _MISSING)
        torch.UntypedStorage._new_shared = classmethod(_new_shared)  # type: ignore[assignment,method-assign]
        _process_config()[_CONFIG_KEY] = _Inherit()
        # The program starts here, so forked children join it rather than each
        # becoming the root of its own (whose broker, and the messages it holds,
        # would go when that child exits: SPEC 7).
        program.current()
        # The fd strategy holds one descriptor per received storage (#973): raise the
        # soft limit to the hard one, as servers do.
        _platform.raise_nofile_limit()
        _registered = True


def _set_strategy(name: str) -> None:
    _strategy.set_sharing_strategy(name)


def unregister() -> None:
    """Put back exactly the reducers installed before ``register()``. Idempotent."""
    global _registered, _use_cloudpickle
    with _lock:
        if not _registered:
            return
        for cls, previous in _saved_reducers.items():
            _restore_reducer(cls, previous)
        _saved_reducers.clear()
        ForkingPickler.dumps = _saved_attrs.pop("dumps")  # type: ignore[method-assign]
        ForkingPickler.loads = _saved_attrs.pop("loads")
        previous = _saved_attrs.pop("_new_shared")
        if previous is _MISSING:
            del torch.UntypedStorage._new_shared
        else:
            torch.UntypedStorage._new_shared = previous  # type: ignore[method-assign]
        torch.UntypedStorage.share_memory_ = _saved_attrs.pop("share_memory_")  # type: ignore[method-assign]
        _process_config().pop(_CONFIG_KEY, None)
        _registered = False
        _use_cloudpickle = False
    broker.close_all()


def is_registered() -> bool:
    """True between ``register()`` and ``unregister()``."""
    return _registered


@contextmanager
def registered(strategy: str | None = None) -> Iterator[None]:
    """Register on enter; restore the previous registration and strategy on exit."""
    was_registered = _registered
    previous_strategy = _strategy.get_sharing_strategy()
    register(strategy=strategy)
    try:
        yield
    finally:
        if not was_registered:
            unregister()
        _strategy.set_sharing_strategy(previous_strategy)


# -- cloudpickle -------------------------------------------------------------------


_cloud_table: list[DispatchTable] = []


def _cloudpickle_table(pickler: Any) -> DispatchTable:
    # cloudpickle.Pickler declares dispatch_table as a class attribute, which hides
    # the C pickler's slot: only a class-level attribute is seen (at __init__), so
    # ours is a property over a table rebuilt when the reducers change.
    if not _cloud_table:
        _cloud_table.append(dispatch_table(cloudpickle.Pickler.dispatch_table))
    return _cloud_table[0]


class _CloudPickler(cloudpickle.Pickler):
    dispatch_table = property(_cloudpickle_table)


def dumps(obj: Any, protocol: int | None = None) -> bytes:
    """cloudpickle ``obj``; tensors and storages inside are shared, not copied.

    The bytes can be loaded once in another process of this program on this host
    (and again in a process that still maps the tensors).
    """
    buf = io.BytesIO()
    with transfer.sending():
        _CloudPickler(buf, protocol).dump(obj)
    return buf.getvalue()


def loads(data: bytes | bytearray | memoryview) -> Any:
    """Load bytes made by ``dumps`` (or by ForkingPickler while registered)."""
    with transfer.receiving():
        return pickle.loads(data)
