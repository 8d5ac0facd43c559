"""Topology: which NUMA nodes and CPUs this process has, as an immutable value.

``Topology.detect()`` reads ``/sys/devices/system/node``; ``Topology.virtual(sockets=N)`` makes N
sockets out of one memory node. Importing this package captures the process's CPU affinity, so import
it before starting OpenMP work.
"""

from __future__ import annotations

from numatp.topology.cpulist import format_cpulist, parse_cpulist
from numatp.topology.default import default_topology, resolve_sockets
from numatp.topology.model import NumaNode, Socket, Topology
from numatp.topology.resources import MachineFacts

__all__ = ["MachineFacts", "NumaNode", "Socket", "Topology", "default_topology", "format_cpulist", "parse_cpulist",
           "resolve_sockets"]
