"""The ``numa`` suite runs on a real multi-node Linux (the numa-vm guest): it fails, never skips, elsewhere."""

from __future__ import annotations

import ctypes
import os

import pytest

from numatp.topology import Topology


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """As the host suite's, except a ``$NUMATP_CACHE_DIR`` given is kept: scripts/numa-suite.sh gives each
    guest one (emptied of all but the C++ library), so the library compiles once, not once per guest."""
    from tests.helpers import private_cache

    with private_cache(str(tmp_path_factory.mktemp("xdg-cache")), keep_given=True):
        yield


@pytest.fixture(scope="session")
def topology() -> Topology:
    """The detected topology; fails the test when this machine has fewer than 2 nodes with CPUs and memory."""
    topo = Topology.detect()
    homes = {s.node for s in topo.sockets}
    if len(topo.nodes_with_memory) < 2 or len(homes) < 2:
        pytest.fail(
            f"the numa suite needs >= 2 NUMA nodes with CPUs and memory; this machine has nodes "
            f"{[n.id for n in topo.nodes]} with memory on {list(topo.nodes_with_memory)} and sockets on "
            f"{sorted(homes)}. Run it in the guest: scripts/numa-suite.sh 2",
            pytrace=False,
        )
    return topo


@pytest.fixture(scope="session")
def sched_getcpu():
    """The CPU the calling thread runs on: ``os.sched_getcpu`` where Python has it, else libc's."""
    if hasattr(os, "sched_getcpu"):
        return os.sched_getcpu
    libc = ctypes.CDLL(None, use_errno=True)
    return lambda: int(libc.sched_getcpu())
