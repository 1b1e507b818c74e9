"""A program whose segments another process of the user cuts (truncates) under it.

Any process of the user can truncate a ``file_system`` segment file (a cleanup script's
``truncate -s 0``); touching a mapping past its file's end is a SIGBUS. Every access
shmreduce makes to such memory (headers at a fork, a send, a load, a drop, a reap; copies
into a slab) goes through the SIGBUS guard: a segment found cut is lost, its messages
fail with ``SharingError``, and the program goes on. A pooled memfd is sealed against
shrinking and growing: under ``file_descriptor`` another process can only punch holes
in it (its pages read as zeros, never a fault).

Each program runs in a child interpreter, so that a signal there is an exit status
seen here, not the end of the test run.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from helpers import broker_procs, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 60.0

# Run by another process of the user, given the program's pids and directory: truncates
# every segment file to nothing; and every memfd of shmreduce the program or its broker
# keeps open (a pooled segment or a ledger, through /proc/<pid>/fd, as any process of
# the user can) it tries to shrink, and punches the pooled ones (their pages zeros from
# now on). Prints what the shrinks raised, how many there were and how many it punched.
_CUT = textwrap.dedent(
    """
    import ctypes, os, sys
    pids, directory = [int(p) for p in sys.argv[1].split(",")], sys.argv[2]
    for name in os.listdir(directory):
        if name.startswith("seg-"):
            os.truncate(os.path.join(directory, name), 0)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    shrinks, punched = [], 0
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            path = f"/proc/{pid}/fd/{fd}"
            try:
                link = os.readlink(path)
                if not link.startswith("/memfd:shmreduce"):
                    continue
                mine = os.open(path, os.O_RDWR)
            except OSError:
                continue  # closed meanwhile
            try:
                size = os.fstat(mine).st_size
                for new_size in sorted({0, size // 2} - {size}):  # to its own size is no shrink
                    try:
                        os.ftruncate(mine, new_size)
                        shrinks.append(f"shrunk {link}")
                    except OSError as exc:
                        shrinks.append(type(exc).__name__)
                if link.startswith("/memfd:shmreduce (deleted)") and size:
                    # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
                    assert libc.fallocate(mine, 3, 0, size) == 0, ctypes.get_errno()
                    punched += 1
            finally:
                os.close(mine)
    print(repr({"shrinks": sorted(set(shrinks)), "tries": len(shrinks), "punched": punched}))
    """
)

_PROGRAM = textwrap.dedent(
    """
    import ast, gc, os, subprocess, sys
    import torch, torch.multiprocessing as mp
    import shmreduce
    from shmreduce import program, transfer
    from shmreduce.errors import SharingError

    SIZES = (16, 50_000, 300_000)  # floats: in a slab, in an arena, a segment of its own

    def make(value):
        return [torch.full((n,), float(value)) for n in SIZES]

    def send_two(conn, done):
        conn.send(make(1))  # received and kept
        conn.send(make(2))  # in flight when the files are cut
        done.wait(60)

    def nothing():
        pass

    def outcome(fn):
        try:
            fn()
            return "ok"
        except SharingError:
            return "SharingError"

    def brokers(directory):
        found = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read()
            except OSError:
                continue
            if b"shmreduce.broker.server" in argv and directory.encode() in argv:
                found.append(entry)
        return found

    if __name__ == "__main__":
        shmreduce.register(strategy=sys.argv[1])
        ctx = mp.get_context("fork")
        a, b = ctx.Pipe()
        done = ctx.Event()
        worker = ctx.Process(target=send_two, args=(b, done))
        worker.start()
        received = a.recv()
        assert all(bool((t == 1).all()) for t in received)
        assert a.poll(60)  # the second message is pickled: its refs are in flight
        own = make(3)
        blobs = [shmreduce.dumps(t) for t in own]  # own moves into this process's segments
        shmreduce.loads(shmreduce.dumps(torch.zeros(SIZES[-1])))  # its segment free in the pool
        waiting = shmreduce.dumps(torch.full((SIZES[-1],), 5.0))  # its segment waits for this blob
        gc.collect()
        transfer.collect()
        directory = program.current().directory
        pids = ",".join([str(os.getpid()), str(worker.pid)] + brokers(directory))
        cut = subprocess.run([sys.executable, "-c", sys.argv[2], pids, directory], capture_output=True, text=True, timeout=60)
        assert cut.returncode == 0, cut.stderr
        result = {"memfds": ast.literal_eval(cut.stdout)}
        first = make(6)  # into this thread's current slab and arena, cut: found so by the copy
        result["send_first"] = [outcome(lambda t=t: shmreduce.loads(shmreduce.dumps(t))) for t in first]
        result["first_intact"] = all(bool((t == 6).all()) for t in first)
        child = ctx.Process(target=nothing)
        child.start()
        child.join(60)
        result["fork"] = child.exitcode
        fresh = make(4)
        result["send_new"] = [outcome(lambda t=t: shmreduce.loads(shmreduce.dumps(t))) for t in fresh]
        result["new_intact"] = all(bool((t == 4).all()) for t in fresh)
        result["send_received"] = [outcome(lambda t=t: shmreduce.dumps(t)) for t in received]
        result["send_own"] = [outcome(lambda t=t: shmreduce.dumps(t)) for t in own]
        result["load_sent"] = [outcome(lambda b=b: shmreduce.loads(b)) for b in blobs]
        result["load_in_flight"] = outcome(a.recv)
        transfer.collect()  # the waiting segment reaped
        result["load_waiting"] = outcome(lambda: shmreduce.loads(waiting))
        del received, own, blobs, waiting
        gc.collect()
        transfer.collect()
        done.set()
        worker.join(60)
        result["worker"] = worker.exitcode
        print("RESULT", repr(result), flush=True)
    """
)


def _run(strategy: str, tmp_path) -> dict:
    script = tmp_path / "cut.py"
    script.write_text(_PROGRAM)
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("SHMREDUCE_BROKER_LOG", None)  # its broker's log, if any, goes to its stderr
    out = subprocess.run(
        [sys.executable, "-X", "faulthandler", str(script), strategy, _CUT],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=ROOT,
    )
    story = f"exit status {out.returncode}\n{out.stdout}\n{out.stderr}"
    assert out.returncode == 0, story  # a SIGBUS is -7
    assert "Bus error" not in out.stderr and "Fatal Python error" not in out.stderr, story
    line = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert line, story
    # Nothing left behind: the program's directory and its broker went with it.
    base = os.environ["SHMREDUCE_SHM_DIR"]
    assert wait_for(lambda: not os.listdir(base), TIMEOUT), f"left in {base}: {os.listdir(base)}"
    assert wait_for(lambda: not broker_procs(), TIMEOUT), f"brokers left: {broker_procs()}"
    result: dict = ast.literal_eval(line[0][len("RESULT ") :])
    # It forked, and its worker lived too; fresh tensors went to fresh segments, before
    # the fork and after (the cut ones left their pools).
    assert result["fork"] == 0 and result["worker"] == 0, result
    for when in ("first", "new"):
        assert result[f"send_{when}"] == ["ok"] * 3 and result[f"{when}_intact"], result
    return result


@pytest.mark.swap_path
def test_a_file_system_program_lives_on_when_another_process_truncates_its_segment_files(tmp_path):
    result = _run("file_system", tmp_path)
    # Its ledgers' memfds (one per process that holds what it received) cannot be shrunk.
    assert result["memfds"]["shrinks"] == ["PermissionError"] and result["memfds"]["tries"] >= 2, result
    # What lay in a cut file is lost: sending it again, or loading a message of it, fails.
    assert result["send_received"] == ["SharingError"] * 3, result
    assert result["send_own"] == ["SharingError"] * 3, result
    assert result["load_sent"] == ["SharingError"] * 3, result
    assert result["load_in_flight"] == "SharingError" and result["load_waiting"] == "SharingError", result


@pytest.mark.swap_path
def test_a_file_descriptor_program_lives_on_when_another_process_punches_its_memfds(tmp_path):
    result = _run("file_descriptor", tmp_path)
    # Every shrink was refused (the seals; growing a pooled one too:
    # test_broker_robustness), and there were pooled memfds to punch.
    assert result["memfds"]["shrinks"] == ["PermissionError"] and result["memfds"]["punched"] >= 3, result
    # Punched pages read as zeros: a header of generation 0 refuses what names the old
    # one, or a process that maps it already loads zeros. Never a signal.
    for key in ("send_received", "send_own", "load_sent", "load_in_flight", "load_waiting"):
        outcomes = result[key] if isinstance(result[key], list) else [result[key]]
        assert set(outcomes) <= {"ok", "SharingError"}, result


_HOLDER = textwrap.dedent(
    """
    import os, sys, torch, shmreduce
    from shmreduce import program
    shmreduce.register(strategy="file_system")
    t = torch.ones(1000)
    shmreduce.dumps(t)  # t moves into a segment file of this program
    directory = program.current().directory
    for name in os.listdir(directory):
        if name.startswith("seg-"):
            os.truncate(os.path.join(directory, name), 0)
    print("cut", flush=True)
    print(float(t.sum()))  # the user's own read of its memory: not shmreduce's to guard
    """
)


@pytest.mark.swap_path
def test_a_tensor_held_in_a_cut_file_faults_as_with_torch(tmp_path):
    # The guard takes only the faults of shmreduce's own accesses: the user's read of a
    # tensor whose file was cut goes to the handler it replaced (here the default: the
    # process ends with SIGBUS), as under torch's own file_system; never swallowed or
    # retried for ever.
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == -signal.SIGBUS and out.stdout == "cut\n", f"{out.returncode}\n{out.stdout}\n{out.stderr}"
    base = os.environ["SHMREDUCE_SHM_DIR"]
    assert wait_for(lambda: not os.listdir(base), TIMEOUT), f"left in {base}: {os.listdir(base)}"
    assert wait_for(lambda: not broker_procs(), TIMEOUT), f"brokers left: {broker_procs()}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
