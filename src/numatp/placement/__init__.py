"""Placement: put tensor memory on a chosen NUMA node, and check where it is.

- ``numa_clone(t, node)``: a copy of ``t`` whose pages are bound to ``node`` (also the graph op
  ``torch.ops.numatp.numa_clone(x, node)``).
- ``pages_by_node(t)``: ``{node: pages}`` for the memory of ``t``.
- ``process_bytes_by_node()``: ``{node: bytes}`` resident for the whole process (``/proc/self/numa_maps``),
  for memory without a data pointer (packed GEMM weights).
- ``membind(node)``: bind the calling thread's new allocations to ``node`` for a ``with`` block.

Talks to the kernel directly through libc's ``syscall`` (mbind, set_mempolicy, get_mempolicy,
move_pages); libnuma is not needed.
"""

from __future__ import annotations

from numatp.placement._common import PlacementError
from numatp.placement.binding import membind
from numatp.placement.memory import numa_clone, numa_empty, pages_by_node, process_bytes_by_node

__all__ = ["PlacementError", "membind", "numa_clone", "numa_empty", "pages_by_node", "process_bytes_by_node"]
