"""The ``numatp`` command line: one module per subcommand, each exposing ``add_parser(subparsers)``.

Environment variables are read here and nowhere deeper in the library: ``NUMATP_PROGRESS=0|1`` turns
numatp's progress lines off or on (default: on where stderr is a terminal).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

__all__ = ["main"]

# Subcommand modules of this package, in the order ``numatp --help`` lists them.
_COMMANDS: tuple[str, ...] = ("demo", "generate", "topo", "explain", "bench", "report", "calibrate", "predict")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="numatp",
        description="NUMA-aware tensor parallelism for torch.compile on multi-socket CPUs.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _progress_from_env()
    return int(args.run(args) or 0)


def _progress_from_env() -> None:
    """``NUMATP_PROGRESS=1`` prints numatp's progress lines on stderr even into a file or a pipe, ``0`` never;
    unset: where stderr is a terminal (:func:`numatp.set_progress`)."""
    from numatp.progress import set_progress

    value = os.environ.get("NUMATP_PROGRESS", "").strip().lower()
    if value:
        set_progress(value not in ("0", "false", "no", "off"))


if __name__ == "__main__":
    sys.exit(main())
