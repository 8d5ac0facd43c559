"""Binding a thread's future allocations to one node (``set_mempolicy``), as a context manager.

The memory policy is per thread: a socket's worker thread enters ``membind(its_node)`` so the
activations it allocates land in its own socket's DRAM.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from numatp.placement import _syscalls
from numatp.placement._common import refused, validate_node

__all__ = ["membind"]


@contextmanager
def membind(node: int, *, strict: bool = False) -> Iterator[int]:
    """Bind the calling thread's new allocations to ``node`` (MPOL_BIND) for the ``with`` body and
    restore the thread's previous policy on exit, even when the body raises. Yields ``node``.

    Only memory first touched inside the body is affected; pages the allocator reuses keep their node.
    Threads started inside the body inherit the binding (the kernel copies the policy at clone) and
    keep it after the body ends; other threads are unaffected. Memory allocated here carries no
    per-range policy, so automatic NUMA balancing (``kernel.numa_balancing=1``) may later move it
    towards the CPUs that touch it; ``numa_clone``'s per-range binding is not moved.
    ``node`` is validated like in ``numa_clone``. If the kernel refuses (EPERM/ENOSYS) the body runs
    unbound after one RuntimeWarning per process, or PlacementError is raised when ``strict=True``.
    """
    validate_node(node)
    try:
        previous_mode, previous_nodes = _syscalls.get_mempolicy()
        _syscalls.set_mempolicy(_syscalls.MPOL_BIND, [node])
    except OSError as e:
        refused("set_mempolicy", node, e, strict=strict, fallback="the thread's current memory policy")
        yield node
        return
    try:
        yield node
    finally:
        if previous_mode & ~_syscalls.MPOL_MODE_FLAGS == _syscalls.MPOL_DEFAULT:
            _syscalls.set_mempolicy(_syscalls.MPOL_DEFAULT, [])
        else:
            _syscalls.set_mempolicy(previous_mode, previous_nodes)
