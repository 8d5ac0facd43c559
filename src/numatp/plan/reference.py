"""The reference executor: the socket programs run one after another on one thread, collectives in plain torch.

It is the correctness oracle of the pass, independent of any threaded runtime: each program runs as a
generator that stops at every collective; when all have stopped at the same one, the partial sums are
added in socket order (so every socket gets bit-identical replicated values) or the shards are placed
at their global indices.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch
import torch.fx

from numatp.plan.localize import Binding, LocalProgram
from numatp.plan.ops import COLLECTIVES
from numatp.plan.schema import Colwise, IndexSet, Placement, Replicate, Rowwise
from numatp.runtime.segments import place

__all__ = ["shard_tensor", "bind_inputs", "run_reference", "gather", "place"]

_ALL_REDUCE, _ALL_GATHER = COLLECTIVES


def shard_tensor(t: torch.Tensor, placement: Placement, rank: int) -> torch.Tensor:
    """Socket ``rank``'s part of a parameter (a view where the part is one interval)."""
    if isinstance(placement, Replicate):
        return t
    assert isinstance(placement, (Colwise, Rowwise))
    s = placement.splits[rank]
    parts = [t.narrow(placement.dim, lo, hi - lo) for lo, hi in s.intervals]
    return parts[0] if len(parts) == 1 else torch.cat(parts, placement.dim)


def bind_inputs(bindings: Sequence[Binding], inputs: Sequence[Any], rank: int) -> list[Any]:
    return [inputs[b.index] if b.placement is None else shard_tensor(inputs[b.index], b.placement, rank)
            for b in bindings]


def _steps(gm: torch.fx.GraphModule, args: list[Any]) -> Generator[tuple[torch.fx.Node, Any], Any, Any]:
    env: dict[torch.fx.Node, Any] = {}
    it = iter(args)

    def load(a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda n: env[n])

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(it)
        elif node.op == "get_attr":
            env[node] = getattr(gm, node.target)
        elif node.op == "output":
            return load(node.args[0])
        elif node.target in COLLECTIVES:
            env[node] = yield node, load(node.args)
        else:
            env[node] = node.target(*load(node.args), **load(node.kwargs))
    raise AssertionError("graph without output")


def gather(shards: Sequence[torch.Tensor], dim: int, sets: Sequence[IndexSet], global_size: int) -> torch.Tensor:
    """Place each socket's shard at its global indices along ``dim``."""
    shape = list(shards[0].shape)
    shape[dim] = global_size
    out = shards[0].new_empty(shape)
    for shard, s in zip(shards, sets):
        place(out, shard, dim, s)
    return out


def run_reference(programs: Sequence[LocalProgram], inputs: Sequence[Any]) -> Any:
    """Run the socket programs in lockstep; returns socket 0's outputs (replicated values are identical)."""
    gens = [_steps(p.gm, bind_inputs(p.bindings, inputs, p.rank)) for p in programs]
    pending: list[Any] = [None] * len(gens)
    results: list[Any] = [None] * len(gens)
    sends: list[Any] = [None] * len(gens)
    while True:
        done = 0
        for r, gen in enumerate(gens):
            if results[r] is not None:
                done += 1
                continue
            try:
                pending[r] = gen.send(sends[r]) if pending[r] is not None else next(gen)
            except StopIteration as stop:
                results[r] = stop.value
                done += 1
        if done == len(gens):
            return results[0]
        nodes = [p[0] for p in pending]
        if len({(n.target, n.args[-1]) for n in nodes}) != 1:
            raise RuntimeError(f"sockets reached different collectives: {[n.format_node() for n in nodes]}")
        node = nodes[0]
        if node.target is _ALL_REDUCE:
            total = pending[0][1][0]
            for p in pending[1:]:
                total = total + p[1][0]
            sends = [total.clone() for _ in gens]
        else:
            tensors = [p[1][0] for p in pending]
            dim, size = pending[0][1][1], pending[0][1][2]
            full = gather(tensors, dim, node.meta["numatp_gather"], size)
            sends = [full for _ in gens]

