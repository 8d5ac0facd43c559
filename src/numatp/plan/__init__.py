"""The NUMA-TP pass: from an unmodified model's ATen graph to one program per socket and a schema.

    graphs = capture(model, **inputs)          # the Dynamo graphs, traced to ATen
    plan = plan_graph(graphs[0], sockets=2)    # annotate + schema
    programs = [localize(graphs[0], plan, r) for r in range(2)]
    run_reference(programs, graphs[0].inputs)  # the oracle: equals the model's output
"""

from __future__ import annotations

from typing import Any

import torch

from numatp.plan.localize import Binding, LocalProgram, localize
from numatp.plan.reference import run_reference, shard_tensor
from numatp.plan.schema import Block, Colwise, IndexSet, Plan, Replicate, Rowwise, WeightPlan
from numatp.plan.tp_pass import BlockCandidate, plan_graph
from numatp.plan.tp_plan import TpPlan, hf_tp_plan, parse as parse_tp_plan
from numatp.plan.trace import AtenGraph, trace_aten

__all__ = [
    "AtenGraph", "Binding", "Block", "BlockCandidate", "Colwise", "IndexSet", "LocalProgram", "Plan",
    "Replicate", "Rowwise", "TpPlan", "WeightPlan", "capture", "hf_tp_plan", "localize", "parse_tp_plan",
    "plan_graph", "run_reference", "shard_tensor", "trace_aten",
]


def capture(model: torch.nn.Module, *args: Any, **kwargs: Any) -> list[tuple[AtenGraph, list[Any]]]:
    """Trace ``model(*args, **kwargs)`` through Dynamo; one ATen graph and its real inputs per Dynamo graph."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    graphs: list[tuple[AtenGraph, list[Any]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]):
        graphs.append((trace_aten(gm, example_inputs, names), list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=False, fullgraph=False)(*args, **kwargs)
    torch._dynamo.reset()
    return graphs
