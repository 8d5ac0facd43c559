"""What the placement functions share: node validation and what to do when the kernel refuses."""

from __future__ import annotations

import errno
import functools
import warnings

from numatp.topology import _sysfs

__all__ = ["PlacementError"]


class PlacementError(RuntimeError):
    """Memory could not be placed (or its placement could not be read) on the requested node."""


# Errors that mean "this environment does not let us set memory policy" rather than "bad request":
# seccomp filters (Docker's default profile without CAP_SYS_NICE) give EPERM, kernels without NUMA
# support give ENOSYS.
_REFUSED = frozenset({errno.EPERM, errno.ENOSYS, errno.EACCES})
_warned = False


@functools.lru_cache(maxsize=1)
def _memory_nodes() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(all node ids, ids of nodes with memory) of this machine, read once per process."""
    raw = _sysfs.read_nodes("/sys")
    if raw is None:  # kernel without NUMA: everything is node 0
        return (0,), (0,)
    return tuple(r.id for r in raw), tuple(r.id for r in raw if r.memory_bytes > 0)


def validate_node(node: object) -> int:
    """Return ``node`` if it names a node with memory; ValueError naming it and the valid ones if not.

    Checked here, not left to the kernel: mbind silently accepts some masks that name no usable node.
    """
    all_nodes, with_memory = _memory_nodes()
    if isinstance(node, bool) or not isinstance(node, int):
        raise ValueError(f"node must be an int NUMA node id, got {node!r}; nodes with memory: "
                         f"{', '.join(map(str, with_memory))}")
    if node not in all_nodes:
        raise ValueError(f"NUMA node {node} does not exist; this machine has nodes "
                         f"{', '.join(map(str, all_nodes))} (with memory: "
                         f"{', '.join(map(str, with_memory))}); see `numatp topo`")
    if node not in with_memory:
        raise ValueError(f"NUMA node {node} has no memory (a CPU-only node); place data on one of "
                         f"{', '.join(map(str, with_memory))}; see `numatp topo`")
    return node


def refused(call: str, node: int, err: OSError, *, strict: bool, fallback: str) -> None:
    """Handle a failed policy syscall: re-raise real errors; for a refusal, warn once per process and
    return (the caller then runs ``fallback``), or raise PlacementError when ``strict``."""
    global _warned
    what = f"{call} to NUMA node {node} failed: {err.strerror} (errno {errno.errorcode.get(err.errno or 0, err.errno)})"
    if err.errno not in _REFUSED:
        raise PlacementError(f"{what}; this is unexpected for a validated node, please report it") from err
    if strict:
        raise PlacementError(
            f"{what}: this environment does not allow NUMA memory policy (a seccomp filter or a "
            f"kernel without NUMA); run with CAP_SYS_NICE / an unconfined seccomp profile, or pass "
            f"strict=False to accept {fallback}"
        ) from err
    if not _warned:
        _warned = True
        warnings.warn(
            f"{what}: this environment does not allow NUMA memory policy; numatp continues with "
            f"{fallback} (memory is not node-placed). This warning is shown once per process.",
            RuntimeWarning,
            stacklevel=4,
        )
