"""Two processes, one per NUMA node of the guest, joined by gloo over loopback: the hosts of a compile."""

from __future__ import annotations

import pytest

from tests.test_hosts import _equal, _hosts

pytestmark = [pytest.mark.numa, pytest.mark.timeout(2400)]


@pytest.fixture
def loopback():
    """The guest boots with its loopback interface down: bring it up (root in the guest), for gloo."""
    import fcntl
    import socket
    import struct

    get_flags, set_flags, up = 0x8913, 0x8914, 0x1   # SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, get_flags, struct.pack("16sH14s", b"lo", 0, b"")))[1]
        if not flags & up:
            fcntl.ioctl(s, set_flags, struct.pack("16sH14s", b"lo", flags | up, b""))


def test_one_process_per_node_matches_eager_with_its_shards_on_its_node(tmp_path, loopback):
    got = _hosts("node", tmp_path, wait=1800)
    _equal(got)
    for r, d in got.items():
        for socket in d["pages"]:
            assert socket["node"] == r, d["pages"]
            assert set(map(int, socket["pages"])) == {r}, f"process {r}: pages {socket['pages']}"
