"""The kernel's CPU-list format (``"0-3,8,10-11"``), as used by sysfs and ``taskset -c``.

One documented pair of functions, so no other module parses or prints CPU lists by hand.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["format_cpulist", "parse_cpulist"]


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse a kernel CPU list into a set of CPU ids.

    >>> sorted(parse_cpulist("0-2,4"))
    [0, 1, 2, 4]
    >>> parse_cpulist("")  # a node without CPUs has an empty cpulist file
    frozenset()

    Ranges may carry a stride (``"0-7:2"`` is ``{0, 2, 4, 6}``), as the kernel's bitmap syntax allows.
    Raises ValueError naming the bad piece when the text is not a CPU list.
    """
    cpus: set[int] = set()
    for piece in text.strip().split(","):
        piece = piece.strip()
        if not piece:
            continue
        try:
            cpus.update(_parse_piece(piece))
        except ValueError as e:
            raise ValueError(
                f"bad CPU list {text.strip()!r}: piece {piece!r} is not N, N-M or N-M:STEP with "
                f"0 <= N <= M; write it like '0-2,4'"
            ) from e
    return frozenset(cpus)


def _parse_piece(piece: str) -> range:
    span, _, step_text = piece.partition(":")
    step = int(step_text) if step_text else 1
    first_text, dash, last_text = span.partition("-")
    first = int(first_text)
    last = int(last_text) if dash else first
    if first < 0 or last < first or step < 1:
        raise ValueError(piece)
    return range(first, last + 1, step)


def format_cpulist(cpus: Iterable[int]) -> str:
    """Format CPU ids as a kernel CPU list, merging consecutive ids into ranges.

    >>> format_cpulist({0, 1, 2, 4})
    '0-2,4'
    >>> format_cpulist([])
    ''
    """
    ordered = sorted(set(cpus))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)
