"""Where a socket program multiplies by a weight: the sites the GEMM pass chooses providers for.

A site is ``aten.mm(x, W)`` / ``aten.addmm(b, x, W)`` where ``W`` is a weight placeholder, or
``permute(W, [1, 0])`` / ``t(W)`` of one (an ``nn.Linear`` weight, stored ``(N, K)``). A weight with any
other use, or whose uses are not all such matmuls, has no sites (it stays on ATen).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from numatp.runtime.gemm import GemmShape, streams
from numatp.plan.lower import gather_in_place
from numatp.topology.resources import last_level_cache_bytes

__all__ = ["Site", "find_sites"]

aten = torch.ops.aten


@dataclass
class Site:
    """One weight matmul of a program: its node, its operands' nodes and the shape it runs."""

    node: torch.fx.Node
    x: torch.fx.Node
    weight: torch.fx.Node      # the placeholder
    bias: torch.fx.Node | None
    shape: GemmShape
    weight_bytes: int = 0   # of the program's weights: whether a few-row call finds its weight in cache


def find_sites(gm: torch.fx.GraphModule, args: list[Any], weights: set[int], threads: int,
               gathers: bool = False, llc_bytes: int | None = None) -> dict[torch.fx.Node, list[Site]]:
    """Weight matmuls grouped by weight placeholder; weights with any other use are left out. ``args``:
    the program's arguments, prepared operands given as their plain stand-ins. With ``gathers``, a matmul
    whose output is all-gathered is measured as written into the full tensor (``GemmShape.into``). A
    few-row matmul streams its weight (``GemmShape.stream``) where the program's weights outgrow a quarter
    of ``llc_bytes`` (None: this machine's last-level cache)."""
    llc = last_level_cache_bytes() if llc_bytes is None else llc_bytes
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    # the weight bytes one call reads: whether a few-row matmul finds its weight in cache (GemmShape.stream)
    weight_bytes = sum(args[i].numel() * args[i].element_size() for i in weights
                       if isinstance(args[i], torch.Tensor))
    FakeTensorProp(gm, fake).propagate(*[fake.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: dict[torch.fx.Node, list[Site]] = {}
    for i in sorted(weights):
        ph = placeholders[i]
        sites: list[Site] = []
        ok = ph.meta["val"].dim() == 2 and ph.meta["val"].dtype in (torch.float32, torch.bfloat16)
        for u in list(ph.users) if ok else []:
            if u.target in (aten.permute.default, aten.t.default) and (u.target is aten.t.default
                                                                        or list(u.args[1]) == [1, 0]):
                for v in u.users:
                    site = _site(v, u, ph, "nk", threads, gathers, weight_bytes, llc)
                    ok = ok and site is not None
                    if site is not None:
                        sites.append(site)
            else:
                site = _site(u, ph, ph, "kn", threads, gathers, weight_bytes, llc)
                ok = ok and site is not None
                if site is not None:
                    sites.append(site)
        if ok and sites:
            out[ph] = sites
    return out


def _site(node: torch.fx.Node, w: torch.fx.Node, ph: torch.fx.Node, layout: str, threads: int,
          gathers: bool, weight_bytes: int, llc_bytes: int) -> Site | None:
    x: Any
    bias: Any
    if node.target is aten.mm.default and node.args[1] is w and node.args[0] is not w:
        x, bias = node.args[0], None
    elif (node.target is aten.addmm.default and node.args[2] is w and not node.kwargs
          and node.args[1] is not w and node.args[0].meta["val"].dim() == 1):
        bias, x = node.args[0], node.args[1]
    else:
        return None
    xv, wv = x.meta["val"], ph.meta["val"]
    if xv.dim() != 2 or xv.dtype != wv.dtype:
        return None
    n, k = (wv.shape[0], wv.shape[1]) if layout == "nk" else (wv.shape[1], wv.shape[0])
    m = int(xv.shape[0])
    shape = GemmShape(m, int(k), int(n), str(wv.dtype).removeprefix("torch."), layout, threads,
                      _gathered_width(node) if gathers else 0, streams(m, weight_bytes, llc_bytes))
    return Site(node, x, ph, bias, shape, weight_bytes)


def _gathered_width(node: torch.fx.Node) -> int:
    """The full width of the all-gather this matmul could write in place
    (:func:`numatp.plan.lower.gather_in_place`), else 0."""
    g = gather_in_place(node)
    return 0 if g is None else int(g.meta["val"].shape[-1])
