"""Shared test helpers: the sysfs fixture trees of tests/fixtures/sysfs/, a private cache, the CLI in this
process, and the tiers: every test is marked ``unit``, ``integration`` or ``numa``, plus ``slow`` where it
is slow (pyproject's markers say which is which); a test without a tier fails the collection."""

from __future__ import annotations

from pathlib import Path

import pytest

SYSFS_FIXTURES = Path(__file__).parent / "fixtures" / "sysfs"
TIERS = ("unit", "integration", "slow", "numa")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a test without a tier (unmarked, it would run in the default selection whatever it costs) or
    with two of unit, integration and numa. ``slow`` may sit beside a module's unit or integration mark:
    the test is then in the slow tier (deselected by default, run by ``-m slow``)."""
    bad = []
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if not tiers or len([t for t in tiers if t != "slow"]) > 1:
            bad.append(f"{item.nodeid}: {', '.join(tiers) or 'no tier'}")
    if bad:
        shown = "\n  ".join(bad[:20]) + ("\n  ..." if len(bad) > 20 else "")
        raise pytest.UsageError(
            f"{len(bad)} test(s) without exactly one tier:\n  {shown}\nmark each with one of unit, integration "
            f"or numa (a module's `pytestmark = pytest.mark.unit`), plus `@pytest.mark.slow` where it is slow; "
            f"pyproject.toml's markers say which tier is which")


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
