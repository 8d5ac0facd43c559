"""Sharding propagation: the layout of every value of the graph, given the roles of the weight matmuls.

A value is replicated (``None``: the same full tensor on every socket) or a :class:`Shard` (socket r
holds the indices ``sets[r]`` of dimension ``dim``). Column matmuls create shards, row matmuls consume
them and produce partial sums that are all-reduced at once, before the bias and before any post-norm.
Between them, each op either carries the shard (pointwise ops, views, per-head attention, reductions over
other dimensions) or raises :class:`Unsupported`, which makes the whole block run replicated.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from numatp.plan.roles import IDENTITY_OPS, VIEW_OPS, constant_index, slice_bounds
from numatp.plan.schema import IndexSet, even_split
from numatp.plan.views import ViewError, map_shard_through_view

__all__ = ["Shard", "NodeInfo", "Unsupported", "GroupSplit", "propagate", "ATTENTION_OPS", "kv_head_sets",
           "group_head_sets"]

aten = torch.ops.aten


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
    def __init__(self, block: int, reason: str):
        super().__init__(reason)
        self.block = block
        self.reason = reason


class GroupSplit(Unsupported):
    """Grouped-query attention whose K/V heads are not split along the query heads' groups (replicated K/V
    projections, or a socket whose query heads span K/V groups unevenly): the pass retries the block with
    group-aware column sets (``numatp.plan.tp_pass``)."""

    def __init__(self, block: int, reason: str, q_heads: int, kv_heads: int):
        super().__init__(block, reason)
        self.q_heads = q_heads
        self.kv_heads = kv_heads


ATTENTION_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten.scaled_dot_product_attention.default,
}
# attention ops that take fewer K/V heads than query heads themselves (CPU flash attention does; the
# composite SDPA does with enable_gqa=True): query head h reads K/V head h // (query heads / K/V heads)
_NATIVE_GQA = {aten._scaled_dot_product_flash_attention_for_cpu.default}
_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
               aten.var_mean.correction, aten.var.correction, aten.std.correction, aten.logsumexp.default,
               # the math attention's check for fully masked rows
               aten.any.dim, aten.any.dims, aten.all.dim}
_SOFTMAX = {aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default}


def _shape(n: Any) -> tuple[int, ...] | None:
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _where(node: torch.fx.Node) -> str:
    return f"{node.target} ({node.name})"


def _align(layouts: list[tuple[Any, Any]], node: torch.fx.Node, info: NodeInfo) -> Shard:
    """Common shard of an elementwise op's inputs, aligned to its output; full replicated inputs get cut."""
    out_rank = len(_shape(node) or ())
    shard: Shard | None = None
    for _key, arg in layouts:
        lay = arg.meta["numatp"].layout
        if isinstance(lay, Shard):
            d = lay.dim + out_rank - len(_shape(arg))
            cand = Shard(d, lay.sets, lay.block)
            if shard is not None and (shard.dim, shard.sets) != (cand.dim, cand.sets):
                raise Unsupported(lay.block, f"{_where(node)} combines values sharded differently "
                                             f"(dim {shard.dim} vs {cand.dim})")
            shard = shard or cand
    assert shard is not None
    for key, arg in layouts:
        if arg.meta["numatp"].layout is None:
            shp = _shape(arg) or ()
            d = shard.dim - (out_rank - len(shp))
            if d >= 0 and shp[d] != 1:
                info.slice_inputs[key] = Shard(d, shard.sets, shard.block)
    return shard


def _inputs(node: torch.fx.Node) -> list[tuple[Any, torch.fx.Node]]:
    out: list[tuple[Any, torch.fx.Node]] = []
    for i, a in enumerate(node.args):
        if isinstance(a, torch.fx.Node) and _shape(a) is not None:
            out.append((i, a))
        elif isinstance(a, (list, tuple)):
            out += [((i, j), x) for j, x in enumerate(a) if isinstance(x, torch.fx.Node) and _shape(x) is not None]
    out += [(k, a) for k, a in node.kwargs.items() if isinstance(a, torch.fx.Node) and _shape(a) is not None]
    return out


def _rule(node: torch.fx.Node, info: NodeInfo, grouped: set[int]) -> Layout:
    t = node.target
    if t is __import__("operator").getitem:
        src = node.args[0].meta["numatp"].layout
        return src[node.args[1]] if isinstance(src, tuple) else src
    ins = _inputs(node)
    sharded = [(k, a) for k, a in ins if isinstance(a.meta["numatp"].layout, Shard)]
    if not sharded:
        return None
    x = node.args[0]
    lay: Shard = x.meta["numatp"].layout if isinstance(x, torch.fx.Node) else sharded[0][1].meta["numatp"].layout
    block = sharded[0][1].meta["numatp"].layout.block
    if t in VIEW_OPS or t is aten.expand.default:
        src, dst = _shape(x), _shape(node)
        if t is aten.expand.default:
            if src[lay.dim] != dst[lay.dim + len(dst) - len(src)]:
                raise Unsupported(block, f"{_where(node)} broadcasts the sharded dimension")
            info.local_shape = True
            return Shard(lay.dim + len(dst) - len(src), lay.sets, block)
        try:
            if len(lay.sets) > 1 and all(len(s) == src[lay.dim] for s in lay.sets):
                # every socket holds all of it (one K/V head each sharing socket computes): replicated
                return None
            d, sets = map_shard_through_view(src, dst, lay.dim, lay.sets)
        except ViewError as e:
            raise Unsupported(block, f"{_where(node)}: {e}") from e
        info.local_shape = True
        return Shard(d, sets, block)
    if t in IDENTITY_OPS:
        return lay
    if t is aten.permute.default:
        return Shard(list(node.args[1]).index(lay.dim), lay.sets, block)
    if t is aten.t.default or t is aten.transpose.int:
        a, b = (0, 1) if t is aten.t.default else (node.args[1] % len(_shape(x)), node.args[2] % len(_shape(x)))
        d = b if lay.dim == a else a if lay.dim == b else lay.dim
        return Shard(d, lay.sets, block)
    if t is aten.unsqueeze.default:
        u = node.args[1] % (len(_shape(x)) + 1)
        return Shard(lay.dim + (u <= lay.dim), lay.sets, block)
    if t in (aten.squeeze.dim, aten.squeeze.dims):
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        removed = [d % len(_shape(x)) for d in dims if _shape(x)[d] == 1]
        return Shard(lay.dim - sum(d < lay.dim for d in removed), lay.sets, block)
    if t in (aten.split.Tensor, aten.split_with_sizes.default):
        dim = (node.args[2] if len(node.args) > 2 else 0) % len(_shape(x))
        if dim != lay.dim:
            return tuple(lay for _ in node.meta["val"])
        info.split_dim = dim
        pieces, lo = [], 0
        for v in node.meta["val"]:
            hi = lo + v.shape[dim]
            sets = tuple(s.clip(lo, hi) for s in lay.sets)
            if any(len(s) == 0 for s in sets):
                raise Unsupported(block, f"{_where(node)} leaves a socket without any of a split piece")
            pieces.append(Shard(dim, sets, block))
            lo = hi
        return tuple(pieces)
    if t is aten.slice.Tensor:
        dim = (node.args[1] if len(node.args) > 1 else 0) % len(_shape(x))
        if dim != lay.dim:
            return lay
        start, end = slice_bounds(node, _shape(x)[dim])
        if (node.args[4] if len(node.args) > 4 else 1) != 1:
            raise Unsupported(block, f"{_where(node)} slices the sharded dimension with a step")
        sets = tuple(s.clip(start, end) for s in lay.sets)
        if any(len(s) == 0 for s in sets):
            raise Unsupported(block, f"{_where(node)} leaves a socket with nothing of the sharded dimension")
        info.slice_dim = dim
        return Shard(dim, sets, block)
    if t is aten.index.Tensor and isinstance(x, torch.fx.Node) and x.meta["numatp"].layout is lay:
        at = constant_index(node, lay.dim)
        if at is None:
            raise Unsupported(block, f"{_where(node)} indexes a sharded tensor other than at one constant "
                                     "position of the sharded dimension")
        at %= _shape(x)[lay.dim]
        missing = [r for r, s in enumerate(lay.sets) if at not in s.indices()]
        if missing:
            raise Unsupported(block, f"{_where(node)} reads position {at} of the sharded dimension, which "
                                     f"socket(s) {missing} do not hold")
        info.index_at = (lay.dim, at)
        # every socket holds that position, computed from the same weight rows: the result is replicated
        return None
    if t is aten.select.int:
        dim = node.args[1] % len(_shape(x))
        if dim == lay.dim:
            raise Unsupported(block, f"{_where(node)} selects one index of the sharded dimension")
        # e.g. Bloom's per-head interleaved q|k|v: (B, S, heads, 3, hd) -> select(3, i) keeps heads sharded
        return Shard(lay.dim - (dim < lay.dim), lay.sets, block)
    if t is aten.cat.default:
        dim = (node.args[1] if len(node.args) > 1 else 0) % len(_shape(node))
        shard = _align(ins, node, info)
        if shard.dim == dim:
            raise Unsupported(block, f"{_where(node)} concatenates along the sharded dimension")
        return shard
    if t in _REDUCTIONS or t in _SOFTMAX:
        rank = len(_shape(x))
        dims = node.args[1] if len(node.args) > 1 else None
        dims = list(range(rank)) if dims is None else [dims] if isinstance(dims, int) else list(dims)
        dims = [d % rank for d in dims]
        if lay.dim in dims:
            raise Unsupported(block, f"{_where(node)} reduces over the sharded dimension {lay.dim} (e.g. a "
                                     "norm over the features): the block is replicated")
        keep = t in _SOFTMAX or node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 and
                                                 isinstance(node.args[2], bool) else False)
        d = lay.dim if keep else lay.dim - sum(x < lay.dim for x in dims)
        out = Shard(d, lay.sets, block)
        return tuple(out for _ in node.meta["val"]) if isinstance(node.meta["val"], (tuple, list)) else out
    if t in ATTENTION_OPS:
        return _attention(node, info, block, grouped)
    if t in (aten.index_put.default, aten.copy_.default):
        return _state_write(node, block)
    if t in (aten.bmm.default, aten.baddbmm.default):   # baddbmm: Bloom's ALiBi bias + q @ k^T
        shard = _align(ins, node, info)
        if shard.dim != 0:
            raise Unsupported(block, f"{_where(node)} multiplies along the sharded dimension")
        return shard
    if hasattr(t, "tags") and torch.Tag.pointwise in t.tags or t is aten.where.self:
        return _align(ins, node, info)
    raise Unsupported(block, f"{_where(node)} has no sharding rule")


def _state_write(node: torch.fx.Node, block: int) -> Layout:
    """A write into an input the graph mutates (a static KV cache): ``index_put(state, [.., positions],
    new)`` with ``new`` sharded along a dimension the positions do not index, or its ``copy_`` back.
    The state takes the shard of what is written into it: each socket keeps its own heads' keys and
    values and never sees the others'."""
    state, new = node.args[0], node.args[2] if node.target is aten.index_put.default else node.args[1]
    lay = new.meta["numatp"].layout if isinstance(new, torch.fx.Node) else None
    if not isinstance(lay, Shard):
        raise Unsupported(block, f"{_where(node)} writes into a sharded value")
    if node.target is aten.index_put.default:
        indices = node.args[1]
        if len(_shape(new)) != len(_shape(state)) or (lay.dim < len(indices) and indices[lay.dim] is not None):
            raise Unsupported(block, f"{_where(node)} writes along the sharded dimension")
        if node.args[3] if len(node.args) > 3 else False:
            raise Unsupported(block, f"{_where(node)} accumulates into its target")
    held = state.meta["numatp"].layout
    if held is None and state.op == "placeholder" and state.meta["numatp"].state:
        before = _seen(node)
        if any(u is not node and u in before for u in state.users):
            raise Unsupported(block, f"{_where(node)} writes heads into {state.name}, which is read whole "
                                     "before")
        state.meta["numatp"].layout = held = lay
    if not isinstance(held, Shard) or (held.dim, held.sets) != (lay.dim, lay.sets):
        raise Unsupported(block, f"{_where(node)} writes a shard into {state.name}, which is "
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


def group_head_sets(heads: int, q_heads: int, kv_heads: int, sockets: int) -> tuple[IndexSet, ...] | None:
    """Per socket, the heads (query heads if ``heads == q_heads``, else K/V heads) of grouped-query
    attention split along its K/V groups, or None where that is impossible.

    With K/V heads a multiple of the sockets, each socket owns whole groups (its K/V heads and their
    query heads). With sockets a multiple of the K/V heads, the sockets sharing one K/V head split its
    query heads and each computes that K/V head itself: the K/V sets overlap, which costs the K/V
    projection's compute and bytes once per sharing socket and saves an all-gather inside attention.

    >>> [str(s) for s in group_head_sets(14, 14, 2, 4)], [str(s) for s in group_head_sets(2, 14, 2, 4)]
    (['0:4', '4:7', '7:11', '11:14'], ['0:1', '0:1', '1:2', '1:2'])
    """
    group = q_heads // kv_heads
    if kv_heads % sockets == 0:
        kv = even_split(kv_heads, sockets)
        return kv if heads == kv_heads else tuple(s.scaled(group) for s in kv)
    share, rest = divmod(sockets, kv_heads)
    if rest or group < share:
        return None
    if heads == kv_heads:
        return tuple(IndexSet.range(r // share, r // share + 1) for r in range(sockets))
    return tuple(even_split(group, share)[r % share].shifted((r // share) * group) for r in range(sockets))


def kv_head_sets(q_sets: tuple[IndexSet, ...], q_heads: int, kv_heads: int) -> tuple[IndexSet, ...] | None:
    """Per socket, the K/V heads its query heads read under grouped-query attention, or None where a
    socket's query heads do not map onto its K/V heads as one local GQA layout (local query head ``i``
    reading local K/V head ``i // (local query heads / local K/V heads)``)."""
    group = q_heads // kv_heads
    out = []
    for s in q_sets:
        heads = s.indices()
        need = sorted({h // group for h in heads})
        if not heads or len(heads) % len(need):
            return None
        per = len(heads) // len(need)
        if any(need[i // per] != h // group for i, h in enumerate(heads)):
            return None
        out.append(IndexSet.of(need))
    return tuple(out)


_EXPANSION = VIEW_OPS | {aten.clone.default, aten.expand.default, aten.unsqueeze.default}


def _expanded_from(t: torch.fx.Node, heads: int) -> int | None:
    """The K/V head count a ``(B, heads, S, D)`` value was expanded from (transformers' ``repeat_kv``:
    unsqueeze, expand, reshape), or None."""
    n = t
    while isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in _EXPANSION:
        n = n.args[0]
        shape = _shape(n)
        if shape is not None and len(shape) >= 4 and 0 < shape[1] < heads and heads % shape[1] == 0:
            return shape[1]
    return None


def _positions(outer: IndexSet, inner: IndexSet) -> IndexSet | None:
    """Local positions of ``inner``'s indices within ``outer`` (None unless ``inner`` is inside it)."""
    held = outer.indices()
    where = {i: k for k, i in enumerate(held)}
    if any(i not in where for i in inner.indices()):
        return None
    return IndexSet.of([where[i] for i in inner.indices()])


def _attention(node: torch.fx.Node, info: NodeInfo, block: int, grouped: set[int]) -> Layout:
    q, k, v = node.args[:3]
    lq = q.meta["numatp"].layout
    if not isinstance(lq, Shard) or lq.dim != 1:
        raise Unsupported(block, f"{_where(node)}: queries are not split by heads")
    hq, hkv = _shape(q)[1], _shape(k)[1]
    if hkv != hq:
        native = node.target in _NATIVE_GQA or (node.target is aten.scaled_dot_product_attention.default
                                                and node.kwargs.get("enable_gqa", False))
        if not native or hq % hkv:
            raise Unsupported(block, f"{_where(node)}: {hkv} K/V heads for {hq} query heads, which this "
                                     "attention op does not group")
    need = kv_head_sets(lq.sets, hq, hkv)
    if need is None:
        raise GroupSplit(block, f"{_where(node)}: a socket's query heads span the {hkv} K/V groups unevenly",
                         hq, hkv)
    for key, t in ((1, k), (2, v)):
        lt = t.meta["numatp"].layout
        origin = _expanded_from(t, hq) if hkv == hq else None
        if (lt is None and origin is not None and block not in grouped
                and group_head_sets(origin, hq, origin, len(lq.sets)) is not None):
            # K/V expanded per query head from fewer heads, replicated (fewer K/V heads than sockets):
            # retry with each socket computing the K/V heads its query heads read
            raise GroupSplit(block, f"{_where(node)}: K/V heads expanded from {origin}, replicated", hq, origin)
        if isinstance(lt, Shard) and lt.dim == 1 and lt.sets != need and origin is not None:
            # sockets sharing a K/V head hold its whole expanded group: each keeps its query heads' part
            cuts = tuple(_positions(o, i) for o, i in zip(lt.sets, need))
            if all(c is not None for c in cuts):
                info.slice_inputs[key] = Shard(1, cuts, block)
                continue
        if lt is None:
            if hkv < hq and block not in grouped:
                # replicated K/V projections (fewer K/V heads than sockets): retry with each socket
                # computing the K/V heads its query heads read
                raise GroupSplit(block, f"{_where(node)}: K/V heads replicated", hq, hkv)
            info.slice_inputs[key] = Shard(1, need, block)
        elif (lt.dim, lt.sets) != (1, need):
            if hkv < hq and block not in grouped:
                raise GroupSplit(block, f"{_where(node)}: K/V heads are split unlike the query groups", hq, hkv)
            raise Unsupported(block, f"{_where(node)}: K/V heads are split unlike the query heads")
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    if isinstance(mask, torch.fx.Node):
        lm = mask.meta["numatp"].layout
        ms = _shape(mask)
        if lm is None and len(ms) == 4 and ms[1] != 1:
            info.slice_inputs["attn_mask" if "attn_mask" in node.kwargs else 3] = Shard(1, lq.sets, block)
        elif isinstance(lm, Shard) and (lm.dim, lm.sets) != (1, lq.sets):
            raise Unsupported(block, f"{_where(node)}: the mask is split unlike the heads")
    val = node.meta["val"]
    if isinstance(val, (tuple, list)):
        return tuple(lq if isinstance(o, torch.Tensor) and o.dim() >= 2 and o.shape[1] == hq else None
                     for o in val)
    return lq


def propagate(gm: torch.fx.GraphModule, column_sets: dict[torch.fx.Node, tuple[int, tuple[IndexSet, ...]]],
              rows: dict[torch.fx.Node, int], lm_heads: set[torch.fx.Node], grouped: AbstractSet[int] = frozenset(),
              states: AbstractSet[torch.fx.Node] = frozenset()) -> None:
    """Annotate every node with its :class:`NodeInfo`.

    ``column_sets`` maps a column (or LM-head) matmul to ``(block, per-socket output sets)``; ``rows`` maps a
    row matmul to its block; ``grouped`` holds the blocks whose column sets already follow their K/V
    groups. Raises :class:`Unsupported` naming the block that cannot be sharded (:class:`GroupSplit` where
    group-aware sets may help). ``states`` are the inputs the graph writes in place: each takes the
    layout of the first shard written into it (:func:`_state_write`).
    """
    for node in gm.graph.nodes:
        info = NodeInfo(state=node in states)
        node.meta["numatp"] = info
        if node.op != "call_function":
            continue
        if node in column_sets:
            block, sets = column_sets[node]
            x = node.args[1] if node.target is aten.addmm.default else node.args[0]
            if x.meta["numatp"].layout is not None:
                raise Unsupported(block, f"{_where(node)}: the input of a column projection is itself sharded")
            info.role, info.block = ("lm_head" if node in lm_heads else "column"), block
            info.layout = Shard(1, sets, block)
        elif node in rows:
            block = rows[node]
            x = node.args[1] if node.target is aten.addmm.default else node.args[0]
            lx = x.meta["numatp"].layout
            if not isinstance(lx, Shard) or lx.dim != 1:
                raise Unsupported(block, f"{_where(node)}: the input of the output projection is not split "
                                         "along its features")
            info.role, info.block = "row", block
            info.layout = None
            info.row_input = lx
        else:
            info.layout = _rule(node, info, grouped)
