"""The four NUMA memory-policy syscalls, through libc's ``syscall`` (no libnuma needed).

Each wrapper raises ``OSError`` with the kernel's errno; callers decide what a refusal means.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

__all__: list[str] = []  # internal to numatp.placement

MPOL_DEFAULT = 0
MPOL_BIND = 2
MPOL_F_STATIC_NODES = 1 << 15
MPOL_F_RELATIVE_NODES = 1 << 14
MPOL_MODE_FLAGS = MPOL_F_STATIC_NODES | MPOL_F_RELATIVE_NODES

# Syscall numbers differ by architecture (asm/unistd.h).
_NUMBERS = {
    "x86_64": {"mbind": 237, "set_mempolicy": 238, "get_mempolicy": 239, "move_pages": 279},
    "aarch64": {"mbind": 235, "get_mempolicy": 236, "set_mempolicy": 237, "move_pages": 239},
    "ppc64le": {"mbind": 259, "get_mempolicy": 260, "set_mempolicy": 261, "move_pages": 301},
}.get(platform.machine(), {})

# Node masks cover 1024 nodes (the kernel's largest MAX_NUMNODES is 1024).
MASK_WORDS = 16
_MASK_BITS = MASK_WORDS * 64
NodeMask = ctypes.c_ulong * MASK_WORDS

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def node_mask(nodes: list[int]) -> ctypes.Array[ctypes.c_ulong]:
    mask = NodeMask()
    for n in nodes:
        mask[n // 64] |= 1 << (n % 64)
    return mask


def mask_nodes(mask: ctypes.Array[ctypes.c_ulong]) -> list[int]:
    return [w * 64 + b for w in range(MASK_WORDS) for b in range(64) if mask[w] >> b & 1]


def _call(name: str, *args: object) -> int:
    number = _NUMBERS.get(name)
    if number is None:
        raise OSError(errno.ENOSYS, f"{name}: no syscall number known for {platform.machine()}")
    ret = _syscall(ctypes.c_long(number), *args)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")
    return int(ret)


# The kernel reads maxnode - 1 bits of a mask (a historical off-by-one that libnuma also works
# around), so pass one more than the mask holds.
_MAXNODE = ctypes.c_ulong(_MASK_BITS + 1)


def mbind(addr: int, length: int, mode: int, nodes: list[int], flags: int = 0) -> None:
    """Set the policy of ``[addr, addr + length)``; ``addr`` must be page-aligned."""
    mask = node_mask(nodes)
    _call("mbind", ctypes.c_void_p(addr), ctypes.c_ulong(length), ctypes.c_long(mode), mask,
          _MAXNODE, ctypes.c_uint(flags))


def set_mempolicy(mode: int, nodes: list[int]) -> None:
    """Set the calling thread's policy for its future allocations."""
    if nodes:
        _call("set_mempolicy", ctypes.c_long(mode), node_mask(nodes), _MAXNODE)
    else:
        _call("set_mempolicy", ctypes.c_long(mode), None, ctypes.c_ulong(0))


def get_mempolicy() -> tuple[int, list[int]]:
    """The calling thread's policy: (mode including mode flags, nodes)."""
    mode = ctypes.c_int(0)
    mask = NodeMask()
    _call("get_mempolicy", ctypes.byref(mode), mask, _MAXNODE, None, ctypes.c_ulong(0))
    return mode.value, mask_nodes(mask)


def move_pages_query(pages: list[int]) -> list[int]:
    """For each page address, its node, or a negative errno (-ENOENT: not present yet)."""
    count = len(pages)
    addrs = (ctypes.c_void_p * count)(*pages)
    status = (ctypes.c_int * count)()
    # pid 0 = this process; nodes=NULL only reports where each page is, moving nothing.
    _call("move_pages", ctypes.c_int(0), ctypes.c_ulong(count), addrs, None, status, ctypes.c_int(0))
    return list(status)
