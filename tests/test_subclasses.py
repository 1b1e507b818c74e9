"""Tensor subclasses pickle as torch pickles them, their storages shared.

The built-in table holds exact classes; a subclass goes through its own
``__reduce_ex__``/``__getstate__`` and the storages inside still reach shmreduce's
storage reducer, so a child's in-place write is seen by the parent.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
import warnings
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

TIMEOUT = 30
CTX = mp.get_context("fork")


class Locked(torch.Tensor):
    """A subclass with an unpicklable attribute that its ``__getstate__`` drops."""

    lock: threading.Lock
    note: str

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("lock", None)
        return state


class Wrapper(torch.Tensor):
    """A ``_make_wrapper_subclass`` subclass: no storage of its own, its data in ``elem``."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    # torch documents __torch_dispatch__ as this classmethod, but types Tensor's attribute
    # as the disabled-dispatch function (one parameter fewer once bound).
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise NotImplementedError(f"Wrapper does not implement {func}")


def _locked() -> Locked:
    t = torch.zeros(8).as_subclass(Locked)
    t.lock = threading.Lock()
    t.note = "kept"
    return t


def _masked():
    from torch.masked import masked_tensor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MaskedTensor is a prototype and says so
        return masked_tensor(torch.zeros(8), torch.ones(8, dtype=torch.bool))


def _data(obj) -> torch.Tensor:
    """The plain tensor holding *obj*'s values, shared with the other side."""
    if isinstance(obj, Wrapper):
        return obj.elem
    if type(obj).__name__ == "MaskedTensor":
        return obj.get_data()
    return obj.detach().as_subclass(torch.Tensor)


def _write_in_child(conn) -> None:
    obj = conn.recv()
    _data(obj).fill_(7)
    conn.send((type(obj).__name__, getattr(obj, "note", None)))
    conn.close()


def _send_to_writing_child(obj):
    parent, child = CTX.Pipe()
    try:
        parent.send(obj)  # before the child starts: a failure to pickle leaves no child waiting
        proc = CTX.Process(target=_write_in_child, args=(child,))
        proc.start()
        try:
            assert parent.poll(TIMEOUT), "child did not answer"
            reply = parent.recv()
        finally:
            proc.join(TIMEOUT)
            if proc.is_alive():
                proc.kill()
                proc.join()
    finally:
        parent.close()
        child.close()
    assert proc.exitcode == 0
    return reply


@pytest.mark.parametrize("make", [_locked, _masked, lambda: Wrapper(torch.zeros(8))], ids=["getstate", "masked", "wrapper"])
def test_subclass_pickles_through_its_own_reduction_and_aliases(strategy, make):
    obj = make()
    name, note = _send_to_writing_child(obj)
    assert name == type(obj).__name__
    assert note == getattr(obj, "note", None)
    assert _data(obj).eq(7).all(), "the child's in-place write was not seen by the parent"


def test_subclass_state_and_class_survive_a_round_trip(strategy):
    t = _locked()
    out = pickle.loads(ForkingPickler.dumps(t))
    assert type(out) is Locked and out.note == "kept" and not hasattr(out, "lock")
    assert out.untyped_storage()._cdata == t.untyped_storage()._cdata


def test_builtin_table_holds_exact_classes_only():
    from shmreduce import registry

    assert registry.lookup(torch.Tensor) is not None
    assert registry.lookup(torch.nn.Parameter) is not None
    assert registry.lookup(Locked) is None and registry.lookup(Wrapper) is None
    assert registry.lookup(type(_masked())) is None


def test_parameter_keeps_its_class_and_requires_grad(strategy):
    p = torch.nn.Parameter(torch.zeros(4))
    back = pickle.loads(ForkingPickler.dumps(p))
    assert type(back) is torch.nn.Parameter and back.requires_grad
    assert back.untyped_storage()._cdata == p.untyped_storage()._cdata
    assert _send_to_writing_child(p) == ("Parameter", None)
    assert p.detach().eq(7).all()
