"""The ``torch.compile`` backend: ``torch.compile(model, backend="numatp")`` and ``numatp.compile(model)``.

For each Dynamo graph and each concrete input signature the backend traces the graph to ATen, runs the
NUMA-TP pass, makes one program per socket, places the weight shards, compiles the programs' segments
with Inductor's C++ backend, and runs them on the socket group. No model code changes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from numatp.backend.weights import WeightStore
from numatp.plan import localize, plan_graph, trace_aten
from numatp.plan.schema import Plan
from numatp.runtime.executor import ShardedExecutor
from numatp.runtime.gemm_pass import GemmOptions, GemmSelector
from numatp.runtime.group import SocketGroup
from numatp.runtime.segments import SegmentCompiler
from numatp.topology import Topology

__all__ = ["compile", "default_decider", "numatp_backend", "NumaTPBackend", "placement_report", "resolve_topology",
           "runs_unsharded"]

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


@dataclass
class _Variant:
    plan: Plan
    executor: ShardedExecutor | None
    bindings: list
    build_seconds: float = 0.0
    baseline: Callable | None = None   # nothing sharded (policy "never", or "auto"): plain Inductor, all cores
    weights: list[list[Any]] | None = None  # per socket: its local weights, None where a call's input goes

    def local_args(self, args: tuple[Any, ...]) -> list[list[Any]]:
        """Each socket's program arguments: the weights made at build time, this call's activations."""
        return [[args[bd.index] if w is None else w for bd, w in zip(bindings, weights)]
                for bindings, weights in zip(self.bindings, self.weights)]


class NumaTPBackend:
    """A Dynamo backend bound to a topology, a policy and (optionally) the model's parameter names."""

    def __init__(self, topology: Topology, *, policy: str = "always", names: dict[int, str] | None = None,
                 decide: Callable | None = None, mode: str = "inductor", strict_placement: bool = False,
                 gemm: bool | GemmOptions | None = None):
        if policy not in ("always", "never", "auto"):
            raise ValueError(f"policy={policy!r}: choose 'always', 'never' or 'auto'")
        self.topology = topology
        self.policy = policy
        self.names = names
        self.decide = decide
        self.group = SocketGroup(topology)
        self.compiler = SegmentCompiler(mode=mode)
        self.weights = WeightStore(topology, strict=strict_placement)
        self.gemm = _gemm_selector(gemm)
        self.graphs: list[_CompiledGraph] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        graph = _CompiledGraph(self, gm)
        self.graphs.append(graph)
        return graph

    @property
    def plans(self) -> list[Plan]:
        return [v.plan for g in self.graphs for v in g.variants.values()]


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
        if variant.baseline is not None:
            return variant.baseline(*args)
        return variant.executor.run(variant.local_args(args))

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
        if runs_unsharded(plan, b.policy):
            if b.compiler.mode == "eager":
                fn = self.gm
            else:
                from torch._inductor.compile_fx import compile_fx
                with torch.no_grad():
                    fn = compile_fx(self.gm, args)
            variant = _Variant(plan, None, [], time.perf_counter() - t0, baseline=fn)
            self.variants[key] = variant
            log.info("numatp: policy %s keeps this graph unsharded (plain Inductor)", b.policy)
            return variant
        programs = [localize(ag, r) for r in range(n)]
        bindings = [p.bindings for p in programs]
        local = [b.weights.local_args(bindings[r], args, r) for r in range(n)]
        executor = ShardedExecutor(b.group, b.compiler, gemm=b.gemm)
        executor.build([p.gm for p in programs], local,
                       weights=[p.weight_indices for p in programs])
        for r, swaps in enumerate(executor.swaps):
            for plain, prepared in swaps.values():
                b.weights.replace(r, plain, prepared)
        local = [b.weights.local_args(bindings[r], args, r) for r in range(n)]
        executor.warm(local)
        # the weights are fixed for this variant: look them up once, not on every call
        weights = [[None if bd.placement is None else a for bd, a in zip(bindings[r], local[r])] for r in range(n)]
        variant = _Variant(plan, executor, bindings, time.perf_counter() - t0, weights=weights)
        self.variants[key] = variant
        log.info("numatp: %d sockets, %d reductions, built in %.1fs", n, plan.reductions, variant.build_seconds)
        return variant


def runs_unsharded(plan: Plan, policy: str) -> bool:
    """Whether the backend runs ``plan`` as plain Inductor on all cores rather than as socket programs:
    policy "never", or "auto" where no block (LM head aside) is sharded. Replicated blocks in socket
    programs would run whole on each socket's share of the cores, never faster than plain Inductor."""
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
            gemm: bool | GemmOptions | None = None) -> torch.nn.Module:
    """``torch.compile(model)`` with NUMA-aware tensor parallelism over ``sockets``.

    ``sockets``: None uses the detected topology; an int N its first N sockets (N virtual sockets on a
    single-node machine); or a :class:`numatp.Topology`. ``policy``: "always" shards every block numatp
    understands, "never" none (the graph runs as plain Inductor on all cores), "auto" asks the cost
    model per block and shards the whole graph or none of it. ``mode="eager"`` skips Inductor (debugging). ``gemm``: pick each weight matmul's kernel
    (MKL, oneDNN, packed or not) by measuring it on this CPU (``True``, or :class:`GemmOptions`), keep
    Inductor's (``False``), or numatp's default (``None``).
    """
    topology = resolve_topology(sockets)
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    backend = NumaTPBackend(topology, policy=policy, names=names, mode=mode, strict_placement=strict_placement,
                            gemm=gemm)
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
