"""A given tp_plan against the graph: each module's decision, checked against the dataflow and put into
the planner's state, and the plan's decisions read back in the tp_plan vocabulary.
"""

from __future__ import annotations

import torch
import torch.fx

from numatp.plan.roles import WeightMatmul, block_module, find_blocks, has_attention, reaches_output
from numatp.plan.schema import Reason
from numatp.plan.state import PlanState
from numatp.plan.tp_plan import TpPlan
from numatp.plan.trace import AtenGraph
from numatp.plan.vocab import embedding_tables

__all__ = ["apply_fixed", "decisions", "fixed_decisions", "module_of"]


def module_of(ag: AtenGraph, index: int, kind: str) -> str:
    """The module that reads placeholder ``index`` as ``kind`` (``matmul`` or ``lookup``)."""
    return ag.modules[index].get(kind) or ag.names[index].rsplit(".", 1)[0]


def fixed_decisions(plan: TpPlan, ag: AtenGraph, matmuls: list[WeightMatmul], placeholders: list[torch.fx.Node],
           params: set[torch.fx.Node]) -> tuple[dict, dict]:
    """The plan's decision ``(value, pattern, module)`` per weight matmul node and per embedding table."""
    index = {p: i for i, p in enumerate(placeholders)}
    names: dict[str, list[tuple[str, object]]] = {}
    for m in matmuls:
        for key in (module_of(ag, index[m.param], "matmul"), ag.names[index[m.param]]):
            names.setdefault(key, []).append(("matmul", m))
    tables = embedding_tables(ag.gm, params)
    for p in tables:
        for key in (module_of(ag, index[p], "lookup"), ag.names[index[p]]):
            names.setdefault(key, []).append(("lookup", p))
    for p in params:   # norms and other readers: a pattern may name them, to replicate (as they are)
        for kind, module in ag.modules[index[p]].items():
            names.setdefault(module, []).append((kind, p))
        names.setdefault(ag.names[index[p]], []).append(("other", p))
    fixed, fixed_tables = {}, {}
    for module, (value, pattern) in plan.decisions(names).items():
        for kind, obj in names[module]:
            if kind == "matmul" and isinstance(obj, WeightMatmul):
                fixed[obj.node] = (value, pattern, module)
            elif kind == "lookup" and obj in tables:
                if value in ("colwise", "rowwise"):
                    raise ValueError(f"{plan.source}: {pattern!r} asks {value} for {module}, an embedding "
                                     "table: a table is 'vocab' (split by rows) or 'replicate'")
                fixed_tables[obj] = (value, pattern, module)
            elif value != "replicate" and not any(k in ("matmul", "lookup") for k, _ in names[module]):
                raise ValueError(f"{plan.source}: {pattern!r} asks {value} for {module}, which is neither a "
                                 "projection nor an embedding table here: only 'replicate' applies to it")
    return fixed, fixed_tables


def apply_fixed(plan: TpPlan | None, fixed: dict, matmuls: list[WeightMatmul], names: dict[torch.fx.Node, str],
                 state: PlanState) -> None:
    """Into ``state``: blocks the plan shards (by row), LM heads it shards, column projections it
    replicates, blocks it replicates. Decisions the dataflow cannot honour are errors."""
    if not fixed:
        return
    in_block = set()
    for row, cols in find_blocks(matmuls, set()):
        in_block |= {row.node, *(c.node for c in cols)}
        module = block_module([names[m.param] for m in [*cols, row]])
        r = fixed.get(row.node)
        if r and r[0] in ("colwise", "vocab"):
            raise ValueError(f"{plan.source}: {r[1]!r} asks {r[0]} for {r[2]}, the output projection of "
                             f"{module}: its input is split along the features by the block's column "
                             "projections, so it is 'rowwise' (or 'replicate', with its whole block)")
        for c in cols:
            v = fixed.get(c.node)
            if v and v[0] in ("rowwise", "vocab"):
                raise ValueError(f"{plan.source}: {v[1]!r} asks {v[0]} for {v[2]}, which reads {module}'s "
                                 "replicated input: it is 'colwise' (or 'replicate')")
        col_values = [fixed[c.node][0] for c in cols if c.node in fixed]
        if (r and r[0] == "replicate") or (len(col_values) == len(cols) and set(col_values) == {"replicate"}):
            state.excluded |= {row.node, *(c.node for c in cols)}
            why = r or next(fixed[c.node] for c in cols)
            kind = "attention" if has_attention(row, cols) else "mlp"
            state.replicated[row.node] = (kind, Reason("by_plan", module=module, source=plan.source,
                                                       pattern=why[1]))
            continue
        state.forced_rep |= {c.node for c in cols if fixed.get(c.node, ("",))[0] == "replicate"}
        if r or col_values:
            state.forced.add(row.node)
    for m in matmuls:
        v = fixed.get(m.node)
        if m.node in in_block or v is None:
            continue
        if v[0] == "colwise":
            if m.out_features < 2 * m.in_features or not reaches_output(m.node):
                raise ValueError(f"{plan.source}: {v[1]!r} asks colwise for {v[2]}, which is in no attention "
                                 "or MLP block: outside a block numatp splits only an LM head (a projection "
                                 "that widens to the output)")
            state.forced_lm.add(m.node)
        elif v[0] == "replicate":
            state.no_lm_head.add(m.node)
        else:
            raise ValueError(f"{plan.source}: {v[1]!r} asks {v[0]} for {v[2]}, which is in no attention or "
                             "MLP block: nothing before it splits its input")


def decisions(ag: AtenGraph, placeholders, matmuls, tables) -> dict[str, str]:
    """Each projection's and embedding table's decision in the tp_plan vocabulary, by module."""
    index = {p: i for i, p in enumerate(placeholders)}
    out: dict[str, str] = {}
    for m in matmuls:
        role = m.node.meta["numatp"].role
        out[module_of(ag, index[m.param], "matmul")] = ("colwise" if role in ("column", "lm_head") else
                                                         "rowwise" if role == "row" else "replicate")
    for p, (sharded, _) in tables.items():
        out[module_of(ag, index[p], "lookup")] = "vocab" if sharded else "replicate"
    return out
