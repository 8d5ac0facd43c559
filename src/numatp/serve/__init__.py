"""``numatp serve``: an OpenAI-compatible HTTP server with continuous batching over a model compiled by numatp.

:mod:`numatp.serve.engine` batches requests into the slots of one static KV cache on one engine thread (no
HTTP; torch only); :mod:`numatp.serve.app` is the HTTP API (FastAPI, the ``numatp[serve]`` extra);
:mod:`numatp.serve.metrics` the Prometheus text page. See docs/serve.md.
"""

from __future__ import annotations

__all__ = ["MISSING_EXTRA", "require_extra"]

MISSING_EXTRA = "numatp serve needs FastAPI and uvicorn: pip install 'numatp[serve]'"


def require_extra() -> None:
    """Raise ImportError with the install line where FastAPI or uvicorn is missing."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"{MISSING_EXTRA} ({' and '.join(missing)} not installed)")
