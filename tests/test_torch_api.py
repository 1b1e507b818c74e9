"""The private torch storage API shmreduce wraps in shmreduce/_torch.py.

If a torch release changes any of these, this module fails loudly: fix _torch.py.
"""

import gc
import os
import warnings
import weakref

import pytest
import torch

from shmreduce import _torch

from helpers import run_in_child

# A storage torch itself shared by descriptor (what segments.adopt_fd meets), and
# a shared storage to swap memory with.
_new_shared_fd = torch.UntypedStorage._new_shared_fd_cpu  # type: ignore[attr-defined]  # private, not in torch's stub: pinned on purpose


def test_new_shared_fd_dups_and_is_shared():
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    os.ftruncate(fd, 64)
    storage = _new_shared_fd(fd, 64)
    os.close(fd)  # torch keeps its own duplicate
    assert storage.is_shared() and storage.nbytes() == 64
    own = _torch.storage_fd(storage)
    assert own >= 0 and os.readlink(f"/proc/self/fd/{own}").startswith("/memfd:t")


RELEASE = _torch._release(torch.__version__)


def test_which_release_has_each_api_shmreduce_chooses_its_path_by():
    # shmreduce asks torch whether each exists, never its version; this pins which
    # release has which, so a release that adds or drops one shows up here first.
    assert (_torch.swap_memory is not None) == (RELEASE >= (2, 12)), "UntypedStorage._swap_data_ptr_ moved: fix _torch.swap_memory"
    assert _torch.path() == ("swap" if RELEASE >= (2, 12) else "adopt")
    assert _torch.dlpack_versioned() == (RELEASE >= (2, 9)), "torch._C._from_dlpack's capsules changed: fix _torch.dlpack_versioned"
    assert hasattr(torch.Tensor, "__dlpack_c_exchange_api__") == (RELEASE >= (2, 10))
    assert RELEASE >= _torch.FLOOR


def test_share_fd_moves_a_storage_into_a_memfd_in_place_under_live_views():
    t = torch.arange(8, dtype=torch.int64)
    view = t[2:5]
    _torch.share_fd(t.untyped_storage())
    assert t.is_shared() and view.is_shared() and view.tolist() == [2, 3, 4]
    assert view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert _torch.storage_fd(t.untyped_storage()) >= 0


def _fd_of_a_storage_shared_by_file_name() -> tuple[str, bool]:
    s = torch.UntypedStorage(64)
    s._share_filename_cpu_()
    ptr = s.data_ptr()
    try:
        _torch.storage_fd(s)
        outcome = "a descriptor"
    except RuntimeError:
        outcome = "none"  # no descriptor: shmreduce does not adopt it
    return outcome, s.data_ptr() == ptr


def test_storage_fd_reads_a_storage_torch_shared_by_file_name_without_moving_it():
    # In a child: torch's file_system sharing connects to its torch_shm_manager for good.
    assert run_in_child(_fd_of_a_storage_shared_by_file_name) == ("ok", ("none", True)), (
        "storage_fd moved the storage out of the file torch's peers map"
    )
    ptr = (plain := torch.UntypedStorage(8)).data_ptr()
    with pytest.raises(RuntimeError):
        _torch.storage_fd(plain)  # not shared at all: not moved either
    assert plain.data_ptr() == ptr


def test_swap_memory_moves_memory_under_live_views():
    if _torch.swap_memory is None:
        pytest.skip(f"torch {torch.__version__} has no UntypedStorage._swap_data_ptr_ (2.12 on): the adopt path")
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


def test_a_storage_object_lives_as_long_as_its_storage_impl():
    # The identity maps (shmreduce/cache.py, _native.rebuild) hold weakref.ref(storage):
    # torch must keep one Python object per StorageImpl while a tensor uses it.
    t = torch.zeros(4)
    weak = weakref.ref(t.untyped_storage())
    gc.collect()
    got = weak()
    assert got is not None and got is t.untyped_storage() and got._cdata == t.untyped_storage()._cdata
    view = t[1:]
    del got, t  # no reference may outlive this line but the view's
    gc.collect()
    assert weak() is view.untyped_storage()
    del view
    gc.collect()
    assert weak() is None


def _require(owner: object, name: str, wrapper: str) -> None:
    where = getattr(owner, "__name__", type(owner).__name__)
    assert hasattr(owner, name), f"torch {torch.__version__} has no {where}.{name}: fix _torch.{wrapper}"


class _Sub(torch.Tensor):
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("torch.Tensor._make_subclass now runs the subclass's __init__: fix _torch.make_subclass")


def test_make_subclass_views_the_data_as_a_leaf_of_the_class():
    _require(torch.Tensor, "_make_subclass", "make_subclass")
    base = torch.arange(12.0).reshape(3, 4)[1:, ::2]
    for requires_grad in (False, True):
        t = _torch.make_subclass(_Sub, base, requires_grad)
        assert type(t) is _Sub, "torch.Tensor._make_subclass no longer returns an instance of the class"
        assert t.requires_grad == requires_grad and t.is_leaf, "torch.Tensor._make_subclass no longer sets requires_grad on a leaf"
        assert (t.untyped_storage().data_ptr(), t.size(), t.stride(), t.storage_offset()) == (
            base.untyped_storage().data_ptr(),
            base.size(),
            base.stride(),
            base.storage_offset(),
        ), "torch.Tensor._make_subclass no longer views the tensor's storage, size, stride and offset"


def test_has_backward_hooks_sees_register_hook():
    _require(torch.Tensor, "_backward_hooks", "has_backward_hooks")
    assert not _torch.has_backward_hooks(torch.zeros(2))
    t = torch.zeros(2, requires_grad=True)
    assert not _torch.has_backward_hooks(t), "Tensor._backward_hooks is truthy on a tensor without hooks"
    t.register_hook(lambda grad: grad)
    assert _torch.has_backward_hooks(t), "Tensor._backward_hooks no longer holds register_hook's hooks: fix _torch.has_backward_hooks"
    # What reductions.reduce_tensor then calls (public module, no underscore, but undocumented).
    with pytest.warns(UserWarning, match="will not be serialized"):
        torch.utils.hooks.warn_if_has_hooks(t)


def test_coo_parts_are_the_stored_parts_even_uncoalesced():
    _require(torch.Tensor, "_indices", "coo_parts")
    _require(torch.Tensor, "_values", "coo_parts")
    indices = torch.tensor([[1, 0, 1], [0, 1, 0]])
    values = torch.tensor([1.5, -0.0, float("nan")])
    t = torch.sparse_coo_tensor(indices, values, (2, 2))
    assert not t.is_coalesced()
    got_indices, got_values = _torch.coo_parts(t)
    assert torch.equal(got_indices, indices), "Tensor._indices() no longer returns an uncoalesced tensor's indices as stored"
    assert torch.equal(got_values.view(torch.int32), values.view(torch.int32)), (
        "Tensor._values() no longer returns an uncoalesced tensor's values as stored, bit for bit"
    )
    coalesced = t.coalesce()
    got_indices, got_values = _torch.coo_parts(coalesced)
    same_values = torch.equal(got_values.view(torch.int32), coalesced.values().view(torch.int32))
    assert torch.equal(got_indices, coalesced.indices()) and same_values, (
        "Tensor._indices()/_values() of a coalesced tensor differ from indices()/values()"
    )


def test_nested_layout_and_nested_from_buffer_round_trip_as_a_view():
    for name in ("_nested_tensor_size", "_nested_tensor_strides", "_nested_tensor_storage_offsets"):
        _require(torch.Tensor, name, "nested_layout")
    _require(torch, "_nested_view_from_buffer", "nested_from_buffer")
    nt = torch.nested.nested_tensor([torch.arange(6.0).reshape(2, 3), torch.arange(4.0).reshape(1, 4)])
    sizes, strides, offsets = _torch.nested_layout(nt)
    assert (sizes.tolist(), strides.tolist(), offsets.tolist()) == ([[2, 3], [1, 4]], [[3, 1], [4, 1]], [0, 6]), (
        "Tensor._nested_tensor_size/_strides/_storage_offsets changed what they return"
    )
    buffer = nt.values()
    back = _torch.nested_from_buffer(buffer, sizes, strides, offsets)
    assert back.is_nested and [x.tolist() for x in back.unbind()] == [x.tolist() for x in nt.unbind()], (
        "torch._nested_view_from_buffer no longer rebuilds the nested tensor"
    )
    assert back.values().data_ptr() == buffer.data_ptr(), "torch._nested_view_from_buffer no longer views its buffer (copies it)"


def test_typed_storage_wraps_and_unwraps_without_the_deprecation_warning(monkeypatch):
    # Make torch warn on every deprecated use, not only the first of the process (if
    # this flag goes, the test still checks the rest).
    monkeypatch.setattr(torch.storage, "_always_warn_typed_storage_removal", True, raising=False)
    untyped = torch.arange(4, dtype=torch.float64).untyped_storage()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        typed = _torch.typed_storage(untyped, torch.float64, torch.TypedStorage)
        unwrapped = _torch.typed_storage_untyped(typed)
    assert type(typed) is torch.TypedStorage and typed.dtype == torch.float64, (
        "TypedStorage(wrap_storage=, dtype=, _internal=True) changed: fix _torch.typed_storage"
    )
    assert unwrapped is untyped, "TypedStorage._untyped_storage is no longer the wrapped UntypedStorage: fix _torch.typed_storage_untyped"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a legacy class warns whatever we pass (reading its dtype)
        legacy = _torch.typed_storage(untyped, torch.float32, torch.DoubleStorage)  # a legacy class keeps its own dtype
        is_legacy = isinstance(legacy, torch.DoubleStorage)
    assert is_legacy and legacy.dtype == torch.float64, (
        "a legacy storage class's (wrap_storage=, _internal=True) changed: fix _torch.typed_storage"
    )
    assert _torch.typed_storage_untyped(legacy) is untyped, "TypedStorage._untyped_storage of a legacy storage is not the wrapped storage"


def test_storage_and_tensor_classes_are_torchs_own_lists():
    _require(torch, "_storage_classes", "storage_classes")
    _require(torch, "_tensor_classes", "tensor_classes")
    storages = _torch.storage_classes()
    assert {torch.UntypedStorage, torch.TypedStorage, torch.FloatStorage, torch.DoubleStorage} <= set(storages), (
        "torch._storage_classes no longer lists UntypedStorage, TypedStorage and the legacy storage classes"
    )
    assert all(issubclass(cls, (torch.UntypedStorage, torch.TypedStorage)) for cls in storages), (
        "torch._storage_classes now holds something that is not a storage class"
    )
    assert {torch.FloatTensor, torch.LongTensor} <= set(_torch.tensor_classes()), (
        "torch._tensor_classes no longer lists the legacy tensor classes (torch.FloatTensor ...)"
    )


def test_from_dlpack_takes_a_legacy_capsule_and_aliases_its_memory():
    # shmreduce._native hands torch "dltensor" capsules it builds itself; torch's
    # importer must alias the memory and call the deleter when the storage dies.
    source = torch.arange(16, dtype=torch.uint8)
    capsule = torch.utils.dlpack.to_dlpack(source)
    t = _torch.from_dlpack(capsule)
    assert t.data_ptr() == source.data_ptr() and t.dtype == torch.uint8
    assert t.untyped_storage().nbytes() == 16


def test_the_sharing_strategy_lives_in_torch_multiprocessing_globals():
    # _native.reduce reads the strategy from torch.multiprocessing's module globals
    # (reductions passes vars(torch.multiprocessing)), where set_sharing_strategy
    # stores it: a release that moves it would send every tensor down the general
    # path (never wrong, only slower), so fail loudly here instead.
    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()
    try:
        for name in ("file_system", "file_descriptor"):
            tmp.set_sharing_strategy(name)
            assert vars(tmp).get("_sharing_strategy") == name, "torch.multiprocessing._sharing_strategy moved: fix reductions' init_send"
    finally:
        tmp.set_sharing_strategy(before)


def test_tensor_attributes_native_reduce_reads():
    # _native.reduce checks these by name on a torch.Tensor, exactly what they are here.
    t = torch.zeros(4)
    assert t.requires_grad is False and t._backward_hooks is None and t.layout is torch.strided
    assert t.is_cpu is True and t.is_nested is False and t.is_quantized is False
    assert t.is_conj() is False and t.is_neg() is False


def test_tensor_has_the_dlpack_exchange_api_native_reduce_reads():
    # _native.reduce reads a plain tensor's dtype, sizes, strides and start through
    # torch.Tensor's DLPack C exchange API (pytorch PRs 165483, 169724; torch 2.10 on):
    # a capsule of a DLPack 1.x table. Without it every tensor takes the general path.
    import ctypes

    if RELEASE < (2, 10):
        pytest.skip(f"torch {torch.__version__} has no DLPack exchange API (2.10 on): every tensor takes the general path")

    capsule = torch.Tensor.__dlpack_c_exchange_api__
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    table = get(capsule, b"dlpack_exchange_api")
    major = ctypes.c_uint32.from_address(table).value
    dltensor_from_py_object = ctypes.c_void_p.from_address(table + 16 + 3 * 8).value  # header, then 3 pointers
    assert major == 1 and dltensor_from_py_object, "torch's DLPack exchange API changed: fix pickler.c's describe()"


def test_neg_view_sets_the_negative_bit_over_the_same_storage():
    x = torch.arange(3.0)
    v = _torch.neg_view(x)
    assert v.is_neg() and torch.equal(v, -x) and v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_quantized_reduce_is_torchs_rebuild_over_a_typed_storage():
    # reductions.reduce_tensor hands a quantized tensor to torch's own pickling, whose
    # TypedStorage our storage reducer then shares. torch deprecates making quantized
    # tensors (a warning, kept out of the output here); once it cannot, this skips.
    if not hasattr(torch, "quantize_per_tensor"):
        pytest.skip("this torch has no quantized tensors")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"(?s).*quantiz.*deprecated", UserWarning)
        q = torch.quantize_per_tensor(torch.linspace(-1, 1, 8), 0.01, 3, torch.quint8)
    _require(torch.Tensor, "_reduce_ex_internal", "quantized_reduce")
    rebuild, args = _torch.quantized_reduce(q)
    assert rebuild is torch._utils._rebuild_qtensor, (
        "Tensor._reduce_ex_internal no longer rebuilds with _rebuild_qtensor: fix quantized_reduce"
    )
    assert isinstance(args[0], torch.TypedStorage) and args[0]._untyped_storage.data_ptr() == q.untyped_storage().data_ptr(), (
        "_rebuild_qtensor's first argument is no longer the tensor's own TypedStorage: fix quantized_reduce"
    )
    back = rebuild(*args)
    assert back.is_quantized and torch.equal(back.int_repr(), q.int_repr()) and back.q_scale() == q.q_scale()
