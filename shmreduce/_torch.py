"""The private torch storage API shmreduce relies on, wrapped in one place.

Every wrapper here is in torch 2.8, hence ``torch>=2.8`` (docs/compatibility.md, "The
private torch API", has each wrapper's history); importing this module under an older
torch raises ``ImportError`` saying so. One is newer: ``UntypedStorage._swap_data_ptr_``
(``swap_memory``, torch 2.12), with which a sender's storage moves into shmreduce's pool
in place. Where torch lacks it, ``swap_memory`` is None and torch moves the storage
itself (``share_fd``), into a memfd shmreduce then adopts (``path()`` says which); what
decides is whether the method exists, never the version. ``tests/test_torch_api.py``
fails loudly if a release changes any of them.
"""

from __future__ import annotations

import itertools
import operator
import warnings
from collections.abc import Callable
from typing import cast

import torch

# The oldest torch every wrapper below has been checked on (tests/test_torch_api.py).
FLOOR = (2, 8)


def _release(version: str) -> tuple[int, ...]:
    """A torch version's (major, minor): "2.11.0+cu130" -> (2, 11); () if unreadable."""
    parts = []
    for part in version.split("+")[0].split(".")[:2]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            return ()
        parts.append(int(digits))
    return tuple(parts)


def check_floor(version: str) -> None:
    """ImportError unless torch *version* is FLOOR or newer (an unreadable one passes:
    a build of torch's main branch names itself oddly)."""
    release = _release(version)
    if release and release < FLOOR:
        need = ".".join(map(str, FLOOR))
        raise ImportError(
            f"shmreduce needs torch>={need}, and this Python has torch {version}: its private storage API "
            f"lacks what shmreduce calls. Upgrade torch (pip install 'torch>={need},<3'), or keep torch's own "
            "sharing (do not call shmreduce.register())"
        )


check_floor(getattr(torch, "__version__", ""))

UntypedStorage = torch.UntypedStorage


# Swap the memory of two storages in place (same size): every tensor viewing the
# first now reads and writes the second's memory; the second is left holding the old
# memory, freed when it is dropped. Bound, not wrapped: one call per storage shared.
# None on a torch without it (before 2.12): see ``share_fd``.
swap_memory: Callable[[torch.UntypedStorage, torch.UntypedStorage], None] | None = getattr(UntypedStorage, "_swap_data_ptr_", None)


def share_fd(storage: torch.UntypedStorage) -> None:
    """Move *storage* into a memfd of torch's own, in place (``_share_fd_cpu_``): torch
    allocates it, copies, and repoints the same StorageImpl, so every view of it sees
    the shared memory. The one way to move a storage in place where torch has no
    ``swap_memory``; shmreduce then adopts the memfd (``segments.adopt``). torch's
    ``_share_filename_cpu_`` leaves no descriptor to adopt, so this serves under both
    strategies."""
    storage._share_fd_cpu_()


def prime_share_fd() -> None:
    """Meet, once, what torch initializes at a process's first ``share_fd`` (its
    process-wide shared-memory handle, ``at::NewProcessWideShmHandle``, a function-local
    static): in the caller's thread, so that a queue's feeder thread never holds that
    guard while another thread forks (the child would wait on it for ever)."""
    storage = UntypedStorage(1)
    share_fd(storage)
    storage_fd(storage)


def path() -> str:
    """How a sender's storage moves into shared memory on this torch: "swap" (into
    shmreduce's pool, with ``swap_memory``) or "adopt" (by torch, ``share_fd``)."""
    return "adopt" if swap_memory is None else "swap"


# torch's DLPack importer for a "dltensor" capsule (the legacy, unversioned ABI, which
# every torch 2.x reads) or, from torch 2.9, a "dltensor_versioned" one: the tensor
# aliases the capsule's memory, and torch calls the capsule's deleter when the storage
# dies. ``shmreduce._native`` calls it from C.
from_dlpack: Callable[[object], torch.Tensor] = torch._C._from_dlpack


# The quantized dtypes (torch's own list, ``torch.storage``): DLPack carries none, and
# making a tensor of one warns that they are deprecated, once a process, through
# whatever filter is active then, so the user's own first one would not warn.
QUANTIZED_DTYPES = frozenset({torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def dlpack_versioned() -> bool:
    """Whether ``from_dlpack`` takes DLPack 1.x ("dltensor_versioned") capsules
    (torch 2.9 on); where it does not, ``_native`` hands it legacy ones. Tried once:
    a torch that takes them can also make one (``__dlpack__(max_version=...)``)."""
    try:
        from_dlpack(torch.zeros(1).__dlpack__(max_version=(1, 0)))
    except (TypeError, RuntimeError, BufferError):
        return False
    return True


def dlpack_dtypes(dltype: Callable[[object], tuple[int, int, int]]) -> dict[torch.dtype, tuple[int, int, int]]:
    """The DLPack dtype (code, bits, lanes) of every torch dtype that goes to DLPack and
    comes back as itself through ``from_dlpack`` (checked here, once, on this torch);
    *dltype* reads a capsule's. The others (sub-byte and quantized ones) are absent."""
    table = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns of experimental dtypes as it makes them
        for dtype in {v for v in vars(torch).values() if isinstance(v, torch.dtype)} - QUANTIZED_DTYPES:
            try:
                capsule = torch.utils.dlpack.to_dlpack(torch.empty(1, dtype=dtype))
                code = dltype(capsule)
                back = from_dlpack(capsule)
            except (RuntimeError, TypeError, BufferError, ValueError):
                continue
            if back.dtype == dtype:
                table[dtype] = code
    return table


def quantized_engine() -> str:
    """The quantized engine (``torch.backends.quantized.engine``): reading it settles
    the one torch's quantized kernels use, as the first quantized tensor would, and
    makes no tensor (nothing warns)."""
    return str(torch.backends.quantized.engine)


# torch's own answer, bound at import: while registered, ``patches`` makes
# UntypedStorage.is_shared also ask shmreduce's cache.
torch_is_shared: Callable[[torch.UntypedStorage], bool] = UntypedStorage.is_shared


# The identity of a storage's StorageImpl (``_cdata``, an int): one per storage,
# whatever the Python wrappers of it. An attrgetter: no Python frame per storage.
storage_key: Callable[[torch.UntypedStorage], int] = operator.attrgetter("_cdata")


def storage_fd(storage: torch.UntypedStorage) -> int:
    """The descriptor of an fd-backed shared storage, or -1 (owned by the storage);
    RuntimeError for one that has none (shared by file name, or not shared). Read,
    never moved: ``_share_fd_cpu_`` would move one torch shared by file name out of
    the file its peers map."""
    return cast(int, storage._get_shared_fd())  # type: ignore[attr-defined]  # private, not in torch's stub


# A weak reference to a storage's Python object is one to its StorageImpl: torch
# keeps one Python object per StorageImpl for as long as any tensor uses it
# (PyObject preservation), so ``weakref.ref(storage)`` dies with the storage, not with
# the wrapper. The caches (``cache``, ``_native.rebuild``) rely on it.


# -- tensors and classes (reductions) --
# What reductions.py needs to take a tensor or storage apart and put it back together
# as torch's own pickling does (torch/_tensor.py's __reduce_ex__, torch/_utils.py's
# _rebuild_* functions): none has a public equivalent that keeps the same result.


# A view of a tensor with the negative bit set (``x.conj().imag`` has it): what a
# received tensor gets back when its sender's had it. Private (torch 1.10+).
neg_view: Callable[[torch.Tensor], torch.Tensor] = torch._neg_view


def make_subclass(cls: type, tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """*tensor*'s data as an instance of the Tensor subclass *cls* (``torch.Tensor._make_subclass``).

    The result views *tensor*'s storage with its size, stride and offset, as a leaf
    with *requires_grad* set; neither ``cls.__new__`` nor ``cls.__init__`` runs, so a
    subclass whose constructor takes other arguments still rebuilds. It is how
    ``torch.nn.Parameter.__new__`` makes a Parameter.
    """
    return torch.Tensor._make_subclass(cls, tensor, requires_grad)


def quantized_reduce(tensor: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple]:
    """torch's own pickling of a quantized CPU tensor (``Tensor._reduce_ex_internal``).

    It is ``(torch._utils._rebuild_qtensor, (TypedStorage, offset, size, stride,
    quantizer params, requires_grad, hooks))``: the storage inside is then pickled by
    whatever reducer the pickler has for storages (ours, so it is shared), and the
    quantizer (scale, zero point, per-channel tensors) travels with it. Quantized
    tensors carry no DLPack dtype, so this is their only way through. torch deprecates
    creating them (2.13 and later warn once per process; pytorch/pytorch#184982).
    """
    return cast("tuple[Callable[..., torch.Tensor], tuple]", tensor._reduce_ex_internal(2))


def has_backward_hooks(tensor: torch.Tensor) -> bool:
    """Whether ``register_hook`` put hooks on *tensor* (``Tensor._backward_hooks``: None or a dict).

    Hooks do not cross processes. torch's reducer warns about them through
    ``torch.utils.hooks.warn_if_has_hooks`` (which reads the same attribute); we test
    first because nearly no tensor has hooks and this is the per-tensor hot path.
    """
    return bool(tensor._backward_hooks)


def coo_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse COO tensor's indices and values as stored (``Tensor._indices()``, ``Tensor._values()``).

    The public ``indices()`` and ``values()`` refuse an uncoalesced tensor; these
    return the parts of either kind as they are, duplicates and order kept, so
    ``torch.sparse_coo_tensor(indices, values, size, is_coalesced=...)`` rebuilds it
    bit for bit. torch's sparse docs name them for uncoalesced tensors.
    """
    return tensor._indices(), tensor._values()


def nested_layout(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A strided nested tensor's per-component sizes, strides and offsets into its buffer.

    ``Tensor._nested_tensor_size()``, ``_nested_tensor_strides()`` and
    ``_nested_tensor_storage_offsets()``: what torch's own ``__reduce_ex__`` pickles
    beside the buffer, and what ``nested_from_buffer`` takes back.
    """
    return tensor._nested_tensor_size(), tensor._nested_tensor_strides(), tensor._nested_tensor_storage_offsets()


def nested_from_buffer(buffer: torch.Tensor, sizes: torch.Tensor, strides: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The strided nested tensor viewing *buffer* (``torch._nested_view_from_buffer``).

    A view, not a copy (the public ``torch.nested`` constructors copy), so a shared
    buffer stays shared; torch's own rebuild (``torch._utils._rebuild_nested_tensor``)
    calls it.
    """
    return torch._nested_view_from_buffer(buffer, sizes, strides, offsets)


def typed_storage_untyped(storage: torch.TypedStorage) -> torch.UntypedStorage:
    """The untyped storage under a TypedStorage (``TypedStorage._untyped_storage``).

    The public ``untyped()`` returns the same object but warns on every call that
    TypedStorage is deprecated; torch's own code reads the attribute.
    """
    return storage._untyped_storage


def typed_storage(untyped: torch.UntypedStorage, dtype: torch.dtype, cls: type) -> torch.TypedStorage:
    """A TypedStorage of class *cls* (TypedStorage, or a legacy one such as FloatStorage) over *untyped*.

    ``wrap_storage=..., _internal=True``, as torch's own rebuild calls it: without
    ``_internal`` TypedStorage's constructor warns that TypedStorage is deprecated. A
    legacy class knows its dtype and takes none; torch builds it as a TypedStorage
    instance (``isinstance`` holds through a metaclass) and warns once a process
    whatever we pass, reading the legacy class's dtype.
    """
    if cls is torch.TypedStorage:
        return torch.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
    return cls(wrap_storage=untyped, _internal=True)


def storage_classes() -> tuple[type, ...]:
    """Every storage class torch defines (``torch._storage_classes``), in that set's order.

    UntypedStorage, TypedStorage and the legacy ``torch.FloatStorage`` ... and
    ``torch.cuda.FloatStorage`` ... classes: the exact classes torch's own
    ``torch.multiprocessing.reductions.init_reductions`` registers.
    """
    return tuple(torch._storage_classes)


def tensor_classes() -> tuple[type, ...]:
    """The legacy typed tensor classes (``torch._tensor_classes``), in that set's order.

    ``torch.FloatTensor``, ``torch.cuda.FloatTensor``, ``torch.sparse.FloatTensor`` ...:
    the exact classes torch's own ``init_reductions`` registers beside ``torch.Tensor``.
    """
    return tuple(torch._tensor_classes)
