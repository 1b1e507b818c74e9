"""Test session set-up: a private shm base under the real /dev/shm, a leak check per module."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# Every program directory the tests create lives under this base, on the real tmpfs,
# so leak checks see exactly what the tests made. Children inherit it.
_base = tempfile.mkdtemp(prefix="shmrt-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
os.environ["SHMREDUCE_SHM_DIR"] = _base
os.environ.setdefault("SHMREDUCE_BROKER_GRACE", "0.3")
# Every broker of the session logs at DEBUG to one file, outside the shm base: a
# broker the leak check finds still running is explained by its last "no client
# left" line, which lists each message it stays for.
_log_fd, _broker_log = tempfile.mkstemp(prefix="shmrt-broker-", suffix=".log")
os.close(_log_fd)
os.environ.setdefault("SHMREDUCE_BROKER_LOG", _broker_log)
os.environ.setdefault("SHMREDUCE_LOG_LEVEL", "DEBUG")

# One intra-op thread, in this process and every child: libgomp's thread pool, once a
# parallel region started it here (a fill or a sum of 32 Ki elements and more), hangs a
# forked child's first parallel region (torch's DataLoader workers run one thread for
# the same reason). The suite forks children after tensors of 256 KiB and more.
os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    import torch.multiprocessing as tmp
except ModuleNotFoundError:  # a venv without torch (make pythons): only the torch-free modules run
    tmp = None  # type: ignore[assignment]

import shmreduce  # noqa: E402

if tmp is not None:
    import torch  # noqa: E402

    torch.set_num_threads(1)  # whatever OMP_NUM_THREADS said before

    from shmreduce import _torch  # noqa: E402

from helpers import open_fds, shutdown_and_check_leaks  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_base, ignore_errors=True)
    if not exitstatus:
        os.unlink(_broker_log)  # kept after a failure, for its story


def pytest_runtest_setup(item):
    """A ``swap_path`` test checks the sender's pool: where a storage sent moves into
    it (the swap), how its segments are reused, held, retired. On a torch without the
    swap no sender's storage goes there (torch moves it, shmreduce adopts it): such a
    test has nothing to check, and says so. The adopt path has its own tests
    (test_older_torch.py, which takes it on any torch)."""
    if item.get_closest_marker("swap_path") is not None and tmp is not None and _torch.path() != "swap":
        pytest.skip(f"torch {torch.__version__} has no UntypedStorage._swap_data_ptr_: a sender's storage never enters its pool")


@pytest.fixture(autouse=True, scope="module")
def _module_leak_check():
    """Every test module ends with: no shm files, no broker, no leaked descriptors."""
    before = open_fds()
    yield
    shutdown_and_check_leaks(before)


@pytest.fixture(params=["file_descriptor", "file_system"])
def strategy(request):
    """Run a test under each strategy, registered; restores the previous state."""
    with shmreduce.registered(strategy=request.param):
        yield request.param


@pytest.fixture
def registered_fd():
    with shmreduce.registered(strategy="file_descriptor"):
        yield


@pytest.fixture(autouse=True)
def _restore_torch_strategy():
    if tmp is None:
        yield
        return
    before = tmp.get_sharing_strategy()
    yield
    tmp.set_sharing_strategy(before)
