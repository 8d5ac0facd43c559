"""``numatp report DIR``: heatmaps, speedup bars, the policy table and summary.md from a bench's
results.jsonl."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="write figures and summary.md from the results of numatp bench",
        description="Read DIR/results.jsonl (or a results file) and write mean-time heatmaps, speedup bars, "
        "speedup vs sequence length (machines with more than 2 NUMA nodes), and summary.md with the policy "
        "table. Figures need matplotlib: pip install 'numatp[plot]'.",
    )
    p.add_argument("results", type=Path, metavar="DIR",
                   help="folder holding results.jsonl (the --out of numatp bench), or a results .jsonl file")
    p.add_argument("--out", type=Path, metavar="OUTDIR",
                   help="where to write the report (default: the folder of the results)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from numatp.bench import RESULTS, write_report

    source = args.results / RESULTS if args.results.is_dir() else args.results
    if not source.is_file():
        raise SystemExit(f"numatp report: {source} does not exist; run `numatp bench --out {args.results}` "
                         "first, or pass the folder that holds its results.jsonl")
    try:
        written = write_report(args.results, args.out)
    except ValueError as e:
        raise SystemExit(f"numatp report: {e}") from e
    for path in written:
        print(f"wrote {path}")
    return 0
