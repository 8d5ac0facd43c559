"""Where numatp keeps what it measures on this host (GEMM rates, the calibrated profile)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """``$NUMATP_CACHE_DIR`` where that is set, else ``~/.cache/numatp`` (``$XDG_CACHE_HOME/numatp`` where
    that is set): measured GEMM rates, the calibrated profile and the compiled C++ library (``ext/``)."""
    if os.environ.get("NUMATP_CACHE_DIR"):
        return Path(os.environ["NUMATP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "numatp"
