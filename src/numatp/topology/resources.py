"""What this machine has beside its NUMA layout: memory available now, the last-level cache's size, and a
signature of the CPU, read from the kernel (``/proc/meminfo``, ``/proc/cpuinfo``,
``/sys/devices/system/cpu/cpu0/cache``), never from tools' text.

:class:`MachineFacts` holds the three as one value: what GEMM measurement and choice are given, so a test
constructs the machine it means (a 1 KiB cache, little memory, another CPU) instead of patching globals.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MachineFacts", "cpu_signature", "last_level_cache_bytes", "memory_available"]


def memory_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (it changes: read at each call), or None where it
    cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@functools.cache
def last_level_cache_bytes(root: str | Path = "/sys") -> int:
    """The largest CPU cache of cpu0 (``<root>/devices/system/cpu/cpu0/cache/index*/size``, read once);
    32 MiB where none can be read."""
    sizes = []
    for index in Path(root, "devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text.rstrip("KMGkmg")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=32 << 20)


@functools.cache
def cpu_signature() -> str:
    """A short hash of this CPU (vendor, family, model, model name, flags) and the torch build (read once):
    what a measured GEMM rate or a compiled kernel is valid for."""
    import torch   # only here: the rest of this module needs no torch

    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                k, _, v = line.partition(":")
                if k.strip() in ("vendor_id", "cpu family", "model", "model name", "flags"):
                    fields[k.strip()] = v.strip()
    except OSError:
        import platform
        fields["machine"] = platform.processor() or platform.machine()
    fields["torch"] = torch.__version__
    fields["mkldnn"] = str(torch.backends.mkldnn.is_available())
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True, kw_only=True)
class MachineFacts:
    """The machine facts GEMM measurement and choice depend on, as one value.

    ``MachineFacts.detect()`` reads this machine; a test builds the one it means, e.g.
    ``replace(MachineFacts.detect(), llc_bytes=1 << 10)`` for a cache that every weight outgrows."""

    llc_bytes: int
    """Size of the last-level cache: whether a decode step's weight comes from memory at every call."""
    memory_available: int | None
    """Bytes of memory available when detected (None: unknown): the room for second copies of weights
    and for the rings of copies a streamed shape is timed on."""
    cpu_signature: str
    """Names the CPU and torch build the measured rates belong to (the rate table's file name)."""

    @classmethod
    def detect(cls, root: str | Path = "/sys") -> MachineFacts:
        """This machine now (``root``: the sysfs folder the cache size is read from)."""
        return cls(llc_bytes=last_level_cache_bytes(root), memory_available=memory_available(),
                   cpu_signature=cpu_signature())
