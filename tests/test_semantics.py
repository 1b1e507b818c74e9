"""Aliasing, faithful rebuild, shared state, autograd, devices and lifetimes, with real
child processes."""

import multiprocessing as mp
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import cast

import pytest
import torch

import shmreduce
from shmreduce import SharingError, _torch

from helpers import pipe_echo

CTX = mp.get_context("fork")


def _roundtrip(obj):
    return pickle.loads(ForkingPickler.dumps(obj))


def _writer(q, done):
    t = q.get(timeout=30)
    t.fill_(7)
    done.put(t.untyped_storage().is_shared())


def test_aliasing_both_ways_and_resend_does_not_copy(strategy):
    t = torch.zeros(16)
    view = t[4:8]
    q, done = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=_writer, args=(q, done))
    proc.start()
    q.put(t)
    assert done.get(timeout=30) is True
    proc.join(30)
    assert proc.exitcode == 0
    assert t.eq(7).all() and view.eq(7).all()  # the child's writes are seen here
    before = shmreduce.stats()
    out = _roundtrip(t)
    after = shmreduce.stats()
    assert after["storages_shared"] == before["storages_shared"]  # no second copy
    assert after["storages_reused"] == before["storages_reused"] + 1
    assert out.untyped_storage()._cdata == t.untyped_storage()._cdata


def test_views_in_one_message_and_in_separate_messages_share_one_storage(strategy):
    base = torch.arange(24.0).reshape(4, 6)
    views = [base, base[1:], base.t(), base[:, ::2], base[2, 3]]
    out = _roundtrip(views)
    cdatas = {v.untyped_storage()._cdata for v in out}
    assert len(cdatas) == 1
    later = _roundtrip(base[3])
    assert later.untyped_storage()._cdata in cdatas
    for a, b in zip(views, out, strict=True):
        assert a.shape == b.shape and a.stride() == b.stride()
        assert a.storage_offset() == b.storage_offset() and torch.equal(a, b)


@pytest.fixture
def echo(strategy):
    with pipe_echo(CTX) as send:
        yield send


def test_share_memory_moves_into_a_shmreduce_segment_then_sends_without_copy(echo, strategy):
    from shmreduce.cache import cache

    t = torch.arange(12.0)
    ptr = t.data_ptr()
    t.share_memory_()
    assert t.is_shared() and t.data_ptr() != ptr and t.tolist() == list(map(float, range(12)))
    place = cache.place_of(t.untyped_storage())
    # Without the swap torch moves it, by descriptor under either strategy (_torch.share_fd).
    kind = "fd" if _torch.path() == "adopt" else {"file_descriptor": "fd", "file_system": "fs"}[strategy]
    assert place is not None and place.segment.kind == kind
    t.share_memory_()  # a no-op the second time
    assert cache.place_of(t.untyped_storage()) == place
    before = shmreduce.stats()
    back = echo(t)
    after = shmreduce.stats()
    assert after["storages_shared"] == before["storages_shared"]
    assert after["storages_reused"] == before["storages_reused"] + 1
    assert back.untyped_storage()._cdata == t.untyped_storage()._cdata


def test_received_storage_is_shared_and_share_memory_keeps_aliasing(echo):
    t = torch.arange(10.0)
    for strategy_now in ("file_descriptor", "file_system"):
        back = echo(t.clone())  # a fresh storage received from the child's side
        storage = back.untyped_storage()
        assert storage.is_shared()
        ptr = storage.data_ptr()
        shmreduce.set_sharing_strategy(strategy_now)
        back.share_memory_()
        assert back.untyped_storage().data_ptr() == ptr


def test_faithful_rebuild_of_class_and_metadata(echo):
    p = torch.nn.Parameter(torch.randn(3, 4))
    q = torch.nn.Parameter(torch.arange(4, dtype=torch.int32), requires_grad=False)
    leaf = torch.randn(2, 2, requires_grad=True)
    out = echo([p, q, leaf, torch.tensor(3.5), torch.empty(0, 3), torch.empty(2, 0, 5)[:, :, ::2]])
    assert type(out[0]) is torch.nn.Parameter and out[0].requires_grad and torch.equal(out[0], p)
    assert type(out[1]) is torch.nn.Parameter and not out[1].requires_grad
    assert out[2].requires_grad and out[2].is_leaf and out[2].grad is None
    assert out[3].dim() == 0 and out[3].item() == 3.5
    assert out[4].shape == (0, 3) and out[5].shape == (2, 0, 3)


def test_conjugate_and_negative_views_keep_their_bits_and_alias(echo, strategy):
    # A conjugate view (x.conj()) and a negative one (x.conj().imag) are lazy: the bit is
    # on the tensor, the storage holds x's bytes. Both were sent as plain tensors over
    # x's storage and arrived without the bit, wrong values with no error (torch's own
    # reducers lose them too; plain pickle keeps them).
    x = torch.tensor([1 + 2j, 3 - 4j, -5 + 6j], dtype=torch.complex64)
    conj, imag = x.conj(), x.conj().imag
    neg = torch._neg_view(torch.arange(4.0))
    assert conj.is_conj() and imag.is_neg() and neg.is_neg()
    out = echo([conj, imag, neg, x])
    for sent, got in zip([conj, imag, neg], out, strict=False):
        assert got.is_conj() == sent.is_conj() and got.is_neg() == sent.is_neg(), (sent, got)
        assert torch.equal(got, sent), (sent, got)
    assert out[0].untyped_storage().data_ptr() == out[3].untyped_storage().data_ptr()  # one storage, as sent
    with shmreduce.registered(strategy=strategy):
        for t in (conj, imag, neg):
            assert torch.equal(shmreduce.loads(shmreduce.dumps(t)), t)


def _empty_views_share_a_storage(conn):
    a, b, c = conn.recv()
    conn.send((a.untyped_storage()._cdata == b.untyped_storage()._cdata, a.untyped_storage()._cdata == c.untyped_storage()._cdata))


def test_empty_views_of_one_empty_storage_arrive_over_one_storage(strategy):
    # torch rebuilds them over one storage (pickle's memo): so do we.
    base = torch.empty(0, 4)
    other = torch.empty(0)
    ours, theirs = CTX.Pipe()
    proc = CTX.Process(target=_empty_views_share_a_storage, args=(theirs,))
    proc.start()
    try:
        ours.send([base, base.t(), other])
        assert ours.poll(30)
        assert ours.recv() == (True, False)
    finally:
        proc.join(30)
    assert proc.exitcode == 0


def test_non_leaf_requiring_grad_is_refused(strategy):
    x = torch.randn(3, requires_grad=True) * 2
    with pytest.raises(RuntimeError, match="detach"):
        ForkingPickler.dumps(x)
    with pytest.raises(SharingError, match="detach"):
        shmreduce.dumps(x)
    assert _roundtrip(x.detach()).requires_grad is False  # the next message works


def test_grad_and_hooks_are_not_sent(strategy):
    x = torch.ones(3, requires_grad=True)
    x.grad = torch.ones(3)
    out = _roundtrip(x)
    assert out.grad is None and out.requires_grad


def test_meta_tensors_and_storages_rebuild_as_meta(strategy):
    t = torch.empty(3, 4, device="meta").t()
    out = _roundtrip(t)
    assert out.is_meta and out.shape == (4, 3) and out.stride() == t.stride()
    storage = _roundtrip(torch.UntypedStorage(12, device="meta"))
    assert storage.device.type == "meta" and storage.nbytes() == 12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_storage_refused_and_cuda_tensor_delegated(strategy):  # pragma: no cover
    t = torch.ones(3, device="cuda")
    with pytest.raises(SharingError, match="pickle the CUDA tensor instead, or move it to CPU"):
        ForkingPickler.dumps(t.untyped_storage())
    assert ForkingPickler.dumps(t)  # torch's CUDA IPC path


def test_cuda_storage_refusal_message():
    """Without a GPU, the refusal is checked on the reducer with a stand-in storage."""

    class FakeCuda:
        class device:
            type = "cuda"

    from shmreduce.reductions import reduce_storage

    with pytest.raises(SharingError, match="pickle the CUDA tensor instead, or move it to CPU"):
        reduce_storage(cast(torch.UntypedStorage, FakeCuda()))  # a stand-in on purpose


def _sparse_cases():
    dense = torch.tensor([[0.0, 1.5, 0.0, 2.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 4.0, 5.0], [0.0, 6.0, 0.0, 0.0]])
    return {
        "coo": dense.to_sparse(),
        # torch accepts nested lists here; its stub says Tensor only
        "coo_uncoalesced": torch.sparse_coo_tensor([[0, 0], [1, 1]], [1.0, 2.0], (2, 2)),  # type: ignore[arg-type]
        "csr": dense.to_sparse_csr(),
        "csc": dense.to_sparse_csc(),
        "bsr": dense.to_sparse_bsr((2, 2)),
        "bsc": dense.to_sparse_bsc((2, 2)),
    }


@pytest.mark.parametrize("name", list(_sparse_cases()))
def test_sparse_layouts_round_trip_with_parts_shared(echo, name):
    sparse = _sparse_cases()[name]
    out = echo(sparse)
    assert out.layout == sparse.layout and out.shape == sparse.shape
    assert torch.equal(out.to_dense(), sparse.to_dense())
    if sparse.layout is torch.sparse_coo:
        assert out.is_coalesced() == sparse.is_coalesced()
        assert out._values().is_shared()
    else:
        assert out.values().is_shared()


def test_nested_tensor_round_trips_with_buffer_shared(echo):
    nt = torch.nested.nested_tensor([torch.arange(3.0), torch.arange(5.0)])
    out = echo(nt)
    assert out.is_nested
    assert [x.tolist() for x in out.unbind()] == [x.tolist() for x in nt.unbind()]
    assert out.values().is_shared()


def test_typed_and_legacy_storages(echo):
    typed = torch.TypedStorage([1.0, 2.0, 3.0], dtype=torch.float64)
    legacy = torch.FloatStorage([1.0, 2.0])
    out_typed, out_legacy, untyped = echo([typed, legacy, torch.ByteTensor([1, 2]).untyped_storage()])
    assert type(out_typed) is torch.TypedStorage and out_typed.dtype == torch.float64
    assert out_typed.tolist() == [1.0, 2.0, 3.0]
    # torch builds legacy storages as TypedStorage instances (isinstance via a metaclass)
    assert type(out_legacy) is type(legacy) and isinstance(out_legacy, torch.FloatStorage)
    assert out_legacy.tolist() == [1.0, 2.0]
    assert type(untyped) is torch.UntypedStorage and untyped.is_shared()


def _put_and_exit(q):
    t = torch.arange(1000.0)
    q.put({"t": t, "v": t[10:20]})
    del t  # the sender drops its tensor and exits right after put()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sender_may_exit_right_after_put(strategy, method):
    ctx = mp.get_context(method)
    q = ctx.Queue()
    procs = [ctx.Process(target=_put_and_exit, args=(q,)) for _ in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    for _ in procs:  # read only after every producer is gone
        msg = q.get(timeout=30)
        assert msg["t"].sum().item() == sum(range(1000))
        assert msg["v"].tolist() == [float(i) for i in range(10, 20)]


def _memfds():
    from helpers import open_fds

    return sum(1 for fd in open_fds() if "memfd:shmreduce (" in fd)  # segments, not the ledger


def _load_64_and_count_memfds(data):

    from helpers import forget_mappings

    forget_mappings()  # a fork child: receive as a process that never saw them
    before = _memfds(), _memfd_mappings()
    msg = pickle.loads(data)
    intact = all(torch.equal(msg[i], torch.full((256,), float(i))) for i in range(64))
    storages = {msg[i].untyped_storage()._cdata for i in range(64)}
    # one mapping, no descriptor kept (a mapping needs none once it exists)
    counts = _memfds() - before[0], len(_memfd_mappings() - before[1])
    return counts, intact, len(storages), all(msg[i].is_shared() for i in range(64))


def _memfd_mappings() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split()[0] for line in maps if "memfd:shmreduce " in line}


@pytest.mark.swap_path
def test_small_storages_of_a_message_travel_in_one_slab(registered_fd):
    # 64 small storages: one memfd, one descriptor in the deposit, one mapping in the
    # receiver, yet 64 distinct storages on both sides, each shared.
    from shmreduce import transfer

    from helpers import run_in_child

    transfer.let_go()  # no current slab: this message starts one
    msg = {i: torch.full((256,), float(i)) for i in range(64)}
    before = _memfds()
    data = ForkingPickler.dumps(msg)
    assert _memfds() - before == 1
    assert len({t.untyped_storage()._cdata for t in msg.values()}) == 64
    assert all(t.is_shared() for t in msg.values())
    assert run_in_child(_load_64_and_count_memfds, bytes(data)) == ("ok", ((0, 1), True, 64, True))
    more = {i: torch.full((256,), float(i)) for i in range(64)}
    ForkingPickler.loads(ForkingPickler.dumps(more))
    assert _memfds() - before == 1  # the next message fills the same slab
    del msg, more
    import gc

    gc.collect()  # the first message of a process starts the broker, whose frames linger in a cycle
    assert _memfds() - before == 1  # the thread's current slab stays for its next messages
    transfer.let_go()
    assert _memfds() == before  # and goes with its last storage once it is not current


def _unaligned_receiver(q, out):
    torch.set_num_threads(1)
    try:
        while (item := q.get(timeout=30)) is not None:
            name, t, expected = item
            ok = torch.equal(t, expected)
            t.add_(1)  # seen by the sender if the memory is shared
            out.put((name, ok, t.untyped_storage().data_ptr() % 64))
    except Exception as exc:  # noqa: BLE001  reported: the test fails on it
        out.put(("error", repr(exc), -1))


def test_a_storage_at_any_offset_in_shared_memory_arrives_with_its_bytes(strategy):
    # A storage may lie anywhere a torch storage can, e.g. 4 bytes into a cache
    # line of a shared tensor (torch.from_numpy(t.numpy()[1:])): sent from where it
    # lies, it must not be refused as out of bounds.
    q, out = CTX.Queue(), CTX.Queue()
    p = CTX.Process(target=_unaligned_receiver, args=(q, out))
    p.start()
    try:
        cases = []
        for dtype in (torch.float32, torch.float64, torch.int16, torch.uint8):
            for numel in (100, 20_000):  # in a slab; in a segment of its own
                for k in (1, 3, 17):
                    base = torch.arange(numel, dtype=torch.int64).to(dtype)  # one each: the receiver writes
                    base.share_memory_()
                    view = torch.from_numpy(base.numpy()[k:])  # a storage of its own, not 64-aligned
                    assert view.untyped_storage().data_ptr() % 64 != 0
                    cases.append((f"{dtype}-{numel}-{k}", view, view.clone()))
        for case in cases:
            q.put(case)
        q.put(None)
        got = [out.get(timeout=30) for _ in cases]
        assert [g[:2] for g in got] == [(name, True) for name, _, _ in cases], got
        for (name, view, expected), g in zip(cases, got, strict=True):
            assert g[2] == view.untyped_storage().data_ptr() % 64, name
            assert torch.equal(view, expected + 1), f"{name}: the receiver's write was not seen (not aliased)"
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join()
