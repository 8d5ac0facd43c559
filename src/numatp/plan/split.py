"""Cut a lowered socket program into the steps the runtime runs.

The program is cut at what :mod:`numatp.plan.lower` left as a step of its own: an all-reduce (the
first; with one socket, a layer's end), an all-gather (with the matmul it runs in place, if marked) and
a ``numatp::gemm`` whose provider is a Python callable (``inductor_cpp``); and right after every node
marked as a segment's end (a layer's last reduction, run inside the segment). Each piece in between is a
:class:`~numatp.runtime.segments.Segment` with canonical node names, so the layers' segments have the
same code and one Inductor compilation serves every layer and every socket with the same local shapes.

Contract. Takes: a lowered local program (``meta["val"]`` on every node). Guarantees: the steps, run
in order over one environment, compute what the program computes; each step reads only values of that
environment (the program's placeholders and earlier steps' outputs); each segment's inputs have example
values of their shapes. Refuses: nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from numatp.plan.lower import ABSORBED, GATHERED, SEGMENT_END
from numatp.plan.ops import COLLECTIVES
from numatp.runtime.gemm import GEMM_OP, GemmStep
from numatp.runtime.segments import Collective, Segment

__all__ = ["split_program"]


def split_program(gm: torch.fx.GraphModule) -> tuple[list[str], list[Any], list[Any]]:
    """(placeholder keys, steps, output spec) of a lowered socket program; steps are Segment,
    Collective or GemmStep."""
    nodes = list(gm.graph.nodes)
    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    steps: list[Any] = []
    current: list[torch.fx.Node] = []
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.target is GEMM_OP:  # a weight matmul the executor runs with its provider (numatp.plan.gemm_pass)
            if current:
                steps.append(_segment(gm, current))
                current = []
            x, w, b, provider, _ = n.args
            steps.append(GemmStep(provider, x.name, w.name, b.name if b is not None else None, n.name,
                                  int(n.meta["val"].shape[1]), int(x.meta["val"].shape[1])))
        elif n.target in COLLECTIVES:
            if current:
                steps.append(_segment(gm, current))
                current = []
            src = n.args[0].name
            if n.target is COLLECTIVES[0]:
                steps.append(Collective("all_reduce", n.args[1], src, n.name))
            else:
                full = n.meta["val"]
                steps.append(Collective("all_gather", n.args[3], src, n.name, n.args[1], n.args[2],
                                        n.meta.get("numatp_gather"), (tuple(map(int, full.shape)), full.dtype),
                                        n.meta.get(GATHERED)))
        elif n.meta.get(ABSORBED):   # run by the all-gather it feeds
            continue
        else:
            current.append(n)
            if n.meta.get(SEGMENT_END):   # after a reduction that runs inside the segment: the end of a layer
                steps.append(_segment(gm, current))
                current = []
    if current:
        steps.append(_segment(gm, current))
    outs = [a.name if isinstance(a, torch.fx.Node) else ("const", a) for a in output.args[0]]
    return placeholders, steps, outs


def _segment(gm: torch.fx.GraphModule, body: list[torch.fx.Node]) -> Segment:
    inside = set(body)
    inputs: list[torch.fx.Node] = []
    for n in body:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outs = [n for n in body if any(u not in inside for u in n.users)]
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for k, a in enumerate(inputs):
        env[a] = g.placeholder(f"in{k}")
        env[a].meta["val"] = a.meta.get("val")
    for i, n in enumerate(body):
        # canonical names: the same layer code in another layer must compare equal
        args = torch.fx.node.map_arg(n.args, lambda x: env[x])
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda x: env[x])
        env[n] = g.create_node(n.op, n.target, args, kwargs, name=f"v{i}")
        env[n].meta = dict(n.meta)
    g.output(tuple(env[o] for o in outs))
    seg_gm = torch.fx.GraphModule(gm, g)
    seg = Segment(seg_gm, [a.name for a in inputs], [o.name for o in outs])
    missing = [a.name for a in inputs if a.meta.get("val") is None]
    if missing:   # the compiler would drop such an input and read the next one in its place
        raise AssertionError(f"numatp: segment inputs {missing} have no example value")
    seg.example = [_example(a.meta["val"]) for a in inputs]
    return seg


def _example(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype)
    return v
