"""The pipeline: from a Dynamo graph to runnable socket programs, step by step, in order.

    trace -> plan -> localize -> choose_gemms -> fuse_attention -> lower -> gather -> split -> compile

Each step is one function below, with its contract (what the graph looks like before and after). The
backend (:mod:`numatp.backend.variants`) runs ``trace`` and ``plan`` itself, because its policy sits
between them and the rest (which plan, which socket group, both plans under policy "auto"), then
:func:`build` for the rest; ``numatp explain`` runs the same functions and stops before ``compile``
(:func:`lower_programs`). Every step but ``compile`` rewrites a graph or reads one: they are the
planning side. ``compile`` hands the segments to :class:`numatp.runtime.segments.SegmentCompiler`, and
the programs it returns are what :class:`numatp.runtime.executor.ShardedExecutor` runs.

With ``check=True`` the contracts between the steps (:mod:`numatp.plan.contracts`) are checked after
each step from ``localize`` on, and a broken one raises :class:`~numatp.plan.contracts.ContractError`
naming the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from numatp.plan import contracts
from numatp.plan.attention_pass import fuse_single_query_attention
from numatp.plan.gemm_pass import BoundSelector, GemmChoice, GemmSelector
from numatp.plan.localize import LocalProgram, for_process, localize as localize_rank
from numatp.plan.lower import lower_gemms, mark_gathered_matmuls, place_reductions, propagate_shapes
from numatp.plan.schema import Plan
from numatp.plan.split import split_program
from numatp.plan.tp_pass import plan_graph
from numatp.plan.trace import AtenGraph, trace_aten
from numatp.runtime.executor import SocketProgram
from numatp.runtime.group import SocketGroup
from numatp.runtime.hosts import Hosts
from numatp.runtime.segments import Segment, SegmentCompiler

__all__ = ["STEPS", "Programs", "trace", "plan", "localize", "choose_gemms", "fuse_attention", "lower", "gather",
           "split", "compile", "lower_programs", "build"]

STEPS = ("trace", "plan", "localize", "choose_gemms", "fuse_attention", "lower", "gather", "split", "compile")
"""The steps, in the order they run (each a function of this module)."""


@dataclass
class Programs:
    """What the pipeline made for one plan on one socket group."""

    plan: Plan
    local: list[LocalProgram]
    """Per rank: the localized program (its graph, rewritten in place by the later steps) and its bindings."""
    args: list[list[Any]]
    """Per rank: the program's arguments (prepared GEMM operands in place of the plain shards)."""
    programs: list[SocketProgram] = field(default_factory=list)
    """Per rank: the steps (after ``split``; compiled and with their frees after ``compile``)."""
    swaps: list[dict[int, tuple]] = field(default_factory=list)
    """Per rank ``{argument index: (plain, prepared)}``: the caller passes the prepared operand from now on."""
    reads: list[dict[int, torch.Tensor]] = field(default_factory=list)
    """Per rank ``{argument index: weight}``: these programs read the weight as stored where the caller
    holds a prompt's copy of it (:attr:`numatp.plan.gemm_pass.GemmChoice.reads`)."""
    choices: list[GemmChoice] = field(default_factory=list)
    """Per rank: the GEMM providers the programs got (empty without a selector)."""
    stand_in: Callable[[Any], Any] = field(default=lambda a: a)
    """A prepared operand's plain stand-in for shape checks and propagation (the GEMM selector's)."""

    @property
    def gms(self) -> list[torch.fx.GraphModule]:
        return [p.gm for p in self.local]


def trace(gm: torch.fx.GraphModule, example_inputs: list[Any], names: dict[int, str] | None = None) -> AtenGraph:
    """Step 1. Before: a Dynamo graph and real inputs. After: a functional ATen graph at the inputs'
    concrete shapes; every node has ``meta["val"]`` (global shape), parameters are placeholders, inputs
    written in place are ``AtenGraph.states`` and written back right after their last read."""
    return trace_aten(gm, example_inputs, names)


def plan(ag: AtenGraph, sockets: int, *, policy: str = "always", decide: Callable | None = None,
         tp_plan: Any = None) -> Plan:
    """Step 2. Before: the ATen graph. After: the graph unchanged, and a :class:`Plan` whose ``nodes``
    record every node's decision (layout, role, local rewrites) and whose ``weights`` say how every
    parameter is placed; a block the propagation cannot carry is replicated with its reason."""
    return plan_graph(ag, sockets, policy=policy, decide=decide, plan=tp_plan)


def localize(ag: AtenGraph, plan: Plan, hosts: Hosts | None = None) -> list[LocalProgram]:
    """Step 3. Before: the ATen graph and its plan. After: one program per socket, read from the plan:
    local shapes, a ``Binding`` per placeholder, one ``numatp::all_reduce`` per sharded block (right
    after its row matmul, before the bias), one ``numatp::all_gather`` per sharded output, the same
    collectives in the same order (tags 0, 1, ...) on every socket. With ``hosts``, the plan is for
    every socket of every process and this process's ranks alone are made, as its sockets 0, 1, ...
    (:func:`numatp.plan.localize.for_process`)."""
    if hosts is None:
        return [localize_rank(ag, plan, r) for r in range(plan.sockets)]
    if plan.sockets != hosts.total:
        raise ValueError(f"this plan is for {plan.sockets} sockets, and the processes hold {hosts.total} "
                         f"({'+'.join(map(str, hosts.sockets))}): plan the graph for every process's sockets")
    first, count = hosts.first, hosts.sockets[hosts.rank]
    return [for_process(localize_rank(ag, plan, r), first, count) for r in range(first, first + count)]


def choose_gemms(selector: GemmSelector | BoundSelector | None, group: SocketGroup, local: list[LocalProgram],
                 args: list[list[Any]]) -> tuple[list[list[Any]], list[dict[int, tuple]], list[dict[int, torch.Tensor]],
                                                 list[GemmChoice]]:
    """Step 4. Before: the local programs and their bound arguments. After: each weight matmul whose
    measured provider is not ATen is a ``numatp::gemm(x, W, b, provider, layout)`` node (in place), and
    its operand is prepared by its socket's worker. Returns the arguments with the prepared operands,
    the swaps, the reads and the choices (:meth:`GemmSelector.apply`); without a selector, nothing changes."""
    if selector is None:
        return args, [{} for _ in local], [{} for _ in local], []
    _, new_args, swaps, reads = selector.apply(group, [p.gm for p in local], args,
                                               [p.weight_indices for p in local])
    return new_args, swaps, reads, list(selector.choices)


def fuse_attention(gm: torch.fx.GraphModule) -> None:
    """Step 5. Before: a local program. After: each CPU flash attention whose query has one position (a
    decode step) is ``numatp::decode_attention`` (fp32, bf16) or two fused reductions over the cached keys
    and values (other dtypes); nothing else changes."""
    fuse_single_query_attention(gm)


def lower(gm: torch.fx.GraphModule, args: list[Any], sockets: int,
          stand_in: Callable[[Any], Any] = lambda a: a, hosts: int = 1) -> None:
    """Step 6. Before: a local program after the GEMM choice. After: ``meta["val"]`` on every node (local
    shapes); a ``numatp::gemm`` with a C++ kernel is ``numatp::linear``; every all-reduce after the first
    is ``numatp::socket_all_reduce`` chained to the one before (a dtype the C++ collective does not sum
    stays an all-reduce), a layer's last marked as a segment's end (every fourth layer's in a decode
    step's program); with one socket the reductions that
    would run inside and the all-gathers are gone (:mod:`numatp.plan.lower`); with more than one
    process (``hosts``) every collective stays a step, for the cross-host sum. ``stand_in`` gives a
    prepared operand's plain stand-in for shape propagation (the GEMM selector's)."""
    propagate_shapes(gm, [stand_in(a) for a in args])
    lower_gemms(gm)
    place_reductions(gm, sockets, hosts)


def gather(gm: torch.fx.GraphModule) -> None:
    """Step 7. Before: a lowered program. After: an all-gather of a weight matmul's column-sharded output
    that can be written in place carries that matmul (``meta["numatp_gathered"]``), and the nodes it
    takes over are marked; the graph's nodes are unchanged."""
    mark_gathered_matmuls(gm)


def split(gm: torch.fx.GraphModule, rank: int) -> SocketProgram:
    """Step 8. Before: a lowered, marked program. After: its steps (segments, collectives, GEMM steps of
    Python providers), each reading only values its program defined before (:mod:`numatp.plan.split`);
    not yet compiled."""
    placeholders, steps, outs = split_program(gm)
    return SocketProgram(rank, placeholders, steps, outs)


def compile(programs: list[SocketProgram], compiler: SegmentCompiler, group: SocketGroup) -> None:
    """Step 9. Before: the socket programs' steps. After: each segment compiled (identical segments
    once, the socket's thread count baked in), and per step the values whose last use it is
    (``SocketProgram.finish``), so a worker frees them at once."""
    for prog in programs:
        threads = len(group.topology.sockets[prog.rank].cpus)
        for s in prog.steps:
            if isinstance(s, Segment):
                s.compiled = compiler.compile(s, threads)
                s.example = []
        prog.finish()


def lower_programs(ag: AtenGraph, plan: Plan, *, group: SocketGroup,
                   bind: Callable[[Sequence[LocalProgram]], list[list[Any]]],
                   gemm: GemmSelector | BoundSelector | None = None,
                   check: bool = False, hosts: Hosts | None = None) -> Programs:
    """Steps 3 to 8 for ``plan`` (made for ``ag``) on ``group``: the socket programs' steps, not compiled.
    ``bind`` gives each rank's arguments for the localized programs (the backend's stores, or
    ``numatp.plan.reference.bind_inputs``); ``hosts``: this process is one of several, ``plan`` is for
    all their sockets, and ``group`` holds this process's."""
    sockets = group.size
    processes = 1 if hosts is None else hosts.size
    local = localize(ag, plan, hosts)
    args = bind(local)
    shapes = contracts.global_shapes(ag) if check else []
    done = Programs(plan, local, args)
    if gemm is not None:
        done.stand_in = gemm.stand_in

    def checked(step: str) -> None:
        if check:
            contracts.check(step, done, shapes, sockets=plan.sockets)   # every process's sockets

    checked("localize")
    done.args, done.swaps, done.reads, done.choices = choose_gemms(gemm, group, local, args)
    checked("choose_gemms")
    for p in local:
        fuse_attention(p.gm)
    checked("fuse_attention")
    for p, a in zip(local, done.args):
        lower(p.gm, a, sockets, done.stand_in, processes)
    checked("lower")
    for p in local:
        gather(p.gm)
    checked("gather")
    done.programs = [split(p.gm, p.rank) for p in local]
    checked("split")
    return done


def build(ag: AtenGraph, plan: Plan, *, group: SocketGroup, compiler: SegmentCompiler,
          bind: Callable[[Sequence[LocalProgram]], list[list[Any]]],
          gemm: GemmSelector | BoundSelector | None = None,
          check: bool = False, hosts: Hosts | None = None) -> Programs:
    """Steps 3 to 9: :func:`lower_programs`, then :func:`compile`."""
    done = lower_programs(ag, plan, group=group, bind=bind, gemm=gemm, check=check, hosts=hosts)
    compile(done.programs, compiler, group)
    if check:
        contracts.check("compile", done, contracts.global_shapes(ag), sockets=plan.sockets)
    return done
