"""``python -m shmreduce doctor`` and ``cleanup``: checks, exit status, stale state."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import broker_pids, shm_base, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, env_extra=None, timeout=60):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "shmreduce", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


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


def test_doctor_flags_low_descriptor_limit_and_stale_dirs(tmp_path):
    stale = os.path.join(shm_base(), "shmreduce-0123456789abcdef")
    os.mkdir(stale, 0o700)
    open(os.path.join(stale, "seg-" + "a" * 24), "w").close()
    try:
        code = (
            "import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256));"
            "from shmreduce.doctor import main; sys.exit(main(['doctor']))"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
        assert out.returncode != 0
        assert "[PROBLEM] descriptor limit" in out.stdout and "file_system" in out.stdout
        assert "[PROBLEM] stale program directories" in out.stdout and "cleanup --yes" in out.stdout
        listed = _run("cleanup")
        assert listed.returncode == 0 and stale in listed.stdout and "--yes" in listed.stdout
        assert os.path.isdir(stale)  # listing removes nothing
        removed = _run("cleanup", "--yes")
        assert removed.returncode == 0 and f"removed {stale}" in removed.stdout
        assert not os.path.exists(stale)
        assert "nothing to clean" in _run("cleanup").stdout
    finally:
        import shutil

        shutil.rmtree(stale, ignore_errors=True)


def test_doctor_flags_small_shm(tmp_path):
    # a directory on a nearly full or small mount is flagged: simulate with a tiny threshold
    code = (
        "import sys, shmreduce.doctor as d; d.MIN_SHM_BYTES = 1 << 60; sys.exit(d.main(['doctor']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert out.returncode != 0
    assert "[PROBLEM] shm mount" in out.stdout and "file_descriptor" in out.stdout
    assert wait_for(lambda: not broker_pids(), 10)


def test_cleanup_keeps_live_program():
    import shmreduce
    import torch

    with shmreduce.registered(strategy="file_system"):
        t = torch.ones(4)
        data = shmreduce.dumps(t)
        from shmreduce import program

        live = program.current().directory
        out = _run("cleanup", "--yes")
        assert out.returncode == 0 and live not in out.stdout
        assert os.path.isdir(live)
        assert float(shmreduce.loads(data).sum()) == 4.0


def test_usage_error():
    out = _run("bogus")
    assert out.returncode != 0 and "usage" in out.stderr
