"""Find the weight matmuls of an ATen graph and group them into blocks, by dataflow alone.

A weight matmul is ``mm``/``addmm`` whose right operand is a parameter placeholder, possibly through a
transpose (``nn.Linear`` stores ``(out, in)``, GPT-2's ``Conv1D`` stores ``(in, out)``). A block is a
*row* matmul together with the *column* matmuls that its input depends on without crossing another
weight matmul: attention (Q/K/V -> ... -> O) and MLP (up or gate/up -> ... -> down) both have this shape.
Blocks are claimed in program order, so that the residual stream cannot pair one block's output
projection with the next block's input projections.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.fx

from numatp.plan.views import view_groups

__all__ = ["WeightMatmul", "find_weight_matmuls", "find_blocks", "column_segments", "block_module",
           "has_attention", "reaches_output", "ATTENTION_OPS", "ATTENTION_MARKS"]

aten = torch.ops.aten
# op groups the pass modules share (propagate, tp_pass and localize import them from here)
TRANSPOSE_OPS = {aten.permute.default, aten.t.default, aten.transpose.int}
IDENTITY_OPS = {aten.clone.default, aten.alias.default, torch.ops.prims.convert_element_type.default,
                aten._to_copy.default, aten.lift_fresh_copy.default, aten.detach.default}
VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
ATTENTION_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten.scaled_dot_product_attention.default,
}
# what marks a block as attention: an attention op, a softmax, or the batched products of the math path
# (Inductor's decompositions turn softmax into exp / sum, so the products are what remains)
ATTENTION_MARKS = ATTENTION_OPS | {aten._softmax.default, aten._safe_softmax.default, aten.bmm.default,
                                   aten.baddbmm.default}


@dataclass(frozen=True)
class WeightMatmul:
    """``node`` computes ``x @ W`` (plus ``bias`` for addmm); ``out_dim``/``in_dim`` are dims of the parameter."""

    node: torch.fx.Node
    param: torch.fx.Node
    chain: tuple[torch.fx.Node, ...]
    out_dim: int
    in_dim: int
    bias: torch.fx.Node | None

    @property
    def x(self) -> torch.fx.Node:
        return self.node.args[1] if self.bias is not None else self.node.args[0]

    @property
    def out_features(self) -> int:
        return int(self.param.meta["val"].shape[self.out_dim])

    @property
    def in_features(self) -> int:
        return int(self.param.meta["val"].shape[self.in_dim])


def find_weight_matmuls(gm: torch.fx.GraphModule, params: set[torch.fx.Node]) -> list[WeightMatmul]:
    found = []
    for node in gm.graph.nodes:
        if node.target not in (aten.mm.default, aten.addmm.default):
            continue
        bias = node.args[0] if node.target is aten.addmm.default else None
        w = node.args[2] if bias is not None else node.args[1]
        chain = []
        while isinstance(w, torch.fx.Node) and w.target in TRANSPOSE_OPS:
            chain.append(w)
            w = w.args[0]
        if not (isinstance(w, torch.fx.Node) and w in params and w.meta["val"].dim() == 2):
            continue
        if bias is not None and not (isinstance(bias, torch.fx.Node) and bias in params):
            continue
        transposed = len(chain) % 2 == 1
        # mm(x, W^T) with W (out, in): out is dim 0; mm(x, W) with W (in, out): out is dim 1
        found.append(WeightMatmul(node, w, tuple(chain), 0 if transposed else 1, 1 if transposed else 0, bias))
    return found


def _cone(start: torch.fx.Node, stops: dict[torch.fx.Node, WeightMatmul]) -> set[torch.fx.Node]:
    """Weight matmuls reached walking back from ``start`` without passing through one."""
    seen, hits, todo = set(), set(), [start]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in stops:
            hits.add(n)
            continue
        todo.extend(a for a in n.all_input_nodes)
    return hits


def find_blocks(
    matmuls: list[WeightMatmul], excluded: set[torch.fx.Node]
) -> list[tuple[WeightMatmul, list[WeightMatmul]]]:
    """(row, columns) pairs in program order; matmuls in ``excluded`` are never paired.

    A projection that widens its input twice or more closes no block (an output or down projection
    narrows or keeps the width): BERT's and RoBERTa's MLM head (dense -> gelu -> LayerNorm -> decoder) is
    not an MLP; its vocabulary decoder is left to the LM-head rule, its dense stays replicated.
    """
    by_node = {m.node: m for m in matmuls}
    taken: set[torch.fx.Node] = set(excluded)
    blocks = []
    for row in matmuls:
        if row.node in taken or row.out_features >= 2 * row.in_features:
            continue
        cols = _cone(row.x, by_node)
        if not cols or cols & taken:
            continue
        ordered = [m for m in matmuls if m.node in cols]
        taken |= cols | {row.node}
        blocks.append((row, ordered))
    return blocks


def constant_index(node: torch.fx.Node, dim: int) -> int | None:
    """The one position ``aten.index.Tensor`` reads along ``dim`` when that is its only index and a
    one-element constant of the graph (Falcon's ``qkv[..., [-2], :]``), else None."""
    indices = node.args[1]
    if dim >= len(indices) or any(ix is not None for d, ix in enumerate(indices) if d != dim):
        return None
    src = indices[dim]
    if isinstance(src, torch.fx.Node) and src.target is aten.lift_fresh_copy.default:
        src = src.args[0]
    if not (isinstance(src, torch.fx.Node) and src.op == "get_attr"):
        return None
    value = getattr(src.graph.owning_module, src.target, None)
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.is_floating_point():
        return None
    return int(value.item())


def slice_bounds(node: torch.fx.Node, size: int) -> tuple[int, int]:
    """``[start, end)`` of an ``aten.slice`` of a dimension of ``size``, negatives and overshoot resolved."""
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else size
    start, end = (v + size if v < 0 else v for v in (start, end))
    return max(0, min(start, size)), max(0, min(end, size))


def column_segments(mm: WeightMatmul) -> list[tuple[int, int, int]]:
    """``(offset, length, unit)`` pieces of a column matmul's output features, from how its users read them.

    A ``split`` or ``slice`` along the features cuts a fused projection into pieces (GPT-2's c_attn: q, k,
    v; Phi-3's qkv_proj and gate_up_proj); the first
    view that splits the features (``(B, S, 768) -> (B, S, 12, 64)``) gives the unit a shard must respect
    (a whole head). Pieces without such a view get unit 1.
    """
    out = mm.out_features
    cuts: set[int] = {0, out}
    units: list[tuple[int, int, int]] = []
    todo = [(mm.node, 1, 0, out, 1)]   # (node, dim, feature offset, length, features per index of dim)
    seen = set()
    while todo:
        node, dim, offset, length, scale = todo.pop()
        if (node, dim, offset) in seen:
            continue
        seen.add((node, dim, offset))
        shape = tuple(node.meta["val"].shape)
        for user in node.users:
            t = user.target
            if t in VIEW_OPS:
                dst = tuple(user.meta["val"].shape)
                last = dim == len(shape) - 1 and len(dst) == len(shape) + 1 and scale == 1
                if last and len(shape) == 2 and dst[-1] == shape[-1]:
                    # (B * S, F) -> (B, S, F): the tokens get their batch and sequence back. Said first: with
                    # B = S = 1 (a decode step) the shapes alone would also read as one head of F features
                    todo.append((user, len(dst) - 1, offset, length, scale))
                    continue
                if last and len(shape) >= 3 and dst[:-2] == shape[:-1] and dst[-2] * dst[-1] == shape[-1]:
                    # (B, S, heads * hd) -> (B, S, heads, hd): a shard holds whole heads (one head: all of
                    # it), whatever sizes of one B and S would make the generic grouping below merge
                    units.append((offset, length, dst[-1]))
                    todo.append((user, len(dst) - 2, offset, length, dst[-1]))
                    continue
                for gi, gj in view_groups(shape, dst):
                    if dim in gi:
                        # dimensions of size one carry no features (view_groups merges them into a group)
                        into = [d for d in gj if dst[d] != 1] or [gj[-1]]
                        if len(into) == 1:
                            todo.append((user, into[0], offset, length, scale))
                        elif [d for d in gi if shape[d] != 1] == [dim] and scale == 1:
                            # (.., heads*hd) -> (.., heads, hd): a shard must hold whole heads
                            inner = 1
                            for d in into[1:]:
                                inner *= dst[d]
                            units.append((offset, length, inner))
                            # heads read apart (Falcon's q = [..., :-2, :], k = [..., [-2], :]) are pieces too
                            todo.append((user, into[0], offset, length, inner))
                        break
            elif t in (aten.split.Tensor, aten.split_with_sizes.default):
                sdim = user.args[2] if len(user.args) > 2 else 0
                if sdim % len(shape) != dim:
                    continue
                sizes = ([user.args[1]] * ((shape[dim] + user.args[1] - 1) // user.args[1])
                         if t is aten.split.Tensor else list(user.args[1]))
                starts = [sum(sizes[:k]) for k in range(len(sizes))]
                for s in starts:
                    cuts.add(offset + s * scale)   # a split of heads (Falcon's q | k | v by heads) cuts whole heads
                for g in user.users:
                    k = g.args[1]
                    todo.append((g, dim, offset + starts[k] * scale, sizes[k] * scale, scale))
            elif t is aten.slice.Tensor:
                sdim = (user.args[1] if len(user.args) > 1 else 0) % len(shape)
                if sdim != dim:
                    todo.append((user, dim, offset, length, scale))
                    continue
                start, end = slice_bounds(user, shape[dim])
                if end > start and (user.args[4] if len(user.args) > 4 else 1) == 1:
                    # a fused projection read in parts (q | k | v, gate | up): each part is its own piece
                    cuts.update((offset + start * scale, offset + end * scale))
                    todo.append((user, dim, offset + start * scale, (end - start) * scale, scale))
            elif t is aten.index.Tensor:
                at = constant_index(user, dim)
                if at is not None:
                    i = at % shape[dim]
                    cuts.update((offset + i * scale, offset + (i + 1) * scale))
            elif t in IDENTITY_OPS or (hasattr(t, "tags") and torch.Tag.pointwise in t.tags):
                if tuple(user.meta["val"].shape)[-len(shape):] == shape:
                    todo.append((user, dim + user.meta["val"].dim() - len(shape), offset, length, scale))
            elif t in (aten.permute.default,):
                todo.append((user, list(user.args[1]).index(dim), offset, length, scale))
    bounds = sorted(cuts)
    pieces = []
    for lo, hi in zip(bounds, bounds[1:]):
        unit = 1
        for off, ln, u in units:
            if off <= lo and hi <= off + ln:
                unit = max(unit, u)
        pieces.append((lo, hi - lo, unit))
    return pieces


def block_module(names: list[str]) -> str:
    """The module a block's parameters share (their names' common prefix), or all of them."""
    parts = [n.split(".")[:-1] for n in names]
    common = os.path.commonprefix(parts) if parts else []
    if len(parts) == 1:
        return ".".join(parts[0])
    return ".".join(common) or ", ".join(".".join(p) for p in parts)


def reaches_output(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value reaches the graph's output without passing another weight matmul."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n.op == "output":
            return True
        if n in seen or (n is not node and n.target in (aten.mm.default, aten.addmm.default)):
            continue
        seen.add(n)
        todo.extend(n.users)
    return False


def has_attention(row: WeightMatmul, cols: list[WeightMatmul]) -> bool:
    """Whether the block of ``row`` and ``cols`` is attention (an attention mark between them)."""
    stops = {c.node for c in cols}
    todo, seen = [row.x], set()
    while todo:
        n = todo.pop()
        if n in seen or n in stops:
            continue
        seen.add(n)
        if n.target in ATTENTION_MARKS:
            return True
        todo.extend(n.all_input_nodes)
    return False
