"""Two processes, one per NUMA node of the guest, joined by gloo over loopback: the hosts of a compile."""

from __future__ import annotations

import pytest

from tests.test_hosts import _equal, _hosts

pytestmark = [pytest.mark.numa, pytest.mark.timeout(2400)]


def test_one_process_per_node_matches_eager_with_its_shards_on_its_node(tmp_path):
    got = _hosts("node", tmp_path, wait=1800)
    _equal(got)
    for r, d in got.items():
        for socket in d["pages"]:
            assert socket["node"] == r, d["pages"]
            assert set(map(int, socket["pages"])) == {r}, f"process {r}: pages {socket['pages']}"
