"""The sharding rule of attention, and how grouped-query attention's heads split over sockets.

Queries must be split by heads; K/V heads follow the query heads' groups (query head ``h`` reads K/V
head ``h // (query heads / K/V heads)``). Where they do not, the rule raises :class:`GroupSplit` and the
pass splits the block's projections along the groups instead (:func:`group_head_sets`).
"""

from __future__ import annotations

import torch
import torch.fx

from numatp.plan.layout import GroupSplit, Layout, NodeInfo, Shard, Unsupported, shape_of, where
from numatp.plan.roles import ATTENTION_OPS, VIEW_OPS
from numatp.plan.schema import IndexSet, even_split

__all__ = ["ATTENTION_OPS", "attention_rule", "group_head_sets", "kv_head_sets"]

aten = torch.ops.aten

# attention ops that take fewer K/V heads than query heads themselves (CPU flash attention does; the
# composite SDPA does with enable_gqa=True): query head h reads K/V head h // (query heads / K/V heads)
_NATIVE_GQA = {aten._scaled_dot_product_flash_attention_for_cpu.default}
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
        shape = shape_of(n)
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


def attention_rule(node: torch.fx.Node, info: NodeInfo, block: int, grouped: set[int]) -> Layout:
    q, k, v = node.args[:3]
    lq = q.meta["numatp"].layout
    if not isinstance(lq, Shard) or lq.dim != 1:
        raise Unsupported(block, f"{where(node)}: queries are not split by heads")
    hq, hkv = shape_of(q)[1], shape_of(k)[1]
    if hkv != hq:
        native = node.target in _NATIVE_GQA or (node.target is aten.scaled_dot_product_attention.default
                                                and node.kwargs.get("enable_gqa", False))
        if not native or hq % hkv:
            raise Unsupported(block, f"{where(node)}: {hkv} K/V heads for {hq} query heads, which this "
                                     "attention op does not group")
    need = kv_head_sets(lq.sets, hq, hkv)
    if need is None:
        raise GroupSplit(block, f"{where(node)}: a socket's query heads span the {hkv} K/V groups unevenly",
                         hq, hkv)
    for key, t in ((1, k), (2, v)):
        lt = t.meta["numatp"].layout
        origin = _expanded_from(t, hq) if hkv == hq else None
        if (lt is None and origin is not None and block not in grouped
                and group_head_sets(origin, hq, origin, len(lq.sets)) is not None):
            # K/V expanded per query head from fewer heads, replicated (fewer K/V heads than sockets):
            # retry with each socket computing the K/V heads its query heads read
            raise GroupSplit(block, f"{where(node)}: K/V heads expanded from {origin}, replicated", hq, origin)
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
                raise GroupSplit(block, f"{where(node)}: K/V heads replicated", hq, hkv)
            info.slice_inputs[key] = Shard(1, need, block)
        elif (lt.dim, lt.sets) != (1, need):
            if hkv < hq and block not in grouped:
                raise GroupSplit(block, f"{where(node)}: K/V heads are split unlike the query groups", hq, hkv)
            raise Unsupported(block, f"{where(node)}: K/V heads are split unlike the query heads")
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    if isinstance(mask, torch.fx.Node):
        lm = mask.meta["numatp"].layout
        ms = shape_of(mask)
        if lm is None and len(ms) == 4 and ms[1] != 1:
            info.slice_inputs["attn_mask" if "attn_mask" in node.kwargs else 3] = Shard(1, lq.sets, block)
        elif isinstance(lm, Shard) and (lm.dim, lm.sets) != (1, lq.sets):
            raise Unsupported(block, f"{where(node)}: the mask is split unlike the heads")
    val = node.meta["val"]
    if isinstance(val, (tuple, list)):
        return tuple(lq if isinstance(o, torch.Tensor) and o.dim() >= 2 and o.shape[1] == hq else None
                     for o in val)
    return lq
