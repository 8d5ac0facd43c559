"""The benchmark behind ``numatp bench`` and ``numatp report`` (the paper's Sec. III).

A sweep measures each (model, batch, seq, dtype, mode) in a fresh child process and appends one
JSON line per outcome to ``DIR/results.jsonl``; the report reads those lines back into heatmaps,
speedup bars, the Table IV policy summary and ``summary.md``. Nothing here imports torch at module
level: the child applies process-level NUMA policies before torch is loaded.
"""

from __future__ import annotations

from numatp.bench.report import policy_table, write_report
from numatp.bench.spec import MODES, QUICK, Config, expand
from numatp.bench.sweep import RESULTS, SweepCounts, read_results, run_sweep

__all__ = [
    "MODES",
    "QUICK",
    "RESULTS",
    "Config",
    "SweepCounts",
    "expand",
    "policy_table",
    "read_results",
    "run_sweep",
    "write_report",
]
