"""Reading the NUMA layout from sysfs (``<root>/devices/system/{node,cpu}``).

Only the kernel's own files are read, never tools' text. ``root`` is a parameter so tests point it at
a fixture tree under ``tests/fixtures/sysfs/`` instead of patching ``open``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from numatp.topology.cpulist import parse_cpulist

__all__: list[str] = []  # internal: used by numatp.topology.model only

_NODE_DIR = re.compile(r"node(\d+)$")
_CPU_DIR = re.compile(r"cpu(\d+)$")
_MEMTOTAL = re.compile(r"MemTotal:\s+(\d+)\s*kB")


@dataclass(frozen=True)
class RawNode:
    """One ``node<N>`` directory as the kernel describes it, before any affinity is applied."""

    id: int
    cpus: frozenset[int]
    memory_bytes: int
    distances: dict[int, int]


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


def read_nodes(root: str | Path) -> list[RawNode] | None:
    """The nodes under ``<root>/devices/system/node``, or None where that directory does not exist
    (a kernel built without NUMA, or a container that hides it)."""
    node_root = Path(root) / "devices" / "system" / "node"
    if not node_root.is_dir():
        return None
    ids = sorted(
        int(m.group(1)) for p in node_root.iterdir() if (m := _NODE_DIR.match(p.name)) and p.is_dir()
    )
    if not ids:
        return None
    # A node's `distance` file lists one number per *online* node, in id order.
    online_text = _read(node_root / "online")
    columns = sorted(parse_cpulist(online_text)) if online_text is not None else ids
    has_cpu = _optional_list(node_root / "has_cpu")
    has_memory = _optional_list(node_root / "has_memory")

    nodes = []
    for nid in ids:
        d = node_root / f"node{nid}"
        cpus = parse_cpulist(_read(d / "cpulist") or "")
        if has_cpu is not None and nid not in has_cpu:
            cpus = frozenset()
        memory = _memtotal(_read(d / "meminfo") or "")
        if has_memory is not None and nid not in has_memory:
            memory = 0  # MemTotal can be non-zero for memory the kernel will not allocate from
        numbers = [int(x) for x in (_read(d / "distance") or "").split()]
        distances = dict(zip(columns, numbers)) if len(numbers) == len(columns) else {nid: 10}
        nodes.append(RawNode(nid, cpus, memory, distances))
    return nodes


def read_online_cpus(root: str | Path) -> frozenset[int] | None:
    """Online CPUs from ``cpu/online`` (or the per-CPU ``cpuN/online`` files); None if unknown."""
    cpu_root = Path(root) / "devices" / "system" / "cpu"
    text = _read(cpu_root / "online")
    if text is not None:
        return parse_cpulist(text)
    if not cpu_root.is_dir():
        return None
    online = set()
    for p in cpu_root.iterdir():
        if (m := _CPU_DIR.match(p.name)) is None:
            continue
        state = _read(p / "online")
        # The boot CPU often has no `online` file: it cannot be taken offline.
        if state is None or state.strip() == "1":
            online.add(int(m.group(1)))
    return frozenset(online) if online else None


def _optional_list(path: Path) -> frozenset[int] | None:
    text = _read(path)
    return None if text is None else parse_cpulist(text)


def _memtotal(meminfo: str) -> int:
    m = _MEMTOTAL.search(meminfo)
    return int(m.group(1)) * 1024 if m else 0
