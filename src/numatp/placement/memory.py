"""Node-placed tensors: the paper's ``clone(numa_node=i)`` (Sec. II-A) and the check that it worked.

``numa_clone`` maps a fresh page-aligned anonymous buffer, binds it to one node with ``mbind`` *before*
anything touches it (a page lands on a node at first touch, so binding afterwards moves nothing), then
copies the data in. ``torch.empty`` is neither page-aligned nor guaranteed untouched, so it is never
bound in place.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

from numatp.placement import _syscalls
from numatp.placement._common import PlacementError, refused, validate_node

__all__ = ["numa_clone", "numa_empty", "pages_by_node", "process_bytes_by_node"]

_QUERY_CHUNK = 1 << 14  # pages per move_pages call: bounds the ctypes arrays, not the tensor size


class _NodeBuffer(mmap.mmap):
    """The anonymous mapping behind a placed tensor. The tensor holds the only reference (through
    ``torch.frombuffer``), so the mapping lives exactly as long as the tensor and its views."""


def _check_cpu_tensor(tensor: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        raise ValueError(f"{what} works on dense CPU tensors, got device={tensor.device} "
                         f"layout={tensor.layout}; move it with .cpu() / .to_dense() first")


def numa_clone(tensor: torch.Tensor, node: int, *, strict: bool = False) -> torch.Tensor:
    """A contiguous copy of ``tensor`` (same shape, dtype and values) whose pages are on ``node``.

    Any dtype, shape and strides are accepted; the result does not require grad. Its memory is an
    anonymous ``mmap`` owned by the returned tensor (and its views) and unmapped when they are gone.

    ``node`` must be a node with memory (ValueError naming the valid nodes otherwise). Where the
    kernel refuses memory policy (EPERM under seccomp, ENOSYS without NUMA), the fallback is the
    same page-aligned copy without binding (first touch puts it on the copying thread's node), with
    one RuntimeWarning per process; with ``strict=True`` that raises PlacementError instead.
    """
    _check_cpu_tensor(tensor, "numa_clone")
    out = numa_empty(tensor.shape, tensor.dtype, node, strict=strict)
    with torch.no_grad():
        out.copy_(tensor)  # first touch: every page is allocated under the binding
    return out


def numa_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, node: int, *,
               strict: bool = False) -> torch.Tensor:
    """An uninitialised contiguous tensor whose pages will be on ``node``, whoever touches them first.

    Unlike ``torch.empty`` made by a thread bound to ``node``, it cannot get memory the allocator
    recycles from elsewhere (a glibc arena's pages stay where they were first touched, and a new
    thread may inherit an exited thread's arena). Same node checks and fallback as :func:`numa_clone`.
    """
    validate_node(node)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    length = max(1, -(-nbytes // _syscalls.PAGE_SIZE)) * _syscalls.PAGE_SIZE
    buf = _NodeBuffer(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # shares the mapping; touches no page
    try:
        _syscalls.mbind(raw.data_ptr(), length, _syscalls.MPOL_BIND, [node])
    except OSError as e:
        refused("mbind", node, e, strict=strict, fallback="a plain page-aligned buffer")
    return raw[:nbytes].view(dtype).view(shape)


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) byte addresses covering every element of ``tensor``."""
    if tensor.numel() == 0:
        return 0, 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return start, start + (last + 1) * tensor.element_size()


def pages_by_node(tensor: torch.Tensor) -> dict[int, int]:
    """Count the pages holding ``tensor``'s elements by the node they are on: ``{node: n_pages}``.

    Uses ``move_pages`` with ``nodes=NULL``, which only reports. Pages that could not be placed are
    counted under the negative errno the kernel gives: ``-errno.ENOENT`` (-2) for a page not yet
    touched (not present), ``-errno.EFAULT`` (-14) for an address not mapped. An empty tensor gives
    ``{}``. With automatic NUMA balancing (``kernel.numa_balancing=1``) the kernel briefly unmaps
    pages to sample accesses; such a page reads as -ENOENT (-EFAULT inside a huge page) until it is
    next touched, so read the tensor (``t.sum()``) just before asking when exact counts matter.
    Raises PlacementError if the kernel refuses the query (e.g. seccomp).
    """
    _check_cpu_tensor(tensor, "pages_by_node")
    start, end = _span(tensor)
    if start == end:
        return {}
    page = _syscalls.PAGE_SIZE
    first = start - start % page
    addrs = list(range(first, end, page))
    counts: dict[int, int] = {}
    for i in range(0, len(addrs), _QUERY_CHUNK):
        try:
            status = _syscalls.move_pages_query(addrs[i : i + _QUERY_CHUNK])
        except OSError as e:
            raise PlacementError(
                f"move_pages could not report where {len(addrs)} pages are: {e.strerror}; this "
                f"environment does not allow NUMA queries (seccomp without CAP_SYS_NICE, or a "
                f"kernel without NUMA)"
            ) from e
        for s in status:
            counts[s] = counts.get(s, 0) + 1
    return dict(sorted(counts.items()))


def process_bytes_by_node(numa_maps: str | Path = "/proc/self/numa_maps", *,
                          anonymous: bool = False) -> dict[int, int]:
    """Resident bytes of this process per NUMA node, summed over every mapping: ``{node: bytes}``.

    Read from ``numa_maps`` (``N<node>=<pages>`` per mapping, in that mapping's ``kernelpagesize_kB``).
    This sees memory that ``pages_by_node`` cannot: opaque tensors without a data pointer, such as the
    packed weights of oneDNN and MKL, whose node shows as the growth of this count when they are made.
    ``anonymous=True`` counts only mappings without a backing file (heap and mmap'd buffers, where
    tensors live): the page cache of mapped files, such as shared libraries' code, sits on the node of
    whichever thread first read it and may be moved by the kernel's NUMA balancing at any time.
    Raises PlacementError where the file cannot be read (a kernel without NUMA).
    """
    try:
        text = Path(numa_maps).read_text()
    except OSError as e:
        raise PlacementError(f"cannot read {numa_maps}: {e.strerror}; this kernel reports no NUMA memory map "
                             "(built without CONFIG_NUMA, or /proc not mounted)") from e
    out: dict[int, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if anonymous and any(f.startswith("file=") for f in fields):
            continue
        page_kb = next((int(f.split("=", 1)[1]) for f in fields if f.startswith("kernelpagesize_kB=")), 4)
        for f in fields:
            if f[0] == "N" and "=" in f and f[1:f.index("=")].isdigit():
                node, pages = f[1:].split("=", 1)
                out[int(node)] = out.get(int(node), 0) + int(pages) * page_kb * 1024
    return dict(sorted(out.items()))


@torch.library.custom_op("numatp::numa_clone", mutates_args=())
def _numa_clone_op(x: torch.Tensor, node: int) -> torch.Tensor:
    """Graph-visible form of :func:`numa_clone` (non-strict)."""
    return numa_clone(x, node)


@_numa_clone_op.register_fake
def _numa_clone_fake(x: torch.Tensor, node: int) -> torch.Tensor:
    return x.new_empty(x.shape)  # contiguous, like the real result
