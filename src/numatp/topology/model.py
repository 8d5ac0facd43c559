"""The machine as an immutable value: NUMA nodes, the sockets (ranks) numatp uses, and the CPUs it may use.

Two named constructors: ``Topology.detect()`` reads sysfs; ``Topology.virtual(sockets=N)`` splits the
usable CPUs of one memory node into N groups, which is how single-node machines and tests exercise the
multi-socket code paths.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from numatp.topology import _sysfs
from numatp.topology.cpulist import format_cpulist

__all__ = ["NumaNode", "Socket", "Topology"]

# Read once, at import, before any OpenMP pool exists: libgomp pins its master thread when the pool
# starts, after which sched_getaffinity(0) can report a single CPU.
_STARTUP_AFFINITY: frozenset[int] = frozenset(os.sched_getaffinity(0))

_LOCAL_DISTANCE = 10  # the kernel's (ACPI SLIT) distance of a node to itself


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def _machine_memory() -> int:
    # All node memory of this machine: the one memory node of a virtual topology stands for all of it.
    raw = _sysfs.read_nodes("/sys")
    return sum(r.memory_bytes for r in raw) if raw else _physical_memory()


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node as the kernel reports it."""

    id: int
    """Kernel node id (the N of ``/sys/devices/system/node/nodeN``)."""
    cpus: frozenset[int]
    """Online CPUs of the node, whether or not this process may use them; empty for memory-only nodes."""
    memory_bytes: int
    """Memory the kernel can allocate on this node (``MemTotal``); 0 for a node without memory."""
    distances: Mapping[int, int] = field(default_factory=dict, hash=False)
    """Distance to each node id (10 = local), from the node's ``distance`` file; read-only."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpus", frozenset(self.cpus))
        pairs = self.distances.items() if isinstance(self.distances, Mapping) else self.distances
        object.__setattr__(self, "distances", MappingProxyType(dict(pairs)))


@dataclass(frozen=True)
class Socket:
    """A compute domain, and so one tensor-parallel rank: the usable CPUs of one NUMA node.

    numatp's "socket" is a NUMA node with CPUs, not a physical package: on an AMD EPYC configured with
    2 nodes per package (NPS2), each node is its own socket and rank, so one package gives two ranks.
    """

    index: int
    """Rank, 0..N-1 in node-id order."""
    node: int
    """Memory node that holds this rank's data: its own node, or the nearest node with memory when its
    own node has none."""
    cpus: tuple[int, ...]
    """The node's online CPUs that this process may use, ascending; never empty."""


@dataclass(frozen=True)
class Topology:
    """NUMA nodes, the sockets numatp would use, and the CPUs this process may use."""

    nodes: tuple[NumaNode, ...]
    """Every node, including memory-only (CXL) nodes, in id order."""
    sockets: tuple[Socket, ...]
    """One per node that has a usable CPU, in node-id order; ``sockets[i].index == i``."""
    allowed_cpus: frozenset[int]
    """CPUs this process may run on (its affinity at import, or what ``detect`` was given)."""
    is_virtual: bool
    """True for ``Topology.virtual``: all sockets share memory node 0, so nothing is mbind-placed."""
    notes: tuple[str, ...] = ()
    """Anything detection had to assume, in words, for ``numatp topo`` to show."""

    @classmethod
    def detect(cls, root: str | Path = "/sys", allowed_cpus: Iterable[int] | None = None) -> Topology:
        """Read the topology under ``<root>/devices/system/node``.

        CPUs are intersected with the online CPUs and with ``allowed_cpus`` (default: this process's
        affinity captured when ``numatp.topology`` was imported). A node none of whose CPUs are
        allowed gives no socket. Where the node directory does not exist, one node holding all
        allowed CPUs is assumed, with a warning and a note saying so.
        """
        allowed = _STARTUP_AFFINITY if allowed_cpus is None else frozenset(allowed_cpus)
        online = _sysfs.read_online_cpus(root)
        raw = _sysfs.read_nodes(root)
        notes: list[str] = []
        if raw is None:
            note = (
                f"{Path(root) / 'devices/system/node'} does not exist (kernel without NUMA, or hidden "
                "by a container): assuming one node with all allowed CPUs"
            )
            warnings.warn(note, stacklevel=2)
            notes.append(note)
            cpus = allowed if online is None else allowed & online
            raw = [_sysfs.RawNode(0, cpus, _physical_memory(), {0: _LOCAL_DISTANCE})]
        nodes = tuple(
            NumaNode(r.id, r.cpus if online is None else r.cpus & online, r.memory_bytes, r.distances)
            for r in raw
        )
        sockets = _sockets(nodes, allowed)
        if not sockets:
            raise ValueError(
                f"none of the CPUs this process may use ({format_cpulist(allowed) or 'none'}) is an "
                f"online CPU of a NUMA node ("
                + "; ".join(f"node {n.id}: {format_cpulist(n.cpus) or 'no CPUs'}" for n in nodes)
                + "); widen the affinity (taskset -c) or pass allowed_cpus= naming CPUs of a node"
            )
        return cls(nodes, sockets, allowed, is_virtual=False, notes=tuple(notes))

    @classmethod
    def virtual(cls, sockets: int, cpus: Iterable[int] | None = None) -> Topology:
        """Split ``cpus`` (default: this process's CPUs) into ``sockets`` near-equal groups of
        consecutive CPUs, all on memory node 0. Earlier groups get the extra CPU when it does not
        divide evenly."""
        usable = sorted(_STARTUP_AFFINITY if cpus is None else set(cpus))
        if isinstance(sockets, bool) or not isinstance(sockets, int) or not 1 <= sockets <= len(usable):
            raise ValueError(
                f"virtual topology of sockets={sockets!r} over {len(usable)} CPUs "
                f"({format_cpulist(usable) or 'none'}): each socket needs at least one CPU, so "
                f"sockets must be an int from 1 to {len(usable)}"
            )
        size, extra = divmod(len(usable), sockets)
        groups, start = [], 0
        for i in range(sockets):
            end = start + size + (1 if i < extra else 0)
            groups.append(Socket(index=i, node=0, cpus=tuple(usable[start:end])))
            start = end
        node = NumaNode(0, frozenset(usable), _machine_memory(), {0: _LOCAL_DISTANCE})
        return cls((node,), tuple(groups), frozenset(usable), is_virtual=True)

    def whole(self) -> Topology:
        """One virtual socket of every socket's CPUs: where numatp runs a graph unsharded on all cores
        (one worker pinned to all of them, nothing placed)."""
        return Topology.virtual(sockets=1, cpus=[c for s in self.sockets for c in s.cpus])

    @property
    def num_sockets(self) -> int:
        """Number of ranks."""
        return len(self.sockets)

    @property
    def nodes_with_memory(self) -> tuple[int, ...]:
        """Ids of the nodes that can hold data (``memory_bytes > 0``), ascending."""
        return tuple(n.id for n in self.nodes if n.memory_bytes > 0)

    def node(self, node_id: int) -> NumaNode:
        """The node with kernel id ``node_id``; ValueError naming the nodes that exist otherwise."""
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise ValueError(
            f"NUMA node {node_id!r} does not exist; this machine has nodes "
            f"{', '.join(str(n.id) for n in self.nodes)}"
        )

    def distance(self, a: int, b: int) -> int:
        """The kernel's distance from node ``a`` to node ``b`` (10 = local, ~20 = one hop)."""
        src = self.node(a)
        self.node(b)
        if b not in src.distances:
            raise ValueError(f"node {a} reports no distance to node {b}; its distance file lists "
                             f"nodes {sorted(src.distances)}")
        return src.distances[b]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description (node CPU sets as sorted lists, distance keys as strings)."""
        return {
            "is_virtual": self.is_virtual,
            "allowed_cpus": sorted(self.allowed_cpus),
            "nodes": [
                {
                    "id": n.id,
                    "cpus": sorted(n.cpus),
                    "usable_cpus": sorted(n.cpus & self.allowed_cpus),
                    "memory_bytes": n.memory_bytes,
                    "distances": {str(k): v for k, v in sorted(n.distances.items())},
                }
                for n in self.nodes
            ],
            "sockets": [{"index": s.index, "node": s.node, "cpus": list(s.cpus)} for s in self.sockets],
            "notes": list(self.notes),
        }


def _sockets(nodes: tuple[NumaNode, ...], allowed: frozenset[int]) -> tuple[Socket, ...]:
    with_memory = [n for n in nodes if n.memory_bytes > 0]
    sockets: list[Socket] = []
    for n in nodes:
        usable = n.cpus & allowed
        if not usable:
            continue
        home = n.id
        if n.memory_bytes == 0 and with_memory:
            # A CPU node without memory (seen on some POWER and CXL-configured systems) allocates
            # from its nearest memory node; ties go to the lower id.
            home = min(with_memory, key=lambda m: (n.distances.get(m.id, 1 << 30), m.id)).id
        sockets.append(Socket(index=len(sockets), node=home, cpus=tuple(sorted(usable))))
    return tuple(sockets)
