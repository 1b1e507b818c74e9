"""Ranks of one host share one copy: ``shmreduce.distributed.broadcast_local``.

Real jobs: one process a rank, started as torchrun starts them (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; gloo on a free port), each running ``tests/dist_rank.py``, which
prints what every rank saw; the example runs under torchrun itself. Every job has its own
shm base under the session's: afterwards no broker serves it and nothing is left in it.

* 4 ranks, each strategy: every rank has the source's bytes, from one program directory;
  a write of each rank is seen by every other (and one of a rank's spawn child); the sum of
  the ranks' PSS grows by one copy, not four; each rank's 2-worker DataLoader over its shard
  works; a rank of another job (its own program) is refused the job's bytes; the source
  SIGKILLed and another rank exited, the two left keep their bytes and their aliasing.
* Two hosts (ranks 0-1 and 2-3 see different shm bases): one copy each, aliased within a
  host only; ranks disagreeing on src, a host whose shm mount is too small, and a rank that
  shares through a program of its own already, are a SharingError on every rank, and the
  next call works; in a group of ranks 1-3, rank 1 (alone of it on its host) keeps its object.
* A rank of another user on the host is refused, on every rank; a call before
  ``init_process_group`` is a SharingError.
* The key file: mode 0600 in the 0700 program directory, the key in nothing that goes
  through the engine; read from nothing else (another name, another directory, a symlink, a
  file others can read, as another user).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

import shmreduce

from helpers import brokers_under, run_in_child, shm_base, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK_SCRIPT = os.path.join(ROOT, "tests", "dist_rank.py")
EXAMPLE = os.path.join(ROOT, "examples", "ddp_shared_dataset.py")
TIMEOUT = 120
MIB = 64  # dist_rank.MIB
N = MIB * 2**20 // 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leftovers(base: str) -> list[str]:
    return [os.path.join(root, n) for root, dirs, files in os.walk(base) for n in dirs + files]


class Job:
    """*world* rank processes of ``dist_rank.py SCENARIO STRATEGY``; *envs*: per rank extras."""

    def __init__(self, scenario: str, strategy: str, world: int, base: str, envs: dict[int, dict[str, str]] | None = None) -> None:
        port = str(_free_port())
        self.procs = []
        self.stderr: list[str] = []  # each rank's, once it exited
        for rank in range(world):
            env = dict(os.environ, SHMREDUCE_SHM_DIR=base, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
            env.update((envs or {}).get(rank, {}))
            cmd = [sys.executable, RANK_SCRIPT, scenario, strategy]
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT))

    def results(self) -> tuple[list[int], dict[int, dict[str, dict]]]:
        """Each rank's exit status, and its steps; every rank killed if it outlives TIMEOUT."""
        codes: list[int] = []
        steps: dict[int, dict[str, dict]] = {}
        try:
            for proc in self.procs:
                out, err = proc.communicate(timeout=TIMEOUT)
                codes.append(proc.returncode)
                self.stderr.append(err)
                for line in out.splitlines():
                    if line.startswith("{"):
                        record = json.loads(line)
                        steps.setdefault(record.pop("rank"), {})[record.pop("step")] = record
        finally:
            self.kill()
        return codes, steps

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def job_base():
    base = tempfile.mkdtemp(prefix="dist-", dir=shm_base())
    yield base
    try:
        # the last rank gone, its host's broker leaves and takes the program directory along
        assert wait_for(lambda: not brokers_under(base), 15), brokers_under(base)
        assert wait_for(lambda: not _leftovers(base), 15), _leftovers(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _sum(n: int) -> int:
    return n * (n - 1) // 2


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_ranks_of_one_host_share_one_copy_and_outlive_the_source(strategy, job_base, tmp_path):
    payload, go = tmp_path / "payload", tmp_path / "go"
    extra = {"DIST_PAYLOAD": str(payload), "DIST_GO": str(go)}
    job = Job("share", strategy, 4, job_base, {r: extra for r in range(4)})
    out_codes: list[int] = []
    out_steps: dict[int, dict[str, dict]] = {}
    try:
        # meanwhile: a rank of another job, on this host, gets this job's bytes
        if wait_for(payload.exists, TIMEOUT):
            outsider = Job("outsider", strategy, 1, job_base, {0: extra})
            out_codes, out_steps = outsider.results()
        go.touch()
        codes, steps = job.results()
    finally:
        go.touch()
        job.kill()
    assert out_codes == [0], (out_codes, codes, job.stderr)
    assert codes == [-9, 0, 0, 0], (codes, job.stderr)

    got = [steps[r]["got"] for r in range(4)]
    assert all(g["sum"] == g["expected"] == _sum(N) and g["name"] == "dataset" and g["shared"] for g in got), got
    assert all(g["registered"] and g["strategy"] == strategy for g in got), got  # rank 2: by broadcast_local
    directories = {g["directory"] for g in got}
    assert len(directories) == 1 and os.path.dirname(directories.pop()) == job_base, got  # one program

    # one copy: the ranks' PSS grew by about the dataset, not four times it. Their memory's
    # (anonymous and shared) by at most 1.2 copies; all of it, with the code pages that first
    # runs fault in (about 2 MiB a rank), by less than 2.
    pss = [steps[r]["pss"] for r in range(4)]
    memory = sum(p["after"]["memory"] - p["before"]["memory"] for p in pss)
    everything = sum(p["after"]["all"] - p["before"]["all"] for p in pss)
    # Not under make asan: its shadow memory and quarantine grow each rank by about 150
    # MiB more whatever is shared (make test checks the bound).
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):
        assert memory <= 1.2 * MIB * 1024 and everything < 2 * MIB * 1024, (memory, everything, pss)

    # aliasing across ranks, and from a rank's spawn child
    assert all(steps[r]["marks"]["marks"] == [-1, -2, -3, -4] for r in range(4)), steps
    spawned = steps[1]["spawn"]
    assert spawned["sum"] == _sum(1024) and spawned["messages"] >= 1 and spawned["exitcode"] == 0, spawned
    assert all(steps[r]["spawn_write"]["value"] == -7 for r in range(4)), steps

    # each rank's own DataLoader workers, over its shard of the shared rows
    assert all(steps[r]["loader"]["messages"] >= N // 1024 // 4 // 256 for r in range(4)), steps
    assert all(steps[r]["loader_sum"]["sum"] == _sum(N) for r in range(4)), steps

    # a rank of another job: its own program, and refused this job's bytes
    assert out_steps[0]["own"]["ok"] and out_steps[0]["own"]["directory"] not in {g["directory"] for g in got}, out_steps
    refused = out_steps[0]["load"].get("error", "")
    assert "another program" in refused or "same program" in refused or "authkey" in refused, out_steps

    # the source SIGKILLed, rank 3 exited: ranks 1 and 2 keep their bytes, and see each other's writes
    for r in (1, 2):
        after = steps[r]["after_kill"]
        assert after["sum"] == _sum(N // 2) - 14, after  # x[7]: -7, from the spawn child
        assert after["marks"] == [-2, -3], after


@pytest.mark.swap_path
def test_two_hosts_each_get_one_copy_and_errors_reach_every_rank(job_base):
    small = os.path.join(job_base, "small")
    os.mkdir(small)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=1777", "tmpfs", small], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        job = Job("hosts", "file_system", 4, job_base, {2: {"SHMREDUCE_SHM_DIR": small}, 3: {"SHMREDUCE_SHM_DIR": small}})
        codes, steps = job.results()
        assert codes == [0, 0, 0, 0], (codes, job.stderr)
        for r in range(4):
            assert "disagree on src" in steps[r]["disagree"]["error"], steps[r]
            too_large = steps[r]["too_large"]["error"]
            assert "rank 2" in too_large and "cannot reserve" in too_large, too_large
            own_program = steps[r]["own_program"]["error"]
            assert "rank 3" in own_program and "already shares through a shmreduce program of its own" in own_program, own_program
            assert steps[r]["good"] == {"ok": True}
            assert steps[r]["hosts"]["sum"] == steps[r]["hosts"]["expected"], steps[r]
        host_a = {steps[r]["hosts"]["directory"] for r in (0, 1)}
        host_b = {steps[r]["hosts"]["directory"] for r in (2, 3)}
        assert len(host_a) == len(host_b) == 1 and host_a != host_b, (host_a, host_b)
        assert os.path.dirname(host_b.pop()) == small
        # aliasing within a host, and only there
        assert steps[0]["marks"]["marks"] == steps[1]["marks"]["marks"] == [-1, -1, 2, 3], steps
        assert steps[2]["marks"]["marks"] == steps[3]["marks"]["marks"] == [0, 1, -1, -1], steps
        # a group of ranks 1-3: rank 1, alone of it on host A, keeps its object; host B shares a copy
        assert steps[1]["group_sum"] == {"sum": 20.0, "same": True, "shared": False}, steps[1]
        assert steps[2]["group_sum"] == steps[3]["group_sum"] == {"sum": 20.0, "same": False, "shared": True}, steps
        assert "group_sum" not in steps[0]
        assert wait_for(lambda: not brokers_under(small) and not _leftovers(small), 15), _leftovers(small)
    finally:
        subprocess.run(["umount", small], capture_output=True)
        os.rmdir(small)


def test_a_rank_of_another_user_is_refused_on_every_rank():
    if os.getuid() != 0:
        pytest.skip("needs root, to run a rank as another user")
    # a base both users reach (the session's is root's alone), as /dev/shm is
    base = tempfile.mkdtemp(prefix="shmrt-dist-user-", dir="/dev/shm")
    os.chmod(base, 0o1777)
    try:
        job = Job("other_user", "file_descriptor", 2, base)
        codes, steps = job.results()
        assert codes == [0, 0], (codes, job.stderr)
        for r in range(2):
            error = steps[r]["call"]["error"]
            assert "rank 1" in error and "uid 65534" in error, error
        assert wait_for(lambda: not brokers_under(base) and not _leftovers(base), 15), _leftovers(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_before_init_process_group_is_a_sharing_error():
    from shmreduce.distributed import broadcast_local

    with pytest.raises(shmreduce.SharingError, match="init_process_group"):
        broadcast_local({"x": 1})


def test_example_ddp_shared_dataset(job_base):
    env = dict(os.environ, SHMREDUCE_SHM_DIR=job_base)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", EXAMPLE]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT, cwd=ROOT)
    assert proc.returncode == 0, f"job failed:\n{proc.stdout}\n{proc.stderr}"
    assert "ddp_shared_dataset: OK" in proc.stdout, proc.stdout


def test_the_key_file_is_private_and_anything_else_is_refused(registered_fd, tmp_path):
    """What goes through the engine is a directory and a file name; the key is in the file,
    mode 0600 in the 0700 program directory, and read from nothing less private."""
    import multiprocessing as mp
    import stat

    import torch

    from shmreduce import distributed, program

    directory, name = distributed._offer({"t": torch.ones(4)}, 2)
    path = os.path.join(directory, name)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and os.stat(path).st_uid == os.getuid()
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        root_pid, authkey, data = distributed._read_key(directory, name)
        assert authkey == bytes(mp.current_process().authkey) and root_pid == program.current().root_pid
        assert float(shmreduce.loads(data)["t"].sum()) == 4.0
        assert authkey.hex() not in directory + name

        refused = [
            (directory, "broker.sock"),  # not a key file's name
            (str(tmp_path), name),  # not a program directory of this user in this shm base
        ]
        link = f"{distributed.KEY_PREFIX}{'0' * 32}"
        os.symlink(path, os.path.join(directory, link))
        refused.append((directory, link))  # a symlink
        for where, what in refused:
            with pytest.raises(shmreduce.SharingError):
                distributed._read_key(where, what)
        os.unlink(os.path.join(directory, link))
        os.chmod(path, 0o640)
        with pytest.raises(shmreduce.SharingError, match="not a private file"):
            distributed._read_key(directory, name)
        os.chmod(path, 0o600)

        if os.getuid() == 0:

            def as_nobody() -> None:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                distributed._read_key(directory, name)

            kind, message = run_in_child(as_nobody)
            assert kind == "SharingError" and "uid 65534" in message, (kind, message)
    finally:
        distributed._remove_key_file(directory, name)
    assert not os.path.exists(path)


def test_the_leader_copies_on_the_threads_of_its_hosts_ranks_and_writes_refs_only(registered_fd, monkeypatch):
    """torchrun gives each rank one intra-op thread; while the leader shares, the other ranks
    of its host wait: its copies take their threads too (within its CPU mask), and the
    process's own setting is back afterwards. What it writes into the key file is refs,
    not the tensor's bytes."""
    import torch

    from shmreduce import _native, distributed, registry

    big = 64 * 2**20
    cpus = len(os.sched_getaffinity(0))
    seen: list[int] = []
    dumps = registry.dumps

    def dumps_seeing_threads(obj):
        seen.append(_native.copy_threads(big))
        return dumps(obj)

    monkeypatch.setattr(registry, "dumps", dumps_seeing_threads)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        directory, name = distributed._offer({"x": torch.ones(big // 4)}, 4)
        try:
            assert seen == [min(cpus, 4)]
            assert _native.copy_threads(big) == 1
            assert os.path.getsize(os.path.join(directory, name)) < 4096
            assert float(shmreduce.loads(distributed._read_key(directory, name)[2])["x"][-1]) == 1.0  # its ref loaded
        finally:
            distributed._remove_key_file(directory, name)
    finally:
        torch.set_num_threads(before)
