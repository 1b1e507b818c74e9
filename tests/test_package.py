"""Packaging: the version is defined once and is the installed distribution's."""

from __future__ import annotations

from importlib import metadata

import shmreduce


def test_version_is_the_distributions():
    assert shmreduce.__version__ == metadata.version("shmreduce")
