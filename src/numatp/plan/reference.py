"""The reference executor: the socket programs run one after another on one thread, collectives in plain torch.

It is the correctness oracle of the pass, independent of any threaded runtime: each program runs as a
generator that stops at every collective; when all have stopped at the same one, the partial sums are
added in socket order (so every socket gets bit-identical replicated values) or the shards are placed
at their global indices.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch
import torch.fx

from numatp.plan.localize import Binding, LocalProgram
from numatp.plan.ops import COLLECTIVES
from numatp.plan.schema import Colwise, IndexSet, Placement, Replicate, Rowwise
from numatp.runtime.segments import place

__all__ = ["shard_tensor", "bind_inputs", "dequantized_inputs", "run_reference", "gather", "place"]

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
    """Each binding's value on ``rank``; bindings of one input with one placement (a tied LM head and
    its vocabulary-parallel lookup) share one shard, as a weight store hands them out."""
    made: dict[tuple[int, str], Any] = {}
    out = []
    for b in bindings:
        if b.placement is None:
            out.append(inputs[b.index])
            continue
        key = (b.index, repr(b.placement))
        if key not in made:
            made[key] = shard_tensor(inputs[b.index], b.placement, rank)
        out.append(made[key])
    return out


def dequantized_inputs(local: Sequence[LocalProgram], args: Sequence[Sequence[Any]], inputs: Sequence[Any],
                       prepared: Callable[[Any], Any]) -> list[Any]:
    """``inputs`` with each weight that the socket programs read quantized replaced by the values the
    sockets hold: every shard dequantized in float32 (:func:`numatp.runtime.gemm.quant.dequantize`) and
    put back at its global indices; the rest of such a weight, and every other input, as given. Running
    the unsharded graph on these (in float32) is the reference a quantized model must equal to float32
    rounding. ``prepared``: what an argument is (a weight store's or GEMM selector's record)."""
    from numatp.runtime.gemm.quant import dequantize

    out = list(inputs)
    done: set[int] = set()
    for prog, rank_args in zip(local, args):
        for b, a in zip(prog.bindings, rank_args):
            info = prepared(a) if b.placement is not None else None
            if info is None or not getattr(info, "weights", ""):
                continue
            w = dequantize(a)
            w = w if info.layout == "nk" else w.t()
            if b.index not in done:
                out[b.index] = inputs[b.index].detach().to(torch.float32).clone()
                done.add(b.index)
            full, p = out[b.index], b.placement
            if isinstance(p, Replicate):
                full.copy_(w)
                continue
            assert isinstance(p, (Colwise, Rowwise))
            at = 0
            for lo, hi in p.splits[prog.rank].intervals:
                full.narrow(p.dim, lo, hi - lo).copy_(w.narrow(p.dim, at, hi - lo))
                at += hi - lo
    return out


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

