"""numatp: NUMA-aware tensor parallelism for ``torch.compile`` on multi-socket CPUs.

Each socket is a tensor-parallel rank inside one process: weight shards live in their socket's DRAM,
a thread group pinned to each socket computes on its local shards, and one all-reduce closes each
attention and MLP block.
"""

from __future__ import annotations

from numatp.backend import compile, placement_report, plans
from numatp.generate import generate
from numatp.placement import membind, numa_clone, pages_by_node
from numatp.plan.gemm_pass import GemmOptions
from numatp.topology import Topology

__all__ = ["GemmOptions", "Topology", "compile", "generate", "membind", "numa_clone", "pages_by_node",
           "placement_report", "plans"]
__version__ = "0.1.0"
