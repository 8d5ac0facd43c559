"""Sharding propagation: the layout of every value of the graph, given the roles of the weight matmuls.

Column matmuls create shards, row matmuls consume them and produce partial sums that are all-reduced at
once, before the bias and before any post-norm. Between them, each op either carries the shard (pointwise
ops, views, per-head attention, reductions over other dimensions) or cannot, and then propagation stops
with a :class:`Conflict` naming the block, which the pass relaxes (:mod:`numatp.plan.tp_pass`). The
per-op rules are a table (:data:`numatp.plan.rules.RULES`); layouts are :mod:`numatp.plan.layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from numatp.plan.gqa import ATTENTION_OPS, group_head_sets, kv_head_sets
from numatp.plan.layout import GroupSplit, NodeInfo, Shard, Unsupported, where
from numatp.plan.rules import RULES, layout_of
from numatp.plan.schema import IndexSet

__all__ = ["Shard", "NodeInfo", "Unsupported", "GroupSplit", "Conflict", "propagate", "RULES", "ATTENTION_OPS",
           "kv_head_sets", "group_head_sets"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Conflict:
    """Why propagation stopped: ``block`` cannot be sharded as asked. ``kind`` as in :class:`Unsupported`;
    ``groups`` = (query heads, K/V heads) where splitting the block along its K/V groups may help."""

    block: int
    kind: str
    reason: str
    op: str = ""
    groups: tuple[int, int] | None = None


def propagate(gm: torch.fx.GraphModule, column_sets: dict[torch.fx.Node, tuple[int, tuple[IndexSet, ...]]],
              rows: dict[torch.fx.Node, int], lm_heads: set[torch.fx.Node], grouped: set[int] = frozenset(),
              states: set[torch.fx.Node] = frozenset()) -> Conflict | None:
    """Annotate every node with its :class:`NodeInfo`, in program order; the first :class:`Conflict`, if any.

    ``column_sets`` maps a column (or LM-head) matmul to ``(block, per-socket output sets)``; ``rows`` maps a
    row matmul to its block; ``grouped`` holds the blocks whose column sets already follow their K/V
    groups. A conflict names the block that cannot be sharded (with ``groups`` where group-aware sets may
    help); the annotations after it are unfinished, for the caller to plan again. ``states`` are the
    inputs the graph writes in place: each takes the layout of the first shard written into it
    (the state-write rule of :mod:`numatp.plan.rules`).
    """
    try:
        for node in gm.graph.nodes:
            info = NodeInfo(state=node in states)
            node.meta["numatp"] = info
            if node.op == "call_function":
                _annotate(node, info, column_sets, rows, lm_heads, frozenset(grouped))
    except GroupSplit as e:
        return Conflict(e.block, e.kind, e.reason, e.op, (e.q_heads, e.kv_heads))
    except Unsupported as e:
        return Conflict(e.block, e.kind, e.reason, e.op)
    return None


def _annotate(node: torch.fx.Node, info: NodeInfo, column_sets: dict, rows: dict, lm_heads: set,
              grouped: frozenset[int]) -> None:
    """One node's decision: a column or row matmul by its role, any other op by its rule."""
    if node in column_sets:
        block, sets = column_sets[node]
        x = node.args[1] if node.target is aten.addmm.default else node.args[0]
        if x.meta["numatp"].layout is not None:
            raise Unsupported(block, f"{where(node)}: the input of a column projection is itself sharded")
        info.role, info.block = ("lm_head" if node in lm_heads else "column"), block
        info.layout = Shard(1, sets, block)
    elif node in rows:
        block = rows[node]
        x = node.args[1] if node.target is aten.addmm.default else node.args[0]
        lx = x.meta["numatp"].layout
        if not isinstance(lx, Shard) or lx.dim != 1:
            raise Unsupported(block, f"{where(node)}: the input of the output projection is not split "
                                     "along its features")
        info.role, info.block = "row", block
        info.layout = None
        info.row_input = lx
    else:
        info.layout = layout_of(node, info, grouped)
