"""The backend object behind one compile: Dynamo graphs in, socket programs out.

One :class:`NumaTPBackend` per compile holds what every graph of the compiled model shares: the
topology and policy, the socket workers, the weight and state stores, the compiled segments and the
GEMM provider choices. Each Dynamo graph it is handed becomes a :class:`~numatp.backend.variants.CompiledGraph`
(one variant per input signature); :mod:`numatp.backend.policy` says when a graph runs unsharded.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from numatp.backend.options import AUTO_MEASURE, Options, resolve_topology
from numatp.backend.policy import close_call, default_decider, runs_unsharded
from numatp.backend.states import StateStore
from numatp.backend.variants import RELEASED, CompiledGraph
from numatp.backend.weights import WeightStore
from numatp.plan.gemm_pass import Decode, GemmOptions, GemmSelector, QuantWeights, report_rows
from numatp.plan.schema import Plan
from numatp.runtime.group import SocketGroup
from numatp.runtime.hosts import Hosts, default_group
from numatp.runtime.segments import SegmentCompiler
from numatp.topology import Topology
from numatp.topology.default import describe

__all__ = ["GEMM_DEFAULT", "NumaTPBackend", "close_call", "default_decider", "runs_unsharded"]

log = logging.getLogger("numatp")


class NumaTPBackend:
    """A Dynamo backend bound to a topology, a policy and (optionally) the model's parameter names.

    One per compile: every graph Dynamo hands it (graph breaks, recompiles) shares its socket workers,
    its weight store and its compiled segments.
    """

    def __init__(self, topology: Topology, *, policy: str = "always", names: dict[int, str] | None = None,
                 decide: Callable | None = None, mode: str = "inductor", strict_placement: bool = False,
                 gemm: bool | GemmOptions | None = None, auto_measure: float = AUTO_MEASURE, plan: Any = None,
                 check: bool = False, weights: str | None = None, keep_head: bool = False,
                 hosts: Hosts | None = None):
        checked = Options(sockets=topology, policy=policy, mode=mode, strict_placement=strict_placement, gemm=gemm,
                          auto_measure=auto_measure, plan=plan, check=check, weights=weights,
                          keep_head=keep_head)   # the same checks as numatp.compile's
        if hosts is not None:
            if policy == "auto":
                raise ValueError(f"policy='auto' across {hosts.size} processes: every process must run the same "
                                 "plan, and 'auto' decides by each machine's own measurements; pass "
                                 "policy='always' (or 'never': every process runs the whole model)")
            hosts.agree("their options", {"sockets": hosts.sockets, "policy": policy, "mode": mode,
                                           "weights": checked.weights, "keep_head": keep_head,
                                           "plan": checked.plan, "gemm": gemm is not False,
                                           "torch": torch.__version__})
        self.hosts = hosts
        """The other processes of a compile across hosts (:mod:`numatp.runtime.hosts`), or None."""
        if checked.plan == "hf":
            raise ValueError("plan='hf' needs the model to read its tp_plan: use numatp.compile(model, plan='hf'), "
                             "or pass the dict (numatp.plan.hf_tp_plan(model))")
        self.tp_plan = checked.plan
        self.topology = topology
        self.policy = policy
        self.auto_measure = float(auto_measure)
        self.check = check   # the pipeline's contracts checked after each step (numatp.plan.contracts)
        self.names = names
        self.decide = decide
        self.compiler = SegmentCompiler(mode=mode)
        self.weights = WeightStore(topology, strict=strict_placement)
        self.states = StateStore(topology, strict=strict_placement)
        # how every graph that writes a cache runs (prefill and decode must agree): fixed by the first
        self.state_policy: str | None = None
        self.quant = QuantWeights.of(checked.weights, keep_head=keep_head)
        """Which weights are quantized, and how (``weights=``; None: the model's dtype)."""
        self.gemm = _gemm_selector(gemm, self.quant)
        self.decode: Decode | None = None
        """The decode steps that follow the graphs compiled now (:meth:`decode_ahead`), which the GEMM
        choice of a prompt's weights is given."""
        self.graphs: list[CompiledGraph] = []
        self.calls = 0   # calls of its graphs: a forward that adds none did not run through numatp
        # the last call of one of its graphs: (graph, its arguments, its outputs), for numatp.generate's
        # replay of decode steps past Dynamo (numatp.generate.Replay)
        self.last_call: tuple[Any, tuple, Any] | None = None
        self.closed = False   # released with its compiled model (close)
        self._group: SocketGroup | None = None
        self._whole: tuple[SocketGroup, WeightStore, StateStore] | None = None
        self._imported: dict[int, tuple[str, Any]] = {}
        self._sources: dict[int, Any] = {}

    @classmethod
    def from_options(cls, options: Options, *, names: dict[int, str] | None = None) -> NumaTPBackend:
        """The backend of one compile with ``options`` (the topology is resolved, and logged once, here)."""
        topology = resolve_topology(options.sockets)
        log.info("numatp: compiling for %s%s. numatp.set_progress(False) silences these lines", describe(topology),
                 " (this machine's default; sockets= chooses)" if options.sockets is None else "")
        group = options.process_group
        if group is None:
            group = default_group()
            if group is not None:
                log.info("numatp: torch.distributed is initialized with %d processes: compiling across its default "
                         "group, each process's sockets a share of the plan (process_group= chooses another)",
                         group.size())
        hosts = None
        if group is not None and group.size() > 1:
            hosts = Hosts(group, topology.num_sockets, timeout=options.host_timeout)
            log.info("numatp: %s", hosts.describe())
        return cls(topology, policy=options.policy, names=names, mode=options.mode,
                   strict_placement=options.strict_placement, gemm=options.gemm,
                   auto_measure=options.auto_measure, plan=options.plan, check=options.check,
                   weights=options.weights, keep_head=options.keep_head, hosts=hosts)

    def import_quantized(self, imported: dict[int, tuple[str, Any]]) -> None:
        """Parameters quantized before numatp saw them (``id -> (name, values)``, :mod:`numatp.quant.torchao`):
        their shards are cut from those values into quantized buffers, read by the quantized GEMM providers."""
        if imported and self.gemm is None:
            name = next(iter(imported.values()))[0]
            raise ValueError(f"{name} is quantized (torchao), and gemm=False leaves its matmuls to Inductor, which "
                             "cannot read numatp's quantized shards; drop gemm=False")
        self.weights.imported = imported
        self._imported = imported

    def read_from(self, sources: dict[int, Any]) -> None:
        """Parameters whose values the model does not hold (``id -> source``, :data:`numatp.backend.weights.Source`):
        every store reads their shards from the sources."""
        self.weights.sources = sources
        self._sources = sources
        if self._whole is not None:
            self._whole[1].sources = sources

    @property
    def group(self) -> SocketGroup:
        """The socket workers, started on the first sharded graph."""
        if self._group is None:
            self._check_open()
            self._group = SocketGroup(self.topology)
        return self._group

    def whole_machine(self) -> tuple[SocketGroup, WeightStore, StateStore]:
        """One worker pinned to every CPU of the topology, a store that leaves weights where they are and
        one for its states: where an unsharded graph runs with measured GEMM providers."""
        if self._whole is None:
            self._check_open()
            whole = self.topology.whole()
            self._whole = SocketGroup(whole), WeightStore(whole, place=False), StateStore(whole)
            self._whole[1].imported = self._imported
            self._whole[1].sources = self._sources
        return self._whole

    @contextlib.contextmanager
    def decode_ahead(self, rows: int, steps: int) -> Iterator[None]:
        """While in this block, graphs compiled are a prompt followed by ``steps`` decode steps of ``rows``
        rows each (:func:`numatp.generate` says so around a generation): their GEMM providers are chosen
        for both."""
        previous, self.decode = self.decode, Decode(rows, steps)
        try:
            yield
        finally:
            self.decode = previous

    def close(self) -> None:
        """Release what this compile holds: stop the socket workers, drop the weight shards, the sockets'
        cache copies and every graph's programs. Called when the compiled model is collected (Dynamo's
        code cache and its list of backends keep the backend itself, and the graphs it made, for the
        life of the process: only these husks stay). A graph called after this raises."""
        groups = [g for g in (self._group, self._whole[0] if self._whole is not None else None) if g is not None]
        for group in groups:
            group.close()
        if self.hosts is not None:
            self.hosts.close()
        self._group = self._whole = None
        self.weights = WeightStore(self.topology)
        self.states = StateStore(self.topology)
        self._imported = {}
        self._sources = {}
        for graph in self.graphs:
            graph.release()
        self.graphs = []
        self.names = None
        self.last_call = None   # its arguments are the model's parameters and caches
        self.closed = True

    def reload_states(self, replicated_only: bool = False) -> None:
        """Copy the caller's state tensors (a cache just reset) into every socket's copy again, once no
        worker of an earlier call cut short (an interrupt) can still write them (``replicated_only``: the
        cache's lengths alone, :meth:`StateStore.reload`)."""
        if self._group is not None:
            self._group.settle()
        self.states.reload(replicated_only)
        if self._whole is not None:
            self._whole[0].settle()
            self._whole[2].reload(replicated_only)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(RELEASED)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        self._check_open()
        from numatp.quant.torchao import is_torchao
        if any(map(is_torchao, example_inputs)):
            raise ValueError("this model holds torchao-quantized weights, which numatp reads into its own quantized "
                             "shards when it sees the model: compile it with numatp.compile(model) instead of "
                             "torch.compile(model, backend='numatp')")
        graph = CompiledGraph(self, gm)
        self.graphs.append(graph)
        return graph

    @property
    def plans(self) -> list[Plan]:
        """The plan of every program this backend runs: per Dynamo graph, per input signature, in build order."""
        return [v.plan for g in self.graphs for v in g.variants.values()]

    @property
    def performed(self) -> dict[str, int]:
        """Collectives the socket workers completed over every call, per kind (``all_reduce``, ``all_gather``)."""
        done = {"all_reduce": 0, "all_gather": 0}
        for g in self.graphs:
            for v in g.variants.values():
                if v.executor is not None:
                    for kind, n in v.executor.performed.items():
                        done[kind] += n
        return done

    def gemm_report(self) -> list[dict[str, Any]]:
        """The GEMM provider of every weight matmul in the programs this backend runs (not in those it
        built, measured and dropped), as ``report_rows`` gives them, each with its ``graph`` index."""
        return [dict(row, graph=i) for i, g in enumerate(self.graphs) for v in g.variants.values()
                if v.executor is not None for row in report_rows(v.executor.gemm_choices)]


def _gemm_selector(gemm: bool | GemmOptions | None, quant: QuantWeights | None = None) -> GemmSelector | None:
    """``gemm``: None = numatp's default (GEMM_DEFAULT), False = Inductor's own matmuls, True = measured
    providers with default options, or :class:`GemmOptions`; ``quant``: the quantized weights it prepares."""
    if gemm is None:
        gemm = GEMM_DEFAULT or quant is not None
    if gemm is False:
        return None
    return GemmSelector(gemm if isinstance(gemm, GemmOptions) else GemmOptions(), quant=quant)


GEMM_DEFAULT = True
"""Whether numatp picks measured GEMM providers when ``gemm`` is not given: yes, each weight matmul of a
socket program runs the provider measured fastest for its shape, dtype and thread count on this CPU (cached
in ``~/.cache/numatp``), ``aten`` (Inductor's call) unless another wins by ``GemmOptions.margin``."""
