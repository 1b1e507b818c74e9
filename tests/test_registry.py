"""register / unregister / reducer table, ForkingPickler integration, children."""

import copyreg
import io
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch

import shmreduce
from shmreduce import _native, reductions

# ForkingPickler.register's table: private, so absent from typeshed.
EXTRA_REDUCERS: dict[type, Any] = vars(ForkingPickler)["_extra_reducers"]


def _snapshot():
    return (
        dict(EXTRA_REDUCERS),
        ForkingPickler.__dict__["dumps"],
        ForkingPickler.__dict__["loads"],
        torch.UntypedStorage.__dict__.get("share_memory_"),
        torch.UntypedStorage.__dict__.get("_new_shared"),
    )


def test_import_changes_nothing_and_does_not_import_torch():
    code = (
        "import sys\n"
        "from multiprocessing.reduction import ForkingPickler\n"
        "before = dict(ForkingPickler._extra_reducers)\n"
        "import shmreduce\n"
        "assert 'torch' not in sys.modules, 'importing shmreduce imported torch'\n"
        "assert dict(ForkingPickler._extra_reducers) == before\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_register_installs_every_class_and_unregister_restores_exactly():
    before = _snapshot()
    shmreduce.register()
    shmreduce.register()  # idempotent
    for cls in [
        torch.Tensor,
        torch.nn.Parameter,
        torch.UntypedStorage,
        torch.TypedStorage,
        *torch._tensor_classes,
        *torch._storage_classes,
    ]:
        # shmreduce's own: plain tensors' in C (shmreduce._native.reduce, which hands every other case to reductions)
        assert EXTRA_REDUCERS[cls].__module__ in ("shmreduce.reductions", "shmreduce._native"), cls
    assert shmreduce.is_registered()
    shmreduce.unregister()
    shmreduce.unregister()  # idempotent
    assert _snapshot() == before
    assert not shmreduce.is_registered()
    assert EXTRA_REDUCERS[torch.Tensor].__module__ == "torch.multiprocessing.reductions"


class Point:
    tagged: bool  # set by _tagged

    def __init__(self, xy):
        self.xy = xy


class SubPoint(Point):
    pass


def _reduce_point(p):
    return Point, (p.xy,)


def _reduce_point_tagged(p):
    return _tagged, (p.xy,)


def _tagged(xy):
    point = Point(xy)
    point.tagged = True
    return point


def test_register_reducer_mro_and_removal(registered_fd):
    shmreduce.register_reducer(Point, _reduce_point)
    assert shmreduce.list_reducers() == {Point: _reduce_point}
    t = torch.arange(4.0)
    # Subclass instances use the nearest registered class: SubPoint -> Point's reducer.
    out = pickle.loads(ForkingPickler.dumps(SubPoint(t)))
    assert type(out) is Point and out.xy.untyped_storage()._cdata == t.untyped_storage()._cdata
    shmreduce.register_reducer(SubPoint, _reduce_point_tagged)
    assert pickle.loads(ForkingPickler.dumps(SubPoint(t))).tagged
    shmreduce.unregister_reducer(SubPoint)
    shmreduce.unregister_reducer(Point)
    assert Point not in EXTRA_REDUCERS
    out = pickle.loads(ForkingPickler.dumps(SubPoint(t)))
    assert type(out) is SubPoint  # plain pickling again
    with pytest.raises(KeyError):
        shmreduce.unregister_reducer(Point)


def test_register_reducer_applies_to_dumps_unregistered():
    shmreduce.register_reducer(Point, _reduce_point)
    try:
        t = torch.ones(3)
        out = shmreduce.loads(shmreduce.dumps(SubPoint(t)))
        assert type(out) is Point and out.xy.untyped_storage()._cdata == t.untyped_storage()._cdata
    finally:
        shmreduce.unregister_reducer(Point)


def test_dispatch_table_for_a_users_own_pickler():
    t = torch.arange(6.0)
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf)
    pickler.dispatch_table = shmreduce.dispatch_table(copyreg.dispatch_table)
    pickler.dump({"t": t})
    out = shmreduce.loads(buf.getvalue())
    assert out["t"].untyped_storage()._cdata == t.untyped_storage()._cdata


class Tagged(torch.Tensor):
    note: str


def test_tensor_subclass_dispatch_through_forking_pickler(registered_fd):
    t = torch.arange(3.0).as_subclass(Tagged)
    t.note = "kept"
    out = pickle.loads(ForkingPickler.dumps(t))
    assert type(out) is Tagged and out.note == "kept"
    assert out.untyped_storage()._cdata == t.untyped_storage()._cdata


def _child_report(conn):
    import shmreduce as s

    conn.send((s.is_registered(), s.get_sharing_strategy(), torch.ones(2)))
    conn.close()


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_children_run_registered_with_the_same_strategy(method):
    with shmreduce.registered(strategy="file_system"):
        ctx = mp.get_context(method)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child_report, args=(child,))
        proc.start()
        child.close()
        try:
            assert parent.poll(60), "child did not answer"
            is_reg, strategy, t = parent.recv()
        finally:
            proc.join(30)
        assert proc.exitcode == 0
        assert is_reg and strategy == "file_system"
        assert t.is_shared() and shmreduce.stats()["storages_received"] >= 1


def test_default_reducers_cover_spec_classes():
    table = reductions.default_reducers()
    assert table[torch.Tensor] is _native.reduce  # reduce_tensor's common case, in C
    assert table[torch.nn.Parameter] is reductions.reduce_tensor
    assert table[torch.UntypedStorage] is reductions.reduce_storage
    assert all(cls in table for cls in torch._storage_classes)


# -- copyreg registrations made after the first message -------------------------------


class Guarded:
    """Holds a lock (unpicklable): only a copyreg reducer makes it picklable."""

    def __init__(self, t):
        self.t = t
        self.lock = threading.Lock()


def _reduce_guarded(g):
    return Guarded, (g.t,)


def _load_and_write(conn):
    g = shmreduce.loads(conn.recv_bytes())
    g.t.fill_(7)
    conn.send(type(g).__name__)
    conn.close()


@pytest.mark.parametrize("via", ["dumps", "ForkingPickler"])
def test_copyreg_registration_after_the_first_message_is_honoured(strategy, via):
    dumps = shmreduce.dumps if via == "dumps" else ForkingPickler.dumps
    shmreduce.loads(dumps(torch.ones(2)))  # the first message: a table made now must not be a snapshot
    copyreg.pickle(Guarded, _reduce_guarded)
    try:
        g = Guarded(torch.zeros(4))
        data = dumps(g)
    finally:
        del copyreg.dispatch_table[Guarded]
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_load_and_write, args=(child,))
    proc.start()
    child.close()
    try:
        parent.send_bytes(data)
        assert parent.poll(60), "child did not answer"
        assert parent.recv() == "Guarded"
    finally:
        parent.close()
        proc.join(30)
    assert proc.exitcode == 0
    assert g.t.eq(7).all(), "the child's write was not seen"
    with pytest.raises(TypeError):  # and the removal is honoured too
        dumps(g)


def _by_name_reducer(obj):
    return str, ("replaced",)


@pytest.mark.parametrize("obj", [torch.float32, torch.bfloat16, _native.rebuild, _native.load, len])
def test_what_pickle_names_pickles_as_pickle_does_and_honours_later_reducers(registered_fd, obj):
    # A tensor's dtype and the rebuild function are found in the table (not missed
    # once per message): pickled by name, byte for byte as pickle does, unless a
    # reducer for their class is registered, even after the first message.
    for protocol in (2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL):
        assert bytes(ForkingPickler.dumps(obj, protocol)) == pickle.dumps(obj, protocol)
        assert shmreduce.dumps(obj, protocol) == pickle.dumps(obj, protocol)
    copyreg.pickle(type(obj), _by_name_reducer)
    try:
        assert pickle.loads(ForkingPickler.dumps(obj)) == "replaced"
        assert pickle.loads(shmreduce.dumps(obj)) == "replaced"
    finally:
        del copyreg.dispatch_table[type(obj)]
    assert pickle.loads(ForkingPickler.dumps(obj)) is obj
    shmreduce.register_reducer(type(obj), _by_name_reducer)
    try:
        assert pickle.loads(ForkingPickler.dumps(obj)) == "replaced"
    finally:
        shmreduce.unregister_reducer(type(obj))
    assert pickle.loads(ForkingPickler.dumps(obj)) is obj


# -- register() at a spawn/forkserver main module's top level ------------------------


_TOP_LEVEL_MAIN = r"""
import multiprocessing as mp
import sys
import time

import torch

import shmreduce

shmreduce.register(strategy=sys.argv[2])  # at top level: spawn children run this too


def produce(q):
    q.put(torch.arange(1000.0))  # and exit at once: its message must still arrive


if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    q = ctx.Queue()
    p = ctx.Process(target=produce, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0, p.exitcode
    time.sleep(1.0)  # well past the broker grace of a program the child might have made
    t = q.get(timeout=60)
    assert torch.equal(t, torch.arange(1000.0))
    print("ok")
"""


@pytest.mark.parametrize("strategy_name", ["file_descriptor", "file_system"])
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_top_level_register_in_child_joins_the_parents_program(tmp_path, method, strategy_name):
    script = tmp_path / "top_level_main.py"
    script.write_text(_TOP_LEVEL_MAIN)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this tree's shmreduce
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(script), method, strategy_name], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
