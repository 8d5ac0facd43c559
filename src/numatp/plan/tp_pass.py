"""The NUMA-TP pass: decide per block how to shard, and produce the partitioning schema.

Steps: find weight matmuls -> apply the tp_plan's and the policy's decisions to a
:class:`~numatp.plan.state.PlanState` -> rounds of :func:`_assign` (pair matmuls into blocks, choose each
column's per-socket output sets) and :func:`~numatp.plan.propagate.propagate` (layouts, stopping at the
first :class:`~numatp.plan.propagate.Conflict`) -> on a conflict :func:`_relax` gives up one decision
(split along K/V groups, replicate the narrower columns, replicate the block) and records why, at most
``PlanState.max_rounds`` rounds -> vocabulary-parallel tables (:mod:`numatp.plan.vocab`) -> the schema,
each block with its :class:`~numatp.plan.schema.Reason`. The graph is annotated in place while planning
(``node.meta["numatp"]``), and the plan keeps each node's decision (``Plan.nodes``), from which
:mod:`numatp.plan.localize` makes one program per socket.

Contract. Takes: an :class:`~numatp.plan.trace.AtenGraph`, a socket count, a policy (with a decider for
"auto") and optionally a tp_plan (:mod:`numatp.plan.tp_plan`). Guarantees: a :class:`Plan` in which
every attention and MLP block is sharded (column/row parallel, one reduction) or replicated with its
reason; the LM head column-parallel where it can be; the largest embedding table vocabulary-parallel
where it can be; ``to_tp_plan()`` gives its decisions back in the tp_plan vocabulary. Refuses
(ValueError): a socket count below 1 or one that leaves a socket without a head of some block, an
unknown policy, and a tp_plan decision the dataflow cannot honour. A graph that does not settle within
its bound of rounds is an internal error (RuntimeError) naming the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.fx

from numatp.plan.overrides import apply_fixed, decisions, fixed_decisions
from numatp.plan.propagate import Conflict, Shard, group_head_sets, propagate
from numatp.plan.roles import (ATTENTION_MARKS, WeightMatmul, block_module, column_segments, find_blocks,
                               find_weight_matmuls, has_attention, reaches_output)
from numatp.plan.schema import Block, Colwise, IndexSet, Plan, Reason, Replicate, Rowwise, WeightPlan, even_split
from numatp.plan.state import PlanState, Round
from numatp.plan.tp_plan import TpPlan
from numatp.plan.trace import AtenGraph
from numatp.plan.vocab import replica_users, shard_vocabulary

__all__ = ["plan_graph", "replica_users", "group_head_sets", "BlockCandidate", "Decider", "PlanState"]

aten = torch.ops.aten


@dataclass(frozen=True)
class BlockCandidate:
    """What a decider sees of a block before it is sharded."""

    kind: str
    module: str
    tokens: int
    hidden: int
    inner: int
    weight_bytes: int
    itemsize: int


Decider = Callable[[BlockCandidate, int], tuple[dict[str, float], str]]
"""``decide(block, sockets) -> ({"sharded": s, "unsharded": s, ...}, reason)``: predicted seconds per choice."""


def _column_sets(col: WeightMatmul, sockets: int,
                 groups: tuple[int, int] | None = None) -> tuple[IndexSet, ...] | None:
    """Per-socket output sets of a column matmul, or None if a piece has fewer units than sockets.

    ``groups`` = (query heads, K/V heads) of the block's grouped-query attention: pieces of that many
    heads are split along the K/V groups (:func:`group_head_sets`), K/V heads shared where sockets
    outnumber them.
    """
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(sockets)]
    pieces = column_segments(col)
    # pieces too small to split ride along whole only beside a piece that is split
    splits_some = any(length // unit >= sockets for _, length, unit in pieces)
    for offset, length, unit in pieces:
        heads = length // unit if unit > 1 else 0
        if groups is not None and heads in groups:
            sets = group_head_sets(heads, *groups, sockets)
            if sets is None:
                return None
            for r, s in enumerate(sets):
                per_rank[r] += s.scaled(unit).shifted(offset).intervals
            continue
        if unit == 1 and length % (16 * sockets) == 0:
            unit = 16  # whole vector-register-sized groups keep the local GEMMs aligned
        if length // unit < sockets and splits_some and unit > 1:
            # a part of a fused projection with fewer heads than sockets (Falcon's one K and one V head
            # beside the query heads): every socket computes it whole from its own copy of its rows
            for r in range(sockets):
                per_rank[r].append((offset, offset + length))
            continue
        if length // unit < sockets:
            return None
        for r, s in enumerate(even_split(length, sockets, unit)):
            per_rank[r] += s.shifted(offset).intervals
    return tuple(IndexSet(tuple(iv)) for iv in per_rank)


def plan_graph(ag: AtenGraph, sockets: int, *, policy: str = "always", decide: Decider | None = None,
               plan: TpPlan | None = None) -> Plan:
    """Annotate ``ag.gm`` for ``sockets`` sockets and return the schema.

    ``policy``: "always" shards every block the pass understands, "never" none, "auto" asks ``decide``
    for every block's predicted time sharded and unsharded and shards all blocks when their total
    sharded time is lower, none otherwise: a block left unsharded inside a sharded program would run
    whole on every socket's share of the cores, so a mixed plan is never the fast one.

    ``plan`` (:mod:`numatp.plan.tp_plan`) fixes the decision of the modules it names, whatever the policy:
    a block with a colwise or rowwise member is sharded (an error where the pass cannot), a replicated
    output projection replicates its block, a replicated column projection is computed whole beside the
    split ones; the policy decides the blocks it does not name. A decision the graph cannot honour (a
    rowwise layer fed by a replicated activation, a colwise one fed by a split one) is an error naming
    the module and the reason.
    """
    if not isinstance(sockets, int) or sockets < 1:
        raise ValueError(f"sockets={sockets!r}: the socket count must be an integer >= 1")
    if policy not in ("always", "never", "auto"):
        raise ValueError(f"policy={policy!r}: choose 'always', 'never' or 'auto'")
    if policy == "auto" and decide is None:
        raise ValueError("policy='auto' needs a decider (numatp.compile passes the cost model's)")
    gm = ag.gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = {n: ag.names[i] for i, n in enumerate(placeholders)}
    params = {n for i, n in enumerate(placeholders) if ag.is_param[i]}
    states = {n for i, n in enumerate(placeholders) if ag.states[i]}
    matmuls = find_weight_matmuls(gm, params)
    by_node = {m.node: m for m in matmuls}
    state = PlanState()
    fixed, fixed_tables = fixed_decisions(plan, ag, matmuls, placeholders, params) if plan is not None else ({}, {})
    apply_fixed(plan, fixed, matmuls, names, state)
    if policy == "auto":
        # only blocks the pass can actually shard count: a block it must replicate (a norm over the
        # sharded features, say) runs whole either way, and its predicted gain would be fiction
        try:
            shardable = {b.row for b in plan_graph(ag, sockets, policy="always").blocks if b.sharded and b.row}
        except ValueError:  # these sockets cannot split some block's heads: nothing is sharded
            shardable = set()
        candidates = [(row, cols) for row, cols in find_blocks(matmuls, set())
                      if names[row.param] in shardable and row.node not in state.forced
                      and row.node not in state.excluded]
        policy = _auto(candidates, names, sockets, decide, state)
    limit = PlanState.max_rounds(matmuls)
    while True:
        state.rounds += 1
        if state.rounds > limit:
            raise RuntimeError(f"numatp internal error: planning the graph of {_graph_name(ag)} did not settle "
                               f"in {limit} rounds (each round must give up one decision); please report it "
                               "with the model")
        rnd = _assign(state, matmuls, by_node, names, sockets, policy)
        conflict = propagate(gm, rnd.column_sets, rnd.rows, rnd.lm_heads, rnd.grouped_ids, states)
        if conflict is None:
            break
        _relax(state, rnd, conflict, sockets, names, fixed, plan)
    if policy != "never" or any(v[0] == "vocab" for v in fixed_tables.values()):
        tables = shard_vocabulary(gm, params, names, rnd.column_sets, by_node, sockets, fixed_tables,
                                   plan.source if plan is not None else "plan")
    else:
        tables = {}
    by_plan = {n: (plan.source, fixed[n][1]) for n in state.forced_rep}
    result = _schema(gm, sockets, rnd.members, state, names, params, by_node, tables,
                     decisions(ag, placeholders, matmuls, tables), by_plan)
    return replace(result, predicted=state.predicted) if state.predicted else result


def _graph_name(ag: AtenGraph) -> str:
    """A graph, named by its first and last parameters (a graph has no name of its own)."""
    named = [n for n, p in zip(ag.names, ag.is_param) if p]
    return f"{named[0]} .. {named[-1]} ({len(named)} parameters)" if named else f"{len(ag.names)} inputs"


def _assign(state: PlanState, matmuls: list[WeightMatmul], by_node: dict[torch.fx.Node, WeightMatmul],
            names: dict[torch.fx.Node, str], sockets: int, policy: str) -> Round:
    """Blocks and LM heads as the state stands, with each split projection's per-socket output sets.
    A block none of whose column projections can split over ``sockets`` is the user's error."""
    blocks = [b for b in find_blocks(matmuls, state.excluded) if policy != "never" or b[0].node in state.forced]
    column_sets: dict[torch.fx.Node, tuple[int, tuple[IndexSet, ...]]] = {}
    rows: dict[torch.fx.Node, int] = {}
    members: list[tuple[WeightMatmul | None, list[WeightMatmul], list[WeightMatmul]]] = []
    grouped_ids: set[int] = set()
    for row, cols in blocks:
        bid = len(members)
        if row.node in state.grouped:
            grouped_ids.add(bid)
        sets = {c.node: _column_sets(c, sockets, state.grouped.get(row.node)) for c in cols}
        if row.node in state.narrowed:
            # K/V heads that split unlike the query heads: replicate the narrower projections
            widest = max(c.out_features for c in cols)
            sets = {n: (v if by_node[n].out_features == widest else None) for n, v in sets.items()}
        sets = {n: (None if n in state.forced_rep else v) for n, v in sets.items()}
        split = [c for c in cols if sets[c.node] is not None]
        if not split:
            module = block_module([names[m.param] for m in [*cols, row]])
            dims = ", ".join(f"{names[c.param]}: {c.out_features} outputs in pieces "
                             f"{[(o, n // u) for o, n, u in column_segments(c)]} (offset, units)" for c in cols)
            raise ValueError(f"{module}: cannot split over {sockets} sockets ({dims}); pass fewer sockets "
                             "or policy='auto'")
        for c in split:
            column_sets[c.node] = (bid, sets[c.node])
        rows[row.node] = bid
        members.append((row, split, [c for c in cols if sets[c.node] is None]))
    lm_heads = set()
    paired = {m.node for r, s, rep in members for m in [r, *s, *rep] if m is not None}
    for m in matmuls:
        if m.node not in state.forced_lm and (m.node in paired or m.node in state.no_lm_head or policy == "never"
                                              or m.out_features < 2 * m.in_features or not reaches_output(m.node)):
            continue
        sets = _column_sets(m, sockets)
        if sets is None:
            continue
        column_sets[m.node] = (len(members), sets)
        lm_heads.add(m.node)
        members.append((None, [m], []))
    return Round(members, column_sets, rows, lm_heads, grouped_ids)


def _relax(state: PlanState, rnd: Round, conflict: Conflict, sockets: int, names: dict[torch.fx.Node, str],
           fixed: dict, plan: TpPlan | None) -> None:
    """Give up one decision of the block ``conflict`` names, in this order: split it along its K/V groups,
    replicate its narrower column projections, replicate the block (or leave the LM head whole). A block
    the tp_plan shards is an error instead, unless splitting along the groups may still honour it."""
    row, cols, _ = rnd.members[conflict.block]
    module = block_module([names[m.param] for m in [*cols, *([row] if row else [])]])
    regroup = conflict.groups is not None and row is not None and row.node not in state.grouped
    q_heads, kv_heads = conflict.groups if conflict.groups is not None else (0, 0)
    can_group = regroup and group_head_sets(q_heads, q_heads, kv_heads, sockets) is not None
    if (row is None and cols[0].node in state.forced_lm) or (row is not None and row.node in state.forced):
        if not can_group:
            key = cols[0].node if row is None else row.node
            value, pattern = (fixed.get(key) or next(fixed[m.node] for m in cols if m.node in fixed))[:2]
            raise ValueError(f"{plan.source}: {pattern!r} asks {value} in {module}, which the pass cannot "
                             f"shard: {conflict.reason}")
    if can_group:
        state.grouped[row.node] = conflict.groups
        return
    if regroup:
        reason = Reason("kv_groups", module=module, sockets=sockets, sizes=conflict.groups, op=conflict.op)
    else:
        reason = Reason(conflict.kind, module=module, sockets=sockets, op=conflict.op, detail=conflict.reason)
    if row is None:
        state.no_lm_head.add(cols[0].node)
        state.replicated[cols[0].node] = ("lm_head", reason)
    elif row.node not in state.narrowed and len({c.out_features for c in cols}) > 1:
        state.narrowed.add(row.node)
    else:
        state.excluded |= {row.node, *(c.node for c in cols)}
        state.replicated[row.node] = ("attention" if has_attention(row, cols) else "mlp", reason)


def _auto(blocks, names, sockets, decide, state: PlanState) -> str:
    """'always' or 'never' for the whole graph from the decider's per-block predictions; into ``state``
    the predicted seconds of the weighed blocks per choice (None when no block could be sharded) and
    each block's words: why it is sharded, or why it stays unsharded."""
    preds = []
    for row, cols in blocks:
        module = block_module([names[m.param] for m in [*cols, row]])
        cand = _candidate(row, cols, module)
        times, why = decide(cand, sockets)
        preds.append((row, cand, module, times, why))
    sharded = sum(t["sharded"] for *_, t, _ in preds)
    unsharded = sum(t["unsharded"] for *_, t, _ in preds)
    shard = bool(preds) and sharded < unsharded
    state.predicted = {"sharded": sharded, "unsharded": unsharded} if preds else None
    for row, cand, module, _times, why in preds:
        if shard:
            state.accepted[row.node] = why
        else:
            state.replicated[row.node] = (cand.kind, Reason("cost", module=module, sockets=sockets, cost=why,
                                                            predicted_ms=(1e3 * sharded, 1e3 * unsharded)))
    return "always" if shard else "never"


def _candidate(row: WeightMatmul, cols: list[WeightMatmul], module: str) -> BlockCandidate:
    ms = [row, *cols]
    itemsize = row.param.meta["val"].element_size()
    return BlockCandidate(
        kind="attention" if has_attention(row, cols) else "mlp", module=module,
        tokens=int(row.x.meta["val"].shape[0]), hidden=row.out_features, inner=row.in_features,
        weight_bytes=sum(m.param.meta["val"].numel() for m in ms) * itemsize, itemsize=itemsize,
    )


def _schema(gm, sockets, members, state: PlanState, names, params, by_node, tables, decisions,
            by_plan: dict[torch.fx.Node, tuple[str, str]]) -> Plan:
    """The schema of the annotated graph: blocks with their reasons, each parameter's placements."""
    kinds: dict[int, str] = {}
    gathers = 0
    for node in gm.graph.nodes:
        info = node.meta["numatp"]
        if node.target in ATTENTION_MARKS:
            lay = [a.meta["numatp"].layout for a in node.all_input_nodes]
            for lo in lay:
                if isinstance(lo, Shard):
                    kinds[lo.block] = "attention"
        if node.op == "output":
            gathers = sum(isinstance(a.meta["numatp"].layout, Shard)
                          for a in node.args[0] if isinstance(a, torch.fx.Node))
    blocks = []
    uses: dict[torch.fx.Node, list[WeightPlan]] = {p: [] for p in params}
    in_block: set[torch.fx.Node] = set()
    for bid, (row, split, rep) in enumerate(members):
        ms = [m for m in [*split, *rep, row] if m is not None]
        in_block |= {m.node for m in ms}
        module = block_module([names[m.param] for m in ms])
        if row is None:
            kind, reason = "lm_head", Reason("vocab_columns", module=module, sockets=sockets)
        else:
            kind = kinds.get(bid, "mlp")
            reason = Reason("column_row", module=module, sockets=sockets,
                            replicated=tuple(names[c.param] for c in rep if c.node not in by_plan),
                            source=next((by_plan[c.node][0] for c in rep if c.node in by_plan), ""),
                            by_plan=tuple((names[c.param], by_plan[c.node][1]) for c in rep if c.node in by_plan),
                            cost=state.accepted.get(row.node, ""),
                            predicted_ms=state.predicted_ms if row.node in state.accepted else None)
        blocks.append(Block(kind, module, tuple(names[c.param] for c in split),
                            names[row.param] if row else None, True, reason,
                            tuple(names[c.param] for c in rep)))
    for node, (kind, why) in state.replicated.items():
        blocks.append(Block(kind, why.module, (), names[by_node[node].param], False, why))
    for p, (sharded, why) in tables.items():
        name = names[p]
        blocks.append(Block("embedding", name.rsplit(".", 1)[0], (name,) if sharded else (), None, sharded, why))
    for node in gm.graph.nodes:
        info = node.meta["numatp"]
        if info.role == "vocab" and node.args[0] in params:
            p = node.args[0]
            use = WeightPlan(names[p], _shape(p), _isz(p), Colwise(0, info.vocab_sets))
            if use not in uses[p]:   # a tied LM head's shard is the same tensor
                uses[p].append(use)
            continue
        if info.role is None or node not in by_node:
            continue
        m = by_node[node]
        if info.role in ("column", "lm_head"):
            sets = info.layout.sets
            use = WeightPlan(names[m.param], _shape(m.param), _isz(m.param), Colwise(m.out_dim, sets))
            if use not in uses[m.param]:
                uses[m.param].append(use)
            if m.bias is not None:
                uses[m.bias].append(WeightPlan(names[m.bias], _shape(m.bias), _isz(m.bias), Colwise(0, sets)))
        else:
            sets = info.row_input.sets
            uses[m.param].append(WeightPlan(names[m.param], _shape(m.param), _isz(m.param), Rowwise(m.in_dim, sets)))
    for p in params:
        if replica_users(p, by_node) or not uses[p]:
            uses[p].append(WeightPlan(names[p], _shape(p), _isz(p), Replicate()))
    rows = sum(1 for n in gm.graph.nodes if n.meta["numatp"].role in ("row", "vocab"))
    blocks.sort(key=lambda b: b.module)
    return Plan(sockets, tuple(blocks), {names[p]: tuple(u) for p, u in uses.items()}, rows, gathers,
                decisions=decisions, nodes={n.name: n.meta["numatp"] for n in gm.graph.nodes})


def _shape(n: torch.fx.Node) -> tuple[int, ...]:
    return tuple(n.meta["val"].shape)


def _isz(n: torch.fx.Node) -> int:
    return n.meta["val"].element_size()
