"""The machine a sweep runs on: the sockets numatp uses, the CPU's name, and whether a
configuration's memory fits."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from numatp.topology import Topology, resolve_sockets

__all__ = [
    "COMPILE_OVERHEAD_BYTES",
    "cpu_model",
    "estimate_bytes",
    "mem_available",
    "resolve_ranks",
]

COMPILE_OVERHEAD_BYTES = 3 << 30
"""Memory of a compiling child beyond weights and activations. A gpt2 (0.5 GB of float32 weights)
child peaked at 1.1 GB resident for the baseline and 1.4-1.6 GB for numatp on the 2-core dev
machine; Inductor's compile worker processes come on top of that and are not in its peak, so this
leaves room for both."""

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def resolve_ranks(sockets: int | None, machine: Topology) -> Topology:
    """The topology numatp runs on for ``--sockets`` on ``machine`` (the detected topology): the rule of
    ``numatp.compile`` (:func:`numatp.topology.resolve_sockets`). None: the machine's sockets, or 2
    virtual sockets on a one-node machine with 2 or more CPUs; N: the first N sockets, or N virtual
    sockets on a one-node machine."""
    return resolve_sockets(sockets, machine=machine)


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The ``model name`` of the first CPU in /proc/cpuinfo, or ``"unknown"`` where there is none
    (some ARM kernels)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return "unknown"
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else "unknown"


def mem_available(meminfo: str | Path = "/proc/meminfo") -> int:
    """``MemAvailable`` in bytes: what the kernel can hand out without swapping."""
    match = re.search(r"^MemAvailable:\s*(\d+) kB$", Path(meminfo).read_text(), re.MULTILINE)
    if match is None:
        raise ValueError(f"{meminfo} has no MemAvailable line (kernel older than 3.14?); pass --no-memory-guard")
    return int(match.group(1)) * 1024


def estimate_bytes(shape: Mapping[str, Any], *, batch: int, seq: int, dtype: str, mode: str) -> int:
    """Peak resident bytes of one benchmark child, deliberately on the high side.

    ``shape`` is ``numatp.zoo.describe(model)``. Weights count twice for numatp modes (the eager
    model plus the per-socket shards). Activations: the logits (batch, seq, vocab), which dominate
    at GPT-2's 50k vocabulary, plus two layers' worth of live intermediates, each holding
    (batch, seq, 4 x hidden + intermediate) and one (batch, heads, seq, seq) score matrix.
    """
    width = _DTYPE_BYTES[dtype]
    copies = 2 if mode.startswith("numatp") else 1
    weights = shape["parameters"] * width * copies
    tokens = batch * seq
    logits = tokens * shape["vocab"] * 4  # at 4 bytes whatever the dtype: heads may upcast to float32
    layer = tokens * (4 * shape["hidden"] + shape["intermediate"]) * width
    scores = batch * shape["heads"] * seq * seq * width
    return weights + logits + 2 * (layer + scores) + COMPILE_OVERHEAD_BYTES
