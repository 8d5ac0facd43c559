"""numatp: NUMA-aware tensor parallelism for ``torch.compile`` on multi-socket CPUs.

Each socket is a tensor-parallel rank inside one process: weight shards live in their socket's DRAM,
a thread group pinned to each socket computes on its local shards, and one all-reduce closes each
attention and MLP block.
"""

from __future__ import annotations

from numatp.progress import install as _install_progress, set_progress

_install_progress()   # before anything logs: progress lines on stderr where it is a terminal

from numatp.backend import compile, placement_report, plans  # noqa: E402
from numatp.generate import generate  # noqa: E402
from numatp.placement import membind, numa_clone, pages_by_node  # noqa: E402
from numatp.plan.gemm_pass import GemmOptions  # noqa: E402
from numatp.topology import Topology  # noqa: E402

__all__ = ["GemmOptions", "Topology", "compile", "generate", "membind", "numa_clone", "pages_by_node", "placement_report",
           "plans", "set_progress"]
__version__ = "0.1.0"
