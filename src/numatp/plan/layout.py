"""The layout of one value over the sockets, the pass's record of each node, and a rule's refusal.

A value is replicated (``None``: the same full tensor on every socket), a :class:`Shard` (socket r holds
the indices ``sets[r]`` of dimension ``dim``), or a tuple of layouts for an op with several outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from numatp.plan.schema import IndexSet

__all__ = ["GroupSplit", "Layout", "NodeInfo", "Shard", "Unsupported", "shape_of", "where"]


@dataclass(frozen=True)
class Shard:
    dim: int
    sets: tuple[IndexSet, ...]
    block: int


Layout = Shard | None | tuple


@dataclass
class NodeInfo:
    """What the pass decided for one node (``node.meta["numatp"]``)."""

    layout: Any = None
    role: str | None = None          # "column", "row", "lm_head" for weight matmuls; "vocab" for a lookup
    block: int | None = None
    local_shape: bool = False        # replace the shape argument with the socket-local output shape
    split_dim: int | None = None     # split along the shard dim: rewrite to local split_with_sizes
    slice_dim: int | None = None     # slice along the shard dim: rewrite start/end to local positions
    # inputs to cut: socket r keeps positions ``sets[r]`` of ``dim`` of its own value (for a replicated
    # input, the global indices; for a sharded one, positions within the socket's shard)
    slice_inputs: dict[Any, Shard] = field(default_factory=dict)
    row_input: Shard | None = None   # a row matmul's sharded input: its weight rows are sliced the same way
    vocab_sets: tuple[IndexSet, ...] | None = None   # a vocabulary-parallel lookup: each socket's table rows
    index_at: tuple[int, int] | None = None   # index of one position along the shard dim: (dim, global position)
    state: bool = False              # an input the graph writes in place; its layout is what is written


class Unsupported(Exception):
    """Raised by a sharding rule: ``block``'s shard cannot go through this op. ``kind`` is the
    :data:`~numatp.plan.schema.ReasonKind` it becomes: "reduction", "no_rule" or "layout"."""

    def __init__(self, block: int, reason: str, kind: str = "layout", op: str = ""):
        super().__init__(reason)
        self.block = block
        self.reason = reason
        self.kind = kind
        self.op = op


class GroupSplit(Unsupported):
    """Grouped-query attention whose K/V heads are not split along the query heads' groups (replicated K/V
    projections, or a socket whose query heads span K/V groups unevenly): the pass retries the block with
    group-aware column sets (``numatp.plan.tp_pass``)."""

    def __init__(self, block: int, reason: str, q_heads: int, kv_heads: int):
        super().__init__(block, reason)
        self.q_heads = q_heads
        self.kv_heads = kv_heads


def shape_of(n: Any) -> tuple[int, ...] | None:
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def where(node: torch.fx.Node) -> str:
    return f"{node.target} ({node.name})"
