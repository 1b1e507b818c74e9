"""shmreduce._native: checked storages over a mapping, native lifetimes (shmreduce/_native/).

Against memory of the test's own (an anonymous mapping), so every address a storage
may cover is known; then fuzzed handles and pickles through the whole loader.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import inspect
import math
import mmap
import pickle
import re
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmreduce
from shmreduce import _native, _torch, reductions, segments, transfer

from helpers import forget_mappings, run_in_child, without_dlpack_exchange_api

LOW = _native.HEADER_BYTES  # a pooled generation's storages start past its header
SIZE = LOW + (1 << 16)


class _Owner:
    """Stands in for a Segment: the Gen keeps it (and so the mapping)."""


_MINE = ("test_native", -1)  # a Gen's info: this test's, no process's (transfer.settle_dead skips it)


@pytest.fixture
def memory() -> Iterator[tuple[mmap.mmap, int]]:
    """A mapping of the test's; the collector thread (which takes what dead() reports,
    through transfer.settle_dead, under this lock) waits meanwhile."""
    m = mmap.mmap(-1, SIZE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    with transfer._releases_lock:
        yield m, addr
        gc.collect()
        _drain()


def _drain() -> list[Any]:
    """What dead() reports of this test's gens; the pool's own go back to settle."""
    mine: list[Any] = []
    others: list[Any] = []
    for gen in _native.dead():
        (mine if isinstance(gen.info, tuple) and gen.info[:2] == _MINE else others).append(gen)
    if others:
        transfer.settle_dead(others)
    return mine


def _gen(addr: int, number: int = 7) -> Any:
    gen = _native.Gen(_Owner(), addr, SIZE, number, LOW)
    gen.info = _MINE
    return gen


@pytest.fixture(params=["exchange api", "capsule"])
def importer(request) -> Iterator[str]:
    """How the native core hands torch its tensors: through torch.Tensor's DLPack
    exchange API, or (a torch without one) a "dltensor_versioned" capsule."""
    if request.param == "capsule":
        with without_dlpack_exchange_api():
            yield request.param
    else:
        yield request.param


def test_a_storage_aliases_the_mapping(memory, importer) -> None:
    m, addr = memory
    gen = _gen(addr)
    s = gen.storage(LOW + 128, 256)
    assert isinstance(s, torch.UntypedStorage) and s.nbytes() == 256 and s.data_ptr() == addr + LOW + 128
    t = torch.empty(0, dtype=torch.uint8).set_(s)
    t.fill_(9)
    assert m[LOW + 128 : LOW + 384] == b"\x09" * 256 and m[LOW + 127] == 0 and m[LOW + 384] == 0
    m[LOW + 200] = 42
    assert int(t[72]) == 42
    # Every common dtype views it, as reductions.rebuild_tensor does.
    for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.complex64, torch.bool):
        assert torch.empty(0, dtype=dtype).set_(s).numel() * dtype.itemsize == 256 or dtype == torch.bool
    del s, t
    gen.release()


@pytest.mark.parametrize("streaming", [True, False])
def test_large_copies_stream_or_not_with_equal_bytes(streaming: bool) -> None:
    """Copies of 1 MiB and up into a segment bypass the cache where the CPU can (AVX2
    non-temporal stores, the head and tail copied plainly): the bytes are those of
    the plain path, at every alignment of either side and any length."""
    size = LOW + (4 << 20)
    m = mmap.mmap(-1, size)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    source = torch.randint(0, 256, ((3 << 20) + 200,), dtype=torch.uint8)
    was = _native.set_streaming(streaming)
    gen = _native.Gen(_Owner(), addr, size, 7, LOW)
    gen.info = _MINE
    try:
        for at, skip, nbytes in [(LOW, 0, 1 << 20), (LOW + 1, 3, (1 << 20) + 127), (LOW + 33, 17, 3 << 20), (LOW + 64, 0, (2 << 20) + 1)]:
            src = source[skip : skip + nbytes].clone()  # its own storage: the copy starts at its first byte
            placed = gen.place(at, nbytes, src.untyped_storage())
            got = torch.empty(0, dtype=torch.uint8).set_(placed)
            assert torch.equal(got, src) and m[at : at + nbytes] == src.numpy().tobytes(), (at, skip, nbytes)
            del got
            del placed
    finally:
        _native.set_streaming(was)
        gen.release()
        with transfer._releases_lock:
            gc.collect()
            _drain()


def test_place_copies_then_aliases(memory) -> None:
    m, addr = memory
    gen = _gen(addr)
    source = torch.arange(200, dtype=torch.uint8).untyped_storage()
    s = gen.place(LOW + 64, 200, source)  # its address read by the copy itself
    assert bytes(s) == bytes(range(200)) == m[LOW + 64 : LOW + 264]
    big = torch.full((SIZE - LOW - 128,), 5, dtype=torch.uint8).untyped_storage()  # copied without the GIL
    assert bytes(gen.place(LOW + 128, big.nbytes(), big)) == b"\x05" * (SIZE - LOW - 128)
    zeros = gen.place(LOW + 64, 128, None)  # zeros, as new_shared() wants
    with pytest.raises(ValueError, match="from a 200-byte storage"):
        gen.place(LOW + 64, 201, source)  # never a copy past the end of its source
    assert bytes(zeros) == bytes(128)
    del s, zeros
    gen.release()


def test_the_last_storage_or_hold_to_die_reports_the_generation_once(memory, importer) -> None:
    _, addr = memory
    gen = _gen(addr)
    assert gen.live == 1 and not gen.ended  # its maker's hold
    a, b = gen.storage(LOW + 64, 64), gen.storage(LOW + 128, 64)
    gen.release()
    assert gen.live == 2 and gen not in _drain()
    del a
    assert gen.live == 1 and gen not in _drain()
    del b
    assert gen.live == 0 and _native.pending()
    reported = _drain()
    assert reported == [gen] and gen.ended
    assert _drain() == []
    assert not gen.acquire()  # over: no hold, no storage
    with pytest.raises(shmreduce.SharingError, match="is over"):
        gen.storage(LOW + 64, 64)
    with pytest.raises(RuntimeError, match="nobody holds"):
        gen.release()


def test_a_generation_revived_before_it_is_reported_is_not_reported(memory) -> None:
    _, addr = memory
    gen = _gen(addr)
    gen.release()  # dead, queued
    assert _native.pending()
    s = gen.storage(LOW + 64, 64)  # revived while queued
    assert _drain() == [] and gen.live == 1 and not gen.ended
    del s
    assert _drain() == [gen]


def test_storages_dying_on_other_threads_are_counted_exactly(memory, importer) -> None:
    _, addr = memory
    gen = _gen(addr)
    storages = [gen.storage(LOW + 64 * (1 + i % 100), 64) for i in range(4000)]
    gen.release()
    chunks = [storages[i::8] for i in range(8)]
    del storages
    barrier = threading.Barrier(8)

    def drop(chunk: list[Any]) -> None:
        barrier.wait()
        chunk.clear()  # torch runs each deleter here, on this thread

    threads = [threading.Thread(target=drop, args=(chunk,)) for chunk in chunks]
    del chunks
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert gen.live == 0
    assert _drain() == [gen]


def test_a_gen_keeps_its_owner_while_a_storage_lives(memory) -> None:
    _, addr = memory
    gen = _gen(addr)
    owner = gen.owner
    s = gen.storage(LOW + 64, 64)
    gen.release()
    del gen
    gc.collect()
    assert s.nbytes() == 64  # the Gen lives on, through its storage, with its owner
    del s
    (reported,) = _drain()
    assert reported.owner is owner


_ANY = st.integers(-(1 << 70), 1 << 70)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    offset=_ANY | st.integers(-128, SIZE + 128) | st.integers(0, SIZE // 64).map(lambda k: k * 64), nbytes=_ANY | st.integers(-8, SIZE + 8)
)
def test_any_range_is_a_checked_storage_or_a_sharing_error(memory, offset: int, nbytes: int) -> None:
    _, addr = memory
    gen = _gen(addr)
    try:
        valid = LOW <= offset and 0 < nbytes and offset + nbytes <= SIZE  # any offset a storage can lie at
        if valid:
            s = gen.storage(offset, nbytes)
            assert s.data_ptr() == addr + offset and s.nbytes() == nbytes
            del s
        else:
            with pytest.raises(shmreduce.SharingError, match="out of bounds|out of range"):
                gen.storage(offset, nbytes)
    finally:
        gen.release()
        _drain()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    offset=_ANY | st.integers(-128, SIZE + 128),
    nbytes=_ANY | st.integers(-8, SIZE + 8),
    ticket=_ANY | st.integers(0, 3) | st.sampled_from([None, "0", 1.0]),
)
def test_a_load_is_a_checked_storage_counted_once_or_a_sharing_error_that_counts_nothing(
    memory, offset: int, nbytes: int, ticket: Any
) -> None:
    # Gen.load, the one load routine: any ref's range and ticket give the
    # storage over exactly that range, the same one when loaded again, each ticket
    # counted loaded at its first load only; or a SharingError, every count as it was.
    m, addr = memory
    m[: _native.HEADER_BYTES] = bytes(_native.HEADER_BYTES)  # a fresh header for each example
    gen = _gen(addr)
    first = _native.hdr_issue(addr)  # tickets 0 and 1 issued, as their sender drew them
    _native.hdr_issue(addr)
    before = (_native.hdr_read(addr), gen.live, _native.loaded())
    try:
        valid = LOW <= offset and 0 < nbytes and offset + nbytes <= SIZE
        if valid:
            s = gen.load(offset, nbytes, ticket)
            assert s.data_ptr() == addr + offset and s.nbytes() == nbytes
            assert gen.stored(offset) is s and gen.load(offset, nbytes, ticket) is s  # loaded again: the same storage
            counted = type(ticket) is int and first <= ticket < first + 2
            assert _native.hdr_read(addr)[2] == before[0][2] + counted  # a ticket issued counts once, any other nothing
            assert _native.loaded()[0] == before[2][0] + 1 and _native.loaded()[2] == before[2][2] + 1
            del s
        else:
            with pytest.raises(shmreduce.SharingError):
                gen.load(offset, nbytes, ticket)
            assert (_native.hdr_read(addr), gen.live, _native.loaded()) == before
    finally:
        gen.release()
        _drain()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(-4, SIZE) | _ANY, min_size=1, max_size=40))
def test_a_slab_places_each_storage_once_on_its_own_cache_lines(memory, sizes: list[int]) -> None:
    # Gen.put, the one placement routine (C's reduce() claims through it too): each
    # storage that fits gets bytes no other one has, from a cache line past the
    # header; one that does not fit is None (a new slab), anything malformed an error.
    _, addr = memory
    gen = _gen(addr)
    placed: list[tuple[int, int, Any]] = []
    try:
        for nbytes in sizes:
            if not -(1 << 63) <= nbytes < 1 << 63:
                with pytest.raises(OverflowError):
                    gen.put(nbytes, None)
                continue
            cursor = gen.cursor
            put = gen.put(nbytes, None)
            if put is None:
                assert nbytes <= 0 or cursor + nbytes > SIZE  # nothing to place, or full
                continue
            offset, storage = put
            assert offset == cursor and offset % _native.ALIGN == 0 and LOW <= offset and offset + nbytes <= SIZE
            assert storage.data_ptr() == addr + offset and storage.nbytes() == nbytes
            placed.append((offset, nbytes, storage))
        spans = sorted((o, o + n) for o, n, _ in placed)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
        gen.seal()
        assert gen.put(1, None) is None  # sealed: nothing more is placed
    finally:
        placed.clear()
        gen.release()
        _drain()


def test_handles_of_the_wrong_type_are_sharing_errors(memory) -> None:
    _, addr = memory
    gen = _gen(addr)
    for args in [("64", 64), (64, 64.0), (None, 1), (True, 64)]:
        with pytest.raises(shmreduce.SharingError):
            gen.storage(*args)
    with pytest.raises(TypeError):
        gen.storage(64)
    gen.release()


# -- typed tensors --------------------------------------------------------------------


def _made(offset: int, nbytes: int, dtype: torch.dtype, size: Any, stride: Any) -> Any:
    """What rebuild(ref, meta, None) makes through the published Gen: a tensor, or
    None where the general rebuild would make it (never the general one itself)."""
    return _native.rebuild((*_KEY, offset, nbytes, 0, 0), (dtype, size, stride, 0, None), None)


def test_a_typed_tensor_spans_exactly_its_storage(memory, importer) -> None:
    m, addr = memory
    gen = _published(addr)
    t = _made(LOW + 128, 96, torch.float32, (4, 6), (6, 1))
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == (4, 6) and t.stride() == (6, 1)
    s = t.untyped_storage()
    assert s.data_ptr() == addr + LOW + 128 and s.nbytes() == 96 and t.storage_offset() == 0
    t.fill_(1.5)
    assert m[LOW + 128 : LOW + 224] == torch.full((24,), 1.5).numpy().tobytes()
    assert _made(LOW + 128, 96, torch.float32, (4, 6), (6, 1)) is None  # loaded here already: the general one's
    tt = _made(LOW + 256, 96, torch.float32, (6, 4), (1, 6))  # a transposed view spans it too
    assert tt is not None and tt.shape == (6, 4) and tt.stride() == (1, 6)
    # Not spanning exactly (a storage larger than the tensor, no element, too many
    # dimensions): None, and the caller takes the storage path.
    assert _made(LOW + 384, 128, torch.float32, (4, 6), (6, 1)) is None
    assert _made(LOW + 384, 96, torch.float32, (0, 6), (6, 1)) is None
    assert _made(LOW + 384, 96, torch.float32, (12,), (1,)) is None
    expanded = _made(LOW + 384, 96, torch.float32, (24, 1000), (1, 0))  # a broadcast whose extent is the storage
    assert expanded is not None and expanded.untyped_storage().nbytes() == 96
    assert _made(LOW + 512, 96, torch.float32, (1,) * 9 + (24,), (24,) * 9 + (1,)) is None
    for size, stride in [
        ((4, 6), (6, -1)),
        ((-4, 6), (6, 1)),
        ((4, 6), (6,)),
        ([4, 6], (6, 1)),
        ((4, 1 << 62), (1 << 62, 1)),
        ((4.0,), (1,)),
    ]:
        with pytest.raises(shmreduce.SharingError, match="forged or corrupted"):
            _made(LOW + 512, 96, torch.float32, size, stride)
    with pytest.raises(shmreduce.SharingError, match="out of bounds"):
        _made(SIZE - 64, 96, torch.float32, (24,), (1,))
    del t, tt, s, expanded
    gen.release()
    gc.collect()
    assert _drain() == [gen]


def test_every_dtype_dlpack_carries_comes_back_as_itself(memory, importer) -> None:
    _, addr = memory
    gen = _published(addr)
    table = _torch.dlpack_dtypes(_native.dltype)
    assert {torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.complex64} <= set(table)
    kept = []
    for i, dtype in enumerate(table):
        n = 64 // dtype.itemsize
        t = _made(LOW + 64 * (i + 1), 64, dtype, (n,), (1,))
        assert t is not None and t.dtype == dtype and t.numel() == n, dtype
        kept.append(t)
        del t
    del kept
    gen.release()


# -- rebuild(): a tensor in one call through a published Gen --------------------------

_KEY = ("fd", "/nonexistent/shmreduce-test-rebuild", 4242, 7)  # a ref's first four fields
_TEMPLATE = (*_KEY, 0)  # and its tag: what a Gen is published by (the sender's template)
_TABLE = {torch.float32, torch.float64, torch.uint8, torch.bool, torch.int16, torch.complex64, torch.bfloat16}


def _published(addr: int) -> Any:
    reductions.dlpack_table()  # rebuild()'s dtypes
    gen = _gen(addr)
    gen.publish(_TEMPLATE)
    return gen


def _dims() -> st.SearchStrategy[tuple[tuple, tuple]]:
    dim = st.integers(1, 9) | st.integers(-2, 0) | st.just(1 << 62)
    step = st.integers(0, 40) | st.just(-1) | st.just(1 << 62)
    return st.integers(0, 3).flatmap(lambda n: st.tuples(st.tuples(*[dim] * n), st.tuples(*[step] * n)))


def _extent(size: tuple, stride: tuple, itemsize: int) -> int | None:
    """The bytes a layout spans, None where rebuild() must not make it itself."""
    if not all(type(v) is int for v in size + stride) or len(size) != len(stride):
        return None
    if any(d <= 0 for d in size) or any(v < 0 for v in stride) or len(size) > 8:
        return None
    if math.prod(size) * itemsize >= 1 << 63:
        return None  # more elements than torch counts: refused, whatever the strides
    return (sum((d - 1) * v for d, v in zip(size, stride, strict=True)) + 1) * itemsize  # a 0-d tensor: one element


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    offset=st.integers(0, SIZE // 64).map(lambda k: k * 64) | _ANY,
    exact=st.booleans(),
    nbytes=st.integers(-8, SIZE + 8) | _ANY,
    layout=_dims(),
    dtype=st.sampled_from(sorted(_TABLE, key=str)) | st.sampled_from([torch.int4 if hasattr(torch, "int4") else None, "float32", 1.0]),
    start=st.sampled_from([0, 0, 0, 1, -1, "0", 0.0]),
    extra=st.sampled_from([None, None, (torch.Tensor, True, None), "x"]),
)
def test_rebuild_makes_only_checked_tensors_or_raises_sharing_error(
    memory, offset: int, exact: bool, nbytes: int, layout: tuple, dtype: Any, start: Any, extra: Any
) -> None:
    # Any ref and metadata through a published Gen: a tensor over exactly the checked
    # range, or SharingError (from rebuild's own checks, or from the general rebuild it
    # hands the rest to, which finds no such program directory): never a crash.
    _, addr = memory
    size, stride = layout
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 1
    span = _extent(size, stride, itemsize)
    if exact and span is not None:
        nbytes = span
    gen = _published(addr)
    ref = (*_KEY, offset, nbytes, 0, 0)
    in_range = LOW <= offset and 0 < nbytes and offset + nbytes <= SIZE  # any offset a storage can lie at
    fast = in_range and dtype in _TABLE and start == 0 and type(start) is int and extra is None and span == nbytes
    try:
        if fast:
            t = _native.rebuild(ref, (dtype, size, stride, start, extra))
            assert t.dtype == dtype and t.shape == size and t.stride() == stride and t.storage_offset() == 0
            assert t.untyped_storage().data_ptr() == addr + offset and t.untyped_storage().nbytes() == nbytes
            assert gen.stored(offset) is t.untyped_storage()  # remembered: a second load is the same storage
            del t
        else:
            with pytest.raises(shmreduce.SharingError):
                _native.rebuild(ref, (dtype, size, stride, start, extra))
    finally:
        gen.release()
        _drain()
    assert _TEMPLATE not in segments.live  # dead() took it out


# load()'s packed bytes, as pickler.c's PackedHead lays them out (native order):
# offset, nbytes, ticket, storage offset, DLPack code, bits, lanes, ndim; then the
# sizes and the strides, int64 each.
_HEAD = struct.Struct("=QQQqBBHI")


def _packed(offset: int, nbytes: int, start: int, code: tuple, size: tuple, stride: tuple) -> bytes:
    return _HEAD.pack(offset % (1 << 64), nbytes % (1 << 64), 0, start, *code, len(size)) + struct.pack(
        f"={2 * len(size)}q", *(v % (1 << 64) - (1 << 64) * (v % (1 << 64) >= 1 << 63) for v in size + stride)
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    offset=st.integers(0, SIZE // 64).map(lambda k: k * 64) | _ANY,
    exact=st.sampled_from([True] * 3 + [False]),
    nbytes=st.integers(-8, SIZE + 8) | _ANY,
    layout=_dims(),
    dtype=st.sampled_from(sorted(_TABLE, key=str) * 2 + [(1, 4, 1), (2, 32, 2), (99, 8, 1)]),
    start=st.sampled_from([0] * 6 + [1, 3]),
    cut=st.sampled_from([0] * 8 + [-1, 1, -8, 8]),
    template=st.sampled_from([_TEMPLATE] * 8 + [("fd", *_TEMPLATE[1:4], 1), _TEMPLATE[:4], [*_TEMPLATE]]),
)
def test_load_makes_only_checked_tensors_or_raises_sharing_error(
    memory, offset: int, exact: bool, nbytes: int, layout: tuple, dtype: Any, start: int, cut: int, template: Any
) -> None:
    # Any packed bytes (truncated or with bytes to spare too) and template through a
    # published Gen: a tensor over exactly the checked range, or SharingError (from
    # load's own checks, or from the general rebuild it hands the rest to, which finds
    # no such program directory), and nothing counted: never a crash.
    _, addr = memory
    size, stride = layout
    code = reductions.dlpack_table()[dtype][:3] if isinstance(dtype, torch.dtype) else dtype
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 1
    span = _extent(size, stride, itemsize)
    if exact and span is not None:
        nbytes = span
    packed = _packed(offset, nbytes, start, code, size, stride)
    packed = packed[:cut] if cut < 0 else packed + bytes(cut)
    gen = _published(addr)
    before = _native.loaded()
    in_range = LOW <= offset and 0 < nbytes and offset + nbytes <= SIZE
    fast = in_range and dtype in _TABLE and start == 0 and span == nbytes and cut == 0 and template == _TEMPLATE
    try:
        if fast:
            t = _native.load(template, packed)
            assert t.dtype == dtype and t.shape == size and t.stride() == stride and t.storage_offset() == 0
            assert t.untyped_storage().data_ptr() == addr + offset and t.untyped_storage().nbytes() == nbytes
            assert gen.stored(offset) is t.untyped_storage()
            assert _native.unpack(template, packed) == ((*_KEY, offset, nbytes, 0, 0), (dtype, size, stride, 0, None))
            del t
        else:
            with pytest.raises(shmreduce.SharingError):
                _native.load(template, packed)
            assert _native.loaded() == before
    finally:
        gen.release()
        _drain()
    assert _TEMPLATE not in segments.live


def test_rebuild_counts_its_loads_in_the_header_and_the_process(memory, importer) -> None:
    m, addr = memory
    gen = _published(addr)
    before = _native.loaded()
    assert _native.hdr_issue(addr) == 0  # the ref's ticket, as its sender drew it
    t = _native.rebuild((*_KEY, LOW + 128, 64, 0, 0), (torch.float32, (16,), (1,), 0, None))
    assert _native.loaded() == (before[0] + 1, before[1] + 64, before[2])
    assert _native.hdr_read(addr)[2] == 1  # refs loaded, in the header a pooled segment has
    assert gen.live == 2
    t.fill_(2.0)
    assert m[LOW + 128 : LOW + 192] == torch.full((16,), 2.0).numpy().tobytes()
    del t
    gen.release()
    gc.collect()
    assert _drain() == [gen] and _TEMPLATE not in segments.live


def test_the_identity_map_keeps_its_weak_references_out_of_the_collector(memory) -> None:
    # Without a callback a weak reference is in no cycle: untracked, the collections
    # do not walk the one each storage sent or loaded has, and the map still answers.
    _, addr = memory
    gen = _published(addr)
    assert _native.hdr_issue(addr) == 0
    t = _native.rebuild((*_KEY, LOW + 128, 64, 0, 0), (torch.float32, (16,), (1,), 0, None))
    weak = weakref.ref(t.untyped_storage())  # the same basic reference the map holds
    assert not gc.is_tracked(weak)
    gc.collect()
    assert gen.stored(LOW + 128) is t.untyped_storage() and weak() is t.untyped_storage()
    del t
    gen.release()
    gc.collect()
    assert weak() is None and _drain() == [gen] and _TEMPLATE not in segments.live


# -- fuzzed messages through the whole loader ------------------------------------------


def _load_mutated(data: bytes) -> str:
    """A mutated message loaded in a fork child (which forgets its parent's mappings):
    whatever happens, an exception or a value, never a crash."""
    forget_mappings()
    try:
        obj = pickle.loads(data)
    except Exception as exc:  # noqa: BLE001  any exception is a fine answer to garbage; a crash is not
        return type(exc).__name__
    # Every storage that loaded must be readable end to end (one past its mapping
    # would fault here). Not the tensors' elements: a mutated shape with stride 0 is
    # a valid tensor of billions of elements.
    for value in obj.values() if isinstance(obj, dict) else [obj]:
        if isinstance(value, torch.Tensor):
            # Every byte read, in C: bytes(storage) iterates in Python, a byte a call
            # (minutes for a mutated size that spans a 16 MiB arena).
            int(torch.empty(0, dtype=torch.uint8).set_(value.untyped_storage()).sum())
    return "loaded"


@pytest.mark.parametrize("strategy_name", ["file_descriptor", "file_system"])
def test_mutated_messages_never_crash_the_loader(strategy_name: str) -> None:
    # Random byte flips and splices in real messages (tensors in a slab, in an arena
    # and in a segment of their own): each load raises or returns; the child never dies of a
    # signal. Children run one at a time, so each message is its own deposit.
    rounds = 40
    outcomes: dict[str, int] = {}
    with shmreduce.registered(strategy=strategy_name):
        rng = torch.Generator().manual_seed(20261125)
        for _ in range(rounds):
            msg = {"small": torch.arange(16.0), "big": torch.ones(40_000), "own": torch.ones(70_000), "view": torch.arange(64)[8:40]}
            original = shmreduce.dumps(msg)
            data = bytearray(original)
            for _ in range(int(torch.randint(1, 4, (1,), generator=rng))):
                at = int(torch.randint(0, len(data), (1,), generator=rng))
                data[at] = int(torch.randint(0, 256, (1,), generator=rng))
            status, value = run_in_child(_load_mutated, bytes(data))
            assert status == "ok", (status, value)
            outcomes[value] = outcomes.get(value, 0) + 1
            try:  # the original, unless the child took it: no message stays undelivered
                shmreduce.loads(original)
            except shmreduce.SharingError:
                pass
    assert sum(outcomes.values()) == rounds, outcomes


def test_a_failed_import_changes_no_count(memory, importer) -> None:
    # sizes (2**62, 2**62) with strides (0, 0) span one element: torch's importer
    # takes the tensor, fails on the element count overflow and calls the deleter;
    # a capsule never renamed would run it a second time (the count dropped twice, the
    # context pushed twice, a cycle in the free list). Through
    # either importer (the exchange API's has no capsule to tell by): counted once.
    _, addr = memory
    gen = _published(addr)
    assert gen.live == 1
    for _ in range(3):
        try:
            _made(LOW + 128, 4, torch.float32, (1 << 62, 1 << 62), (0, 0))
        except (RuntimeError, ValueError, OverflowError):
            pass
        assert gen.live == 1, "a failed import changed the generation's count"
    # The contexts it used are whole: many storages made and let go of, each counted once.
    kept = [_made(LOW + 64 * (i + 2), 64, torch.uint8, (64,), (1,)) for i in range(20)]
    assert gen.live == 21
    del kept
    gc.collect()
    assert gen.live == 1
    gen.release()
    gc.collect()
    assert _drain() == [gen]


def _reduce_while_a_collection_unindexes() -> int:
    # reduce() moves a storage into the slab through torch code (the importer, the
    # storage's wrapper, the swap), where any allocation may start a collection whose
    # finalizers unindex every Gen (unindex_all(), a broker reconnect). A gc callback
    # stands in for them, at the k-th collection after the tensor is made, for k over
    # a range, with a collection at every allocation: the sends where it struck inside
    # reduce()'s move are counted (moved by C, then sent by Python from where it lay).
    import gc
    from multiprocessing.reduction import ForkingPickler

    torch.set_num_threads(1)
    fire = [-1]

    def unindex_at(phase: str, info: dict) -> None:
        if phase == "start" and fire[0] >= 0:
            if fire[0] == 0:
                _native.unindex_all()
            fire[0] -= 1

    gc.callbacks.append(unindex_at)
    threshold = gc.get_threshold()
    inside = 0
    for i in range(80):
        ForkingPickler.loads(ForkingPickler.dumps(torch.full((16,), -1.0)))  # indexes this thread's slab (the general path)
        t = torch.full((16,), float(i))
        moved, reused = _native.shared()[0], transfer.counters()["storages_reused"]
        fire[0] = i % 40
        gc.set_threshold(1)
        try:
            blob = ForkingPickler.dumps(t)
        finally:
            gc.set_threshold(*threshold)
            fire[0] = -1
        inside += _native.shared()[0] > moved and transfer.counters()["storages_reused"] > reused
        assert torch.equal(ForkingPickler.loads(blob), t), i
    return inside


@pytest.mark.swap_path
def test_reduce_survives_a_collection_that_unindexes_its_generation(strategy) -> None:
    # place() runs torch code, which can clear gen->ref: reduce() must not read it
    # after (a NULL dereference). The collection must have struck inside
    # the move at least once, or this tested nothing.
    status, inside = run_in_child(_reduce_while_a_collection_unindexes, timeout=120)
    assert status == "ok" and inside >= 1, (status, inside)


def test_an_unhashable_dtype_is_a_sharing_error(memory) -> None:
    # rebuild() must not go on with the TypeError of the dtype's look-up pending: that
    # TypeError would escape instead of a SharingError.
    _, addr = memory
    gen = _published(addr)
    try:
        with pytest.raises(shmreduce.SharingError, match="dtype"):
            _native.rebuild((*_KEY, LOW + 128, 64, 0, 0), ([torch.float32], (16,), (1,), 0, None))
        assert gen.live == 1
    finally:
        gen.release()
        gc.collect()
        _drain()


# -- the module's form: signatures, module state, the collector --------------------


def _public_callables() -> list[tuple[str, Any]]:
    functions = [(name, obj) for name, obj in vars(_native).items() if callable(obj) and not name.startswith("_")]
    methods = [(f"Gen.{name}", obj) for name, obj in vars(_native.Gen).items() if callable(obj) and not name.startswith("_")]
    return functions + methods


@pytest.mark.parametrize("name, fn", _public_callables(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_function_has_a_signature(name: str, fn: Any) -> None:
    parameters = inspect.signature(fn).parameters.values()
    assert all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters), name


@pytest.mark.parametrize("name, fn", _public_callables(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_wrong_argument_count_is_a_type_error_naming_the_function(name: str, fn: Any) -> None:
    if name in ("load", "rebuild") or name.startswith("Gen."):
        return  # a pickle's calls: SharingError (below); methods: on a live Gen (below)
    count = len(inspect.signature(fn).parameters)
    with pytest.raises(TypeError, match=rf"(^|\.){name}\(\) takes "):
        fn(*([None] * (count + 3)))


def test_a_pickle_calling_load_or_rebuild_wrongly_is_a_sharing_error() -> None:
    for fn in (_native.load, _native.rebuild):
        with pytest.raises(shmreduce.SharingError, match="wrong number of arguments"):
            cast(Any, fn)(None)


def test_gen_methods_check_their_argument_count_as_one(memory) -> None:
    _, addr = memory
    gen = _gen(addr)
    try:
        for name, method in vars(_native.Gen).items():
            if name.startswith("_") or not callable(method):
                continue
            count = len(inspect.signature(getattr(gen, name)).parameters)
            with pytest.raises(TypeError, match=rf"(^|\.){name}\(\) takes "):
                getattr(gen, name)(*([None] * (count + 3)))
    finally:
        gen.release()


def test_a_gen_in_a_cycle_through_its_info_is_collected(memory) -> None:
    _, addr = memory
    gen = _gen(addr)
    gen.release()
    assert _drain() == [gen] and gen.ended
    gen.info = [gen]  # the pool's bookkeeping may refer back to it
    ref = weakref.ref(gen)
    del gen
    gc.collect()
    assert ref() is None


def test_a_held_gen_is_never_collected(memory) -> None:
    _, addr = memory
    gen = _gen(addr)
    gen.info = [gen]
    ref = weakref.ref(gen)
    del gen
    gc.collect()
    gen = ref()
    assert gen is not None and gen.live == 1  # its hold owns a reference to it
    gen.info = _MINE
    gen.release()


def test_a_sub_interpreter_is_refused_cleanly() -> None:
    # The segment table, the dead stack and the SIGBUS handler are the process's: the
    # module says it supports no sub-interpreter (3.12 on, for isolated ones), and its
    # exec refuses any interpreter but the main one (legacy ones, and before 3.12).
    if all(importlib.util.find_spec(name) is None for name in ("_xxsubinterpreters", "_interpreters")):
        pytest.skip("this Python has no sub-interpreter module")
    load = (
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('shmreduce._native', {_native.__file__!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
    )
    code = f"""
try:
    import _xxsubinterpreters as interpreters
except ImportError:
    import _interpreters as interpreters  # 3.13
interp = interpreters.create()
try:
    run = getattr(interpreters, "run_string", None) or interpreters.exec
    failed = run(interp, {load!r})
except Exception as exc:
    print("refused:", exc)
else:
    print("refused:", failed.formatted if failed is not None else "imported")
finally:
    interpreters.destroy(interp)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "ImportError" in done.stdout, done.stdout
    assert re.search("sub-?interpreters", done.stdout), done.stdout
