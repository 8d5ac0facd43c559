"""The sharding rules, a table keyed by op (like DTensor's op strategies): given the shard an op's input
carries, the layout of its output, or :class:`~numatp.plan.layout.Unsupported`.

Each rule is a small function of :class:`RuleArgs`. An op not in :data:`RULES` is carried when it is
elementwise (its inputs' common shard) and refused otherwise (``no_rule``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from numatp.plan.gqa import ATTENTION_OPS, attention_rule
from numatp.plan.layout import Layout, NodeInfo, Shard, Unsupported, shape_of, where
from numatp.plan.roles import IDENTITY_OPS, VIEW_OPS, constant_index, slice_bounds
from numatp.plan.views import ViewError, map_shard_through_view

__all__ = ["RULES", "Rule", "RuleArgs", "layout_of"]

aten = torch.ops.aten
_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
               aten.var_mean.correction, aten.var.correction, aten.std.correction, aten.logsumexp.default,
               # the math attention's check for fully masked rows
               aten.any.dim, aten.any.dims, aten.all.dim}
_SOFTMAX = {aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default}


def _align(layouts: list[tuple[Any, Any]], node: torch.fx.Node, info: NodeInfo) -> Shard:
    """Common shard of an elementwise op's inputs, aligned to its output; full replicated inputs get cut."""
    out_rank = len(shape_of(node) or ())
    shard: Shard | None = None
    for _key, arg in layouts:
        lay = arg.meta["numatp"].layout
        if isinstance(lay, Shard):
            d = lay.dim + out_rank - len(shape_of(arg))
            cand = Shard(d, lay.sets, lay.block)
            if shard is not None and (shard.dim, shard.sets) != (cand.dim, cand.sets):
                raise Unsupported(lay.block, f"{where(node)} combines values sharded differently "
                                             f"(dim {shard.dim} vs {cand.dim})")
            shard = shard or cand
    assert shard is not None
    for key, arg in layouts:
        if arg.meta["numatp"].layout is None:
            shp = shape_of(arg) or ()
            d = shard.dim - (out_rank - len(shp))
            if d >= 0 and shp[d] != 1:
                info.slice_inputs[key] = Shard(d, shard.sets, shard.block)
    return shard


def _inputs(node: torch.fx.Node) -> list[tuple[Any, torch.fx.Node]]:
    out: list[tuple[Any, torch.fx.Node]] = []
    for i, a in enumerate(node.args):
        if isinstance(a, torch.fx.Node) and shape_of(a) is not None:
            out.append((i, a))
        elif isinstance(a, (list, tuple)):
            out += [((i, j), x) for j, x in enumerate(a) if isinstance(x, torch.fx.Node) and shape_of(x) is not None]
    out += [(k, a) for k, a in node.kwargs.items() if isinstance(a, torch.fx.Node) and shape_of(a) is not None]
    return out


@dataclass(frozen=True)
class RuleArgs:
    """What a sharding rule sees of one node: the node, its decision to fill in, its first argument
    ``x``, the shard ``lay`` it carries (``x``'s, or the first sharded input's), the block that shard
    belongs to, the tensor inputs as ``(argument key, node)`` and the blocks already split by K/V groups."""

    node: torch.fx.Node
    info: NodeInfo
    x: Any
    lay: Shard | None   # None where ``x`` is replicated and another input is sharded (``_align`` decides)
    block: int
    inputs: list[tuple[Any, torch.fx.Node]]
    grouped: frozenset[int]

    def fail(self, what: str, kind: str = "layout") -> Unsupported:
        """The conflict of this node, in words that follow its op and name."""
        return Unsupported(self.block, f"{where(self.node)}{what}", kind, where(self.node))


Rule = Callable[[RuleArgs], Layout]


def _view(a: RuleArgs) -> Layout:
    src, dst = shape_of(a.x), shape_of(a.node)
    try:
        if len(a.lay.sets) > 1 and all(len(s) == src[a.lay.dim] for s in a.lay.sets):
            # every socket holds all of it (one K/V head each sharing socket computes): replicated
            return None
        d, sets = map_shard_through_view(src, dst, a.lay.dim, a.lay.sets)
    except ViewError as e:
        raise a.fail(f": {e}") from e
    a.info.local_shape = True
    return Shard(d, sets, a.block)


def _expand(a: RuleArgs) -> Layout:
    src, dst = shape_of(a.x), shape_of(a.node)
    if src[a.lay.dim] != dst[a.lay.dim + len(dst) - len(src)]:
        raise a.fail(" broadcasts the sharded dimension")
    a.info.local_shape = True
    return Shard(a.lay.dim + len(dst) - len(src), a.lay.sets, a.block)


def _identity(a: RuleArgs) -> Layout:
    return a.lay


def _permute(a: RuleArgs) -> Layout:
    return Shard(list(a.node.args[1]).index(a.lay.dim), a.lay.sets, a.block)


def _transpose(a: RuleArgs) -> Layout:
    rank = len(shape_of(a.x))
    i, j = (0, 1) if a.node.target is aten.t.default else (a.node.args[1] % rank, a.node.args[2] % rank)
    d = j if a.lay.dim == i else i if a.lay.dim == j else a.lay.dim
    return Shard(d, a.lay.sets, a.block)


def _unsqueeze(a: RuleArgs) -> Layout:
    u = a.node.args[1] % (len(shape_of(a.x)) + 1)
    return Shard(a.lay.dim + (u <= a.lay.dim), a.lay.sets, a.block)


def _squeeze(a: RuleArgs) -> Layout:
    dims = a.node.args[1] if isinstance(a.node.args[1], (list, tuple)) else [a.node.args[1]]
    removed = [d % len(shape_of(a.x)) for d in dims if shape_of(a.x)[d] == 1]
    return Shard(a.lay.dim - sum(d < a.lay.dim for d in removed), a.lay.sets, a.block)


def _split(a: RuleArgs) -> Layout:
    node, lay = a.node, a.lay
    dim = (node.args[2] if len(node.args) > 2 else 0) % len(shape_of(a.x))
    if dim != lay.dim:
        return tuple(lay for _ in node.meta["val"])
    a.info.split_dim = dim
    pieces, lo = [], 0
    for v in node.meta["val"]:
        hi = lo + v.shape[dim]
        sets = tuple(s.clip(lo, hi) for s in lay.sets)
        if any(len(s) == 0 for s in sets):
            raise a.fail(" leaves a socket without any of a split piece")
        pieces.append(Shard(dim, sets, a.block))
        lo = hi
    return tuple(pieces)


def _slice(a: RuleArgs) -> Layout:
    node, lay = a.node, a.lay
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(shape_of(a.x))
    if dim != lay.dim:
        return lay
    start, end = slice_bounds(node, shape_of(a.x)[dim])
    if (node.args[4] if len(node.args) > 4 else 1) != 1:
        raise a.fail(" slices the sharded dimension with a step")
    sets = tuple(s.clip(start, end) for s in lay.sets)
    if any(len(s) == 0 for s in sets):
        raise a.fail(" leaves a socket with nothing of the sharded dimension")
    a.info.slice_dim = dim
    return Shard(dim, sets, a.block)


def _index(a: RuleArgs) -> Layout:
    lay = a.lay
    if not (isinstance(a.x, torch.fx.Node) and a.x.meta["numatp"].layout is lay):
        return _pointwise(a)   # the indices are sharded, not the tensor: today's fallback decides
    at = constant_index(a.node, lay.dim)
    if at is None:
        raise a.fail(" indexes a sharded tensor other than at one constant position of the sharded dimension")
    at %= shape_of(a.x)[lay.dim]
    missing = [r for r, s in enumerate(lay.sets) if at not in s.indices()]
    if missing:
        raise a.fail(f" reads position {at} of the sharded dimension, which socket(s) {missing} do not hold")
    a.info.index_at = (lay.dim, at)
    # every socket holds that position, computed from the same weight rows: the result is replicated
    return None


def _select(a: RuleArgs) -> Layout:
    dim = a.node.args[1] % len(shape_of(a.x))
    if dim == a.lay.dim:
        raise a.fail(" selects one index of the sharded dimension")
    # e.g. Bloom's per-head interleaved q|k|v: (B, S, heads, 3, hd) -> select(3, i) keeps heads sharded
    return Shard(a.lay.dim - (dim < a.lay.dim), a.lay.sets, a.block)


def _cat(a: RuleArgs) -> Layout:
    dim = (a.node.args[1] if len(a.node.args) > 1 else 0) % len(shape_of(a.node))
    shard = _align(a.inputs, a.node, a.info)
    if shard.dim == dim:
        raise a.fail(" concatenates along the sharded dimension")
    return shard


def _reduction(a: RuleArgs) -> Layout:
    node, lay = a.node, a.lay
    rank = len(shape_of(a.x))
    dims = node.args[1] if len(node.args) > 1 else None
    dims = list(range(rank)) if dims is None else [dims] if isinstance(dims, int) else list(dims)
    dims = [d % rank for d in dims]
    if lay.dim in dims:
        raise a.fail(f" reduces over the sharded dimension {lay.dim} (e.g. a norm over the features): the "
                     "block is replicated", "reduction")
    keep = node.target in _SOFTMAX or node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 and
                                                      isinstance(node.args[2], bool) else False)
    d = lay.dim if keep else lay.dim - sum(x < lay.dim for x in dims)
    out = Shard(d, lay.sets, a.block)
    return tuple(out for _ in node.meta["val"]) if isinstance(node.meta["val"], (tuple, list)) else out


def _batched_matmul(a: RuleArgs) -> Layout:
    # bmm: (heads * B, S, D) products per head; baddbmm: Bloom's ALiBi bias + q @ k^T
    shard = _align(a.inputs, a.node, a.info)
    if shard.dim != 0:
        raise a.fail(" multiplies along the sharded dimension")
    return shard


def _attention_rule(a: RuleArgs) -> Layout:
    return attention_rule(a.node, a.info, a.block, a.grouped)


def _state_write_rule(a: RuleArgs) -> Layout:
    return _state_write(a.node, a.block)


def _pointwise(a: RuleArgs) -> Layout:
    """The rule of an op without its own: an elementwise op carries the common shard of its inputs,
    anything else cannot take a sharded value."""
    t = a.node.target
    if hasattr(t, "tags") and torch.Tag.pointwise in t.tags or t is aten.where.self:
        return _align(a.inputs, a.node, a.info)
    raise a.fail(" has no sharding rule", "no_rule")


RULES: dict[Any, Rule] = {
    **{t: _view for t in VIEW_OPS},
    aten.expand.default: _expand,
    **{t: _identity for t in IDENTITY_OPS},
    aten.permute.default: _permute,
    aten.t.default: _transpose,
    aten.transpose.int: _transpose,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _squeeze,
    aten.squeeze.dims: _squeeze,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.slice.Tensor: _slice,
    aten.index.Tensor: _index,
    aten.select.int: _select,
    aten.cat.default: _cat,
    **{t: _reduction for t in _REDUCTIONS | _SOFTMAX},
    **{t: _attention_rule for t in ATTENTION_OPS},
    aten.index_put.default: _state_write_rule,
    aten.copy_.default: _state_write_rule,
    aten.bmm.default: _batched_matmul,
    aten.baddbmm.default: _batched_matmul,
}
"""The sharding rule of each op, like DTensor's op strategies: given the shard an op's input carries,
the shard of its output (None: replicated), or :class:`Unsupported`. An op not listed falls back to
:func:`_pointwise`."""


def layout_of(node: torch.fx.Node, info: NodeInfo, grouped: frozenset[int]) -> Layout:
    """The layout of ``node``'s value from its inputs' (already annotated): an item of a multi-output
    op takes its piece, an op without a sharded input is replicated, any other op goes to its rule."""
    if node.target is operator.getitem:
        src = node.args[0].meta["numatp"].layout
        return src[node.args[1]] if isinstance(src, tuple) else src
    ins = _inputs(node)
    sharded = [(k, a) for k, a in ins if isinstance(a.meta["numatp"].layout, Shard)]
    if not sharded:
        return None
    x = node.args[0]
    lay = x.meta["numatp"].layout if isinstance(x, torch.fx.Node) else sharded[0][1].meta["numatp"].layout
    block = sharded[0][1].meta["numatp"].layout.block
    args = RuleArgs(node, info, x, lay, block, ins, grouped)
    return RULES.get(node.target, _pointwise)(args)


def _state_write(node: torch.fx.Node, block: int) -> Layout:
    """A write into an input the graph mutates (a static KV cache): ``index_put(state, [.., positions],
    new)`` with ``new`` sharded along a dimension the positions do not index, or its ``copy_`` back.
    The state takes the shard of what is written into it: each socket keeps its own heads' keys and
    values and never sees the others'."""
    state, new = node.args[0], node.args[2] if node.target is aten.index_put.default else node.args[1]
    lay = new.meta["numatp"].layout if isinstance(new, torch.fx.Node) else None
    if not isinstance(lay, Shard):
        raise Unsupported(block, f"{where(node)} writes into a sharded value")
    if node.target is aten.index_put.default:
        indices = node.args[1]
        if len(shape_of(new)) != len(shape_of(state)) or (lay.dim < len(indices) and indices[lay.dim] is not None):
            raise Unsupported(block, f"{where(node)} writes along the sharded dimension")
        if node.args[3] if len(node.args) > 3 else False:
            raise Unsupported(block, f"{where(node)} accumulates into its target")
    held = state.meta["numatp"].layout
    if held is None and state.op == "placeholder" and state.meta["numatp"].state:
        before = _seen(node)
        if any(u is not node and u in before for u in state.users):
            raise Unsupported(block, f"{where(node)} writes heads into {state.name}, which is read whole "
                                     "before")
        state.meta["numatp"].layout = held = lay
    if not isinstance(held, Shard) or (held.dim, held.sets) != (lay.dim, lay.sets):
        raise Unsupported(block, f"{where(node)} writes a shard into {state.name}, which is "
                                 f"{'replicated' if held is None else 'split differently'}")
    return held


def _seen(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The nodes before ``node`` in its graph."""
    out: set[torch.fx.Node] = set()
    for n in node.graph.nodes:
        if n is node:
            return out
        out.add(n)
    return out
