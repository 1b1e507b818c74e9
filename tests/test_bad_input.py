"""Bad input on the receiving side: stale handles, forged keys, wrong sizes, names
outside the program directory, truncated pickles (SPEC 8).

Each raises SharingError with a message that says what happened, within seconds, and
damages nothing: the next message works and no descriptor is left open.

Truncated pickles: the bytes themselves are broken, which is not a sharing failure,
so pickle's own error surfaces (``pickle.UnpicklingError`` or ``EOFError``, as for
any truncated pickle). If the cut falls after a handle, that part of the message was
already fetched; shmreduce closes what the failed load left over (``receiving()``)
and the rest of the message is consumed: load it again and you get SharingError
(stale), never a hang.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time

import pytest
import torch

import shmreduce
from shmreduce import program, reductions, transfer
from shmreduce.broker.client import client_for

from helpers import forget_mappings, let_go_now, open_fds, run_in_child, shm_base, wait_for

TIMEOUT = 20.0


def _rebuild_sum(ref):
    # a fork child inherits the parent's mappings (and cache): forget them, so the
    # child is a receiver that has never seen the segment
    forget_mappings()
    t = torch.empty(0).set_(reductions.rebuild_storage(ref))
    return float(t.sum()) if t.dtype.is_floating_point else t.numel()


def _shared_ref(t):
    """A real handle for t's storage, deposited as its own message."""
    with transfer.sending():
        ref = transfer.SegmentRef(*transfer.share(t.untyped_storage()))
    return ref


def _next_message_works():
    t = torch.arange(10.0)
    status, value = run_in_child(lambda b: float(pickle.loads(b).sum()), shmreduce.dumps(t))
    assert (status, value) == ("ok", 45.0)


def _assert_sharing_error(result, *words):
    status, message = result
    assert status == "SharingError", result
    for w in words:
        assert w in message, (w, message)


@pytest.fixture(params=["file_descriptor", "file_system"])
def strat(request):
    with shmreduce.registered(strategy=request.param):
        yield request.param


def test_forged_key_is_stale(strat):
    t = torch.ones(8)
    ref = _shared_ref(t)
    forged = ref._replace(message=os.urandom(16))
    t0 = time.monotonic()
    result = run_in_child(_rebuild_sum, forged)
    assert time.monotonic() - t0 < 10
    # fd: the broker knows no such key; fs: the handle's tag does not match the key
    _assert_sharing_error(result, "forged")
    # the real message is still deliverable
    assert run_in_child(_rebuild_sum, ref) == ("ok", 8.0)
    _next_message_works()


def test_bad_key_length_and_kind_refused(strat):
    ref = _shared_ref(torch.ones(4))
    _assert_sharing_error(run_in_child(_rebuild_sum, ref._replace(message=b"short")), "forged")
    _assert_sharing_error(run_in_child(_rebuild_sum, ref._replace(kind="evil")), "not a shmreduce segment handle")
    assert run_in_child(_rebuild_sum, ref) == ("ok", 4.0)
    _next_message_works()


def test_wrong_size_refused(strat):
    t = torch.ones(16)
    ref = _shared_ref(t)
    from shmreduce.pool import SLAB_SIZE

    result = run_in_child(_rebuild_sum, ref._replace(nbytes=SLAB_SIZE + 4))  # beyond its segment
    _assert_sharing_error(result, "does not match")
    _next_message_works()


def test_wrong_fd_slot_or_identity_refused(registered_fd):
    ref = _shared_ref(torch.ones(16))
    _assert_sharing_error(run_in_child(_rebuild_sum, ref._replace(slot=5)), "cannot receive")
    ref = _shared_ref(torch.ones(16))
    _assert_sharing_error(run_in_child(_rebuild_sum, ref._replace(segment=12345)), "does not match its handle")
    ref = _shared_ref(torch.ones(16))
    _assert_sharing_error(run_in_child(_rebuild_sum, ref._replace(segment="1:2")), "not a shmreduce segment handle")
    _next_message_works()


@pytest.mark.parametrize(
    "name",
    ["../../../etc/passwd", "seg-../../etc/shadowxxxxxxxxxx", "seg-ZZZZZZZZZZZZZZZZZZZZZZZZ", "broker.sock", "seg-" + "0" * 24],
)
def test_names_outside_program_dir_refused(name):
    with shmreduce.registered(strategy="file_system"):
        ref = _shared_ref(torch.ones(4))
        result = run_in_child(_rebuild_sum, ref._replace(segment=name))
        status, message = result
        assert status == "SharingError", result
        assert "forged" in message or "gone" in message or "stale" in message, message
        _next_message_works()


@pytest.mark.parametrize("directory", ["/tmp/evil", "/etc", "/tmp/shmreduce-evil", "shmreduce-relative"])
def test_program_dir_outside_base_refused(strat, directory, tmp_path):
    before = set(os.listdir("/tmp"))
    ref = _shared_ref(torch.ones(4))
    if directory.startswith("/tmp/shmreduce"):
        directory = str(tmp_path / "shmreduce-evil")
    existed = os.path.exists(directory)
    result = run_in_child(_rebuild_sum, ref._replace(program=directory))
    assert result[0] == "SharingError", result
    assert existed or not os.path.exists(directory), "a forged handle made a directory"
    assert set(os.listdir("/tmp")) <= before | {tmp_path.name}
    _next_message_works()


_DUMPER = """
import sys, torch, shmreduce
shmreduce.register(strategy=sys.argv[1])
sys.stdout.write(shmreduce.dumps(torch.full((32,), 3.0)).hex())
"""


def test_stale_handle_program_gone(strat):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _DUMPER, strat], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    data = bytes.fromhex(out.stdout)
    # the dumping program is gone: its broker leaves (root dead) and takes the directory
    assert wait_for(lambda: not [d for d in os.listdir(shm_base()) if d != os.path.basename(program.current().directory)], 10)
    fds = len(open_fds())
    t0 = time.monotonic()
    result = run_in_child(lambda b: float(shmreduce.loads(b).sum()), data)
    assert time.monotonic() - t0 < 10
    _assert_sharing_error(result)
    assert "send it again" in result[1] or "gone" in result[1], result
    with pytest.raises(shmreduce.SharingError):
        shmreduce.loads(data)  # and in this process too
    assert len(open_fds()) <= fds
    _next_message_works()


def test_stale_handle_already_received(strat):
    t = torch.full((32,), 2.0)
    data = shmreduce.dumps(t)

    def load(b: bytes) -> float:
        forget_mappings()  # a fork child inherits this process's mappings: receive as a stranger
        return float(shmreduce.loads(b).sum())

    assert run_in_child(load, data) == ("ok", 64.0)
    if strat == "file_descriptor":
        # the descriptors went to the first receiver
        _assert_sharing_error(run_in_child(load, data), "already received")
    else:
        # file_system: the bytes load again while a process holds the files ...
        assert run_in_child(load, data) == ("ok", 64.0)
        # ... and are stale once the last holder (this process, the sender) lets go
        # (the thread's current slab is dropped: its generation would go on otherwise)
        del t
        transfer.let_go()
        let_go_now()
        result = run_in_child(load, data)
        _assert_sharing_error(result)
        assert "gone" in result[1] or "generation" in result[1], result
    _next_message_works()


def test_truncated_pickle(strat):
    data = shmreduce.dumps({"a": torch.ones(100), "b": torch.zeros(100), "c": list(range(50))})
    fds, pending = len(open_fds()), transfer.pending_count()
    for cut in (1, len(data) // 3, len(data) // 2, len(data) - 1):
        with pytest.raises((pickle.UnpicklingError, EOFError, shmreduce.SharingError)):
            shmreduce.loads(data[:cut])
    assert transfer.pending_count() <= pending
    assert len(open_fds()) <= fds
    # the whole bytes still load: a truncated copy consumed nothing
    assert float(shmreduce.loads(data)["a"].sum()) == 100.0
    # a truncated message received in another process: pickle's error, nothing hangs
    data = shmreduce.dumps([torch.ones(100), torch.ones(100)])
    result = run_in_child(lambda b: shmreduce.loads(b), data[: len(data) - 2])
    assert result[0] in ("UnpicklingError", "EOFError"), result
    assert float(sum(t.sum() for t in shmreduce.loads(data))) == 200.0
    _next_message_works()


def test_broker_gone_is_sharing_error(registered_fd):
    """A handle whose broker was killed: SharingError within seconds."""
    import signal

    from shmreduce.broker import client

    data = shmreduce.dumps(torch.ones(8))
    prog = program.current()
    c = client.client_for(prog.directory, prog.root_pid)
    pid = c.broker_pid
    os.kill(pid, signal.SIGKILL)
    # Gone means gone: its janitor removes the program directory. Before that, a fork
    # child that inherited the sender's mapping of the segment may load the message
    # without the broker (seen under AddressSanitizer's slowness), which is no error.
    assert wait_for(lambda: not os.path.isdir(prog.directory), 10.0)
    t0 = time.monotonic()
    result = run_in_child(lambda b: shmreduce.loads(b), data)
    assert time.monotonic() - t0 < 10
    _assert_sharing_error(result)
    _next_message_works()


def test_missing_file_is_gone_and_never_created():
    # torch's from_file would create a missing path full of zeros: map_file must not
    # let it (a file released a moment ago is an error, never silent zeros).
    from shmreduce import pool

    with shmreduce.registered(strategy="file_system"):
        shmreduce.loads(shmreduce.dumps(torch.ones(4)))  # the program directory exists
        directory = program.current().directory
        name = "seg-" + "ab" * 12
        with pytest.raises(shmreduce.SharingError, match="gone"):
            pool.open_file(directory, name)
        assert not os.path.exists(os.path.join(directory, name))


_CORRUPTIONS: dict[str, list[object]] = {
    "kind": [None, b"fd", 0],
    "program": [None, b"/dev/shm", "", "\x00"],
    "message": [None, "k" * 16, b"\x00" * 15],
    "segment": [None, b"seg-", 2.5, "seg-\x00", "", 1 << 70],
    "gen": [None, -1, 1 << 96, "1", 2.5, 12345],
    "offset": [None, -1, 1 << 62, 2.5, 3],
    "nbytes": [None, -1, 0, 1 << 62, 2.5],
    "slot": [None, -1, 1 << 40, "0"],
}


@pytest.mark.parametrize("field", sorted(_CORRUPTIONS))
def test_corrupted_handle_fields_are_sharing_errors(strat, field):
    # Each field of a real handle replaced by a value of the wrong type or range: a
    # SharingError every time (never TypeError, ValueError or a crash), and the
    # uncorrupted handle still loads afterwards.
    for value in _CORRUPTIONS[field]:
        ref = _shared_ref(torch.ones(4))
        result = run_in_child(_rebuild_sum, ref._replace(**{field: value}))
        assert result[0] == "SharingError", (field, value, result)
        _receive_if_undelivered(ref)
    _next_message_works()


def _receive_if_undelivered(ref):
    """Receive *ref*'s message here if no receiver took it (a refused handle may be
    refused before it reaches the broker): an undelivered message keeps the broker."""
    client = client_for(ref.program, program.current().root_pid)
    if client.ping()["messages"]:
        with transfer.receiving():
            reductions.rebuild_storage(ref)
    assert client.ping()["messages"] == 0


def test_handle_naming_a_folder_shmreduce_did_not_make_is_refused(strat):
    # A user's own folder that happens to be named like a program directory, under
    # the shm base: refused; no broker is started there and nothing in it is touched.
    folder = os.path.join(shm_base(), "shmreduce-0.1.0")
    os.mkdir(folder, 0o700)
    try:
        with open(os.path.join(folder, "notes.txt"), "w") as f:
            f.write("mine")
        ref = _shared_ref(torch.ones(4))
        _assert_sharing_error(run_in_child(_rebuild_sum, ref._replace(program=folder)), "not a shmreduce program directory")
        assert os.listdir(folder) == ["notes.txt"]
        _receive_if_undelivered(ref)
        _next_message_works()
    finally:
        import shutil

        shutil.rmtree(folder)


@pytest.mark.parametrize(
    "meta",
    [None, (), ("float32", (4,), (1,), 0, None), (torch.float32, (1 << 40,), (1,), 0, None), (torch.float32, (4,), (1,), -3, None)],
)
def test_corrupted_tensor_metadata_is_a_sharing_error(strat, meta):
    # A tensor's metadata that does not fit its storage (wrong types, beyond its end)
    # is refused like a corrupted handle, never a TypeError or ValueError.
    t = torch.ones(4)
    with transfer.sending():
        ref = transfer.share(t.untyped_storage())
    with pytest.raises(shmreduce.SharingError, match="forged or corrupted"):
        reductions.rebuild_tensor(ref, meta)
    assert torch.equal(reductions.rebuild_tensor(ref, (torch.float32, (4,), (1,), 0, None)), t)
