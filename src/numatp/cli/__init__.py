"""The ``numatp`` command line: one module per subcommand, each exposing ``add_parser(subparsers)``.

Environment variables are read here and nowhere deeper in the library. A command fails with one line on
stderr and exit code 2 for a bad argument (a model name, a path, a value out of range); ``--debug`` shows
the traceback as well. Torch and transformers are imported inside the commands that need them, so that
``--help`` and ``numatp topo`` start in a fraction of a second. ``NUMATP_PROGRESS=0|1`` turns numatp's
progress lines off or on (default: on where stderr is a terminal).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
import warnings
from typing import TextIO

__all__ = ["build_parser", "main"]

# Subcommand modules of this package, in the order ``numatp --help`` lists them.
_COMMANDS: tuple[str, ...] = ("demo", "generate", "serve", "topo", "explain", "bench", "report", "calibrate",
                             "predict")

# What a bad argument raises inside a command: a name or path that names nothing (ValueError, OSError),
# a model too large for this machine (MemoryError). Anything else is a fault of numatp, reported in one
# line too, with exit code 1 and the way to see its traceback.
_USER_ERRORS = (ValueError, OSError, MemoryError)

_DEBUG_HELP = "on an error, print the Python traceback as well as the one-line message"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="numatp",
        description="NUMA-aware tensor parallelism for torch.compile on multi-socket CPUs.",
    )
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(subparsers)
    for sub in subparsers.choices.values():  # also after the command: `numatp generate gpt-2 --debug`
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    return parser


def _one_line(text: str) -> str:
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def _fail(command: str, message: str, *, debug: bool, code: int) -> int:
    if debug:
        traceback.print_exc()
    prefix = f"numatp {command}: "
    message = _one_line(message)
    print(message if message.startswith(prefix) else prefix + message, file=sys.stderr, flush=True)
    return code


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
    """A warning as its message alone: the file and source line Python adds (``warnings.warn(...)``
    inside numatp or torch) mean nothing to someone running a command; ``--debug`` keeps them."""
    text = str(message)
    print(text if text.startswith("numatp") else f"warning: {text}", file=file or sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _progress_from_env()
    debug = bool(getattr(args, "debug", False))
    with warnings.catch_warnings():   # restores the caller's showwarning: main is also called in-process
        if not debug:
            warnings.showwarning = _show_warning
        return _run(args, debug)


def _run(args: argparse.Namespace, debug: bool) -> int:
    try:
        return int(args.run(args) or 0)
    except SystemExit as e:   # commands raise SystemExit("numatp X: ...") for arguments they refuse
        if not isinstance(e.code, str):
            raise
        return _fail(args.command, e.code, debug=debug, code=2)
    except _USER_ERRORS as e:
        return _fail(args.command, str(e) or type(e).__name__, debug=debug, code=2)
    except KeyboardInterrupt:
        print(f"numatp {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        hint = "" if debug else " (run again with --debug for the traceback)"
        return _fail(args.command, f"{type(e).__name__}: {_one_line(str(e))}{hint}", debug=debug, code=1)


def _progress_from_env() -> None:
    """``NUMATP_PROGRESS=1`` prints numatp's progress lines on stderr even into a file or a pipe, ``0`` never;
    unset: where stderr is a terminal (:func:`numatp.set_progress`)."""
    from numatp.progress import set_progress

    value = os.environ.get("NUMATP_PROGRESS", "").strip().lower()
    if value:
        set_progress(value not in ("0", "false", "no", "off"))


if __name__ == "__main__":
    sys.exit(main())
