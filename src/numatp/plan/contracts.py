"""The contracts between the pipeline's steps, checked on the socket programs.

Four invariants hold after every step of :mod:`numatp.plan.pipeline` from ``localize`` on:

- :func:`same_collectives`: every socket performs the same collectives in the same order (kind, tag,
  and where known the reduced shape and dtype, or the gathered tensor's): otherwise the sockets wait for
  each other at different reductions, or sum tensors that do not match;
- :func:`one_reduction_per_block`: one all-reduce per sharded block that ends in a reduction (every
  sharded block but the LM head, whose output is gathered), and one all-gather per sharded graph
  output (``plan.gathers``); with one socket the lowered program keeps only the reductions that end a
  segment, and the count is not checked after ``lower``;
- :func:`shard_shapes`: every argument has the shape its :class:`~numatp.plan.localize.Binding` gives
  it (a shard: its socket's index count along the split dim; anything else: the caller's shape);
- :func:`local_reads`: no node reads a value another socket holds: a partial sum (a reduction's input)
  is read by its reduction alone, and each step of a socket's program reads only the values its own
  program defined before it (placeholders, earlier steps' outputs).

:func:`check` runs the four after a named step and raises :class:`ContractError` naming the step, the
rule and the socket. The pipeline calls it with ``check=True``: the tests do, and ``numatp.compile``'s
option ``check`` (``torch.compile(..., options={"check": True})``) or ``numatp explain --check`` do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.fx

from numatp.plan.localize import Binding, LocalProgram
from numatp.plan.ops import COLLECTIVES
from numatp.plan.schema import Colwise, Plan, Rowwise
from numatp.plan.trace import AtenGraph
from numatp.runtime.executor import SocketProgram
from numatp.runtime.segments import Collective, Segment

__all__ = ["ContractError", "check", "global_shapes", "same_collectives", "one_reduction_per_block",
           "shard_shapes", "local_reads"]

_ALL_REDUCE, _ALL_GATHER = COLLECTIVES


class Programs(Protocol):
    """What the checks read of the pipeline's result (:class:`numatp.plan.pipeline.Programs`)."""

    plan: Plan
    local: list[LocalProgram]
    args: list[list[Any]]
    programs: list[SocketProgram]
    stand_in: Callable[[Any], Any]


class ContractError(AssertionError):
    """A socket program breaks a contract between the pipeline's steps (a bug of a step, not of the model)."""


def _socket_all_reduce() -> Any:
    ops = getattr(torch.ops, "numatp", None)
    op = getattr(ops, "socket_all_reduce", None) if ops is not None else None
    return op.default if op is not None else None


def global_shapes(ag: AtenGraph) -> list[tuple[int, ...] | None]:
    """The caller's shape of each of the graph's inputs (what a binding's ``index`` names)."""
    return [tuple(p.meta["val"].shape) if isinstance(p.meta.get("val"), torch.Tensor) else None
            for p in ag.gm.graph.nodes if p.op == "placeholder"]


def _signature(n: torch.fx.Node, kind: str, tag: Any, val: Any) -> tuple:
    shape = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None
    return (kind, tag, shape)


def _graph_collectives(gm: torch.fx.GraphModule) -> list[tuple]:
    inline = _socket_all_reduce()
    out = []
    for n in gm.graph.nodes:
        if n.target is _ALL_REDUCE:
            out.append(_signature(n, "all_reduce", n.args[1], n.args[0].meta.get("val")))
        elif inline is not None and n.target is inline:
            out.append(_signature(n, "all_reduce", None, n.args[0].meta.get("val")))
        elif n.target is _ALL_GATHER:
            out.append(_signature(n, "all_gather", n.args[3], n.meta.get("val")))
    return out


def _step_collectives(steps: Sequence[Any]) -> list[tuple]:
    out: list[tuple] = []
    for s in steps:
        if isinstance(s, Segment):
            out += _graph_collectives(s.gm)
        elif isinstance(s, Collective):
            out.append((s.kind, s.tag, (tuple(s.full[0]), s.full[1]) if s.full is not None else None))
    return out


def _collectives(done: Programs, stepped: bool) -> list[list[tuple]]:
    if stepped:   # an all-reduce step records no shape: its kind and tag are compared
        return [_step_collectives(p.steps) for p in done.programs]
    return [_graph_collectives(p.gm) for p in done.local]


def same_collectives(done: Programs, *, stepped: bool = False) -> None:
    """Every socket's program performs the same collectives in the same order."""
    seqs = _collectives(done, stepped)
    for rank, seq in enumerate(seqs[1:], 1):
        if seq != seqs[0]:
            at = next((i for i, (a, b) in enumerate(zip(seqs[0], seq)) if a != b), min(len(seq), len(seqs[0])))
            raise ContractError(
                f"socket {rank} performs {len(seq)} collectives and socket 0 {len(seqs[0])}, first differing at "
                f"#{at}: {seq[at] if at < len(seq) else 'none'} against "
                f"{seqs[0][at] if at < len(seqs[0]) else 'none'}; "
                "every socket must perform the same collectives in the same order")


def one_reduction_per_block(done: Programs, *, stepped: bool = False, lowered: bool = False,
                            sockets: int = 2) -> None:
    """One all-reduce per sharded block that ends in a reduction, one all-gather per sharded output."""
    if lowered and sockets == 1:
        return   # the reductions inside segments and the gathers are gone (a sum over one socket)
    blocks = [b for b in done.plan.blocks if b.sharded and b.kind != "lm_head"]
    want = {"all_reduce": done.plan.reductions, "all_gather": done.plan.gathers}
    for rank, seq in enumerate(_collectives(done, stepped)):
        got = {k: sum(c[0] == k for c in seq) for k in want}
        if got != want:
            raise ContractError(
                f"socket {rank}: {got['all_reduce']} all-reduces and {got['all_gather']} all-gathers, where the "
                f"plan has {want['all_reduce']} reductions ({len(blocks)} sharded blocks end in one) and "
                f"{want['all_gather']} gathered outputs; each sharded block is reduced exactly once")


def shard_shapes(done: Programs, shapes: Sequence[tuple[int, ...] | None]) -> None:
    """Every argument (and placeholder, where it has a shape) is as large as its binding says."""
    for p, args in zip(done.local, done.args):
        placeholders = [n for n in p.gm.graph.nodes if n.op == "placeholder"]
        for i, bd in enumerate(p.bindings):
            want = _bound_shape(bd, shapes, p.rank)
            if want is None:
                continue
            arg = done.stand_in(args[i]) if i < len(args) else None
            val = placeholders[i].meta.get("val") if i < len(placeholders) else None
            for what, t in (("argument", arg), ("placeholder", val)):
                if isinstance(t, torch.Tensor) and tuple(t.shape) != want:
                    raise ContractError(
                        f"socket {p.rank}: {what} {i} ({placeholders[i].name}) has shape {tuple(t.shape)}, "
                        f"where its binding {bd} of the caller's {shapes[bd.index]} gives {want}")


def _bound_shape(bd: Binding, shapes: Sequence[tuple[int, ...] | None], rank: int) -> tuple[int, ...] | None:
    full = shapes[bd.index] if bd.index < len(shapes) else None
    if full is None:
        return None
    if isinstance(bd.placement, (Colwise, Rowwise)):
        local = list(full)
        local[bd.placement.dim] = len(bd.placement.splits[rank])
        return tuple(local)
    return tuple(full)


def local_reads(done: Programs, *, stepped: bool = False) -> None:
    """No node reads a value another socket holds."""
    inline = _socket_all_reduce()
    for p in done.local:
        for n in p.gm.graph.nodes:
            if n.target is _ALL_REDUCE or (inline is not None and n.target is inline):
                partial = n.args[0]
                others = [u.name for u in partial.users if u is not n]
                if others:
                    raise ContractError(
                        f"socket {p.rank}: {others} read {partial.name}, a partial sum whose other parts the "
                        f"other sockets hold; only its reduction {n.name} may read it")
    if not stepped:
        return
    for prog in done.programs:
        known = set(prog.placeholders)
        for i, s in enumerate(prog.steps):
            foreign = [k for k in s.inputs if k not in known]
            if foreign:
                raise ContractError(
                    f"socket {prog.rank}: step {i} ({type(s).__name__}) reads {foreign}, which this socket's "
                    "program has not made: a value only another socket holds, or none does")
            known.update(s.outputs if isinstance(s, Segment) else [s.dst])
        foreign = [o for o in prog.outputs if isinstance(o, str) and o not in known]
        if foreign:
            raise ContractError(f"socket {prog.rank}: the program returns {foreign}, which it has not made")


def check(step: str, done: Programs, shapes: Sequence[tuple[int, ...] | None], *, sockets: int) -> None:
    """The four contracts after pipeline step ``step``; raises :class:`ContractError` naming the step."""
    stepped = step in ("split", "compile")
    lowered = step not in ("localize", "choose_gemms", "fuse_attention")
    try:
        same_collectives(done, stepped=stepped)
        one_reduction_per_block(done, stepped=stepped, lowered=lowered, sockets=sockets)
        shard_shapes(done, shapes)
        local_reads(done, stepped=stepped)
    except ContractError as e:
        raise ContractError(f"after pipeline step {step!r}: {e}") from e
