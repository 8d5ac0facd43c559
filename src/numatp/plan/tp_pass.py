"""The NUMA-TP pass: decide per block how to shard, and produce the partitioning schema.

Steps (each a function below): find weight matmuls -> pair them into blocks -> choose each column's
per-socket output sets -> propagate layouts -> on an unsupported op, replicate that block and repeat ->
record the schema. The graph is annotated in place while planning (``node.meta["numatp"]``), and the
plan keeps each node's decision (``Plan.nodes``), from which :mod:`numatp.plan.localize` makes one
program per socket.

Contract. Takes: an :class:`~numatp.plan.trace.AtenGraph`, a socket count, a policy (with a decider for
"auto") and optionally a tp_plan (:mod:`numatp.plan.tp_plan`). Guarantees: a :class:`Plan` in which
every attention and MLP block is sharded (column/row parallel, one reduction) or replicated with its
reason; the LM head column-parallel where it can be; the largest embedding table vocabulary-parallel
where it can be; ``to_tp_plan()`` gives its decisions back in the tp_plan vocabulary. Refuses
(ValueError): a socket count below 1 or one that leaves a socket without a head of some block, an
unknown policy, and a tp_plan decision the dataflow cannot honour.
"""

from __future__ import annotations


import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.fx

from numatp.plan.propagate import ATTENTION_OPS, GroupSplit, Shard, Unsupported, group_head_sets, propagate
from numatp.plan.roles import TRANSPOSE_OPS, WeightMatmul, column_segments, find_blocks, find_weight_matmuls
from numatp.plan.schema import (Block, Colwise, IndexSet, Plan, Replicate, Rowwise, WeightPlan, even_split)
from numatp.plan.tp_plan import TpPlan
from numatp.plan.trace import AtenGraph

__all__ = ["plan_graph", "replica_users", "group_head_sets", "BlockCandidate", "Decider"]

aten = torch.ops.aten
_SOFTMAX = {aten._softmax.default, aten._safe_softmax.default}
_EMBEDDING = aten.embedding.default
# what marks a block as attention: an attention op, a softmax, or the batched products of the math path
# (Inductor's decompositions turn softmax into exp / sum, so the products are what remains)
_ATTENTION_MARKS = ATTENTION_OPS | _SOFTMAX | {aten.bmm.default, aten.baddbmm.default}


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


def _module(names: list[str]) -> str:
    parts = [n.split(".")[:-1] for n in names]
    common = os.path.commonprefix(parts) if parts else []
    if len(parts) == 1:
        return ".".join(parts[0])
    return ".".join(common) or ", ".join(".".join(p) for p in parts)


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
    excluded: set[torch.fx.Node] = set()
    reasons: dict[torch.fx.Node, tuple[str, str, str]] = {}  # row (or LM head) -> (kind, module, why) if replicated
    accepted: dict[torch.fx.Node, str] = {}  # row -> the decider's reason to shard
    no_lm_head: set[torch.fx.Node] = set()
    narrowed: set[torch.fx.Node] = set()   # rows whose block retries with only the widest columns split
    grouped: dict[torch.fx.Node, tuple[int, int]] = {}  # rows whose block retries split along its K/V groups
    predicted = None
    fixed, fixed_tables = _fixed(plan, ag, matmuls, placeholders, params) if plan is not None else ({}, {})
    forced, forced_lm, forced_rep = _apply_fixed(plan, fixed, matmuls, names, excluded, reasons, no_lm_head)
    if policy == "auto":
        # only blocks the pass can actually shard count: a block it must replicate (a norm over the
        # sharded features, say) runs whole either way, and its predicted gain would be fiction
        try:
            shardable = {b.row for b in plan_graph(ag, sockets, policy="always").blocks if b.sharded and b.row}
        except ValueError:  # these sockets cannot split some block's heads: nothing is sharded
            shardable = set()
        candidates = [(row, cols) for row, cols in find_blocks(matmuls, set())
                      if names[row.param] in shardable and row.node not in forced and row.node not in excluded]
        policy, predicted = _auto(candidates, names, sockets, decide, accepted, reasons)
    while True:
        blocks = [b for b in find_blocks(matmuls, excluded) if policy != "never" or b[0].node in forced]
        column_sets: dict[torch.fx.Node, tuple[int, tuple[IndexSet, ...]]] = {}
        rows: dict[torch.fx.Node, int] = {}
        members: list[tuple[WeightMatmul | None, list[WeightMatmul], list[WeightMatmul]]] = []
        grouped_ids: set[int] = set()
        for row, cols in blocks:
            bid = len(members)
            if row.node in grouped:
                grouped_ids.add(bid)
            sets = {c.node: _column_sets(c, sockets, grouped.get(row.node)) for c in cols}
            if row.node in narrowed:
                # K/V heads that split unlike the query heads: replicate the narrower projections
                widest = max(c.out_features for c in cols)
                sets = {n: (v if by_node[n].out_features == widest else None) for n, v in sets.items()}
            sets = {n: (None if n in forced_rep else v) for n, v in sets.items()}
            split = [c for c in cols if sets[c.node] is not None]
            module = _module([names[m.param] for m in [*cols, row]])
            if not split:
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
            if m.node not in forced_lm and (m.node in paired or m.node in no_lm_head or policy == "never"
                                            or m.out_features < 2 * m.in_features or not _reaches_output(m.node)):
                continue
            sets = _column_sets(m, sockets)
            if sets is None:
                continue
            column_sets[m.node] = (len(members), sets)
            lm_heads.add(m.node)
            members.append((None, [m], []))
        try:
            propagate(gm, column_sets, rows, lm_heads, grouped_ids, states)
            break
        except Unsupported as e:
            row, cols, _ = members[e.block]
            if (row is None and cols[0].node in forced_lm) or (row is not None and row.node in forced):
                grouping = isinstance(e, GroupSplit) and row is not None and row.node not in grouped
                # grouping implies a GroupSplit, which carries the head counts
                if not grouping or group_head_sets(e.q_heads, e.q_heads, e.kv_heads,  # type: ignore[attr-defined]
                                                   sockets) is None:
                    key = cols[0].node if row is None else row.node
                    value, pattern = (fixed.get(key) or next(fixed[m.node] for m in cols if m.node in fixed))[:2]
                    raise ValueError(f"{plan.source}: {pattern!r} asks {value} in "
                                     f"{_module([names[m.param] for m in [*cols, *([row] if row else [])]])}, "
                                     f"which the pass cannot shard: {e.reason}") from e
            if isinstance(e, GroupSplit) and row is not None and row.node not in grouped:
                if group_head_sets(e.q_heads, e.q_heads, e.kv_heads, sockets) is not None:
                    grouped[row.node] = (e.q_heads, e.kv_heads)
                    continue
                e = Unsupported(e.block, f"{e.q_heads} query heads in {e.kv_heads} K/V groups cannot be split "
                                         f"along the groups over {sockets} sockets")
            if row is None:
                no_lm_head.add(cols[0].node)
                reasons[cols[0].node] = ("lm_head", _module([names[cols[0].param]]), e.reason)
            elif row.node not in narrowed and len({c.out_features for c in cols}) > 1:
                narrowed.add(row.node)
            else:
                excluded |= {row.node, *(c.node for c in cols)}
                kind = "attention" if _has_attention(row, cols) else "mlp"
                reasons[row.node] = (kind, _module([names[m.param] for m in [*cols, row]]), e.reason)
    if policy != "never" or any(v[0] == "vocab" for v in fixed_tables.values()):
        tables = _shard_vocabulary(gm, params, names, column_sets, by_node, sockets, fixed_tables,
                                   plan.source if plan is not None else "plan")
    else:
        tables = {}
    result = _schema(gm, sockets, matmuls, members, reasons, accepted, names, params, by_node, tables,
                     _decisions(ag, placeholders, matmuls, tables),
                     {n: f"by {plan.source} ({fixed[n][1]!r})" for n in forced_rep})
    return replace(result, predicted=predicted) if predicted else result


def _module_of(ag: AtenGraph, index: int, kind: str) -> str:
    """The module that reads placeholder ``index`` as ``kind`` (``matmul`` or ``lookup``)."""
    return ag.modules[index].get(kind) or ag.names[index].rsplit(".", 1)[0]


def _fixed(plan: TpPlan, ag: AtenGraph, matmuls: list[WeightMatmul], placeholders: list[torch.fx.Node],
           params: set[torch.fx.Node]) -> tuple[dict, dict]:
    """The plan's decision ``(value, pattern, module)`` per weight matmul node and per embedding table."""
    index = {p: i for i, p in enumerate(placeholders)}
    names: dict[str, list[tuple[str, object]]] = {}
    for m in matmuls:
        for key in (_module_of(ag, index[m.param], "matmul"), ag.names[index[m.param]]):
            names.setdefault(key, []).append(("matmul", m))
    tables = _embedding_tables(ag.gm, params)
    for p in tables:
        for key in (_module_of(ag, index[p], "lookup"), ag.names[index[p]]):
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


def _apply_fixed(plan, fixed, matmuls, names, excluded, reasons, no_lm_head) -> tuple[set, set, set]:
    """Blocks the plan shards (by row), LM heads it shards, column projections it replicates; blocks it
    replicates join ``excluded``. Decisions the dataflow cannot honour are errors."""
    forced: set[torch.fx.Node] = set()
    forced_lm: set[torch.fx.Node] = set()
    forced_rep: set[torch.fx.Node] = set()
    if not fixed:
        return forced, forced_lm, forced_rep
    in_block = set()
    for row, cols in find_blocks(matmuls, set()):
        in_block |= {row.node, *(c.node for c in cols)}
        module = _module([names[m.param] for m in [*cols, row]])
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
            excluded |= {row.node, *(c.node for c in cols)}
            why = r or next(fixed[c.node] for c in cols)
            kind = "attention" if _has_attention(row, cols) else "mlp"
            reasons[row.node] = (kind, module, f"replicated by {plan.source} ({why[1]!r})")
            continue
        forced_rep |= {c.node for c in cols if fixed.get(c.node, ("",))[0] == "replicate"}
        if r or col_values:
            forced.add(row.node)
    for m in matmuls:
        v = fixed.get(m.node)
        if m.node in in_block or v is None:
            continue
        if v[0] == "colwise":
            if m.out_features < 2 * m.in_features or not _reaches_output(m.node):
                raise ValueError(f"{plan.source}: {v[1]!r} asks colwise for {v[2]}, which is in no attention "
                                 "or MLP block: outside a block numatp splits only an LM head (a projection "
                                 "that widens to the output)")
            forced_lm.add(m.node)
        elif v[0] == "replicate":
            no_lm_head.add(m.node)
        else:
            raise ValueError(f"{plan.source}: {v[1]!r} asks {v[0]} for {v[2]}, which is in no attention or "
                             "MLP block: nothing before it splits its input")
    return forced, forced_lm, forced_rep


def _decisions(ag: AtenGraph, placeholders, matmuls, tables) -> dict[str, str]:
    """Each projection's and embedding table's decision in the tp_plan vocabulary, by module."""
    index = {p: i for i, p in enumerate(placeholders)}
    out: dict[str, str] = {}
    for m in matmuls:
        role = m.node.meta["numatp"].role
        out[_module_of(ag, index[m.param], "matmul")] = ("colwise" if role in ("column", "lm_head") else
                                                         "rowwise" if role == "row" else "replicate")
    for p, (sharded, _) in tables.items():
        out[_module_of(ag, index[p], "lookup")] = "vocab" if sharded else "replicate"
    return out


def _embedding_tables(gm: torch.fx.GraphModule, params: set[torch.fx.Node]) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Each 2-D parameter that ``aten.embedding`` looks up, with its lookups."""
    tables: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.target is _EMBEDDING and n.args[0] in params and n.args[0].meta["val"].dim() == 2:
            tables.setdefault(n.args[0], []).append(n)
    return tables


def _shard_vocabulary(gm, params, names, column_sets, by_node, sockets, fixed=None,
                      source="plan") -> dict[torch.fx.Node, tuple[bool, str]]:
    """Make the largest embedding table vocabulary-parallel: socket r holds a contiguous range of its rows,
    looks up the ids in that range (zeros elsewhere), and one all-reduce sums the lookups. A tied LM head
    keeps its own column sets and the table takes the same ones, so both read one shard. ``fixed``: the
    plan's ``(value, pattern, module)`` per table, which chooses the table ("vocab") or none ("replicate").
    Returns every table with (sharded, why)."""
    tables = _embedding_tables(gm, params)
    if not tables:
        return {}
    fixed = fixed or {}
    chosen = [p for p, v in fixed.items() if v[0] == "vocab"]
    vocab = chosen[0] if chosen else max(tables, key=lambda p: p.meta["val"].numel())
    out: dict[torch.fx.Node, tuple[bool, str]] = {}
    if vocab in fixed and fixed[vocab][0] == "replicate":
        for p in tables:
            out[p] = (False, f"replicated by {source} ({fixed[p][1]!r})" if p in fixed else "replicated")
        return out
    for p in tables:
        if p in fixed and p is not vocab:
            out[p] = (False, f"replicated by {source} ({fixed[p][1]!r})")
        elif p is not vocab:
            rows, width = p.meta["val"].shape
            out[p] = (False, f"small table ({rows} x {width}) beside the {tuple(vocab.meta['val'].shape)} "
                             "vocabulary: replicated, sharding it would add an all-reduce for little memory")
    rows = vocab.meta["val"].shape[0]
    heads = [m for m in by_node.values() if m.param is vocab and m.node in column_sets]
    sets = (column_sets[heads[0].node][1] if heads
            else even_split(rows, sockets, 16 if rows % (16 * sockets) == 0 else 1))
    if rows < sockets or any(len(s.intervals) != 1 for s in sets):
        why = f"{rows} rows cannot be split into one contiguous range per socket over {sockets} sockets"
        if vocab in fixed:
            raise ValueError(f"{source}: {fixed[vocab][1]!r} asks vocab for {fixed[vocab][2]}, but {why}")
        out[vocab] = (False, why)
        return out
    for n in tables[vocab]:
        n.meta["numatp"].role = "vocab"
        n.meta["numatp"].vocab_sets = sets
    readers = replica_users(vocab, by_node)
    if readers and vocab in fixed:
        raise ValueError(f"{source}: {fixed[vocab][1]!r} asks vocab for {fixed[vocab][2]}, but "
                         f"{readers[0].target} ({readers[0].name}) reads the whole table (a tied LM head left "
                         "replicated?): split that reader too, or replicate the table")
    if readers:   # e.g. a tied LM head the pass left replicated: the whole table is on every socket anyway
        for n in tables[vocab]:
            n.meta["numatp"].role, n.meta["numatp"].vocab_sets = None, None
        out[vocab] = (False, f"read whole by {readers[0].target} ({readers[0].name}): replicated")
        return out
    ranges = ", ".join(f"{s.intervals[0][0]}:{s.intervals[0][1]}" for s in sets)
    out[vocab] = (True, f"vocabulary-parallel: rows {ranges} per socket, lookups summed by one all-reduce"
                        + ("; the same shards as the tied LM head" if heads else ""))
    return out


def _auto(blocks, names, sockets, decide, accepted, reasons) -> tuple[str, dict[str, float] | None]:
    """'always' or 'never' for the whole graph from the decider's per-block predictions, and the
    predicted seconds of the weighed blocks per choice (None when no block could be sharded)."""
    preds = []
    for row, cols in blocks:
        module = _module([names[m.param] for m in [*cols, row]])
        cand = _candidate(row, cols, module)
        times, why = decide(cand, sockets)
        preds.append((row, cand, module, times, why))
    sharded = sum(t["sharded"] for *_, t, _ in preds)
    unsharded = sum(t["unsharded"] for *_, t, _ in preds)
    shard = bool(preds) and sharded < unsharded
    total = f"graph predicted {1e3 * sharded:.1f} ms sharded vs {1e3 * unsharded:.1f} ms unsharded"
    for row, cand, module, _times, why in preds:
        if shard:
            accepted[row.node] = f"{why}; {total}"
        else:
            reasons[row.node] = (cand.kind, module, f"{why}; {total}: the graph stays unsharded")
    return ("always" if shard else "never"), ({"sharded": sharded, "unsharded": unsharded} if preds else None)


def _reaches_output(node: torch.fx.Node) -> bool:
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


def _has_attention(row: WeightMatmul, cols: list[WeightMatmul]) -> bool:
    stops = {c.node for c in cols}
    todo, seen = [row.x], set()
    while todo:
        n = todo.pop()
        if n in seen or n in stops:
            continue
        seen.add(n)
        if n.target in _ATTENTION_MARKS:
            return True
        todo.extend(n.all_input_nodes)
    return False


def _candidate(row: WeightMatmul, cols: list[WeightMatmul], module: str) -> BlockCandidate:
    ms = [row, *cols]
    itemsize = row.param.meta["val"].element_size()
    return BlockCandidate(
        kind="attention" if _has_attention(row, cols) else "mlp", module=module,
        tokens=int(row.x.meta["val"].shape[0]), hidden=row.out_features, inner=row.in_features,
        weight_bytes=sum(m.param.meta["val"].numel() for m in ms) * itemsize, itemsize=itemsize,
    )


def replica_users(param: torch.fx.Node, by_node: dict[torch.fx.Node, WeightMatmul],
                  infos: dict | None = None) -> list[torch.fx.Node]:
    """Users of a parameter that read it whole: everything but sharded matmuls, their transposes and
    vocabulary-parallel lookups (the decisions from ``infos``, a plan's per-node record, or else from the
    graph being planned)."""
    def sharded_use(u: torch.fx.Node) -> bool:
        info = infos[u] if infos is not None else u.meta["numatp"]
        if (u in by_node or u.target is _EMBEDDING) and info.role:
            return True
        return u.target in TRANSPOSE_OPS and all(sharded_use(v) for v in u.users)
    return [u for u in param.users if not sharded_use(u)]


def _schema(gm, sockets, matmuls, members, reasons, accepted, names, params, by_node, tables, decisions,
            replicated_by) -> Plan:
    kinds: dict[int, str] = {}
    gathers = 0
    for node in gm.graph.nodes:
        info = node.meta["numatp"]
        if node.target in _ATTENTION_MARKS:
            lay = [a.meta["numatp"].layout for a in node.all_input_nodes]
            for layout in lay:
                if isinstance(layout, Shard):
                    kinds[layout.block] = "attention"
        if node.op == "output":
            gathers = sum(isinstance(a.meta["numatp"].layout, Shard)
                          for a in node.args[0] if isinstance(a, torch.fx.Node))
    blocks = []
    uses: dict[torch.fx.Node, list[WeightPlan]] = {p: [] for p in params}
    in_block: set[torch.fx.Node] = set()
    for bid, (row, split, rep) in enumerate(members):
        ms = [m for m in [*split, *rep, row] if m is not None]
        in_block |= {m.node for m in ms}
        module = _module([names[m.param] for m in ms])
        if row is None:
            kind, reason = "lm_head", "column-parallel over the vocabulary, then gathered"
        else:
            kind = kinds.get(bid, "mlp")
            few = [names[c.param] for c in rep if c.node not in replicated_by]
            reason = "column/row parallel" + (f"; {', '.join(few)} replicated: too few heads to split" if few else "")
            reason += "".join(f"; {names[c.param]} replicated {replicated_by[c.node]}" for c in rep
                              if c.node in replicated_by)
            if row.node in accepted:
                reason += f"; {accepted[row.node]}"
        blocks.append(Block(kind, module, tuple(names[c.param] for c in split),
                            names[row.param] if row else None, True, reason,
                            tuple(names[c.param] for c in rep)))
    for node, (kind, module, why) in reasons.items():
        blocks.append(Block(kind, module, (), names[by_node[node].param], False, why))
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
