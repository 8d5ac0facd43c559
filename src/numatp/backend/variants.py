"""Per-shape variants of one Dynamo graph: for each concrete input signature, the graph traced, planned,
localized, placed, compiled and run on the socket group (or, unsharded, on one worker of all CPUs).

A graph with symbolic sizes (``dynamic=True``, or Dynamo's automatic dynamic shapes after a recompile) is
specialised to the concrete sizes of each call: one variant per input signature, the same as
``dynamic=False`` would compile.
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from numatp.backend.policy import AUTO_ROUNDS, close_call, default_decider, runs_unsharded
from numatp.backend.states import StateStore
from numatp.backend.weights import WeightStore
from numatp.plan import pipeline
from numatp.plan.schema import Plan, Reason, Replicate
from numatp.progress import inputs_text, step
from numatp.runtime.executor import ShardedExecutor
from numatp.plan.gemm_pass import GemmSelector
from numatp.runtime.group import SocketGroup
from numatp.runtime.hosts import Hosts
from numatp.runtime.segments import SegmentCompiler, keep_cpp_references
from numatp.topology import Topology

__all__ = ["Backend", "CompiledGraph", "Variant"]

log = logging.getLogger("numatp")


class Backend(Protocol):
    """What a compiled graph reads and keeps in the backend of its compile
    (:class:`numatp.backend.core.NumaTPBackend`, which holds the graphs it is handed)."""

    topology: Topology
    policy: str
    names: dict[int, str] | None
    decide: Callable | None
    tp_plan: Any
    auto_measure: float
    check: bool
    compiler: SegmentCompiler
    weights: WeightStore
    states: StateStore
    gemm: GemmSelector | None
    calls: int
    last_call: tuple[Any, tuple, Any] | None
    """The last call of one of its graphs: (graph, arguments, outputs)."""
    graphs: list[Any]
    decode: Any
    """The decode steps that follow the programs compiled now (``NumaTPBackend.decode_ahead``), or None."""
    state_policy: str | None
    """How every graph that writes a cache runs (prefill and decode must agree): fixed by the first."""
    hosts: Hosts | None
    """The other processes of a compile across hosts, or None."""

    @property
    def group(self) -> SocketGroup: ...

    def whole_machine(self) -> tuple[SocketGroup, WeightStore, StateStore]: ...


RELEASED = ("this numatp-compiled model was released (collected, or its backend closed): its socket workers "
            "and weight shards are gone; compile the model again")


@dataclass(eq=False)   # hashed by identity: the state store keeps a weak set of the variants that read it
class Variant:
    plan: Plan
    executor: ShardedExecutor | None
    bindings: list
    build_seconds: float = 0.0
    baseline: Callable | None = None   # nothing sharded and GEMM providers off: plain Inductor, all cores
    weights: list[list[Any]] | None = None  # per socket: its local weights, None where a call's input goes
    states: StateStore | None = None        # where the sockets' copies of the inputs they write are

    def __post_init__(self) -> None:
        # replicated states (a cache's length) go back to the caller's tensor after each call
        self._write_backs = [bd.index for bd in (self.bindings[0] if self.bindings else [])
                             if bd.state and isinstance(bd.placement, Replicate)]
        # per socket, which positions take this call's inputs and which its states (a decode step is
        # a few milliseconds: only those positions are filled per call, each state by its layout code)
        self._inputs = [[(i, bd.index) for i, bd in enumerate(b) if bd.placement is None] for b in self.bindings]
        self._states = [[(i, bd, self.states.code(bd.placement)) for i, bd in enumerate(b) if bd.state]
                        for b in self.bindings]
        self._held = [keep_cpp_references(w) for w in self.weights or []]
        # the call's inputs that name states, and what they were bound to last (``_bound``): a decode step
        # passes the same cache tensors at every call, and looking up their copies again was most of the
        # arguments' cost; the store drops ``bound`` whenever it forgets a tensor (``StateStore.follow``)
        self._state_inputs = sorted({bd.index for b in self._states for _, bd, _ in b})
        self.bound: tuple[tuple[int, ...], list[list[Any]], list[Any]] | None = None
        if self._state_inputs and self.states is not None:
            self.states.follow(self)

    def local_args(self, args: tuple[Any, ...]) -> list[list[Any]]:
        """Each socket's program arguments: the weights made at build time, this call's activations, and
        the socket's copies of the states this call's inputs name."""
        return self._fill(self._bound(args)[1], args)

    def _fill(self, templates: list[list[Any]], args: tuple[Any, ...]) -> list[list[Any]]:
        out = []
        for r, template in enumerate(templates):
            local = template.copy()
            for i, src in self._inputs[r]:
                local[i] = args[src]
            out.append(local)
        return out

    def _bound(self, args: tuple[Any, ...]) -> tuple[tuple[int, ...], list[list[Any]], list[Any]]:
        """``(ids, templates, replicated)``: the ids of the state inputs in ``args``; per socket its weights
        with its copies of those states in place; socket 0's copies of the replicated ones (in
        ``_write_backs``' order). Kept while the same tensors come: while the store follows a tensor, its
        id names it."""
        ids = tuple([id(args[i]) for i in self._state_inputs])
        bound = self.bound
        if bound is not None and bound[0] == ids:
            return bound
        get = self.states.get
        templates = []
        for r, weights in enumerate(self.weights):
            local = list(weights)
            for i, bd, code in self._states[r]:
                local[i] = get(args[bd.index], bd, r, code)
            templates.append(local)
        bound = (ids, templates, self.states.replicated([args[i] for i in self._write_backs]))
        if self._state_inputs:
            self.bound = bound
        return bound

    def __call__(self, *args: Any) -> Any:
        if self.baseline is not None:
            return self.baseline(*args)
        _, templates, replicated = self._bound(args)
        out = self.executor.run(self._fill(templates, args))
        if replicated:
            with torch.no_grad():
                torch._foreach_copy_([args[i] for i in self._write_backs], replicated)
        return out


@dataclass
class _Fast:
    """The variants of one set of parameter objects, by the signature of the other arguments."""

    fixed: Callable[[tuple], tuple]   # the parameters out of a call's arguments
    objects: tuple                     # the parameters those variants were looked up with
    others: list[int]                  # every other position
    variants: dict[tuple, Variant]


class CompiledGraph:
    """One Dynamo graph: a variant (plan and socket programs) per concrete input signature."""

    def __init__(self, backend: Backend, gm: torch.fx.GraphModule):
        self.backend = backend
        self.gm = gm
        self.variants: dict[tuple, Variant] = {}
        self._lock = threading.Lock()
        # inputs whose value the graph reads with .item(): under dynamic shapes Dynamo lifts Python floats
        # (eps, dropout p, scaling) to 0-d tensor inputs; a variant is specialised to their values
        self.scalars = _item_inputs(gm)
        self._fast: _Fast | None = None
        self.released = False
        self.index = len(backend.graphs)   # for progress lines: the backend's graphs in build order

    def release(self) -> None:
        """Drop the variants (programs, executors, their weights) and the parameters kept for the fast
        lookup: the backend's compiled model is gone (``NumaTPBackend.close``)."""
        self.variants.clear()
        self._fast = None
        self.released = True

    def __call__(self, *args: Any) -> Any:
        if self.released:
            raise RuntimeError(RELEASED)
        self.backend.calls += 1
        fast = self._fast
        variant = None
        if fast is not None and all(map(operator.is_, fast.fixed(args), fast.objects)):
            variant = fast.variants.get(self._key(args, fast.others))
        if variant is None:
            key = self._key(args, range(len(args)))
            with self._lock:
                variant = self.variants.get(key)
                if variant is None:
                    with step("building socket programs for graph %d, inputs %s", self.index, inputs_text(args),
                              done=f"graph {self.index}:"):
                        variant = self._build(key, list(args))
                self._remember(args, key, variant)
        out = variant(*args)
        self.backend.last_call = (self, args, out)
        return out

    def _key(self, args: tuple[Any, ...], positions: Any) -> tuple:
        """The signature of ``args`` at ``positions``: shape and dtype of a tensor, anything else as is,
        and the values the graph reads with ``.item()``."""
        key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                    for a in map(args.__getitem__, positions))
        if self.scalars:
            key += tuple(args[i].item() for i in self.scalars)
        return key

    def _remember(self, args: tuple[Any, ...], key: tuple, variant: Variant) -> None:
        """Let later calls with these parameters find ``variant`` by the signature of the other arguments.
        A decode step passes every parameter of the model (hundreds): when they are the same objects as
        here (Dynamo guards their shapes), checking that they are takes a fraction of keying them."""
        fast = self._fast
        if fast is None or not all(map(operator.is_, fast.fixed(args), fast.objects)):
            fixed = [i for i, a in enumerate(args) if isinstance(a, torch.nn.Parameter)]
            if len(fixed) < 2:
                return   # itemgetter of one position returns the object, not a tuple; nothing to gain
            skip = set(fixed)
            others = [i for i in range(len(args)) if i not in skip]
            getter = operator.itemgetter(*fixed)
            fast = self._fast = _Fast(getter, getter(args), others, {})
        fast.variants[tuple(key[i] for i in fast.others) + key[len(args):]] = variant

    def _build(self, key: tuple, args: list[Any]) -> Variant:
        import time
        t0 = time.perf_counter()
        b = self.backend
        n = b.topology.num_sockets
        gm = _specialise(self.gm, {i: args[i].item() for i in self.scalars}) if self.scalars else self.gm
        ag = pipeline.trace(gm, args, b.names)
        stateful = any(ag.states)
        policy = b.state_policy if stateful and b.state_policy is not None else b.policy
        decide = None
        if policy == "auto":
            decide = b.decide or default_decider(b.topology)
        plan = pipeline.plan(ag, n if b.hosts is None else b.hosts.total, policy=policy, decide=decide,
                             tp_plan=b.tp_plan)
        if b.hosts is not None:
            b.hosts.agree(f"graph {self.index}", _facts(ag, key, plan))
        if stateful and b.state_policy is None:
            # the graphs that write one cache (prefill, decode) hold its states the same way
            b.state_policy = "never" if runs_unsharded(plan, policy) else "always"
        # measuring both plans would run the graph's writes (a cache's length) more than once
        if policy == "auto" and close_call(plan, b.auto_measure) and not stateful:
            variant = self._measure_both(plan, ag, args, t0)
            self.variants[key] = variant
            return variant
        if runs_unsharded(plan, policy):
            if b.gemm is None:
                variant = Variant(plan, None, [], time.perf_counter() - t0,
                                   baseline=_plain(self.gm, args, b.compiler.mode))
                log.info("numatp: policy %s keeps this graph unsharded (plain Inductor)", policy)
            else:
                variant = self._unsharded(plan, ag, args, t0)
                log.info("numatp: policy %s keeps this graph unsharded (one program on all %d CPUs)",
                         policy, len(variant.executor.group.topology.sockets[0].cpus))
            self.variants[key] = variant
            return variant
        variant = self._programs(plan, ag, args, b.group, b.weights, b.states, t0, hosts=b.hosts)
        self.variants[key] = variant
        log.info("numatp: %d sockets, %d reductions, built in %.1fs", n, plan.reductions, variant.build_seconds)
        return variant

    def _unsharded(self, plan: Plan, ag: Any, args: list[Any], t0: float) -> Variant:
        """One program on one socket of all CPUs: unsharded, but with the measured GEMM providers the
        sharded programs get, so that the choice between the two compares like with like."""
        group, store, states = self.backend.whole_machine()
        # the program's own plan (one socket), with the blocks' reasons for leaving them unsharded
        one = replace(pipeline.plan(ag, 1, policy="never"), blocks=plan.blocks, predicted=plan.predicted)
        return self._programs(one, ag, args, group, store, states, t0)

    def _measure_both(self, plan: Plan, ag: Any, args: list[Any], t0: float) -> Variant:
        """policy "auto" where the model's two predictions are close: build the graph sharded and
        unsharded, time both on this call's inputs (one untimed call each, then alternating, best of
        ``AUTO_ROUNDS``), keep the faster and drop the other's weights. The blocks' reasons say what
        was predicted and what was measured."""
        import time
        b = self.backend
        n = b.topology.num_sockets
        sharded_plan = pipeline.plan(ag, n, policy="always", tp_plan=b.tp_plan)
        marks = {"sharded": (b.weights, b.weights.mark())}
        sharded = self._programs(sharded_plan, ag, args, b.group, b.weights, b.states, t0)
        unsharded_plan = pipeline.plan(ag, n, policy="never")
        if b.gemm is None:
            unsharded = Variant(unsharded_plan, None, [], baseline=_plain(self.gm, args, b.compiler.mode))
        else:
            store = b.whole_machine()[1]
            marks["unsharded"] = (store, store.mark())
            unsharded = self._unsharded(unsharded_plan, ag, args, t0)
        best = {"sharded": float("inf"), "unsharded": float("inf")}
        with torch.no_grad():
            for v in (sharded, unsharded):
                v(*args)   # untimed: the workers' first call starts their thread pools and allocations
            for _ in range(AUTO_ROUNDS):
                for name, v in (("sharded", sharded), ("unsharded", unsharded)):
                    start = time.perf_counter()
                    v(*args)
                    best[name] = min(best[name], time.perf_counter() - start)
        pick = "sharded" if best["sharded"] < best["unsharded"] else "unsharded"
        lost = "unsharded" if pick == "sharded" else "sharded"
        if lost in marks:
            store, mark = marks[lost]
            store.drop_since(mark)   # no shard or packed weight made for the losing plan stays alive
        keep = sharded if pick == "sharded" else unsharded
        pred = plan.predicted
        note = (f"predicted {1e3 * pred['sharded']:.1f} ms sharded vs {1e3 * pred['unsharded']:.1f} ms unsharded "
                f"(within {100 * b.auto_measure:.0f}%), so both were built and timed on the first call: "
                f"sharded {1e3 * best['sharded']:.1f} ms, unsharded {1e3 * best['unsharded']:.1f} ms: {pick}")
        # the blocks the pass can shard, as the sharded plan found them, each with the model's reason
        # and the measurement; the kept plan's weights say how they run
        why = {blk.module: blk.reason for blk in plan.blocks}
        blocks = tuple(replace(blk, sharded=blk.sharded and pick == "sharded",
                               reason=why[blk.module].measured(note) if blk.module in why
                               else Reason("measured", module=blk.module, sockets=n, detail=note))
                       for blk in sharded_plan.blocks)
        keep.plan = replace(keep.plan, blocks=blocks, predicted=pred)
        keep.build_seconds = time.perf_counter() - t0
        log.info("numatp: policy auto measured both plans: %s", note)
        return keep

    def _programs(self, plan: Plan, ag: Any, args: list[Any], group: SocketGroup, store: WeightStore,
                  states: StateStore, t0: float, hosts: Hosts | None = None) -> Variant:
        """Localize ``ag`` (annotated for ``group``'s socket count, or with ``hosts`` for every process's),
        place its weights in ``store`` and its states in ``states``, compile and warm the programs on
        ``group``."""
        import time
        b = self.backend
        n = group.size
        built = pipeline.build(ag, plan, group=group, compiler=b.compiler, check=b.check,
                               gemm=None if b.gemm is None else b.gemm.bind(store, decode=b.decode),
                               bind=lambda local: [_bind(store, states, p.bindings, args, p.rank) for p in local],
                               hosts=hosts)
        bindings = [p.bindings for p in built.local]
        executor = ShardedExecutor(group, built.programs, swaps=built.swaps, reads=built.reads,
                                   gemm_choices=built.choices, hosts=hosts)
        for r, swaps in enumerate(executor.swaps):
            for plain, prepared in swaps.values():
                store.replace(r, plain, prepared)
        local = [_bind(store, states, bindings[r], args, r) for r in range(n)]
        for r, reads in enumerate(executor.reads):   # this variant's own: the store keeps the prompt's copy
            for i, weight in reads.items():
                local[r][i] = weight
        # warmed on copies of the states: this call's own run writes the cache (and its length) once
        executor.warm([[a.clone() if bd.state else a for bd, a in zip(bindings[r], local[r])] for r in range(n)])
        # the weights are fixed for this variant: look them up once, not on every call
        weights = [[None if bd.placement is None or bd.state else a for bd, a in zip(bindings[r], local[r])]
                   for r in range(n)]
        return Variant(plan, executor, bindings, time.perf_counter() - t0, weights=weights, states=states)


def _facts(ag: Any, key: tuple, plan: Plan) -> dict[str, Any]:
    """What every process must agree on before it runs a graph with the others: the parameters (name and
    shape), the inputs, the plan's decisions and the traced graph itself (its code, hashed)."""
    import hashlib
    placeholders = [n for n in ag.gm.graph.nodes if n.op == "placeholder"]
    params = [(ag.names[i], tuple(p.meta["val"].shape)) for i, p in enumerate(placeholders) if ag.is_param[i]]
    return {"parameters": params, "inputs": key, "plan": (plan.decisions, plan.reductions, plan.gathers),
            "graph": hashlib.sha256(ag.gm.code.encode()).hexdigest()[:16]}


def _bind(store: WeightStore, states: StateStore, bindings: list, args: list[Any], rank: int) -> list[Any]:
    """Socket ``rank``'s arguments: activations as given, its weights from ``store``, its states from ``states``."""
    return [states.get(args[bd.index], bd, rank) if bd.state else
            args[bd.index] if bd.placement is None else store.get(args[bd.index], bd, rank) for bd in bindings]


_ITEM_FUNCTIONS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default, torch.Tensor.item)


def _is_item(node: torch.fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "item") or (
        node.op == "call_function" and node.target in _ITEM_FUNCTIONS)


def _item_inputs(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """Positions of the placeholders whose value ``gm`` reads with ``.item()``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    read = {n.args[0] for n in gm.graph.nodes if _is_item(n) and n.args and n.args[0] in placeholders}
    return tuple(i for i, p in enumerate(placeholders) if p in read)


def _specialise(gm: torch.fx.GraphModule, values: dict[int, Any]) -> torch.fx.GraphModule:
    """A copy of ``gm`` where each ``.item()`` of placeholder ``i`` is the constant ``values[i]`` (tracing
    with fake tensors cannot read a value; the variant's key holds it, so another value builds another)."""
    import copy
    gm = copy.deepcopy(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in list(gm.graph.nodes):
        if _is_item(node) and node.args and node.args[0] in placeholders:
            i = placeholders.index(node.args[0])
            if i in values:
                node.replace_all_uses_with(values[i])
                gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def _plain(gm: torch.fx.GraphModule, args: list[Any], mode: str) -> Callable:
    """The graph as plain Inductor on the calling thread (all cores), or uncompiled in eager mode."""
    if mode == "eager":
        return gm
    from torch._inductor.compile_fx import compile_fx
    with torch.no_grad():
        return compile_fx(gm, args)  # type: ignore[return-value]  # a callable unless compiled ahead of time
