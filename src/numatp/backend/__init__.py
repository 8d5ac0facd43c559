"""The ``torch.compile`` backend: ``torch.compile(model, backend="numatp")`` and ``numatp.compile(model)``.

For each Dynamo graph and each concrete input signature the backend traces the graph to ATen, runs the
NUMA-TP pass, makes one program per socket, places the weight shards, compiles the programs' segments
with Inductor's C++ backend, and runs them on the socket group. No model code changes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from numatp.backend.weights import WeightStore
from numatp.plan import localize, plan_graph, trace_aten
from numatp.plan.schema import Plan
from numatp.runtime.executor import ShardedExecutor
from numatp.runtime.gemm_pass import GemmOptions, GemmSelector, report_rows
from numatp.runtime.group import SocketGroup
from numatp.runtime.segments import SegmentCompiler
from numatp.topology import Topology

__all__ = ["AUTO_MEASURE", "close_call", "compile", "default_decider", "numatp_backend", "NumaTPBackend",
           "placement_report", "resolve_topology", "runs_unsharded"]

log = logging.getLogger("numatp")


def resolve_topology(sockets: None | int | Topology) -> Topology:
    """The topology to run on: detected (``None``), its first N sockets, or N virtual sockets on a one-node machine."""
    if isinstance(sockets, Topology):
        return sockets
    detected = Topology.detect()
    if sockets is None:
        return detected
    if isinstance(sockets, bool) or not isinstance(sockets, int) or sockets < 1:
        raise ValueError(f"sockets={sockets!r}: pass None (detect), a positive int or a numatp.Topology")
    if detected.num_sockets == 1 and sockets > 1:
        return Topology.virtual(sockets=sockets)
    if sockets > detected.num_sockets:
        raise ValueError(f"sockets={sockets}: this machine has {detected.num_sockets} usable sockets "
                         f"(see `numatp topo`); pass at most {detected.num_sockets}, or a "
                         "numatp.Topology.virtual(...) to try more")
    return Topology(detected.nodes, detected.sockets[:sockets], detected.allowed_cpus, detected.is_virtual)


AUTO_MEASURE = 0.15
"""policy "auto": where the cost model predicts the sharded and unsharded plans within this fraction of
each other, build both and keep the one measured faster on the first call (0: trust the model alone)."""

_AUTO_ROUNDS = 3


@dataclass
class _Variant:
    plan: Plan
    executor: ShardedExecutor | None
    bindings: list
    build_seconds: float = 0.0
    baseline: Callable | None = None   # nothing sharded and GEMM providers off: plain Inductor, all cores
    weights: list[list[Any]] | None = None  # per socket: its local weights, None where a call's input goes

    def local_args(self, args: tuple[Any, ...]) -> list[list[Any]]:
        """Each socket's program arguments: the weights made at build time, this call's activations."""
        return [[args[bd.index] if w is None else w for bd, w in zip(bindings, weights)]
                for bindings, weights in zip(self.bindings, self.weights)]

    def __call__(self, *args: Any) -> Any:
        if self.baseline is not None:
            return self.baseline(*args)
        return self.executor.run(self.local_args(args))


class NumaTPBackend:
    """A Dynamo backend bound to a topology, a policy and (optionally) the model's parameter names."""

    def __init__(self, topology: Topology, *, policy: str = "always", names: dict[int, str] | None = None,
                 decide: Callable | None = None, mode: str = "inductor", strict_placement: bool = False,
                 gemm: bool | GemmOptions | None = None, auto_measure: float = AUTO_MEASURE):
        if policy not in ("always", "never", "auto"):
            raise ValueError(f"policy={policy!r}: choose 'always', 'never' or 'auto'")
        if isinstance(auto_measure, bool) or not isinstance(auto_measure, (int, float)) or auto_measure < 0:
            raise ValueError(f"auto_measure={auto_measure!r}: pass a fraction >= 0 (0 trusts the cost model "
                             f"alone; default {AUTO_MEASURE})")
        self.topology = topology
        self.policy = policy
        self.auto_measure = float(auto_measure)
        self.names = names
        self.decide = decide
        self.compiler = SegmentCompiler(mode=mode)
        self.weights = WeightStore(topology, strict=strict_placement)
        self.gemm = _gemm_selector(gemm)
        self.graphs: list[_CompiledGraph] = []
        self._group: SocketGroup | None = None
        self._whole: tuple[SocketGroup, WeightStore] | None = None

    @property
    def group(self) -> SocketGroup:
        """The socket workers, started on the first sharded graph."""
        if self._group is None:
            self._group = SocketGroup(self.topology)
        return self._group

    def whole_machine(self) -> tuple[SocketGroup, WeightStore]:
        """One worker pinned to every CPU of the topology and a store that leaves weights where they are:
        where an unsharded graph runs with measured GEMM providers."""
        if self._whole is None:
            whole = self.topology.whole()
            self._whole = SocketGroup(whole), WeightStore(whole, place=False)
        return self._whole

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        graph = _CompiledGraph(self, gm)
        self.graphs.append(graph)
        return graph

    @property
    def plans(self) -> list[Plan]:
        return [v.plan for g in self.graphs for v in g.variants.values()]

    def gemm_report(self) -> list[dict[str, Any]]:
        """The GEMM provider of every weight matmul in the programs this backend runs (not in those it
        built, measured and dropped), as ``report_rows`` gives them, each with its ``graph`` index."""
        return [dict(row, graph=i) for i, g in enumerate(self.graphs) for v in g.variants.values()
                if v.executor is not None for row in report_rows(v.executor.gemm_choices)]


class _CompiledGraph:
    def __init__(self, backend: NumaTPBackend, gm: torch.fx.GraphModule):
        self.backend = backend
        self.gm = gm
        self.variants: dict[tuple, _Variant] = {}
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
        with self._lock:
            variant = self.variants.get(key) or self._build(key, list(args))
        return variant(*args)

    def _build(self, key: tuple, args: list[Any]) -> _Variant:
        import time
        t0 = time.perf_counter()
        b = self.backend
        n = b.topology.num_sockets
        ag = trace_aten(self.gm, args, b.names)
        decide = None
        if b.policy == "auto":
            decide = b.decide or default_decider(b.topology)
        plan = plan_graph(ag, n, policy=b.policy, decide=decide)
        if b.policy == "auto" and close_call(plan, b.auto_measure):
            variant = self._measure_both(plan, ag, args, t0)
            self.variants[key] = variant
            return variant
        if runs_unsharded(plan, b.policy):
            if b.gemm is None:
                variant = _Variant(plan, None, [], time.perf_counter() - t0,
                                   baseline=_plain(self.gm, args, b.compiler.mode))
                log.info("numatp: policy %s keeps this graph unsharded (plain Inductor)", b.policy)
            else:
                variant = self._unsharded(plan, ag, args, t0)
                log.info("numatp: policy %s keeps this graph unsharded (one program on all %d CPUs)",
                         b.policy, len(variant.executor.group.topology.sockets[0].cpus))
            self.variants[key] = variant
            return variant
        variant = self._programs(plan, ag, args, b.group, b.weights, t0)
        self.variants[key] = variant
        log.info("numatp: %d sockets, %d reductions, built in %.1fs", n, plan.reductions, variant.build_seconds)
        return variant

    def _unsharded(self, plan: Plan, ag: Any, args: list[Any], t0: float) -> _Variant:
        """One program on one socket of all CPUs: unsharded, but with the measured GEMM providers the
        sharded programs get, so that the choice between the two compares like with like."""
        group, store = self.backend.whole_machine()
        plan_graph(ag, 1, policy="never")
        return self._programs(plan, ag, args, group, store, t0)

    def _measure_both(self, plan: Plan, ag: Any, args: list[Any], t0: float) -> _Variant:
        """policy "auto" where the model's two predictions are close: build the graph sharded and
        unsharded, time both on this call's inputs (one untimed call each, then alternating, best of
        ``_AUTO_ROUNDS``), keep the faster and drop the other's weights. The blocks' reasons say what
        was predicted and what was measured."""
        import time
        b = self.backend
        n = b.topology.num_sockets
        sharded_plan = plan_graph(ag, n, policy="always")
        marks = {"sharded": (b.weights, b.weights.mark())}
        sharded = self._programs(sharded_plan, ag, args, b.group, b.weights, t0)
        unsharded_plan = plan_graph(ag, n, policy="never")
        if b.gemm is None:
            unsharded = _Variant(unsharded_plan, None, [], baseline=_plain(self.gm, args, b.compiler.mode))
        else:
            store = b.whole_machine()[1]
            marks["unsharded"] = (store, store.mark())
            unsharded = self._unsharded(unsharded_plan, ag, args, t0)
        best = {"sharded": float("inf"), "unsharded": float("inf")}
        with torch.no_grad():
            for v in (sharded, unsharded):
                v(*args)   # untimed: the workers' first call starts their thread pools and allocations
            for _ in range(_AUTO_ROUNDS):
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
                               reason=f"{why[blk.module]}; {note}" if why.get(blk.module) else note)
                       for blk in sharded_plan.blocks)
        keep.plan = replace(keep.plan, blocks=blocks, predicted=pred)
        keep.build_seconds = time.perf_counter() - t0
        log.info("numatp: policy auto measured both plans: %s", note)
        return keep

    def _programs(self, plan: Plan, ag: Any, args: list[Any], group: SocketGroup, store: WeightStore,
                  t0: float) -> _Variant:
        """Localize ``ag`` (annotated for ``group``'s socket count), place its weights in ``store``,
        compile and warm the programs on ``group``."""
        import time
        b = self.backend
        n = group.size
        programs = [localize(ag, r) for r in range(n)]
        bindings = [p.bindings for p in programs]
        local = [store.local_args(bindings[r], args, r) for r in range(n)]
        executor = ShardedExecutor(group, b.compiler, gemm=b.gemm)
        executor.build([p.gm for p in programs], local,
                       weights=[p.weight_indices for p in programs])
        for r, swaps in enumerate(executor.swaps):
            for plain, prepared in swaps.values():
                store.replace(r, plain, prepared)
        local = [store.local_args(bindings[r], args, r) for r in range(n)]
        executor.warm(local)
        # the weights are fixed for this variant: look them up once, not on every call
        weights = [[None if bd.placement is None else a for bd, a in zip(bindings[r], local[r])] for r in range(n)]
        return _Variant(plan, executor, bindings, time.perf_counter() - t0, weights=weights)


def close_call(plan: Plan, margin: float = AUTO_MEASURE) -> bool:
    """Whether policy "auto" measures both plans of ``plan``'s graph: its predictions lie within ``margin``."""
    pred = plan.predicted
    if not pred or margin <= 0:
        return False
    low, high = sorted((pred["sharded"], pred["unsharded"]))
    return low > 0 and high / low - 1 <= margin


def _plain(gm: torch.fx.GraphModule, args: list[Any], mode: str) -> Callable:
    """The graph as plain Inductor on the calling thread (all cores), or uncompiled in eager mode."""
    if mode == "eager":
        return gm
    from torch._inductor.compile_fx import compile_fx
    with torch.no_grad():
        return compile_fx(gm, args)


def runs_unsharded(plan: Plan, policy: str) -> bool:
    """Whether the backend runs ``plan`` unsharded on all cores rather than as socket programs: policy
    "never", or "auto" where no block (LM head aside) is sharded. Replicated blocks in socket programs
    would run whole on each socket's share of the cores, never faster than one program on all of them
    (plain Inductor, or with GEMM providers on, one numatp program on one socket of all CPUs)."""
    return policy == "never" or (policy == "auto" and not any(b.sharded for b in plan.blocks if b.kind != "lm_head"))


def default_decider(topology: Topology) -> Callable:
    """Ask the cost model, with this host's calibrated profile or a built-in estimate, per block."""
    from numatp.cost import BlockShape, decide, default_profile

    profile = default_profile(topology)

    def decider(cand, sockets: int) -> tuple[dict[str, float], str]:
        # the graph gives tokens (batch x seq) but not the split between them: the attention core is
        # modelled as one sequence of all tokens, an upper bound on its quadratic term
        head_dim = 64 if cand.inner % 64 == 0 else cand.inner
        heads = max(1, cand.inner // head_dim)
        shape = BlockShape(kind=cand.kind, batch=1, seq=cand.tokens, hidden=cand.hidden, inner=cand.inner,
                           kv_inner=cand.inner if cand.kind == "attention" else 0,
                           heads=heads if cand.kind == "attention" else 0,
                           kv_heads=heads if cand.kind == "attention" else 0,
                           head_dim=head_dim if cand.kind == "attention" else 0,
                           dtype="bfloat16" if cand.itemsize == 2 else "float32")
        (d,) = decide([shape], profile, sockets)
        times = ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in d.times.items())
        return d.times, f"{d.reason} (predicted: {times})"

    return decider


def _gemm_selector(gemm: bool | GemmOptions | None) -> GemmSelector | None:
    """``gemm``: None = numatp's default (GEMM_DEFAULT), False = Inductor's own matmuls, True = measured
    providers with default options, or :class:`GemmOptions`."""
    if gemm is None:
        gemm = GEMM_DEFAULT
    if gemm is False:
        return None
    return GemmSelector(gemm if isinstance(gemm, GemmOptions) else GemmOptions())


GEMM_DEFAULT = True
"""Whether numatp picks measured GEMM providers when ``gemm`` is not given: yes, each weight matmul of a
socket program runs the provider measured fastest for its shape, dtype and thread count on this CPU (cached
in ``~/.cache/numatp``), ``aten`` (Inductor's call) unless another wins by ``GemmOptions.margin``."""


def compile(model: torch.nn.Module, *, sockets: None | int | Topology = None, policy: str = "always",
            mode: str = "inductor", strict_placement: bool = False,
            gemm: bool | GemmOptions | None = None, auto_measure: float = AUTO_MEASURE) -> torch.nn.Module:
    """``torch.compile(model)`` with NUMA-aware tensor parallelism over ``sockets``.

    ``sockets``: None uses the detected topology; an int N its first N sockets (N virtual sockets on a
    single-node machine); or a :class:`numatp.Topology`. ``policy``: "always" shards every block numatp
    understands, "never" none (the graph runs unsharded on all cores), "auto" asks the cost
    model per block and shards the whole graph or none of it; where its two predictions lie within
    ``auto_measure`` (a fraction) of each other, both plans are built and the first call keeps the one
    it measures faster. ``mode="eager"`` skips Inductor (debugging). ``gemm``: pick each weight matmul's
    kernel (MKL, oneDNN, packed or not) by measuring it on this CPU (``True``, or :class:`GemmOptions`),
    keep Inductor's (``False``), or numatp's default (``None``).
    """
    topology = resolve_topology(sockets)
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    backend = NumaTPBackend(topology, policy=policy, names=names, mode=mode, strict_placement=strict_placement,
                            gemm=gemm, auto_measure=auto_measure)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    compiled._numatp_backend = backend  # type: ignore[attr-defined]
    return compiled


def placement_report(compiled: Any) -> dict[str, Any]:
    """Where each socket's weights are: ``{"ranks": [{"socket", "node", "pages": {node: n}}], "local_fraction"}``."""
    backend = getattr(compiled, "_numatp_backend", None)
    if backend is None:
        raise ValueError("placement_report() takes a model returned by numatp.compile(...)")
    return backend.weights.report()


_default_backend: NumaTPBackend | None = None


def numatp_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **options: Any) -> Callable:
    """Entry point of ``torch.compile(model, backend="numatp")``: detected topology, policy "always"."""
    global _default_backend
    if _default_backend is None:
        _default_backend = NumaTPBackend(resolve_topology(options.get("sockets")),
                                         policy=options.get("policy", "always"))
    return _default_backend(gm, example_inputs)
