"""Where numatp keeps what it measures on this host (GEMM rates, the calibrated profile)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """``~/.cache/numatp`` (``$XDG_CACHE_HOME/numatp`` where that is set)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "numatp"
