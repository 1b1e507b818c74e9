"""Multi-node style jobs: each rank, each host, is a shmreduce program of its own.

* ``examples/torchrun_job.py`` under ``torch.distributed.run --standalone
  --nproc-per-node 2`` (gloo, CPU): every rank registers, loads its half of a dataset
  with 2 DataLoader workers under both strategies and all_reduces a checksum; the job
  checks each rank has its own broker and program directory and that tensors between
  ranks go through gloo, not shmreduce. Here: the exit code, the checksum it prints
  against one computed from the dataset itself, two directories, and nothing left in
  the job's shm base (its own ``SHMREDUCE_SHM_DIR``) or in the process table after.
* A shmreduce handle that reaches another host fails with a clear ``SharingError``.
  A host is simulated by a process of another program (its own authkey) with another
  ``SHMREDUCE_SHM_DIR``: the producer's directory is not in its base, or (as on a real
  other host) does not exist at all once the producer is gone. A process of another
  program on the same host (another rank) is refused too. Every failure comes within
  seconds, in the receiver's own process, and creates nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

from helpers import brokers_under, shm_base, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "torchrun_job.py")
TIMEOUT = 180


def _job_base(tag: str) -> str:
    # Under the session's base: conftest's module leak check (brokers, files) covers it,
    # and broker_pids() finds brokers serving it.
    return tempfile.mkdtemp(prefix=f"{tag}-", dir=shm_base())


def _expected_checksum() -> int:
    """The example's dataset summed directly, without loaders, ranks or shmreduce."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("torchrun_job", EXAMPLE)
    assert spec is not None and spec.loader is not None
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)  # defines things; main() runs only as __main__
    ds = job.Synthetic()
    return sum(int(ds[i]["x"].sum()) + int(ds[i]["image"].sum(dtype=torch.int64)) for i in range(len(ds)))


def test_torchrun_job_ranks_are_separate_programs():
    base = _job_base("torchrun")
    try:
        env = dict(os.environ, SHMREDUCE_SHM_DIR=base)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", EXAMPLE]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT, cwd=ROOT)
        assert proc.returncode == 0, f"job failed:\n{proc.stdout}\n{proc.stderr}"
        assert "torchrun_job: OK" in proc.stdout, proc.stdout
        expected = _expected_checksum()
        for strategy in ("file_descriptor", "file_system"):
            found = re.search(rf"^{strategy}: world 2, checksum (\d+) == expected (\d+)", proc.stdout, re.M)
            assert found, proc.stdout
            assert int(found.group(1)) == int(found.group(2)) == expected, (found.group(0), expected)
        ranks = re.findall(r"^rank (\d): pid (\d+), program directory (shmreduce-\w+), broker pids \[([\d, ]+)\]$", proc.stdout, re.M)
        assert [r[0] for r in ranks] == ["0", "1"], proc.stdout
        assert len({r[1] for r in ranks}) == len({r[2] for r in ranks}) == 2, ranks  # two processes, two programs
        assert not set(ranks[0][3].split(", ")) & set(ranks[1][3].split(", ")), ranks  # two brokers
        assert "2 ranks, 2 program directories and brokers, none shared" in proc.stdout
        # every rank's broker leaves with its rank and takes its directory along
        assert wait_for(lambda: not brokers_under(base), 15), brokers_under(base)
        assert wait_for(lambda: not os.listdir(base), 15), os.listdir(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# A program (think: a rank on host A) that shares a tensor under each strategy and
# prints ForkingPickler's bytes for each, then what a spawn child of its own (same
# program, same host, a process that never saw the tensors) loads from them; it keeps
# its tensors, broker and directory until its stdin closes.
_PRODUCER = """
import json, multiprocessing as mp, sys
from multiprocessing.reduction import ForkingPickler
import torch, shmreduce

def load_all(payloads, q):
    q.put({s: float(ForkingPickler.loads(bytes.fromhex(h))["t"].sum()) for s, h in payloads.items()})

if __name__ == "__main__":
    shmreduce.register()
    keep, payloads = [], {}
    for strategy in ("file_descriptor", "file_system"):
        shmreduce.set_sharing_strategy(strategy)
        keep.append(torch.full((1024,), 3.0))
        payloads[strategy] = bytes(ForkingPickler.dumps({"t": keep[-1]})).hex()
    print(json.dumps(payloads), flush=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=load_all, args=(payloads, q))
    p.start()
    print(json.dumps(q.get(timeout=120)), flush=True)
    p.join(60)
    sys.stdin.read()
"""

# A process of another program (another rank, another host): its own authkey, and the
# SHMREDUCE_SHM_DIR of its environment. It loads each line's payloads as a rank would
# and answers a line of results.
_CONSUMER = """
import json, sys, time
from multiprocessing.reduction import ForkingPickler
import shmreduce

shmreduce.register()
for line in sys.stdin:
    out = {}
    for strategy, payload in json.loads(line).items():
        t0 = time.monotonic()
        try:
            ForkingPickler.loads(bytes.fromhex(payload))
            out[strategy] = ["loaded", "", time.monotonic() - t0]
        except Exception as exc:
            out[strategy] = [type(exc).__name__, str(exc), time.monotonic() - t0]
    print(json.dumps(out), flush=True)
"""


class _Consumer:
    def __init__(self, base: str) -> None:
        env = dict(os.environ, SHMREDUCE_SHM_DIR=base)
        self.proc = subprocess.Popen([sys.executable, "-c", _CONSUMER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def send(self, payloads: dict[str, str]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(payloads) + "\n")
        self.proc.stdin.flush()

    def results(self) -> dict[str, list]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"consumer exited: {self.proc.wait(TIMEOUT)}"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            assert self.proc.wait(TIMEOUT) == 0
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def _assert_clear_errors(results: dict[str, list], *words: str) -> None:
    assert set(results) == {"file_descriptor", "file_system"}, results
    for strategy, (kind, message, seconds) in results.items():
        assert kind == "SharingError", (strategy, kind, message)
        assert seconds < 10, (strategy, seconds)
        assert any(w in message for w in words), (strategy, words, message)


def test_handle_reaching_another_host_is_a_clear_sharing_error(tmp_path):
    host_a, host_b = _job_base("host-a"), _job_base("host-b")
    script = tmp_path / "producer.py"  # a file, not -c: its spawn child imports it
    script.write_text(_PRODUCER)
    env = dict(os.environ, SHMREDUCE_SHM_DIR=host_a)
    producer = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    # started now, so that their imports overlap the producer's
    other_host, other_rank = _Consumer(host_b), _Consumer(host_a)
    assert producer.stdin is not None and producer.stdout is not None
    try:
        payloads = json.loads(producer.stdout.readline())
        [directory] = os.listdir(host_a)  # the producer's program directory
        program_dir = os.path.join(host_a, directory)

        # another host while the producer lives: its handles name a directory outside
        # this host's shm base; another rank on the producer's host: the broker and
        # the file tags refuse a process of another program. Meanwhile the producer's
        # own spawn child loads the same bytes.
        other_host.send(payloads)
        other_rank.send(payloads)
        _assert_clear_errors(other_host.results(), program_dir)
        other = other_rank.results()
        _assert_clear_errors(other, "another program", "same program")
        assert "authkey" in other["file_descriptor"][1], other
        other_rank.close()
        # the bytes were good: a process of the producer's own program loaded them
        assert json.loads(producer.stdout.readline()) == {"file_descriptor": 3072.0, "file_system": 3072.0}
        producer.stdin.close()
        assert producer.wait(TIMEOUT) == 0
        assert wait_for(lambda: not os.listdir(host_a), 15), os.listdir(host_a)

        # another host, as it really is: no such directory there at all
        other_host.send(payloads)
        gone = other_host.results()
        _assert_clear_errors(gone, "no such program directory")
        for _kind, message, _seconds in gone.values():
            assert program_dir in message and "send it again" in message, message
        other_host.close()
        # no refusal made anything
        assert not os.listdir(host_b) and not os.listdir(host_a)
    finally:
        for proc in (producer, other_host.proc, other_rank.proc):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        wait_for(lambda: not brokers_under(host_a) and not brokers_under(host_b), 15)
        shutil.rmtree(host_a, ignore_errors=True)
        shutil.rmtree(host_b, ignore_errors=True)
