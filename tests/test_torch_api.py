"""The private torch storage API shmreduce wraps in shmreduce/_torch.py.

If a torch release changes any of these, this module fails loudly: fix _torch.py.
"""

import os

import torch

from shmreduce import _torch

# A storage torch itself shared by descriptor (what segments.adopt_fd meets), and
# a shared storage to swap memory with.
_new_shared_fd = torch.UntypedStorage._new_shared_fd_cpu


def test_new_shared_fd_dups_and_is_shared():
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    os.ftruncate(fd, 64)
    storage = _new_shared_fd(fd, 64)
    os.close(fd)  # torch keeps its own duplicate
    assert storage.is_shared() and storage.nbytes() == 64
    own = _torch.storage_fd(storage)
    assert own >= 0 and os.readlink(f"/proc/self/fd/{own}").startswith("/memfd:t")


def test_swap_memory_moves_memory_under_live_views():
    t = torch.arange(8, dtype=torch.int64)
    view = t[2:5]
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    os.ftruncate(fd, t.untyped_storage().nbytes())
    shared = _new_shared_fd(fd, t.untyped_storage().nbytes())
    os.close(fd)
    shared.copy_(t.untyped_storage())
    _torch.swap_memory(t.untyped_storage(), shared)
    assert t.is_shared() and view.is_shared()
    assert view.tolist() == [2, 3, 4]
    assert not shared.is_shared()  # it holds the old private memory now


def test_map_file_keeps_no_descriptor(tmp_path):
    path = tmp_path / "seg"
    path.write_bytes(bytes(range(16)))
    before = len(os.listdir("/proc/self/fd"))
    storage = _torch.map_file(str(path), 16)
    assert len(os.listdir("/proc/self/fd")) == before
    assert storage.is_shared() and bytes(storage.tolist()) == bytes(range(16))
    assert _torch.storage_fd(storage) == -1


def test_weak_storage_tracks_the_storage_impl():
    t = torch.zeros(4)
    weak = _torch.WeakStorage(t.untyped_storage())
    assert not weak.expired()
    assert weak.get()._cdata == t.untyped_storage()._cdata
    del t
    assert weak.expired() and weak.get() is None


def test_map_file_through_proc_fd_maps_the_open_file_even_unlinked(tmp_path):
    # segments.map_file relies on this: the descriptor pins the file it checked, so a
    # file unlinked meanwhile still maps its bytes, and from_file creates nothing.
    path = tmp_path / "seg"
    path.write_bytes(bytes(range(16)))
    fd = os.open(path, os.O_RDWR)
    try:
        os.unlink(path)
        storage = _torch.map_file(f"/proc/self/fd/{fd}", 16)
    finally:
        os.close(fd)
    assert storage.is_shared() and list(storage) == list(range(16))
    assert not path.exists()
