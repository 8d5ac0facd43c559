"""What this machine has beside its NUMA layout: memory available now, the last-level cache's size, and a
signature of the CPU (what the GEMM rate table and the C++ library are keyed by).

Read from the kernel (``/proc/meminfo``, ``/sys/devices/system/cpu/cpu0/cache``), never from tools' text.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

__all__ = ["memory_available", "last_level_cache_bytes", "cpu_signature"]


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


def cpu_signature() -> str:
    """A short hash of this CPU (vendor, family, model, model name, flags) and the torch build."""
    import torch   # the torch build is part of it; the topology alone never needs torch

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
