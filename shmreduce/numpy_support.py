"""Opt-in sharing of large ``numpy.ndarray`` objects through shmreduce's segments.

joblib's idea (``max_nbytes``): arrays at or above a size threshold travel through
shared memory, smaller ones are pickled by value as usual. Built only on the public
``register_reducer`` hook, so it serves ForkingPickler (while registered), ``dumps``
and ``dispatch_table()`` alike.

Semantics:

* **A copy at send time, shared afterwards.** Sending an array copies its bytes once
  into a fresh shared segment (numpy memory cannot be moved in place the way a torch
  storage can). The receiver's array maps that segment: no copy on receive, and every
  process that later receives the *received* array sees the same memory — it is sent
  on without a second copy. The sender's original array is *not* aliased: writes to
  it after sending are not seen by the receiver, and vice versa.
* Dtype (including structured, datetime, fixed-width string and non-native byte
  order dtypes), shape and C/Fortran order survive; the bytes are identical. A
  non-contiguous array arrives contiguous (like ``np.ascontiguousarray``). Received
  arrays are writeable.

Limits (these are pickled by value, exactly as without shmreduce):

* arrays smaller than ``min_nbytes``, and empty arrays;
* dtypes holding Python objects (``dtype.hasobject``: ``object``, or structured
  dtypes with object fields);
* subclasses of ``ndarray`` (``np.memmap``, ``np.matrix``, masked arrays): they keep
  their own pickling.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import numpy as np
import torch

from shmreduce import registry

DEFAULT_MIN_NBYTES = 1 << 16
_state = {"min_nbytes": DEFAULT_MIN_NBYTES}

Order = Literal["C", "F"]


def share_numpy(min_nbytes: int = DEFAULT_MIN_NBYTES) -> None:
    """Share ``numpy.ndarray`` objects of at least *min_nbytes* bytes. Idempotent.

    Calling it again changes the threshold. Undo with ``unshare_numpy()``.
    """
    if not isinstance(min_nbytes, int) or min_nbytes < 0:
        raise ValueError(f"min_nbytes must be a non-negative int, not {min_nbytes!r}")
    _state["min_nbytes"] = min_nbytes
    registry.register_reducer(np.ndarray, reduce_ndarray)


def unshare_numpy() -> None:
    """Stop sharing numpy arrays (they pickle by value again). Idempotent."""
    if registry.list_reducers().get(np.ndarray) is reduce_ndarray:
        registry.unregister_reducer(np.ndarray)


def _order(arr: np.ndarray) -> Order:
    return "F" if arr.flags.f_contiguous and not arr.flags.c_contiguous else "C"


def _backing_tensor(arr: np.ndarray) -> torch.Tensor | None:
    # An array made by rebuild_ndarray (or by tensor.numpy() over a flat uint8 tensor)
    # has that tensor as its base: send the tensor itself, which is already shared.
    base = arr.base
    while isinstance(base, np.ndarray):
        base = base.base
    if (
        isinstance(base, torch.Tensor)
        and base.dtype == torch.uint8
        and base.dim() == 1
        and base.is_contiguous()
        and base.nbytes == arr.nbytes
        and base.data_ptr() == arr.__array_interface__["data"][0]
        and (arr.flags.c_contiguous or arr.flags.f_contiguous)
    ):
        return base
    return None


def reduce_ndarray(arr: np.ndarray) -> tuple:
    """Reducer for ``numpy.ndarray``: large plain arrays via a shared uint8 tensor."""
    if type(arr) is not np.ndarray or arr.dtype.hasobject or arr.nbytes == 0 or arr.nbytes < _state["min_nbytes"]:
        # ndarray.__reduce__ always returns a tuple (the str form is for singletons).
        return cast(tuple, arr.__reduce__())
    order = _order(arr)
    buf = _backing_tensor(arr)
    if buf is None:
        buf = torch.empty(arr.nbytes, dtype=torch.uint8)
        np.copyto(_view(buf, arr.dtype, arr.shape, order), arr, casting="no")
    return rebuild_ndarray, (buf, arr.dtype, arr.shape, order)


def _view(buf: torch.Tensor, dtype: np.dtype, shape: tuple[int, ...], order: Order) -> np.ndarray:
    return buf.numpy().view(dtype).reshape(shape, order=order)


def rebuild_ndarray(buf: torch.Tensor, dtype: Any, shape: tuple[int, ...], order: Order) -> np.ndarray:
    """An array of *dtype*/*shape*/*order* over the shared bytes of *buf* (no copy)."""
    return _view(buf, np.dtype(dtype), tuple(shape), order)
