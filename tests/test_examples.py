"""Every example runs to completion, quickly, and prints what it promises."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

CASES = {
    "dataloader_dicts.py": ["file_descriptor: 16 batches", "file_system: 16 batches"],
    "hogwild.py": ["after hogwild training"],
    "actor_learner.py": ["30 trajectories from 3 actors"],
    "custom_transport.py": ["child wrote into the parent's tensor"],
    "custom_types.py": ["worker got a PrioritizedRollout"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs(name):
    # SHMREDUCE_SHM_DIR is inherited from conftest: the module leak check covers the
    # examples' segments and brokers too.
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=EXAMPLES,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    stem = name[:-3]
    assert f"{stem}: OK" in proc.stdout
    for expected in CASES[name]:
        assert expected in proc.stdout, proc.stdout


def test_ecosystem_examples_present():
    found = {n for n in os.listdir(EXAMPLES) if n.endswith(".py")}
    assert set(CASES) <= found
