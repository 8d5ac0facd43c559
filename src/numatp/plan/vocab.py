"""Vocabulary-parallel embedding tables: the largest table split by rows over the sockets, lookups
summed by one all-reduce; the other tables replicated, each with its reason.
"""

from __future__ import annotations

import torch
import torch.fx

from numatp.plan.roles import TRANSPOSE_OPS, WeightMatmul
from numatp.plan.schema import Reason, even_split

__all__ = ["embedding_tables", "replica_users", "shard_vocabulary"]

aten = torch.ops.aten
_EMBEDDING = aten.embedding.default


def embedding_tables(gm: torch.fx.GraphModule, params: set[torch.fx.Node]) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Each 2-D parameter that ``aten.embedding`` looks up, with its lookups."""
    tables: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.target is _EMBEDDING and n.args[0] in params and n.args[0].meta["val"].dim() == 2:
            tables.setdefault(n.args[0], []).append(n)
    return tables


def shard_vocabulary(gm, params, names, column_sets, by_node, sockets, fixed=None,
                      source="plan") -> dict[torch.fx.Node, tuple[bool, Reason]]:
    """Make the largest embedding table vocabulary-parallel: socket r holds a contiguous range of its rows,
    looks up the ids in that range (zeros elsewhere), and one all-reduce sums the lookups. A tied LM head
    keeps its own column sets and the table takes the same ones, so both read one shard. ``fixed``: the
    plan's ``(value, pattern, module)`` per table, which chooses the table ("vocab") or none ("replicate").
    Returns every table with (sharded, why)."""
    tables = embedding_tables(gm, params)
    if not tables:
        return {}
    fixed = fixed or {}
    chosen = [p for p, v in fixed.items() if v[0] == "vocab"]
    vocab = chosen[0] if chosen else max(tables, key=lambda p: p.meta["val"].numel())
    out: dict[torch.fx.Node, tuple[bool, Reason]] = {}
    module = {p: names[p].rsplit(".", 1)[0] for p in tables}
    replicate_all = vocab in fixed and fixed[vocab][0] == "replicate"
    for p in tables:
        if p in fixed and (p is not vocab or replicate_all):
            out[p] = (False, Reason("by_plan", module=module[p], source=source, pattern=fixed[p][1]))
        elif p is not vocab:
            out[p] = (False, Reason("small_table", module=module[p], sockets=sockets,
                                    sizes=(*p.meta["val"].shape, *vocab.meta["val"].shape)))
    if replicate_all:
        return out
    rows = vocab.meta["val"].shape[0]
    heads = [m for m in by_node.values() if m.param is vocab and m.node in column_sets]
    sets = (column_sets[heads[0].node][1] if heads
            else even_split(rows, sockets, 16 if rows % (16 * sockets) == 0 else 1))
    if rows < sockets or any(len(s.intervals) != 1 for s in sets):
        why = Reason("uneven_table", module=module[vocab], sockets=sockets, sizes=(rows,))
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
        out[vocab] = (False, Reason("read_whole", module=module[vocab], sockets=sockets,
                                    op=f"{readers[0].target} ({readers[0].name})"))
        return out
    out[vocab] = (True, Reason("vocab_rows", module=module[vocab], sockets=sockets,
                               sizes=tuple(i for s in sets for i in s.intervals[0]), tied=bool(heads)))
    return out


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
