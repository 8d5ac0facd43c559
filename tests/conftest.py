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


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """GEMM rates, profiles and the C++ library go to a folder of this test session, never to the user's
    cache."""
    from tests.helpers import private_cache

    with private_cache(str(tmp_path_factory.mktemp("xdg-cache"))):
        yield


@pytest.fixture
def cli(capsys, monkeypatch, tmp_path):
    """``cli("explain", ...)`` -> (exit code, stdout, stderr) of ``numatp ...`` run in this process, with a
    fresh cache folder."""
    from numatp.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err

    return run
