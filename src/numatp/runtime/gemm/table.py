"""The measured GEMM rates of this CPU, cached on disk: ``{shape key: {provider: GFLOP/s}}`` in one JSON
file per CPU signature (:class:`~numatp.topology.resources.MachineFacts`), shared by every process.

Only rates are kept: a positive, finite number of GFLOP/s. A measurement that failed or read nothing (0,
NaN, inf, negative) is never written, and one found in a file is ignored, so it can neither become a
choice nor hide the shape from being measured again. Writers take an exclusive ``fcntl.flock`` on
``<table>.lock`` around read, merge and replace, so processes that write at once keep each other's rates;
readers need no lock (the file is replaced by a rename, never rewritten in place).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from numatp._cache import cache_dir
from numatp.runtime.gemm.providers import GemmShape
from numatp.topology.resources import cpu_signature

__all__ = ["TABLE_FORMAT", "GemmTable", "ceiling_table", "ceilings", "default_cache_dir", "is_rate",
           "stored_rate", "usable_rates"]

default_cache_dir = cache_dir  # ``~/.cache/numatp``, or as numatp._cache.cache_dir says

TABLE_FORMAT = 10
"""Part of the table's file name: a change of how rates are measured starts a new table (2: shapes of
few rows are timed streaming their weight; 3: a streamed rate is the mean over the ring's copies, see
:func:`~numatp.runtime.gemm.measurement.measure_all`; 4: ``mkl_packed`` writes a gathered matmul's columns in
place; 5: ``gemv`` reads the weight once for up to 8 rows, not 4; 6: ``gemv`` sums 7-8 rows of a (K, N)
weight in column strips; 7: the ``amx`` provider, which a table of rates taken before it would never
time; 8: the ``dpbf16`` provider, likewise; 9: ``dpbf16`` reads up to 4 rows in address order without software
prefetch, faster than the rates an older table holds for it; 10: ``gemv`` reads one row's fp32 (or
widened bf16) weight rows one after another, likewise faster), so no choice compares rates taken one way
against rates taken the other."""


def is_rate(value: object) -> bool:
    """Whether ``value`` is a measured rate: a positive, finite number (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def usable_rates(rates: Mapping[str, object] | None) -> dict[str, float]:
    """The providers of ``rates`` that carry a measured rate (:func:`is_rate`); the rest are left out."""
    return {p: float(r) for p, r in (rates or {}).items() if is_rate(r)}  # type: ignore[arg-type]


def stored_rate(rate: float) -> float:
    """``rate`` as the table keeps it: two decimals, or three significant digits below 0.1 GFLOP/s, so a
    slow but real rate (a tiny matmul timed on a loaded machine) never rounds to 0."""
    return round(rate, 2) if rate >= 0.1 else float(f"{rate:.3g}")


class GemmTable:
    """The measured rates of one CPU (``signature``; this one's where None) in one JSON file.

    Writes go to a temporary file renamed over the old one under the lock, so a reader never sees half a
    file and entries of other processes written since the load are merged in, not overwritten.
    """

    def __init__(self, cache_dir: str | os.PathLike | None = None, *, signature: str | None = None):
        self.signature = signature or cpu_signature()
        self.path = Path(cache_dir or default_cache_dir()) / f"gemm-{self.signature}-v{TABLE_FORMAT}.json"
        self._lock = threading.Lock()
        self.entries: dict[str, dict[str, float]] = self._read()
        self.measured = 0   # shapes measured by this table (not served from the file)

    def _read(self) -> dict[str, dict[str, float]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        rates = data.get("rates", {}) if isinstance(data, dict) else {}
        if not isinstance(rates, dict):
            return {}
        found = {k: usable_rates(r) for k, r in rates.items() if isinstance(r, dict)}
        return {k: r for k, r in found.items() if r}

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """This process's threads one at a time, and across processes an exclusive lock on the lock file."""
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)

    def get(self, shape: GemmShape) -> dict[str, float] | None:
        """The rates measured at ``shape`` (None: never measured)."""
        with self._lock:
            return self.entries.get(shape.key)

    def put(self, results: Mapping[GemmShape, Mapping[str, float]]) -> None:
        """Add measured rates (a provider without a usable rate is left out, a shape without any too)."""
        clean = {s.key: usable_rates(r) for s, r in results.items()}
        clean = {k: r for k, r in clean.items() if r}
        with self._locked():
            self.measured += len(results)
            merged = self._read()
            merged.update(self.entries)
            merged.update(clean)
            self.entries = merged
            fd, tmp = tempfile.mkstemp(prefix=".gemm-", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"cpu": self.signature, "unit": "GFLOP/s", "rates": merged}, f, indent=1,
                          sort_keys=True)
            os.replace(tmp, self.path)


def ceilings(dtype: str | object, *, cache_dir: str | os.PathLike | None = None,
             threads: int | None = None) -> dict[str, float]:
    """Best measured GFLOP/s per provider for ``dtype`` on this CPU (optionally at one thread count).

    Read from the on-disk table that compiling and ``benchmarks/gemm_providers.py`` fill; empty when
    nothing was measured yet. This is the GEMM roofline ``numatp explain`` and ``calibrate`` report.
    """
    by_threads = ceiling_table(cache_dir=cache_dir).get(str(dtype).removeprefix("torch."), {})
    best: dict[str, float] = {}
    for t, rates in by_threads.items():
        if threads is None or t == threads:
            for p, r in rates.items():
                best[p] = max(best.get(p, 0.0), r)
    return best


def ceiling_table(*, cache_dir: str | os.PathLike | None = None) -> dict[str, dict[int, dict[str, float]]]:
    """Best measured GFLOP/s per dtype, thread count and provider: ``{dtype: {threads: {provider: rate}}}``.
    Shapes timed into a gathered tensor (``GemmShape.into``: a strided write, or a copy) are left out."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for key, rates in GemmTable(cache_dir).entries.items():
        shape = GemmShape.from_key(key)
        if shape.into:
            continue
        best = out.setdefault(shape.dtype, {}).setdefault(shape.threads, {})
        for p, r in rates.items():
            best[p] = max(best.get(p, 0.0), r)
    return out
