"""Topology detection on fixture sysfs trees, virtual topologies, CPU lists and `numatp topo`."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest

from numatp.cli import build_parser, main
from numatp.topology import NumaNode, Socket, Topology, format_cpulist, model, parse_cpulist

GIB = 1 << 30
ALL = range(256)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0-2,4", {0, 1, 2, 4}), ("", set()), ("\n", set()), ("7", {7}), ("0-7:2", {0, 2, 4, 6}),
     ("0-1,32-33\n", {0, 1, 32, 33})],
)
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == frozenset(cpus)


@pytest.mark.parametrize("cpus", [set(), {3}, {0, 1, 2, 4}, {0, 2, 4}, set(range(64)) - {5, 37}])
def test_format_then_parse_round_trips(cpus):
    assert parse_cpulist(format_cpulist(cpus)) == cpus
    assert format_cpulist({0, 1, 2, 4}) == "0-2,4"


@pytest.mark.parametrize("bad", ["a", "3-1", "-1", "1-2-3", "0-4:0"])
def test_parse_cpulist_names_bad_piece(bad):
    with pytest.raises(ValueError, match="bad CPU list") as info:
        parse_cpulist(f"0,{bad}")
    assert repr(bad) in str(info.value)


def test_xeon_two_sockets_without_offline_cpus(sysfs_root):
    topo = Topology.detect(root=sysfs_root("xeon-2s"), allowed_cpus=ALL)
    assert [n.id for n in topo.nodes] == [0, 1]
    assert topo.num_sockets == 2 and not topo.is_virtual
    assert [s.index for s in topo.sockets] == [0, 1] and [s.node for s in topo.sockets] == [0, 1]
    # CPUs 5 and 37 are offline: listed in node0/cpulist, absent from cpu/online.
    assert 5 not in topo.nodes[0].cpus and 37 not in topo.sockets[0].cpus
    assert topo.sockets[0].cpus == tuple(sorted((set(range(16)) | set(range(32, 48))) - {5, 37}))
    assert len(topo.sockets[1].cpus) == 32
    assert topo.nodes[1].memory_bytes == 192 * GIB
    assert topo.distance(0, 1) == 21 and topo.distance(1, 1) == 10
    assert topo.nodes_with_memory == (0, 1)
    assert topo.notes == ()


def test_affinity_mask_limits_sockets(sysfs_root):
    topo = Topology.detect(root=sysfs_root("xeon-2s"), allowed_cpus={16, 17, 48})
    # Node 0 has no allowed CPU, so it gives no socket; node 1 becomes rank 0.
    assert topo.sockets == (Socket(index=0, node=1, cpus=(16, 17, 48)),)
    assert len(topo.nodes) == 2 and topo.allowed_cpus == frozenset({16, 17, 48})


def test_four_sockets(sysfs_root):
    topo = Topology.detect(root=sysfs_root("quad-4s"), allowed_cpus=ALL)
    assert topo.num_sockets == 4
    assert [s.cpus for s in topo.sockets] == [tuple(range(8 * i, 8 * i + 8)) for i in range(4)]
    assert topo.distance(0, 1) == 20 and topo.distance(0, 3) == 30 and topo.distance(3, 2) == 20


def test_epyc_nps2_each_node_is_a_socket(sysfs_root):
    topo = Topology.detect(root=sysfs_root("epyc-2s-nps2"), allowed_cpus=ALL)
    assert [(s.index, s.node) for s in topo.sockets] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert topo.distance(0, 1) == 12 and topo.distance(1, 2) == 32


def test_cpu_less_memory_node_is_a_node_but_not_a_socket(sysfs_root):
    topo = Topology.detect(root=sysfs_root("cxl-memory-node"), allowed_cpus=ALL)
    assert [n.id for n in topo.nodes] == [0, 1, 2]
    assert topo.nodes[2].cpus == frozenset() and topo.nodes[2].memory_bytes == 256 * GIB
    assert [s.node for s in topo.sockets] == [0, 1]
    assert topo.nodes_with_memory == (0, 1, 2)
    assert topo.distance(0, 2) == 14


def test_cpu_node_without_memory_uses_nearest_memory_node(sysfs_root, tmp_path):
    root = tmp_path / "sys"
    shutil.copytree(sysfs_root("quad-4s"), root)
    (root / "devices/system/node/has_memory").write_text("0,2-3\n")
    topo = Topology.detect(root=root, allowed_cpus=ALL)
    assert topo.nodes[1].memory_bytes == 0 and topo.nodes_with_memory == (0, 2, 3)
    assert topo.sockets[1] == Socket(index=1, node=0, cpus=tuple(range(8, 16)))


def test_per_cpu_online_files(sysfs_root, tmp_path):
    root = tmp_path / "sys"
    shutil.copytree(sysfs_root("quad-4s"), root)
    for cpu in range(32):
        d = root / f"devices/system/cpu/cpu{cpu}"
        d.mkdir(parents=True)
        if cpu:  # the boot CPU has no `online` file
            (d / "online").write_text("0\n" if cpu in (1, 9) else "1\n")
    topo = Topology.detect(root=root, allowed_cpus=ALL)
    assert topo.sockets[0].cpus == (0, 2, 3, 4, 5, 6, 7) and 9 not in topo.nodes[1].cpus


def test_no_node_directory_falls_back_to_one_node_and_says_so(tmp_path):
    with pytest.warns(UserWarning, match="does not exist"):
        topo = Topology.detect(root=tmp_path, allowed_cpus={0, 1, 2})
    assert [n.id for n in topo.nodes] == [0]
    assert topo.sockets == (Socket(index=0, node=0, cpus=(0, 1, 2)),)
    assert topo.notes and "assuming one node" in topo.notes[0]


def test_no_usable_cpu_is_an_error_naming_the_cpus(sysfs_root):
    with pytest.raises(ValueError, match=r"\(300\).*node 0: 0-4,6-15,32-36,38-47.*taskset"):
        Topology.detect(root=sysfs_root("xeon-2s"), allowed_cpus={300})


def test_unknown_node_in_distance_names_existing_nodes(sysfs_root):
    topo = Topology.detect(root=sysfs_root("quad-4s"), allowed_cpus=ALL)
    with pytest.raises(ValueError, match="node 7 does not exist; this machine has nodes 0, 1, 2, 3"):
        topo.distance(0, 7)


def test_values_are_immutable(sysfs_root):
    topo = Topology.detect(root=sysfs_root("quad-4s"), allowed_cpus=ALL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.is_virtual = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        topo.nodes[0].distances[0] = 1  # type: ignore[index]
    assert hash(topo) == hash(Topology.detect(root=sysfs_root("quad-4s"), allowed_cpus=ALL))
    assert NumaNode(0, {1}, 0, ((0, 10),)).distances == {0: 10}


def test_to_dict_is_json(sysfs_root):
    topo = Topology.detect(root=sysfs_root("cxl-memory-node"), allowed_cpus=ALL)
    data = json.loads(json.dumps(topo.to_dict()))
    assert data["sockets"][1] == {"index": 1, "node": 1, "cpus": [4, 5, 6, 7]}
    assert data["nodes"][2]["cpus"] == [] and data["nodes"][0]["distances"]["2"] == 14


def test_detect_this_machine():
    topo = Topology.detect()
    assert topo.num_sockets >= 1
    # The affinity captured at import, not a later read that OpenMP pinning may have narrowed.
    assert topo.allowed_cpus == model._STARTUP_AFFINITY
    assert model._STARTUP_AFFINITY >= frozenset(os.sched_getaffinity(0)) or len(os.sched_getaffinity(0)) == 1
    assert all(set(s.cpus) <= topo.allowed_cpus for s in topo.sockets)


@pytest.mark.parametrize(("n", "groups"), [(1, [(0, 1, 2, 3, 4)]), (2, [(0, 1, 2), (3, 4)]),
                                            (5, [(0,), (1,), (2,), (3,), (4,)])])
def test_virtual_splits_near_equally(n, groups):
    topo = Topology.virtual(sockets=n, cpus=range(5))
    assert topo.is_virtual and [s.cpus for s in topo.sockets] == groups
    assert {s.node for s in topo.sockets} == {0} and topo.nodes_with_memory == (0,)
    assert [s.index for s in topo.sockets] == list(range(n))


@pytest.mark.parametrize("n", [0, 6, -1, True])
def test_virtual_rejects_bad_socket_counts(n):
    with pytest.raises(ValueError, match=rf"sockets={n!r} over 5 CPUs.*from 1 to 5"):
        Topology.virtual(sockets=n, cpus=range(5))


def test_topo_command_tables(sysfs_root, capsys):
    assert main(["topo", "--sysfs-root", str(sysfs_root("cxl-memory-node"))]) == 0
    out = capsys.readouterr().out
    assert "Distances" in out and "256.0" in out and "Sockets numatp would use" in out


def test_topo_command_json_and_virtual(capsys):
    assert main(["topo", "--json", "--virtual", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["is_virtual"] is True and len(data["sockets"]) == 1
    assert main(["topo", "--virtual", "99999"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("numatp topo: ") and "sockets=99999" in err and len(err.splitlines()) == 1


def test_every_topo_option_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["topo"]
    assert sub.description
    assert all(a.help for a in sub._actions), [a.dest for a in sub._actions if not a.help]


def test_last_level_cache_is_the_largest_cache_of_cpu0(tmp_path):
    from numatp.topology.resources import last_level_cache_bytes, memory_available

    cache = tmp_path / "devices/system/cpu/cpu0/cache"
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "105M")):
        (cache / index).mkdir(parents=True)
        (cache / index / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == 105 << 20
    assert last_level_cache_bytes(tmp_path / "none") == 32 << 20   # nothing to read: the stated default
    assert memory_available() > 0   # Linux: /proc/meminfo
