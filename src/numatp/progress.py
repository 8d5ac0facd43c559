"""What numatp is doing during long work, as lines on stderr: the ``numatp`` logger and its progress handler.

A first call compiles for tens of seconds (a 2-layer model: 36-80 s on 2 cores; each socket program is
traced, planned, compiled by Inductor and its GEMM shapes measured). numatp reports those steps, and the
sockets each compile runs on, through the ``numatp`` logger at INFO level. Importing numatp installs a
handler on that logger which prints them on stderr when stderr is a terminal (a TTY), and prints nothing
otherwise:

>>> import numatp
>>> numatp.set_progress(False)   # never print progress; True: always, also into a file or a pipe
>>> numatp.set_progress(None)    # the default: print where stderr is a terminal

Where the program configured logging itself (the root logger has a handler), numatp's records go to those
handlers instead, and the INFO ones only when progress is on or the root logger's level lets INFO through.
Warnings of the ``numatp`` logger are always shown, as Python shows any logger's warning. The ``numatp``
command line reads ``NUMATP_PROGRESS=0|1`` (``set_progress(False|True)``); the library reads no variable.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator, Sequence

__all__ = ["install", "inputs_text", "progress_enabled", "set_progress", "step"]

log = logging.getLogger("numatp")

_enabled: bool | None = None   # None: print where stderr is a terminal


def set_progress(enabled: bool | None = None) -> None:
    """Whether numatp prints its progress (compiles, GEMM measurement, the sockets of each compile) on
    stderr: ``True`` always, ``False`` never, ``None`` (the default) only where stderr is a terminal."""
    global _enabled
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"set_progress({enabled!r}): pass True (always print), False (never) or None "
                         "(print where stderr is a terminal)")
    _enabled = enabled


def progress_enabled() -> bool:
    """Whether a progress line would be printed now (see :func:`set_progress`)."""
    if _enabled is not None:
        return _enabled
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:   # a closed stream
        return False


@contextlib.contextmanager
def step(what: str, *args: object, done: str = "") -> Iterator[None]:
    """Log ``what`` (a %-format with ``args``) when a long step starts, and ``done`` (default: ``what``)
    with the elapsed time when it ends: ``numatp: measuring ... ...`` then ``numatp: measuring ... done in
    12.3s``."""
    if not log.isEnabledFor(logging.INFO):
        yield
        return
    text = what % args if args else what
    log.info("numatp: %s ...", text)
    start = time.perf_counter()
    yield
    log.info("numatp: %s done in %.1fs", done or text, time.perf_counter() - start)


def inputs_text(args: Sequence[object], most: int = 3) -> str:
    """The shapes and dtypes of a graph's tensor inputs that are not parameters, for a progress line:
    ``(1, 16) int64, (1, 16) int64``."""
    shown = [f"({', '.join(map(str, a.shape))}) {str(a.dtype).removeprefix('torch.')}"
             for a in args if hasattr(a, "shape") and hasattr(a, "dtype") and type(a).__name__ != "Parameter"]
    more = f", ... {len(shown) - most} more" if len(shown) > most else ""
    return ", ".join(shown[:most]) + more if shown else "no tensor inputs"


class _Gate(logging.Filter):
    """On the ``numatp`` logger: a record below WARNING goes on only where progress is on, or where the
    root logger's level lets it through (the program asked for INFO logs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno >= logging.WARNING or progress_enabled()
                or logging.getLogger().isEnabledFor(record.levelno))


class _ProgressHandler(logging.Handler):
    """Prints numatp's records on the current ``sys.stderr`` where the program has not configured logging
    (the root logger has no handler; where it has, propagation hands the records to those)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:   # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def install() -> None:
    """Put the progress handler and gate on the ``numatp`` logger (once), and let INFO records reach them
    unless a level was set on the logger already."""
    if any(isinstance(h, _ProgressHandler) for h in log.handlers):
        return
    log.addHandler(_ProgressHandler())
    log.addFilter(_Gate())
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
