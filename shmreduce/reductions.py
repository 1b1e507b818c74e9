"""``reduce_x`` / ``rebuild_x`` pairs for every torch tensor and storage type.

A reducer returns ``(rebuild, args)`` as for ``copyreg``; tensors and storages inside
*args* are pickled again through the same table, so sparse and nested tensors share
their CPU parts. Rebuild functions are importable by name and take small
structures: named tuples, except a strided tensor's (ref, meta), which travel as plain
tuples on the hot path (see below). Devices: CPU is shared through ``transfer``; CUDA tensors go through
torch's own CUDA IPC reducer; CUDA storages on their own are refused; meta tensors
and storages rebuild as meta.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, NamedTuple

import torch

from shmreduce import _faults, _native, _torch, forking, segments, transfer
from shmreduce.errors import SharingError

_SPARSE_COMPRESSED = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}


# A strided tensor travels as (ref, meta): *ref* the storage's ref (``transfer``),
# a plain tuple (or None for an empty storage), *meta* everything else as a plain
# tuple (dtype, size, stride, offset, extra), where *extra* is None for a plain
# Tensor that does not require grad and is neither a conjugate nor a negative view,
# else (class, requires_grad, instance __dict__ or None, conj, neg): the view bits are
# on the tensor, its storage holds the bytes they are lazily applied to. Plain tuples
# pickle and load in C: a (ref, meta) pair as two NamedTuples costs several times as
# much to pickle and to load, on the per-tensor hot path. transfer.share names the
# ref's fields; receive() checks the shape of what arrives. A plain tensor
# _native.reduce sends travels in a more compact form still, _native.load(template,
# packed): its generation's template tuple (pickled once a message) and a few packed
# bytes; rebuild_packed below is its general path.
Meta = tuple
_Tensor = torch.Tensor


def _refuse_non_leaf(tensor: torch.Tensor) -> None:
    if tensor.requires_grad and not tensor.is_leaf:
        raise SharingError(
            # torch's words, which people (and torch's own tests) match on
            "Cowardly refusing to serialize non-leaf tensor which requires_grad, since "
            "autograd does not support crossing process boundaries. If you just want to "
            "transfer the data, call detach() on the tensor before serializing (e.g., "
            "putting it on the queue)."
        )


def _meta(tensor: torch.Tensor) -> Meta:
    cls = type(tensor)
    extra = None
    conj, neg = tensor.is_conj(), tensor.is_neg()
    if cls is not _Tensor or tensor.requires_grad or conj or neg:
        state = tensor.__dict__ if cls is not _Tensor and tensor.__dict__ else None
        extra = (cls, tensor.requires_grad, dict(state) if state else None, conj, neg)
    return (tensor.dtype, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset(), extra)


def _finish(t: torch.Tensor, extra: tuple | None) -> torch.Tensor:
    if extra is None:
        return t
    cls, requires_grad, state, conj, neg = extra
    if conj:
        t = t.conj()  # a view with the conjugate bit, over the same storage
    if neg:
        t = _torch.neg_view(t)
    if cls is not torch.Tensor:
        t = _torch.make_subclass(cls, t, requires_grad)
    elif requires_grad:
        t.requires_grad_(True)
    if state:
        t.__dict__.update(state)
    return t


# -- tensors -----------------------------------------------------------------------


_STRIDED = torch.strided


def reduce_tensor(tensor: torch.Tensor) -> tuple[Any, tuple]:
    if tensor.requires_grad:
        _refuse_non_leaf(tensor)
    if _torch.has_backward_hooks(tensor):
        torch.utils.hooks.warn_if_has_hooks(tensor)
    layout = tensor.layout
    if layout is not _STRIDED:
        if layout is torch.sparse_coo:
            return reduce_sparse_coo(tensor)
        if layout in _SPARSE_COMPRESSED:
            return reduce_sparse_compressed(tensor)
    if tensor.is_nested:
        return reduce_nested(tensor)
    if tensor.is_quantized:  # torch's own rebuild and quantizer, over a storage shared by reduce_storage
        return _torch.quantized_reduce(tensor)
    if tensor.is_cpu:
        dlpack_table()  # filled once: _native.reduce packs the dtypes it has
        storage = tensor.untyped_storage()
        # An empty storage travels as itself (reduce_storage): pickle's memo then
        # rebuilds views of one empty storage in one message over one storage, as torch.
        return _rebuild, (transfer.share(storage) if storage.nbytes() else storage, _meta(tensor))
    device = tensor.device.type
    if device == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor as torch_reduce_tensor

        return torch_reduce_tensor(tensor)
    if device == "meta":
        return rebuild_meta_tensor, (_meta(tensor), tensor.untyped_storage().nbytes())
    raise SharingError(f"cannot share a tensor on device {tensor.device}: move it to CPU first")


_EMPTY: dict[torch.dtype, torch.Tensor] = {}  # one empty tensor per dtype: new_empty is cheap
_DLPACK = segments.dtypes  # (code, bits, lanes, itemsize) of each dtype DLPack carries, filled by prepare()


def dlpack_table() -> dict[torch.dtype, tuple[int, int, int, int]]:
    """The dtypes ``_native.rebuild`` makes tensors of (``segments.dtypes``), filled once."""
    if not _prepared:
        prepare()
    return _DLPACK


# -- what torch initializes on first use ---------------------------------------------
#
# torch initializes much on first use, in C++ function-local statics: each op's
# dispatcher handle and each binding's argument parser at its first call, the
# quantized engine (``at::Context::qEngine``, which reads the CPU's features) at the
# first quantized tensor. A thread that meets one being initialized waits on its guard
# (``__cxa_guard_acquire``, a futex), and a forked child inherits a guard marked "in
# progress" that no thread of its own will ever finish: the child waits there for ever
# the first time it takes that path. The dtype table makes a tensor of every dtype: a
# queue's feeder thread building it (inside qEngine's initialization) while the main
# thread forks leaves the child waiting in qEngine's guard at its first load.
#
# So ``prepare`` meets, once, what the reducers meet in torch: the dtype table, the
# quantized engine, and a tiny tensor of each kind taken apart and rebuilt (nothing is
# shared), but a quantized one and a compressed sparse one (torch warns once a process
# as it makes the first of either kind, whatever filter is active: the user's own would
# not; their first share and load initialize a few op handles). ``register()`` runs it in its caller's thread; without it (``dumps`` and
# ``loads`` unregistered) the first thread that needs the table does. It runs under
# ``_prepare_lock``, which a fork waits for; re-entrant, so that a fork from inside it
# (a finalizer on the same thread) takes it again rather than waiting for itself.
_prepare_lock = threading.RLock()
_prepared = False


def prepare() -> None:
    """Build the dtype table and initialize what torch initializes on the reducers'
    first use (see above): at once, in this thread, and once a process."""
    global _prepared
    if _prepared:
        return
    with _prepare_lock:
        if _prepared or _DLPACK:  # done, or under way in this very thread (its examples need the table)
            return
        _faults.pause("prepare.torch")
        _DLPACK.update((dtype, (*code, dtype.itemsize)) for dtype, code in _torch.dlpack_dtypes(_native.dltype).items())
        try:
            _torch.quantized_engine()  # what a quantized tensor's rebuild would settle
            if _torch.swap_memory is None:
                _torch.prime_share_fd()  # every storage sent takes torch's share_fd on this torch
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch calls nested tensors a prototype
                for example in _examples():
                    rebuild, args = reduce_tensor(example)
                    rebuild(*args)
        except (RuntimeError, TypeError, ValueError, SharingError):
            pass  # a kind this torch cannot make or take: its first user meets the error, not register()
        finally:
            _prepared = True


def _examples() -> list[torch.Tensor]:
    """A tiny tensor of each kind ``reduce_tensor`` takes apart, none with a byte to share."""
    x = torch.empty(0)
    z = torch.empty(0, dtype=torch.complex64)
    return [
        x,
        z.conj(),
        z.conj().imag,  # the negative bit
        torch.empty(0, requires_grad=True),
        torch.nn.Parameter(x),
        torch.empty((0, 0)).to_sparse(),
        _torch.nested_from_buffer(
            x, torch.zeros((1, 1), dtype=torch.int64), torch.ones((1, 1), dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        ),
        torch.empty(0, device="meta"),
    ]


def _before_fork() -> None:
    _faults.pause("fork.waits")  # a test's sign that a fork waits here
    _prepare_lock.acquire()


forking.part("reductions", before=_before_fork, after_in_parent=_prepare_lock.release, after_in_child=_prepare_lock.release)


def _plain(meta: Any) -> tuple | None:
    """*meta* as a plain tensor's (its class and grad are applied after, ``_finish``),
    for ``_native.rebuild`` to make in one step: if well formed, starting its storage,
    in a dtype DLPack carries (the table filled on first use)."""
    if type(meta) is not tuple or len(meta) != 5 or meta[3] != 0 or type(meta[0]) is not torch.dtype or meta[0] not in dlpack_table():
        return None
    return meta if meta[4] is None else (*meta[:4], None)


def rebuild_tensor(ref: tuple | torch.UntypedStorage | None, meta: Meta) -> torch.Tensor:
    """The general rebuild of a strided CPU tensor: *ref*, a storage's ref (``transfer``), or
    an empty storage already rebuilt (None from older pickles). Pickles name
    ``_native.rebuild``, which makes the common case in one C call (a plain tensor
    over the whole of a storage not loaded here yet, in a generation this process
    holds already) and hands every other case here."""
    if isinstance(ref, tuple):
        got = transfer.receive_tensor(ref, _plain(meta))
    else:
        got = torch.UntypedStorage(0) if ref is None else ref
    try:
        if isinstance(got, torch.Tensor):  # the tensor itself, made over the mapping (its layout checked in C)
            extra = meta[4]
            return got if extra is None else _finish(got, extra)
        storage = got
        dtype, size, stride, offset, extra = meta
        empty = _EMPTY.get(dtype)
        if empty is None:
            empty = _EMPTY[dtype] = torch.empty((0,), dtype=dtype)
        if storage.resizable() and not _fits(storage.nbytes(), empty.element_size(), size, stride, offset):
            # set_ would grow it: a storage torch shared (loaded in its own process,
            # transfer._adopted_here) is its mapping, which torch then reallocates
            # (SIGSEGV). One over shmreduce's mapping cannot grow: set_ refuses.
            raise ValueError("past the end of its storage")
        # new(): an empty tensor of empty's dtype and device, in half the time of
        # new_empty((0,)), on the per-tensor hot path.
        t = empty.new().set_(storage, offset, size, stride)
        return t if extra is None else _finish(t, extra)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise SharingError(f"tensor metadata that does not fit its storage ({exc}): forged or corrupted message") from None


def _fits(nbytes: int, itemsize: int, size: tuple, stride: tuple, offset: int) -> bool:
    """Whether a view (*size*, *stride*, *offset*, in elements) lies within *nbytes*."""
    if offset < 0 or len(size) != len(stride) or min(stride, default=0) < 0:
        return False
    if 0 in size:
        return True
    return (offset + sum((n - 1) * step for n, step in zip(size, stride, strict=True)) + 1) * itemsize <= nbytes


def rebuild_packed(template: Any, packed: Any) -> torch.Tensor:
    """The general rebuild of a plain tensor ``_native.reduce`` pickled in its compact
    form, ``_native.load(template, packed)``: every case ``load`` does not make itself
    (the generation not held here yet, its storage loaded here already, a view that
    does not span its storage), as the (ref, meta) form it stands for."""
    dlpack_table()  # what unpack reads the dtype from
    ref, meta = _native.unpack(template, packed)
    return rebuild_tensor(ref, meta)


def bind_sender(tensor_type: type = torch.Tensor) -> None:
    """Bind what ``_native.reduce`` needs: the form it pickles to, the tensor type it
    takes (exactly; its DLPack exchange API is read from it), torch's strategy and
    ``is_shared``. Tests bind a type without the exchange API to stand for an older torch."""
    _native.init_send(_native.load, tensor_type, torch.strided, vars(torch.multiprocessing), _torch.torch_is_shared)


_rebuild = _native.rebuild
bind_sender()


def rebuild_meta_tensor(meta: Meta, nbytes: int) -> torch.Tensor:
    dtype, size, stride, offset, extra = meta
    storage = torch.UntypedStorage(nbytes, device="meta")
    return _finish(torch.empty((0,), dtype=dtype, device="meta").set_(storage, offset, size, stride), extra)


class SparseCoo(NamedTuple):
    indices: torch.Tensor
    values: torch.Tensor
    size: tuple[int, ...]
    coalesced: bool
    requires_grad: bool


def reduce_sparse_coo(tensor: torch.Tensor) -> tuple[Any, tuple]:
    indices, values = _torch.coo_parts(tensor)
    parts = SparseCoo(indices.detach(), values.detach(), tuple(tensor.shape), tensor.is_coalesced(), tensor.requires_grad)
    return rebuild_sparse_coo, (parts,)


def rebuild_sparse_coo(parts: SparseCoo) -> torch.Tensor:
    t = torch.sparse_coo_tensor(parts.indices, parts.values, parts.size, is_coalesced=parts.coalesced)
    return t.requires_grad_(parts.requires_grad)


class SparseCompressed(NamedTuple):
    compressed: torch.Tensor
    plain: torch.Tensor
    values: torch.Tensor
    size: tuple[int, ...]
    layout: torch.layout
    requires_grad: bool


def reduce_sparse_compressed(tensor: torch.Tensor) -> tuple[Any, tuple]:
    compressed, plain = _SPARSE_COMPRESSED[tensor.layout]
    parts = SparseCompressed(
        getattr(tensor, compressed)().detach(),
        getattr(tensor, plain)().detach(),
        tensor.values().detach(),
        tuple(tensor.shape),
        tensor.layout,
        tensor.requires_grad,
    )
    return rebuild_sparse_compressed, (parts,)


def rebuild_sparse_compressed(parts: SparseCompressed) -> torch.Tensor:
    t = torch.sparse_compressed_tensor(parts.compressed, parts.plain, parts.values, parts.size, layout=parts.layout)
    return t.requires_grad_(parts.requires_grad)


class Nested(NamedTuple):
    buffer: torch.Tensor
    sizes: torch.Tensor
    strides: torch.Tensor
    offsets: torch.Tensor


def reduce_nested(tensor: torch.Tensor) -> tuple[Any, tuple]:
    # Only strided nested tensors get here: jagged ones are a Python subclass, which
    # the table (exact classes) leaves to its own reduction; the values and offsets
    # tensors that pickles still come through reduce_tensor.
    parts = Nested(tensor.values().detach(), *_torch.nested_layout(tensor))
    return rebuild_nested, (parts,)


def rebuild_nested(parts: Nested) -> torch.Tensor:
    return _torch.nested_from_buffer(parts.buffer, parts.sizes, parts.strides, parts.offsets)


# -- storages ----------------------------------------------------------------------


def reduce_storage(storage: torch.UntypedStorage) -> tuple[Any, tuple]:
    device = storage.device.type
    if device == "cuda":
        raise SharingError("cannot share a CUDA storage on its own: pickle the CUDA tensor instead, or move it to CPU")
    if device == "meta":
        return rebuild_meta_storage, (storage.nbytes(),)
    if device != "cpu":
        raise SharingError(f"cannot share a storage on device {storage.device}: move it to CPU first")
    return rebuild_storage, (transfer.share(storage) if storage.nbytes() else None,)


def rebuild_storage(ref: tuple | None) -> torch.UntypedStorage:
    return transfer.receive(ref) if ref is not None else torch.UntypedStorage(0)


def rebuild_meta_storage(nbytes: int) -> torch.UntypedStorage:
    return torch.UntypedStorage(nbytes, device="meta")


def reduce_typed_storage(storage: torch.TypedStorage) -> tuple[Any, tuple]:
    # The untyped storage in args is pickled through reduce_storage.
    return rebuild_typed_storage, (_torch.typed_storage_untyped(storage), storage.dtype, type(storage))


def rebuild_typed_storage(untyped: torch.UntypedStorage, dtype: torch.dtype, cls: type) -> torch.TypedStorage:
    return _torch.typed_storage(untyped, dtype, cls)


def default_reducers() -> dict[type, Any]:
    """The built-in table: every torch tensor and storage class shmreduce shares."""
    table: dict[type, Any] = {}
    for cls in _torch.storage_classes():
        table[cls] = reduce_storage if issubclass(cls, torch.UntypedStorage) else reduce_typed_storage
    table[torch.UntypedStorage] = reduce_storage
    table[torch.TypedStorage] = reduce_typed_storage
    for tensor_cls in _torch.tensor_classes():
        table[tensor_cls] = reduce_tensor
    table[torch.Tensor] = _native.reduce  # reduce_tensor's common case in one C call; the rest goes there
    table[torch.nn.Parameter] = reduce_tensor
    return table
