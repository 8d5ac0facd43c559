"""Single-query attention (a decode step) as one read of the cache instead of CPU flash attention.

A decode step attends one new query per sequence to the whole cache. This pass replaces each
``_scaled_dot_product_flash_attention_for_cpu`` whose query has one position by

    scores = sum_d q[d] * k[s, d] * scale (+ mask);  p = softmax_s(scores);  out = sum_s p[s] * v[s, :]

in fp32. For fp32 and bf16 it is ``numatp::decode_attention`` (``runtime/attention.cpp``): each K and V row
read once for the query heads of its group, vectorized for this CPU, and the positions the mask rules out
for every head (a static cache's positions not reached yet: the dtype's lowest value, or -inf) not read at
all, since their weight is exactly 0 in fp32, and those outside the span of a group's unmasked positions not
even visited (a server's long cache costs what its written positions cost). Measured on a 2-core AVX-512
Xeon, one thread, bf16, 8 heads of 64, a 224-position cache, 24 layers' caches in turn: 8 sequences with 160
positions written 4.5 ms against torch's CPU flash attention's 6.6 and 14.7 for the fused Inductor loops
this pass emitted before (one sequence: 0.53, 0.62, 1.31 ms). Other dtypes get those loops still:
elementwise products and sums over the cache, which Inductor fuses into two passes that stream K and V once
each. Grouped K/V heads (fewer K/V heads than query heads, as CPU flash attention takes them) are read once
per group either way.

Contract. Takes: a socket program (after localize; shapes in ``meta["val"]``). Guarantees: each
rewritten node's output equals flash attention's within fp32 rounding (bf16: rounded once at the end),
for any batch, head count and grouping, with an additive mask or none (a head whose every position is
masked: flash attention's output too, through the C++ op). Refuses: nothing; a query of more than one
position, causal attention, dropout, or a use of the log-sum-exp output leaves the node as it is.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from numatp.runtime.native import load_ops

__all__ = ["fuse_single_query_attention"]

aten = torch.ops.aten
_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default


def fuse_single_query_attention(gm: torch.fx.GraphModule) -> int:
    """Rewrite every single-query flash attention of ``gm`` in place; returns how many were rewritten."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.target is not _FLASH or not _rewritable(node):
            continue
        q, k, v = node.args[:3]
        with gm.graph.inserting_before(node):
            out = _emit(gm.graph, q, k, v, node.kwargs.get("attn_mask"), node.kwargs.get("scale"))
        for user in list(node.users):   # only getitem(node, 0) users remain (checked by _rewritable)
            user.replace_all_uses_with(out)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _rewritable(node: torch.fx.Node) -> bool:
    q = node.args[0].meta.get("val")
    dropout = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
    causal = node.args[4] if len(node.args) > 4 else node.kwargs.get("is_causal", False)
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[-2] != 1 or dropout or causal:
        return False
    k = node.args[1].meta["val"]
    if q.shape[1] % k.shape[1]:
        return False
    mask = node.kwargs.get("attn_mask")
    if mask is not None:   # (B or 1, H or 1, 1, S), the shapes transformers passes
        m = mask.meta["val"]
        if (m.dim() != 4 or m.dtype != q.dtype or m.shape[1] not in (1, q.shape[1]) or m.shape[2] != 1
                or m.shape[3] != k.shape[2]):
            return False
    return all(u.target is operator.getitem and u.args[1] == 0 for u in node.users)


def _emit(g: torch.fx.Graph, q, k, v, mask, scale) -> torch.fx.Node:
    """Nodes computing single-query attention of ``q`` (B, H, 1, D) over ``k``/``v`` (B, Hk, S, D)."""
    qv, kv = q.meta["val"], k.meta["val"]
    b, h, _, d = qv.shape
    hk, s = kv.shape[1], kv.shape[2]
    group = h // hk
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if qv.dtype in (torch.float32, torch.bfloat16):
        load_ops()
        return g.call_function(torch.ops.numatp.decode_attention.default, (q, k, v, mask, float(scale)))
    f32 = torch.float32

    def call(op, *args, **kwargs):
        return g.call_function(op, args, kwargs)

    def fp32(x):
        return call(aten._to_copy.default, x, dtype=f32)

    # (B, Hk, G, 1, D) * (B, Hk, 1, S, D), summed over D: the scores of each query head of each group
    qg = call(aten.view.default, fp32(q), [b, hk, group, 1, d])
    kg = call(aten.unsqueeze.default, fp32(k), 2)
    scores = call(aten.mul.Tensor, call(aten.sum.dim_IntList, call(aten.mul.Tensor, qg, kg), [-1]), scale)
    if mask is not None:
        mv = mask.meta["val"]
        bm, hm = mv.shape[0], mv.shape[1]
        # a mask broadcast over heads (hm == 1) or given per query head (hm == H)
        m = call(aten.view.default, mask, [bm, hk if hm == h else 1, group if hm == h else 1, s])
        scores = call(aten.add.Tensor, scores, fp32(m))
    peak = call(aten.amax.default, scores, [-1], True)
    e = call(aten.exp.default, call(aten.sub.Tensor, scores, peak))
    p = call(aten.div.Tensor, e, call(aten.sum.dim_IntList, e, [-1], True))
    # (B, Hk, G, S, 1) * (B, Hk, 1, S, D), summed over S
    pv = call(aten.mul.Tensor, call(aten.unsqueeze.default, p, -1), call(aten.unsqueeze.default, fp32(v), 2))
    out = call(aten.sum.dim_IntList, pv, [3])
    return call(aten.view.default, call(aten._to_copy.default, out, dtype=qv.dtype), [b, h, 1, d])
