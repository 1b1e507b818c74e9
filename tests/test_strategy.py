"""The strategy toggle: validation, default, and one switch with torch.multiprocessing."""

import subprocess
import sys

import pytest
import torch.multiprocessing as tmp

import shmreduce


def test_default_and_all():
    assert shmreduce.get_all_sharing_strategies() >= {"file_descriptor", "file_system"}
    code = "import shmreduce; print(shmreduce.get_sharing_strategy())"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "file_descriptor"


@pytest.fixture(autouse=True)
def _start_from_default():
    shmreduce.set_sharing_strategy("file_descriptor")


def test_invalid_strategy_names_the_valid_ones():
    with pytest.raises(ValueError, match="file_descriptor.*file_system"):
        shmreduce.set_sharing_strategy("bogus")
    assert shmreduce.get_sharing_strategy() == "file_descriptor"


def test_one_toggle_with_torch_while_registered():
    with shmreduce.registered():
        shmreduce.set_sharing_strategy("file_system")
        assert tmp.get_sharing_strategy() == "file_system"
        tmp.set_sharing_strategy("file_descriptor")
        assert shmreduce.get_sharing_strategy() == "file_descriptor"


def test_register_with_strategy_and_registered_restores():
    with shmreduce.registered(strategy="file_system"):
        assert shmreduce.get_sharing_strategy() == "file_system"
        assert shmreduce.is_registered()
    assert not shmreduce.is_registered()
    assert shmreduce.get_sharing_strategy() == "file_descriptor"
