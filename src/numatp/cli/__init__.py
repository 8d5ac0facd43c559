"""The ``numatp`` command line: one module per subcommand, each exposing ``add_parser(subparsers)``.

Environment variables are read here and nowhere deeper in the library.
"""

from __future__ import annotations

import argparse
import importlib
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
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
