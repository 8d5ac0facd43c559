"""``--weights`` and ``--keep-head``, the quantized-weights options of every command that compiles (demo,
generate, bench, explain): added to a parser, checked before torch is imported, and described in one line.

The formats are :data:`numatp.bench.spec.WEIGHTS` (``numatp.compile(weights=...)``'s, spelled without
importing torch). A bad one is refused by the command, not by argparse, so that it is one line on stderr
with exit code 2 that names the value and the formats (argparse's ``choices`` print the usage as well).
"""

from __future__ import annotations

import argparse

from numatp.bench.spec import WEIGHTS, canonical_weights

__all__ = ["add_weight_args", "check_weight_args", "describe_weights", "format_bytes", "socket_bytes_line"]

PLAIN = "none"
"""What ``numatp bench --weights`` takes for the model's own dtype (a sweep may compare it with formats)."""

_FORMATS_HELP = ("int8: one scale per output channel; int4: groups of 64 along the input dimension, "
                 "int4:g32/g64/g128 groups of 32, 64, 128")


def add_weight_args(p: argparse.ArgumentParser, *, sweep: bool = False) -> None:
    """Add ``--weights`` (one format; with ``sweep``, one or more, ``none`` among them for the model's dtype)
    and ``--keep-head``."""
    choices = "{" + ",".join(((PLAIN,) if sweep else ()) + WEIGHTS) + "}"
    if sweep:
        p.add_argument("--weights", nargs="+", metavar=choices,
                       help="quantized weights of the numatp modes, one configuration each (" + _FORMATS_HELP +
                       f"; {PLAIN}: the model's dtype), e.g. --weights none int8 int4 to compare them; each socket "
                       "quantizes its own shard; the other modes run torch.compile on the model as it is "
                       f"(default: {PLAIN})")
    else:
        p.add_argument("--weights", metavar=choices,
                       help="store the weight matmuls quantized, each socket quantizing its own shard after sharding "
                       "(" + _FORMATS_HELP + "); the LM head and the embedding tables are int8 unless --keep-head "
                       "(default: the model's dtype)")
    p.add_argument("--keep-head", action="store_true",
                   help="with --weights: keep the LM head and the embedding tables in the model's dtype")


def check_weight_args(command: str, args: argparse.Namespace) -> None:
    """Refuse a format numatp does not store and ``--keep-head`` without ``--weights``; leave ``args.weights``
    in canonical form (``int4`` -> ``int4:g64``; for a sweep a list, None for ``none``)."""
    given = args.weights
    values = given if isinstance(given, list) else [given] if given is not None else []
    out: list[str | None] = []
    for value in values:
        if isinstance(given, list) and value.strip().lower() == PLAIN:
            out.append(None)
            continue
        try:
            out.append(canonical_weights(value))
        except ValueError:
            formats = ", ".join(((PLAIN,) if isinstance(given, list) else ()) + WEIGHTS)
            raise SystemExit(f"numatp {command}: --weights {value}: not a format numatp stores weights in; pass one "
                             f"of {formats}") from None
    if args.keep_head and not any(w is not None for w in out):
        raise SystemExit(f"numatp {command}: --keep-head keeps the LM head in the model's dtype when --weights "
                         "quantizes the other matmuls; pass --weights int8 (or int4) too, or drop --keep-head")
    args.weights = list(dict.fromkeys(out)) if isinstance(given, list) else (out[0] if out else None)


def describe_weights(weights: str | None, keep_head: bool, dtype: str) -> str:
    """``"int8, LM head and embeddings int8"``, ``"int4:g64, LM head and embeddings float32"``,
    ``"int4:g64:a8, LM head and embeddings int8:a8"``, or ``"float32, not quantized"`` (the model's
    ``dtype``) where nothing is quantized."""
    if weights is None:
        return f"{dtype}, not quantized"
    head = "int8:a8" if weights.endswith(":a8") else "int8"
    return f"{weights}, LM head and embeddings {dtype if keep_head else head}"


def format_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit they reach: ``"832 B"``, ``"82.8 KiB"``, ``"1.50 MiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}" if nbytes < 10 * scale else f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def socket_bytes_line(placement: dict, weights: str | None, keep_head: bool, dtype: str, model_bytes: int) -> str:
    """One line of a compiled model's weight bytes per socket (``numatp.placement_report``'s ``bytes``: as
    stored, quantized shards at their size) against the model's own bytes."""
    per = [r["bytes"] for r in placement["ranks"]]
    return (f"weights ({describe_weights(weights, keep_head, dtype)}) per socket: "
            + ", ".join(f"socket {r}: {format_bytes(b)}" for r, b in enumerate(per))
            + f"; the model in {dtype}: {format_bytes(model_bytes)}")
