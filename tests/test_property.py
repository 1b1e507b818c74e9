"""Property tests: every CPU dtype, shape and layout round-trips bit-exact, with aliasing.

Each case goes (a) in-process through ``loads(dumps(x))`` (still via shared memory and
the broker) and (b) through a persistent echo child over a Pipe and over a Queue,
for both strategies.
"""

import io
import multiprocessing as mp
import pickle
import warnings
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmreduce

from helpers import pipe_echo

CTX = mp.get_context("fork")


def _is_quantized(dtype):
    return "qint" in str(dtype) or "quint" in str(dtype)


def _cpu_dtypes():
    """Every dtype a plain CPU tensor can have. Quantized dtypes are left out before any
    tensor of theirs is made (torch 2.14 warns on making one): a quantized tensor carries
    a quantizer, not only bytes, and has its own tests below."""
    found = []
    for name in dir(torch):
        dtype = getattr(torch, name)
        if not isinstance(dtype, torch.dtype) or dtype in found or _is_quantized(dtype):
            continue
        try:
            torch.empty(2, dtype=dtype).view(torch.uint8)
            repr(torch.zeros(2, dtype=dtype).clone())  # placeholder dtypes (int1, bits8...) fail here
        except (RuntimeError, TypeError):
            continue
        found.append(dtype)
    return sorted(found, key=str)


DTYPES = _cpu_dtypes()
GRAD_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128}


def test_dtype_list_is_complete():
    names = {str(d) for d in DTYPES}
    for expected in ["torch.bool", "torch.bfloat16", "torch.complex64", "torch.float8_e4m3fn", "torch.uint16", "torch.uint64"]:
        assert expected in names


@st.composite
def tensors(draw):
    """A tensor of random bits (NaN payloads, -0.0 included) and a random view of it."""
    dtype = draw(st.sampled_from(DTYPES))
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=4)))
    extra = draw(st.integers(0, 3))  # room for a storage offset
    numel = 1
    for n in shape:
        numel *= n
    raw = draw(st.binary(min_size=(numel + extra) * itemsize, max_size=(numel + extra) * itemsize))
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
    offset = draw(st.integers(0, extra)) if numel else 0
    t = flat[offset : offset + numel].reshape(shape) if numel else torch.empty(shape, dtype=dtype)
    layout = draw(st.sampled_from(["contiguous", "permute", "step"]))
    if layout == "permute" and t.dim() >= 2:
        t = t.permute(*reversed(range(t.dim())))
    elif layout == "step" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[::2]
    kind = draw(st.sampled_from(["tensor", "grad", "param"]))
    if kind == "grad" and dtype in GRAD_DTYPES:
        t.requires_grad_(True)
    elif kind == "param":
        t = torch.nn.Parameter(t, requires_grad=dtype in GRAD_DTYPES and draw(st.booleans()))
    return t


def _bits(t):
    return t.detach().reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def _check(original, snapshot, out):
    assert type(out) is type(original)
    assert out.dtype == original.dtype and out.shape == original.shape
    assert out.stride() == original.stride() and out.storage_offset() == original.storage_offset()
    assert out.requires_grad == original.requires_grad
    assert torch.equal(_bits(out), snapshot)


def _views_check(originals, outs):
    """Views of one storage arrive as views of one storage, aliasing the sender's."""
    src = {t.untyped_storage()._cdata for t in originals if t.untyped_storage().nbytes()}
    got = {t.untyped_storage()._cdata for t in outs if t.untyped_storage().nbytes()}
    assert len(got) == len(src)


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("strategy_name", ["file_descriptor", "file_system"])
@SETTINGS
@given(t=tensors())
def test_in_process_round_trip_is_bit_exact(strategy_name, t):
    snapshot = _bits(t)
    with shmreduce.registered(strategy=strategy_name):
        out = shmreduce.loads(shmreduce.dumps(t))
        _check(t, snapshot, out)
        if t.untyped_storage().nbytes():
            assert out.untyped_storage()._cdata == t.untyped_storage()._cdata
            assert out.is_shared()


def _echo_queue(inq, outq):
    while (obj := inq.get(timeout=60)) is not None:
        outq.put(obj)


@pytest.fixture(scope="module", params=["file_descriptor", "file_system"])
def echo_child(request):
    """A persistent echo child per strategy, over a Pipe and over a Queue."""
    previous = shmreduce.get_sharing_strategy()
    shmreduce.register(strategy=request.param)
    inq, outq = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=_echo_queue, args=(inq, outq))
    proc.start()

    def via_queue(obj):
        inq.put(obj)
        return outq.get(timeout=30)

    with pipe_echo(CTX) as via_pipe:
        yield request.param, via_pipe, via_queue
    inq.put(None)
    proc.join(30)
    assert proc.exitcode == 0
    for q in (inq, outq):
        q.close()
        q.join_thread()
    shmreduce.unregister()
    shmreduce.set_sharing_strategy(previous)


@SETTINGS
@given(data=st.data())
def test_round_trip_through_a_child_is_bit_exact_and_aliased(echo_child, data):
    strategy_name, via_pipe, via_queue = echo_child
    shmreduce.set_sharing_strategy(strategy_name)
    t = data.draw(tensors())
    extra_views = []
    if t.dim() >= 1 and t.shape[0] > 1:
        extra_views = [t.detach()[1:], t.detach()[:1]]
    message = [t, *extra_views]
    snapshots = [_bits(x) for x in message]
    for send in (via_pipe, via_queue):
        outs = send(message)
        for original, snap, out in zip(message, snapshots, outs, strict=True):
            _check(original, snap, out)
        _views_check(message, outs)
        if t.untyped_storage().nbytes():
            # Back in the sender: the very same storage (aliasing both ways).
            assert outs[0].untyped_storage()._cdata == t.untyped_storage()._cdata


def test_child_writes_are_seen_for_every_dtype(echo_child):
    strategy_name, via_pipe, _ = echo_child
    shmreduce.set_sharing_strategy(strategy_name)
    for dtype in DTYPES:
        t = (
            torch.zeros(4, dtype=torch.uint8).view(dtype)
            if torch.empty(0, dtype=dtype).element_size() == 1
            else torch.zeros(4 * torch.empty(0, dtype=dtype).element_size(), dtype=torch.uint8).view(dtype)
        )
        out = via_pipe(t)
        out.view(torch.uint8).fill_(0x5A)
        assert bool((t.view(torch.uint8) == 0x5A).all()), dtype
    assert pickle.loads(ForkingPickler.dumps(1)) == 1


# -- quantized tensors ----------------------------------------------------------------------
# torch deprecates making them (2.13 and 2.14 warn once per process, pytorch/pytorch#184982)
# but still supports them: they are tested while torch makes them, with torch's warning
# kept out of the output (only that one warning: any other still shows).
QUANTIZED_DEPRECATION = r"(?s).*quantiz.*deprecated"


def _quantized():
    """A per-tensor and a per-channel quantized tensor, and a view of one; skips if torch no
    longer makes them."""
    if not hasattr(torch, "quantize_per_tensor"):
        pytest.skip("this torch has no quantized tensors")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", QUANTIZED_DEPRECATION, UserWarning)
        try:
            per_tensor = torch.quantize_per_tensor(torch.linspace(-1, 1, 12), 0.01, 3, torch.quint8)
            per_channel = torch.quantize_per_channel(
                torch.linspace(-1, 1, 6).reshape(2, 3), torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, torch.qint8
            )
        except (RuntimeError, NotImplementedError) as exc:
            pytest.skip(f"this torch no longer makes quantized tensors: {exc}")
    return [per_tensor, per_channel, per_tensor[2:]]


def _same_quantized(out, original):
    assert out.is_quantized and out.dtype == original.dtype and out.qscheme() == original.qscheme()
    assert out.shape == original.shape and out.stride() == original.stride() and out.storage_offset() == original.storage_offset()
    assert torch.equal(out.int_repr(), original.int_repr())
    assert torch.equal(out.dequantize(), original.dequantize())
    assert out.untyped_storage()._cdata == original.untyped_storage()._cdata  # shared, not copied


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")  # torch's _rebuild_qtensor reads it
@pytest.mark.timeout(60)
def test_quantized_tensors_round_trip_through_a_dispatch_table_pickler(strategy):
    """torch's own pickling (``_rebuild_qtensor`` and its quantizer) over a shared storage."""
    for q in _quantized():
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf)
        pickler.dispatch_table = shmreduce.dispatch_table()
        pickler.dump(q)
        _same_quantized(pickle.loads(buf.getvalue()), q)


@pytest.mark.timeout(60)
def test_quantized_tensors_round_trip_through_forking_pickler_and_dumps(strategy):
    # The native reduce took a quantized tensor for a plain one (strided, CPU) and
    # dropped its quantizer: its load was refused (torch.multiprocessing fails on them
    # too). It hands them to reductions.reduce_tensor now, as it does subclasses.
    def round_trips() -> str | None:
        try:
            for q in _quantized():
                _same_quantized(pickle.loads(ForkingPickler.dumps(q)), q)
                _same_quantized(shmreduce.loads(shmreduce.dumps(q)), q)
        except shmreduce.SharingError as exc:
            return str(exc)
        return None

    # Raised here, after the tensors died: the traceback pytest keeps of an expected
    # failure would keep them, and their segments, past the module's leak check.
    failure = round_trips()
    if failure is not None:
        raise shmreduce.SharingError(failure)
