"""One toggle, one error, one owner of the strategy.

While registered, ``torch.multiprocessing.set_sharing_strategy`` and
``shmreduce.set_sharing_strategy`` are one toggle: an invalid name is the same
``ValueError`` from either (torch's own says ``AssertionError``). ``unregister()``
undoes what ``register()`` did to the strategy, as it does for the reducers; a second
``register(strategy=X)`` that switches it says so.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch.multiprocessing as tmp

import shmreduce


@pytest.fixture(autouse=True)
def _start_unregistered_on_the_default():
    shmreduce.unregister()
    shmreduce.set_sharing_strategy("file_descriptor")
    yield
    shmreduce.unregister()


def _error(set_strategy) -> BaseException:
    with pytest.raises(Exception) as info:
        set_strategy("bogus")
    return info.value


def test_an_invalid_strategy_is_one_error_from_either_toggle():
    with shmreduce.registered():
        ours, torchs = _error(shmreduce.set_sharing_strategy), _error(tmp.set_sharing_strategy)
        assert type(torchs) is type(ours) is ValueError, (ours, torchs)
        assert str(torchs) == str(ours) and "file_descriptor" in str(ours), (ours, torchs)
        assert tmp.get_sharing_strategy() == "file_descriptor"
        tmp.set_sharing_strategy("file_system")  # a valid one still switches both
        assert shmreduce.get_sharing_strategy() == "file_system"
    assert tmp.set_sharing_strategy.__module__ == "torch.multiprocessing"  # torch's own again


def test_unregister_restores_the_strategy_register_changed():
    shmreduce.register(strategy="file_system")
    shmreduce.unregister()
    assert tmp.get_sharing_strategy() == "file_descriptor"
    shmreduce.register(strategy="file_system")
    shmreduce.register(strategy="file_descriptor")
    shmreduce.register(strategy="file_system")
    shmreduce.unregister()  # what was there before the first register()
    assert tmp.get_sharing_strategy() == "file_descriptor"


def test_unregister_keeps_a_strategy_set_with_the_toggle_since():
    shmreduce.register()
    tmp.set_sharing_strategy("file_system")  # the user's own choice, with the toggle
    shmreduce.unregister()
    assert tmp.get_sharing_strategy() == "file_system"


def test_a_second_register_that_switches_the_strategy_says_so(caplog):
    caplog.set_level(logging.DEBUG, logger="shmreduce")
    shmreduce.register(strategy="file_system")
    shmreduce.register(strategy="file_system")  # the same: nothing to say
    shmreduce.register()  # no strategy: nothing to say
    assert not [r for r in caplog.records if "strategy" in r.getMessage()]
    shmreduce.register(strategy="file_descriptor")
    said = [r for r in caplog.records if "strategy" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said
    assert "'file_system'" in said[0].getMessage() and "'file_descriptor'" in said[0].getMessage()


def test_registered_switches_and_restores_without_a_warning(caplog):
    caplog.set_level(logging.DEBUG, logger="shmreduce")
    shmreduce.register()
    with shmreduce.registered(strategy="file_system"):  # a scoped switch, on purpose
        assert shmreduce.get_sharing_strategy() == "file_system"
    assert shmreduce.get_sharing_strategy() == "file_descriptor"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_spawn_child_runs_the_parents_strategy_and_torchs_toggle_there_is_one_too():
    # A fresh program: a spawn child registered through the parent's marker.
    code = textwrap.dedent(
        """
        import multiprocessing as mp
        import torch.multiprocessing as tmp
        import shmreduce

        def child(q):
            try:
                tmp.set_sharing_strategy("bogus")
            except Exception as exc:
                q.put((tmp.get_sharing_strategy(), type(exc).__name__))

        if __name__ == "__main__":
            shmreduce.register(strategy="file_system")
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            print(q.get(timeout=60))
            p.join(60)
            shmreduce.unregister()
            print(tmp.get_sharing_strategy())
        """
    )
    path = os.path.join(os.environ["SHMREDUCE_SHM_DIR"], "..", f"toggle-{os.getpid()}.py")
    with open(path, "w") as f:
        f.write(code)
    try:
        done = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=120)
    finally:
        os.unlink(path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["('file_system', 'ValueError')", "file_descriptor"], done.stdout
