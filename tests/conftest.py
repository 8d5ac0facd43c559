"""Shared test helpers: the sysfs fixture trees of tests/fixtures/sysfs/."""

from __future__ import annotations

from pathlib import Path

import pytest

SYSFS_FIXTURES = Path(__file__).parent / "fixtures" / "sysfs"


@pytest.fixture
def sysfs_root():
    """``sysfs_root("xeon-2s")`` -> the root of that fixture tree, to pass as ``Topology.detect(root=)``."""

    def root(name: str) -> Path:
        path = SYSFS_FIXTURES / name
        assert path.is_dir(), f"no sysfs fixture {name!r} under {SYSFS_FIXTURES}"
        return path

    return root
