"""``python -m shmreduce doctor`` and ``cleanup``: checks, exit status, stale state."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time

import pytest

from shmreduce.broker import programdir
from shmreduce.broker import protocol as P

from helpers import broker_pids, shm_base, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The CLI itself never imports torch; the tests marked so share a tensor to have a
# program to look at. Without torch (make pythons) they are skipped, the rest run.
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="shares a tensor: needs torch")


def _run(*args, env_extra=None, timeout=60):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "shmreduce", *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def test_doctor_healthy_and_cleans_up_its_broker():
    before = set(os.listdir(shm_base()))
    out = _run("doctor")
    assert out.returncode == 0, out.stdout + out.stderr
    for what in ("shm mount", "descriptor limit", "memfd", "broker", "stale program directories"):
        assert what in out.stdout
    assert "pinged" in out.stdout
    assert wait_for(lambda: not broker_pids(), 10)
    assert wait_for(lambda: set(os.listdir(shm_base())) == before, 10)


def test_doctor_does_not_import_torch():
    code = "import sys, shmreduce.doctor; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT), timeout=60).returncode == 0


def _program_dir(name, age):
    """A program directory as a broker leaves it (marker, lock, a segment), *age* seconds old."""
    path = os.path.join(shm_base(), name)
    os.mkdir(path, 0o700)
    for entry in (P.MARKER_NAME, P.LOCK_NAME, "seg-" + "a" * 24):
        open(os.path.join(path, entry), "w").close()
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_doctor_flags_low_descriptor_limit_and_stale_dirs(tmp_path):
    stale = _program_dir("shmreduce-0123456789abcdef", programdir.STALE_MIN_AGE + 5)
    try:
        code = (
            "import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256));"
            "from shmreduce.doctor import main; sys.exit(main(['doctor']))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=60
        )
        assert out.returncode != 0
        assert "[PROBLEM] descriptor limit" in out.stdout and "file_system" in out.stdout
        assert "[PROBLEM] stale program directories" in out.stdout and "cleanup --yes" in out.stdout
        assert not os.path.exists(stale)  # the doctor's throwaway broker swept it, as any launch does
        _program_dir(os.path.basename(stale), programdir.STALE_MIN_AGE + 5)
        listed = _run("cleanup")
        assert listed.returncode == 0 and stale in listed.stdout and "--yes" in listed.stdout
        assert os.path.isdir(stale)  # listing removes nothing
        removed = _run("cleanup", "--yes")
        assert removed.returncode == 0 and f"removed {stale}" in removed.stdout
        assert not os.path.exists(stale)
        assert "nothing to clean" in _run("cleanup").stdout
    finally:
        shutil.rmtree(stale, ignore_errors=True)


def test_doctor_flags_small_shm(tmp_path):
    # a directory on a nearly full or small mount is flagged: simulate with a tiny threshold
    code = "import sys, shmreduce.doctor as d; d.MIN_SHM_BYTES = 1 << 60; sys.exit(d.main(['doctor']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert out.returncode != 0
    assert "[PROBLEM] shm mount" in out.stdout and "file_descriptor" in out.stdout
    assert wait_for(lambda: not broker_pids(), 10)


@needs_torch
def test_cleanup_keeps_live_program():
    import torch

    import shmreduce

    with shmreduce.registered(strategy="file_system"):
        t = torch.ones(4)
        data = shmreduce.dumps(t)
        from shmreduce import program

        live = program.current().directory
        out = _run("cleanup", "--yes")
        assert out.returncode == 0 and live not in out.stdout
        assert os.path.isdir(live)
        assert float(shmreduce.loads(data).sum()) == 4.0


def test_console_script():
    # The `shmreduce` command that pip installs beside this interpreter ([project.scripts]).
    script = os.path.join(os.path.dirname(sys.executable), "shmreduce")
    assert os.access(script, os.X_OK), f"{script} missing: install the package (pip install -e .)"
    env = dict(os.environ, PYTHONPATH=ROOT)
    usage = subprocess.run([script, "--help"], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: shmreduce ") and "cleanup" in usage.stdout, usage.stderr
    out = subprocess.run([script, "doctor"], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "pinged" in out.stdout, out.stdout + out.stderr
    assert wait_for(lambda: not broker_pids(), 10)


def test_usage_error():
    out = _run("bogus")
    assert out.returncode != 0 and "usage" in out.stderr


def test_cleanup_and_sweep_leave_a_directory_shmreduce_did_not_make():
    # A user's own folder that merely looks like ours (name, owner, 0700, old, no lock
    # held) is never touched, and neither is anything in it.
    mine = os.path.join(shm_base(), "shmreduce-0.1.0")
    os.mkdir(mine, 0o700)
    with open(os.path.join(mine, "notes.txt"), "w") as f:
        f.write("mine")
    then = time.time() - programdir.STALE_MIN_AGE - 5
    os.utime(mine, (then, then))
    try:
        assert programdir.sweep_stale(shm_base()) == []
        out = _run("cleanup", "--yes")
        assert out.returncode == 0 and mine not in out.stdout, out.stdout
        with open(os.path.join(mine, "notes.txt")) as f:
            assert f.read() == "mine"
    finally:
        shutil.rmtree(mine, ignore_errors=True)


def test_cleanup_leaves_a_program_directory_that_may_be_starting():
    # Younger than STALE_MIN_AGE, its lock free: a launcher between making it and
    # taking the lock, alive (its command line names the directory, as a launcher's
    # does). Both the sweep and cleanup --yes keep it. (Without a live launcher, the
    # lock free and nothing using it, cleanup removes it at once:
    # tests/test_doctor_stale.py.)
    young = _program_dir("shmreduce-00112233445566ff", 0)
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "shmreduce.broker.server", young, "1"])
    try:
        assert programdir.sweep_stale(shm_base()) == []
        out = _run("cleanup", "--yes")
        assert out.returncode == 0 and os.path.isdir(young), out.stdout
    finally:
        launcher.kill()
        launcher.wait()
        shutil.rmtree(young, ignore_errors=True)


def test_cleanup_leaves_a_broker_in_use_whose_root_exited():
    # The program's root is gone but one of its processes (here, this one) is still
    # connected: the broker serves it, so it is no orphan.
    from shmreduce.broker import client

    dead = subprocess.Popen(["true"])
    dead.wait()
    directory = os.path.join(shm_base(), "shmreduce-77665544332211aa")
    c = client.BrokerClient(directory, dead.pid)
    try:
        pid = c.ping()["pid"]
        assert c.ping()["root_alive"] is False
        out = _run("cleanup", "--yes")
        assert out.returncode == 0 and str(pid) not in out.stdout, out.stdout
        time.sleep(0.5)
        assert c.ping()["pid"] == pid
    finally:
        c.close()
    assert wait_for(lambda: not os.path.exists(directory), 10)  # it exits once unused


_RUNNING_PROGRAM = """
import sys, time, torch, shmreduce
shmreduce.register(strategy="file_system")
t = torch.ones(1 << 16)
t.share_memory_()  # a file held at this program's broker
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.mark.swap_path
@needs_torch
def test_doctor_json_lists_running_programs_and_their_files():
    import json

    env = dict(os.environ, PYTHONPATH=ROOT)
    prog = subprocess.Popen([sys.executable, "-c", _RUNNING_PROGRAM], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert prog.stdout is not None and prog.stdout.readline().strip() == "ready"
        out = _run("doctor", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        data = json.loads(out.stdout)
        assert data["ok"] and {c["check"] for c in data["checks"]} >= {"shm mount", "memfd", "broker"}
        rows = [r for r in data["programs"] if r["root_pid"] == prog.pid]
        assert len(rows) == 1, data["programs"]
        row = rows[0]
        assert row["root_alive"] and row["connections"] >= 1 and row["segment_files"] >= 1 and row["segment_bytes"] >= 1 << 18
        table = _run("doctor")
        assert str(row["broker_pid"]) in table.stdout and row["directory"] in table.stdout
    finally:
        if prog.stdin is not None:
            prog.stdin.write("\n")
            prog.stdin.close()
        prog.wait(30)
        if prog.stdout is not None:
            prog.stdout.close()
    assert wait_for(lambda: not broker_pids(), 15)


@pytest.mark.swap_path
@needs_torch
def test_report_gives_this_process_pools_and_its_broker_state(capsys):
    import torch

    import shmreduce
    from shmreduce import doctor

    with shmreduce.registered(strategy="file_descriptor"):
        t = torch.ones(1 << 16)
        back = shmreduce.loads(shmreduce.dumps(t))
        data = doctor.report()
        assert data["process"]["segments_mapped"] >= 1 and data["process"]["bytes_mapped"] >= 1 << 18
        assert data["process"]["descriptors"] >= 1 and data["process"]["fd_segments_made"] >= 1
        assert data["broker"]["clients"] >= 1 and "draining" in data["broker"] and "segment_files" in data["broker"]
        doctor.print_report(data)
        printed = capsys.readouterr().out
        assert "segments_mapped" in printed and "clients" in printed
        del t, back
