"""One program per socket from the annotated graph: local shapes, local weights, explicit collectives.

The program of socket r has the same structure as the global graph, with
- each sharded parameter replaced by socket r's shard (a placeholder of local shape),
- shape constants of views, expands, splits and slices rewritten to socket r's sizes,
- ``numatp::all_reduce`` right after each row-parallel matmul, before its bias, and after each
  vocabulary-parallel lookup (the ids outside the socket's rows look up zeros),
- ``numatp::all_gather`` before each sharded value that leaves the program,
- replicated values that meet sharded ones cut to socket r's indices.

Contract. Takes: the traced graph and the :class:`~numatp.plan.schema.Plan` that :func:`plan_graph` made
for it, and a rank below ``plan.sockets``. Guarantees: every decision comes from ``plan.nodes``, so a
later planning of the same graph (another socket count, another policy) changes nothing here; every
socket's program performs the same collectives in the same order; each placeholder is a
:class:`Binding`. Refuses: a rank outside the plan, a plan made for another graph (ValueError).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from numatp.plan import ops  # noqa: F401  (registers numatp::all_reduce / all_gather)
from numatp.plan.propagate import NodeInfo, Shard
from numatp.plan.roles import TRANSPOSE_OPS, WeightMatmul, find_weight_matmuls, slice_bounds
from numatp.plan.schema import Colwise, IndexSet, Placement, Plan, Replicate, Rowwise
from numatp.plan.tp_pass import replica_users
from numatp.plan.trace import AtenGraph

__all__ = ["Binding", "LocalProgram", "localize", "for_process"]

aten = torch.ops.aten
numatp_ops = torch.ops.numatp


@dataclass(frozen=True)
class Binding:
    """Where a local placeholder's value comes from: caller input ``index``, whole or as ``placement``."""

    index: int
    placement: Placement | None  # None: an activation input, passed through as is
    lookup: bool = False
    """A vocabulary-parallel lookup's rows: the same shard as a tied LM head's, kept plain (unpacked) when
    the LM head's operand is replaced by a GEMM-packed one."""
    state: bool = False
    """An input the program writes in place (a KV cache, its length): each socket holds its own copy of
    its part (``Replicate()`` or the heads of a ``Colwise``), kept from call to call."""


@dataclass
class LocalProgram:
    rank: int
    gm: torch.fx.GraphModule
    bindings: list[Binding]

    @property
    def weight_indices(self) -> set[int]:
        """Indices of the program's arguments that are weights (bound with a placement, not a state)."""
        return {i for i, bd in enumerate(self.bindings) if bd.placement is not None and not bd.state}


def _local_shape(node: torch.fx.Node, rank: int, infos: dict) -> list[int]:
    shape = list(node.meta["val"].shape)
    lay = infos[node].layout
    if isinstance(lay, Shard):
        shape[lay.dim] = len(lay.sets[rank])
    return shape


def _cut(g: torch.fx.Graph, x: torch.fx.Node, dim: int, s: IndexSet) -> torch.fx.Node:
    pieces = [g.call_function(aten.slice.Tensor, (x, dim, lo, hi)) for lo, hi in s.intervals]
    return pieces[0] if len(pieces) == 1 else g.call_function(aten.cat.default, (pieces, dim))


def localize(ag: AtenGraph, plan: Plan, rank: int) -> LocalProgram:
    """The program of socket ``rank`` of ``plan`` (made by :func:`plan_graph` for ``ag``): every decision
    is read from the plan's per-node record, none from whatever a later planning left on the graph."""
    src = ag.gm.graph
    if not 0 <= rank < plan.sockets:
        raise ValueError(f"rank {rank}: this plan is for {plan.sockets} socket(s), ranks 0 to {plan.sockets - 1}")
    missing = [n.name for n in src.nodes if n.name not in plan.nodes]
    if missing:
        raise ValueError(f"this plan was made for another graph (it has no decision for {missing[:3]}); "
                         "plan the graph you localize")
    infos: dict[torch.fx.Node, NodeInfo] = {n: plan.nodes[n.name] for n in src.nodes}
    placeholders = [n for n in src.nodes if n.op == "placeholder"]
    params = {n for i, n in enumerate(placeholders) if ag.is_param[i]}
    by_node = {m.node: m for m in find_weight_matmuls(ag.gm, params)}
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    bindings: list[Binding] = []
    weights: dict[tuple[torch.fx.Node, str, int, bool], torch.fx.Node] = {}

    def weight(p: torch.fx.Node, placement: Placement, lookup: bool = False) -> torch.fx.Node:
        key = (p, type(placement).__name__, getattr(placement, "dim", -1), lookup)
        if key not in weights:
            idx = placeholders.index(p)
            weights[key] = g.placeholder(f"{p.name}_{type(placement).__name__.lower()}{'_rows' if lookup else ''}")
            weights[key].meta["numatp_param"] = ag.names[idx]   # the parameter's name, for messages
            bindings.append(Binding(idx, placement, lookup))
        return weights[key]

    # placeholders first: activations, then replicated weights, then shards (created below in order)
    for i, p in enumerate(placeholders):
        if p not in params:
            env[p] = g.placeholder(p.name)
            lay = infos[p].layout
            bindings.append(Binding(i, None) if not ag.states[i] else
                            Binding(i, Replicate() if lay is None else Colwise(lay.dim, lay.sets), state=True))
        elif replica_users(p, by_node, infos):
            env[p] = weight(p, Replicate())
    for p in placeholders:
        for u in p.users:
            if u in by_node and infos[u].role:
                _shard_placeholders(u, by_node[u], weight, infos)
            elif infos[u].role == "vocab" and u.args[0] is p:
                weight(p, Colwise(0, infos[u].vocab_sets), lookup=True)
            for v in u.users if u.target in TRANSPOSE_OPS else ():
                if v in by_node and infos[v].role:
                    _shard_placeholders(v, by_node[v], weight, infos)
    tag = 0
    for node in src.nodes:
        info = infos[node]
        if node.op == "placeholder" or node in env:
            continue
        if node.op == "output":
            outs = []
            for a in node.args[0]:
                lay = infos[a].layout if isinstance(a, torch.fx.Node) else None
                if isinstance(lay, Shard):
                    full = int(a.meta["val"].shape[lay.dim])
                    gathered = g.call_function(numatp_ops.all_gather.default, (env[a], lay.dim, full, tag))
                    gathered.meta["numatp_gather"] = lay.sets
                    outs.append(gathered)
                    tag += 1
                else:
                    outs.append(env[a] if isinstance(a, torch.fx.Node) else a)
            g.output(tuple(outs))
            continue
        if info.role == "vocab":
            env[node] = g.call_function(numatp_ops.all_reduce.default,
                                        (_lookup(g, node, env, weight, rank, infos), tag))
            tag += 1
            continue
        if info.role is not None:
            m = by_node[node]
            w = _shard_placeholders(node, m, weight, infos)
            for c in reversed(m.chain):
                w = g.call_function(c.target, (w, *c.args[1:]))
            x = env[m.x]
            if info.role == "row":
                out = g.call_function(aten.mm.default, (x, w))
                out = g.call_function(numatp_ops.all_reduce.default, (out, tag))
                tag += 1
                if m.bias is not None:
                    out = g.call_function(aten.add.Tensor, (out, weight(m.bias, Replicate())))
            elif m.bias is not None:
                out = g.call_function(aten.addmm.default, (weight(m.bias, Colwise(0, info.layout.sets)), x, w))
            else:
                out = g.call_function(aten.mm.default, (x, w))
            env[node] = out
            continue
        if all(infos[u].role for u in node.users) and node.users and node.target in TRANSPOSE_OPS \
                and node.args[0] in params:
            continue  # a weight transpose only sharded matmuls read: they transpose their own shard
        env[node] = _copy(g, node, env, rank, infos)
    g.lint()
    return LocalProgram(rank, torch.fx.GraphModule(ag.gm, g), bindings)


def _lookup(g: torch.fx.Graph, node: torch.fx.Node, env: dict, weight, rank: int, infos: dict) -> torch.fx.Node:
    """Socket ``rank``'s part of a vocabulary-parallel ``embedding(table, ids)``: its rows ``[lo, hi)``
    looked up at ``ids - lo`` where ``lo <= ids < hi``, zero rows elsewhere (summed over sockets: the lookup)."""
    table, ids = node.args[0], env[node.args[1]]
    sets = infos[node].vocab_sets
    (lo, hi), = sets[rank].intervals
    shard = weight(table, Colwise(0, sets), lookup=True)
    inside = g.call_function(aten.bitwise_and.Tensor, (g.call_function(aten.ge.Scalar, (ids, lo)),
                                                       g.call_function(aten.lt.Scalar, (ids, hi))))
    local = g.call_function(aten.mul.Tensor, (g.call_function(aten.sub.Tensor, (ids, lo)), inside))
    rows = g.call_function(aten.embedding.default, (shard, local))
    return g.call_function(aten.mul.Tensor, (rows, g.call_function(aten.unsqueeze.default, (inside, -1))))


def _shard_placeholders(node, m: WeightMatmul, weight, infos: dict):
    info = infos[node]
    if info.role == "row":
        return weight(m.param, Rowwise(m.in_dim, info.row_input.sets))
    if m.bias is not None:
        weight(m.bias, Colwise(0, info.layout.sets))
    return weight(m.param, Colwise(m.out_dim, info.layout.sets))


def _copy(g: torch.fx.Graph, node: torch.fx.Node, env: dict, rank: int, infos: dict) -> torch.fx.Node:
    info = infos[node]

    def arg(key, a):
        if isinstance(a, torch.fx.Node):
            new = env[a]
            cut = info.slice_inputs.get(key)
            return _cut(g, new, cut.dim, cut.sets[rank]) if cut is not None else new
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in a):
            return type(a)(arg((key, j), x) for j, x in enumerate(a))
        return a

    args = [arg(i, a) for i, a in enumerate(node.args)]
    kwargs = {k: arg(k, v) for k, v in node.kwargs.items()}
    x = node.args[0] if node.args else None
    if info.local_shape:
        args[1] = _local_shape(node, rank, infos)
    if info.index_at is not None:
        dim, at = info.index_at
        lo, _ = infos[node.args[0]].layout.sets[rank].local_range(at, at + 1)
        here = g.call_function(aten.full.default, ([1], lo), {"dtype": torch.int64})
        args[1] = [here if d == dim else ix for d, ix in enumerate(args[1])]
    if info.split_dim is not None:
        sizes = [len(p.sets[rank]) for p in info.layout]
        return g.call_function(aten.split_with_sizes.default, (args[0], sizes, info.split_dim))
    if info.slice_dim is not None:
        lay = infos[x].layout
        lo, hi = lay.sets[rank].local_range(*slice_bounds(node, x.meta["val"].shape[info.slice_dim]))
        args = [args[0], info.slice_dim, lo, hi]
    new = g.call_function(node.target, tuple(args), kwargs) if node.op == "call_function" else \
        g.node_copy(node, lambda n: env[n])
    new.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace",)})
    return new


def for_process(program: LocalProgram, first: int, count: int) -> LocalProgram:
    """Plan rank ``first + r``'s program as socket ``r`` of a process that holds the plan's ranks ``first`` to
    ``first + count - 1`` (one host of several, :class:`numatp.runtime.hosts.Hosts`): its bindings and
    gathers keep only those ranks' index sets, so that the process's stores, workers and executor see
    ``count`` sockets, rank 0 first. Other hosts' columns are theirs: a gather writes this host's and
    the cross-host sum adds the rest."""
    r = program.rank - first
    if not 0 <= r < count:
        raise ValueError(f"plan rank {program.rank} is not one of this process's ranks {first} to {first + count - 1}")

    def narrow(placement: Placement | None) -> Placement | None:
        if isinstance(placement, (Colwise, Rowwise)):
            return type(placement)(placement.dim, placement.splits[first:first + count])
        return placement

    for n in program.gm.graph.nodes:
        sets = n.meta.get("numatp_gather")
        if sets is not None:
            n.meta["numatp_gather"] = sets[first:first + count]
    bindings = [Binding(bd.index, narrow(bd.placement), bd.lookup, bd.state) for bd in program.bindings]
    return LocalProgram(r, program.gm, bindings)
