"""The reducer table and its installation into picklers.

One table: torch's tensor/storage classes from ``reductions`` (exact classes only)
plus user types from ``register_reducer`` (resolved by MRO, nearest class wins),
served to:

* ``multiprocessing.reduction.ForkingPickler`` while registered: exact classes via
  its public ``register``; subclasses of user types, and the per-message scopes
  (``transfer.sending`` / ``receiving``), via a ``dumps``/``loads`` pair installed on it (no public hook exists for
  either);
* ``shmreduce.dumps`` / ``loads`` (cloudpickle), registered or not;
* any user pickler, through ``dispatch_table()``.

``register()`` installs, and ``unregister()`` removes, every patch on torch and
multiprocessing through ``patches`` (the one module that sets them).
Children: a marker in the process config (``current_process()._config``, which
multiprocessing copies into every child it starts and pickles for spawn and
forkserver) re-registers spawn/forkserver children, with the same program and
strategy, before their arguments are unpickled; forked children inherit everything.
A ``register()`` that such a child runs first (at its main module's top level, or
earlier: ``sitecustomize``, a ``.pth`` file), or that the forkserver runs, does not
start a program of its own there: the marker then adopts the parent's.
"""

from __future__ import annotations

import copyreg
import io
import logging
import multiprocessing
import multiprocessing.queues
import multiprocessing.spawn
import os
import pickle
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Any

import cloudpickle
import torch

from shmreduce import _faults, _platform, errors, forking, patches, program, reductions, transfer
from shmreduce import strategy as _strategy
from shmreduce.broker import client as broker

log = logging.getLogger("shmreduce")

Reducer = Callable[[Any], tuple]

_lock = threading.RLock()
_builtin: dict[type, Reducer] = {}
_user: dict[type, Reducer] = {}
_resolved: dict[type, Reducer | None] = {}
_registered = False
_use_cloudpickle = False


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
    subclass pickles through its own ``__reduce_ex__``/``__getstate__``,
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
    """A pickler ``dispatch_table``: shmreduce's table (exact classes), then the dicts
    *bases* (the first that has the class wins), then user reducers by MRO.

    *bases* are read at each lookup, never copied, as cloudpickle's ChainMap over
    copyreg's: a ``copyreg.pickle()`` made after the first message is honoured, as
    plain pickle and cloudpickle honour it, at no cost per message. Only a class
    outside shmreduce's table pays for a lookup in Python.
    """

    __slots__ = ("bases",)

    def __init__(self, bases: tuple[Mapping[Any, Any], ...]) -> None:
        super().__init__(_table())
        self.bases = bases
        for cls in _BY_NAME:
            self.setdefault(cls, self._by_name(cls))

    def _by_name(self, cls: type) -> Reducer:
        """For a class every message meets (a tensor's dtype, the rebuild function):
        the reducer the lookup would find (*bases*, then user reducers), looked up at
        each call, else what pickle does itself (``__reduce__`` gives the name). A
        miss costs a Python ``__missing__`` and a KeyError per message: a fifth or
        more of pickling one small tensor."""
        bases = self.bases

        def reduce(obj: Any) -> Any:
            found = _find(bases, cls)
            return found(obj) if found is not None else obj.__reduce__()

        return reduce

    def __missing__(self, cls: type) -> Reducer:
        found = _find(self.bases, cls)
        if found is None:
            raise KeyError(cls)
        return found


def _find(bases: tuple[Mapping[Any, Any], ...], cls: Any) -> Reducer | None:
    """The reducer for *cls* outside shmreduce's table: the first of *bases* that has
    it, then user reducers by MRO (``lookup``)."""
    for base in bases:
        found = base.get(cls)
        if found is not None:
            return found
    return lookup(cls) if isinstance(cls, type) else None


# Pickled by name (their ``__reduce__`` returns it), found in the table rather than
# missed: see ``DispatchTable._by_name``.
_BY_NAME = (torch.dtype, type(len))


def dispatch_table(base: Mapping[Any, Any] | None = None) -> DispatchTable:
    """A dispatch table for your own pickler: shmreduce's, then *base* (default copyreg's)."""
    return DispatchTable((copyreg.dispatch_table if base is None else base,))


class _Made:
    """One dispatch table over *bases*, made at its first use and again after the
    reducers change (``clear``)."""

    def __init__(self, bases: tuple[Mapping[Any, Any], ...]) -> None:
        self.bases = bases
        self.table: DispatchTable | None = None

    def get(self) -> DispatchTable:
        table = self.table  # read once: another thread may clear it meanwhile
        if table is None:
            table = self.table = DispatchTable(self.bases)
        return table

    def clear(self) -> None:
        self.table = None


# -- user reducers -----------------------------------------------------------------


def register_reducer(cls: type, reduce: Reducer) -> None:
    """Share instances of *cls* (and its subclasses) as ``reduce(obj) -> (callable, args)``."""
    if not isinstance(cls, type) or not callable(reduce):
        raise TypeError("register_reducer(cls, reduce) takes a class and a callable")
    with _lock:
        _user[cls] = reduce
        _changed()
        if _registered:
            patches.set_reducer(cls, reduce)


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
                patches.set_reducer(cls, builtin)
            else:
                patches.restore_reducer(cls)


def list_reducers() -> dict[type, Reducer]:
    """The user reducers registered with ``register_reducer``."""
    return dict(_user)


# A fork waits for a register(), unregister() or reducer change in progress on another
# thread: else the child inherits _lock held by a thread it does not have, and its own
# register() waits for ever. Re-entrant: a fork from inside one takes it again. Let go of
# after the fork in both processes (``_after_fork_in_child``; ``forking`` runs both).
def _before_fork() -> None:
    _faults.pause("fork.waits")
    _lock.acquire()


def _changed() -> None:
    _resolved.clear()
    _cloud_table.clear()
    _forking_table.clear()


# -- the ForkingPickler entry points while registered -------------------------------


# ForkingPickler's table (its _extra_reducers over copyreg's, under shmreduce's),
# made once rather than copied for every message as ForkingPickler.__init__ does.
_FORKING_BASES = (patches.EXTRA_REDUCERS, copyreg.dispatch_table)
_forking_table = _Made(_FORKING_BASES)


def _forking_dispatch_table() -> DispatchTable:
    return _forking_table.get()


def _forking_dumps(cls: type, obj: Any, protocol: int | None = None) -> memoryview:
    if not _dumps_begin():
        # unregister() began after this call found the patch: ForkingPickler's own
        # dumps (put back by then) pickles it, with torch's reducers.
        return cls.dumps(obj, protocol)  # type: ignore[attr-defined]
    try:
        buf = io.BytesIO()
        if _use_cloudpickle:
            pickler: Any = _CloudPickler(buf, protocol)
        elif cls is ForkingPickler:
            pickler = pickle.Pickler(buf, protocol)  # what ForkingPickler adds is its table
            pickler.dispatch_table = _forking_dispatch_table()
        else:  # a subclass may set up its own table: extend whatever it made
            pickler = cls(buf, protocol)
            pickler.dispatch_table = DispatchTable((pickler.dispatch_table,))
        try:
            with transfer.sending():
                pickler.dump(obj)
        except errors.SharingError as exc:
            if not _in_feeder_thread():
                raise
            return _failed_send(exc)
        return buf.getbuffer()
    finally:
        _dumps_end()


# -- unregister() and the dumps in flight -------------------------------------------
#
# A queue's feeder thread pickles whenever it gets to a message, after the put
# returned: it may be inside ``_forking_dumps`` when another thread calls
# ``unregister()``, sharing into pools and through broker connections that
# ``unregister()`` is about to close, and that it would open again behind it (a broker,
# its directory and the descriptors kept for the process's life). So a dumps counts
# itself in flight, or, if ``unregister()`` began first, goes through torch's
# reducers; and ``unregister()`` closes once those in flight are done: at once if they
# finish within UNREGISTER_WAIT, else the last of them closes as it finishes.
# ``_dumps_cond`` is a leaf: taken under ``_lock`` or alone, nothing is called under it.

UNREGISTER_WAIT = broker.START_TIMEOUT + broker.IO_TIMEOUT  # a share's worst case: a broker launched, then a round trip
_dumps_cond = threading.Condition(threading.Lock())
_dumps_in_flight = 0
_dumps_by_thread: dict[int, int] = {}  # thread ident -> its dumps in flight (nested: a pickle inside a pickle)
_close_when_done = False  # unregister() stopped waiting: the last dumps in flight closes


def _dumps_begin() -> bool:
    """Count a registered dumps in flight; False once ``unregister()`` began."""
    global _dumps_in_flight
    with _dumps_cond:
        if not _registered:
            return False
        _dumps_in_flight += 1
        me = threading.get_ident()
        _dumps_by_thread[me] = _dumps_by_thread.get(me, 0) + 1
        return True


def _dumps_end() -> None:
    global _dumps_in_flight, _close_when_done
    with _dumps_cond:
        _dumps_in_flight -= 1
        me = threading.get_ident()
        if _dumps_by_thread[me] > 1:
            _dumps_by_thread[me] -= 1
        else:
            del _dumps_by_thread[me]
        if _dumps_in_flight:
            return
        _dumps_cond.notify_all()
        close, _close_when_done = _close_when_done and not _registered, False
    if close:
        _let_go_of_program()


def _close_after_dumps() -> None:
    """``unregister()``: close once no dumps that began before it is in flight (unless
    ``register()`` came again meanwhile: the connections are the new registration's)."""
    global _close_when_done
    me = threading.get_ident()
    with _dumps_cond:
        others = lambda: _dumps_in_flight - _dumps_by_thread.get(me, 0)  # noqa: E731
        if not _dumps_cond.wait_for(lambda: not others() or _registered, UNREGISTER_WAIT):
            log.debug("unregister(): a message still being pickled; shmreduce closes once it is done")
            _close_when_done = True
            return
        if _registered:
            return
        if _dumps_in_flight:
            # Called from inside a dumps of this thread (a finalizer or a reducer that
            # unregisters while it pickles): waiting for it would wait for ever; it
            # closes as it finishes.
            _close_when_done = True
            return
    _let_go_of_program()


def _let_go_of_program() -> None:
    broker.close_all()
    transfer.let_go()


def _after_fork_in_child() -> None:
    global _dumps_cond, _dumps_in_flight, _dumps_by_thread, _close_when_done
    _lock.release()  # taken before the fork (_before_fork)
    # The parent's threads, and the dumps they had in flight, did not come along (one
    # may have held the condition's lock).
    _dumps_cond = threading.Condition(threading.Lock())
    _dumps_in_flight = 0
    _dumps_by_thread = {}
    _close_when_done = False


forking.part("registry", before=_before_fork, after_in_parent=_lock.release, after_in_child=_after_fork_in_child)


# -- a failure in a queue's feeder thread -------------------------------------------
#
# ``mp.Queue.put`` only buffers: its feeder thread pickles and writes later, and a
# pickling error there is printed (a traceback per message) and the message dropped;
# at the sender's exit, silently, with every message still buffered after it. The
# receiver, where the user waits, then waits for ever. So a *sharing* failure there
# (a SharingError: descriptors or shared memory run out, the broker gone, a non-leaf
# tensor that requires grad) is sent in the message's place, as bytes whose load
# raises it: the receiver's get() raises, the sender logs it once.
#
# Only sharing failures: an object that cannot be pickled at all (a lambda, a lock)
# fails the same way in every run and with or without shmreduce, and multiprocessing
# documents where that error goes; registering shmreduce does not change it. Only
# queues that keep multiprocessing's own ``_on_queue_feeder_error``: a queue that
# overrides it (ProcessPoolExecutor's call queue fails the future there) hears its
# errors as it would without shmreduce.

# Both private, so absent from typeshed; present from 3.8 to 3.13.
_FEED = multiprocessing.queues.Queue._feed.__code__  # type: ignore[attr-defined]
_DEFAULT_ONERROR = multiprocessing.queues.Queue._on_queue_feeder_error  # type: ignore[attr-defined]
_failures_logged: set[type] = set()


def _in_feeder_thread() -> bool:
    """Whether ``ForkingPickler.dumps`` was called by a multiprocessing queue's feeder
    thread (``Queue._feed``) whose queue keeps the default error hook."""
    frame = sys._getframe(2)  # _forking_dumps's caller (the classmethod adds no frame)
    if frame.f_code is not _FEED:
        return False
    onerror = frame.f_locals.get("onerror")  # a staticmethod's function, or an override's bound method
    return getattr(onerror, "__func__", onerror) is _DEFAULT_ONERROR


def _failed_send(exc: errors.SharingError) -> memoryview:
    pid = os.getpid()
    level = logging.DEBUG if type(exc) in _failures_logged else logging.WARNING
    _failures_logged.add(type(exc))
    log.log(
        level,
        "a message put on a multiprocessing queue could not be shared; its receiver's get() raises this instead of loading it%s: %s",
        "" if level == logging.DEBUG else " (further such failures of this process are logged at DEBUG)",
        exc,
    )
    failure = errors.failed_send(exc, pid)
    return memoryview(pickle.dumps(_RaiseOnLoad(str(failure))))


class _RaiseOnLoad:
    """Pickles as a call that raises SharingError with *message* when loaded."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    def __reduce__(self) -> tuple:
        return errors.raise_failed_send, (self.message,)


def _forking_loads(data: Any, /, **kwargs: Any) -> Any:
    with transfer.receiving():
        return pickle.loads(data, **kwargs)


# -- children ----------------------------------------------------------------------


class _Inherit:
    """Process-config marker: unpickled in a spawn/forkserver child, it registers it."""

    def __reduce__(self) -> tuple:
        return _inherit, (program.current(), _strategy.get_sharing_strategy(), _use_cloudpickle)


def _inherit(prog: program.Program, strategy_name: str, use_cloudpickle: bool = False) -> _Inherit:
    if program.peek() is None:
        program.adopt(prog)
    if _registered:  # by its main module's top level: the parent's strategy is the program's
        _strategy.set_sharing_strategy(strategy_name)
        register(cloudpickle=use_cloudpickle)
    else:
        register(strategy=strategy_name, cloudpickle=use_cloudpickle)
    return _Inherit()


def _inheriting() -> bool:
    """True in a process that multiprocessing starts for a parent, until the parent's
    state (and its marker, with its program) is loaded there: a spawn/forkserver child
    inside its bootstrap (multiprocessing's own flag, set by ``spawn._main`` and
    ``forkserver.main``); a spawn child before it, where ``sitecustomize``, a ``.pth``
    file or a launcher registered (its command line says what it is); and the
    forkserver itself, whose children each load their own parent's state."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        return True
    if multiprocessing.parent_process() is not None:
        return False  # bootstrapped: whatever its command line says, its parent's state is in
    return multiprocessing.spawn.is_forking(sys.argv) or _is_forkserver()


def _is_forkserver() -> bool:
    """Whether this process is multiprocessing's forkserver: ``python -c 'from
    multiprocessing.forkserver import main; main(...)'`` (its ``sys.argv`` is only
    ``['-c']``)."""
    argv = sys.orig_argv
    return any(flag == "-c" and code.startswith(_FORKSERVER_CODE) for flag, code in zip(argv, argv[1:], strict=False))


_FORKSERVER_CODE = "from multiprocessing.forkserver import main"


# -- register / unregister ---------------------------------------------------------


def register(*, strategy: str | None = None, cloudpickle: bool | None = None) -> None:
    """Install shmreduce's reducers into multiprocessing's ForkingPickler. Idempotent.

    *strategy*, if given, is set as by ``set_sharing_strategy``. *cloudpickle=True*
    makes queues and pipes pickle with cloudpickle (lambdas, closures, local
    classes), the way loky lets users choose its pickler; ``unregister()`` undoes it.
    """
    global _use_cloudpickle, _strategy_before
    # In this thread, before any message: what the reducers initialize on first use
    # is then never initialized by a queue's feeder thread while another forks.
    reductions.prepare()
    with _lock:
        _faults.pause("registry.locked")
        before = _strategy.get_sharing_strategy()
        if strategy is not None:
            _register_strategy(strategy, before)
        if cloudpickle is not None:
            _use_cloudpickle = bool(cloudpickle)
        if _registered:
            return
        _strategy_before = before
        import torch.multiprocessing  # noqa: F401  torch's reducers first, so we record them

        patches.install(_forking_dumps, _forking_loads, _table(), _Inherit())
        # The program starts here, so forked children join it rather than each
        # becoming the root of its own (whose broker, and the messages it holds,
        # would go when that child exits). Not in a spawn/forkserver child
        # still inheriting: sitecustomize, a .pth file and its main module's top level
        # (and a register() there) run before the parent's marker is unpickled, which
        # then adopts the parent's.
        if not _inheriting():
            program.current()
            _sweep_dead_programs()
            _warn_of_workers_started_before()
        # The fd strategy holds one descriptor per received storage (#973): raise the
        # soft limit to the hard one, as servers do.
        _platform.raise_nofile_limit()
        _set_registered(True)


_workers_warned = False


def _warn_of_workers_started_before() -> None:
    """Warn, once a process, of the children that run without shmreduce: started
    before the first ``register()`` (no marker in their process config, which
    multiprocessing copied when it made them), they keep torch's reducers, and what
    they send back does not go through shmreduce. A user must act on it, so it is
    a warning: move ``register()`` before the Pool, DataLoader or Process."""
    global _workers_warned
    if _workers_warned:
        return
    unregistered = [p for p in multiprocessing.active_children() if patches.CONFIG_KEY not in getattr(p, "_config", {})]
    if not unregistered:
        return
    _workers_warned = True
    names = ", ".join(f"{p.name} (pid {p.pid})" for p in unregistered[:8]) + (
        f" and {len(unregistered) - 8} more" if len(unregistered) > 8 else ""
    )
    log.warning(
        "shmreduce.register() was called after %d worker process(es) of this process started: %s. "
        "They run with torch's reducers: what they send does not go through shmreduce. Call "
        "shmreduce.register() before you create the Pool, ProcessPoolExecutor, DataLoader "
        "(persistent_workers) or Process, e.g. first thing in your main module",
        len(unregistered),
        names,
    )


def _sweep_dead_programs() -> None:
    """What programs killed with their broker and its janitor left in the shm base
    goes at the next program's ``register()``, not only once it
    starts a broker; ``shmreduce cleanup`` does the same by hand."""
    from shmreduce.broker import programdir

    try:
        programdir.sweep_stale(program.shm_base(), keep=program.current().directory)
    except OSError:
        pass  # a base we cannot read: its owner's to clean


# What register() did to the strategy, for unregister() to undo: the
# strategy before the first register(), and the one register(strategy=...) set last.
_strategy_before: str | None = None
_strategy_set: str | None = None


def _register_strategy(name: str, current: str) -> None:
    """``register(strategy=name)``: set it; said if it switches a registered
    program's strategy (a second caller overriding the first, silently before)."""
    global _strategy_set
    _strategy.set_sharing_strategy(name)  # ValueError first: nothing changed
    _strategy_set = name
    if _registered and name != current:
        log.warning(
            "shmreduce.register(strategy=%r) switched this registered process's sharing strategy from %r "
            "(set by an earlier register() or the toggle) to %r: storages shared from now on use %r. To "
            "switch on purpose, call shmreduce.set_sharing_strategy(); to keep one, pass the same strategy "
            "to every register()",
            name,
            current,
            name,
            name,
        )


def unregister() -> None:
    """Put back exactly the reducers installed before ``register()``, and the strategy
    before it if ``register(strategy=...)`` changed it (one set with the toggle since
    is the user's and stays). Idempotent."""
    global _use_cloudpickle, _strategy_before, _strategy_set
    with _lock:
        if not _registered:
            return
        patches.remove()
        if _strategy_set is not None and _strategy_before is not None and _strategy.get_sharing_strategy() == _strategy_set:
            _strategy.set_sharing_strategy(_strategy_before)
        _strategy_before = _strategy_set = None
        _set_registered(False)
        _use_cloudpickle = False
    _close_after_dumps()


def _set_registered(registered: bool) -> None:
    """Under ``_lock``; and under ``_dumps_cond``, which ``_forking_dumps`` reads it under."""
    global _registered
    with _dumps_cond:
        _registered = registered
        _dumps_cond.notify_all()  # a waiting unregister() stops waiting for a registration that came again


def is_registered() -> bool:
    """True between ``register()`` and ``unregister()``."""
    return _registered


@contextmanager
def registered(strategy: str | None = None) -> Iterator[None]:
    """Register on enter; restore the previous registration and strategy on exit."""
    was_registered = _registered
    previous_strategy = _strategy.get_sharing_strategy()
    if was_registered and strategy is not None:
        _strategy.set_sharing_strategy(strategy)  # a scoped switch, on purpose: no warning
    else:
        register(strategy=strategy)
    try:
        yield
    finally:
        if not was_registered:
            unregister()
        _strategy.set_sharing_strategy(previous_strategy)


# -- cloudpickle -------------------------------------------------------------------


_CLOUD_BASES = tuple(cloudpickle.Pickler.dispatch_table.maps)  # cloudpickle's reducers, copyreg's
_cloud_table = _Made(_CLOUD_BASES)


def _cloudpickle_table(pickler: Any) -> DispatchTable:
    # cloudpickle.Pickler declares dispatch_table as a class attribute, which hides
    # the C pickler's slot: only a class-level attribute is seen (at __init__), so
    # ours is a property over a table remade when the reducers change, reading
    # the dicts of cloudpickle's own ChainMap live.
    return _cloud_table.get()


class _CloudPickler(cloudpickle.Pickler):
    dispatch_table = property(_cloudpickle_table)


def dumps(obj: Any, protocol: int | None = None) -> bytes:
    """cloudpickle ``obj``; tensors and storages inside are shared, not copied.

    The bytes load in any process of this program on this host, as often as wanted,
    while the memory they name lives (a process holds the tensors, or a load of them
    is still due).
    """
    buf = io.BytesIO()
    with transfer.sending():
        _CloudPickler(buf, protocol).dump(obj)
    return buf.getvalue()


def loads(data: bytes | bytearray | memoryview) -> Any:
    """Load bytes made by ``dumps`` (or by ForkingPickler while registered)."""
    with transfer.receiving():
        return pickle.loads(data)
