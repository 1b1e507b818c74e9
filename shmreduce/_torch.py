"""The private torch storage API shmreduce relies on, wrapped in one place.

These are stable across torch 2.x; ``tests/test_torch_api.py`` fails loudly if a
release changes any of them.
"""

from __future__ import annotations

from typing import Callable, cast

import torch

UntypedStorage = torch.UntypedStorage

_new_with_weak_ptr = UntypedStorage._new_with_weak_ptr
_expired = UntypedStorage._expired
_free_weak_ref: Callable[[int], None] = UntypedStorage._free_weak_ref


def map_file(path: str, nbytes: int) -> torch.UntypedStorage:
    """A MAP_SHARED mapping of *path* (which keeps no descriptor open)."""
    return cast(torch.UntypedStorage, UntypedStorage.from_file(path, shared=True, nbytes=nbytes))


def swap_memory(storage: torch.UntypedStorage, shared: torch.UntypedStorage) -> None:
    """Swap the memory of two storages in place (same size).

    Every tensor viewing *storage* now reads and writes *shared*'s memory; *shared*
    is left holding the old memory, freed when it is dropped.
    """
    storage._swap_data_ptr_(shared)  # type: ignore[attr-defined]


def storage_fd(storage: torch.UntypedStorage) -> int:
    """The descriptor of an fd-backed shared storage, or -1 (owned by the storage)."""
    return storage._share_fd_cpu_()[0]


class WeakStorage:
    """A weak reference to a storage's StorageImpl (not to a Python wrapper).

    Tensors keep the StorageImpl alive, not the Python ``UntypedStorage`` object, so
    Python's weakref would report storages dead while still in use.
    """

    __slots__ = ("cdata",)

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.cdata: int = storage._weak_ref()  # type: ignore[assignment]  # stubs say storage; it is an int

    def expired(self) -> bool:
        return bool(_expired(self.cdata))

    def get(self) -> torch.UntypedStorage | None:
        if _expired(self.cdata):
            return None
        return _new_with_weak_ptr(self.cdata)

    # Bound at definition: the torch module may be torn down before us at shutdown.
    def __del__(self, _free: Callable[[int], None] = _free_weak_ref) -> None:
        _free(self.cdata)
