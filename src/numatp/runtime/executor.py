"""Run the per-socket programs on a socket group: compiled segments, all-reduces between them.

Contract. Takes: each socket's :class:`SocketProgram` (its steps, made and compiled by
:mod:`numatp.plan.pipeline`; nothing here rewrites a graph). ``run`` guarantees socket 0's outputs, every
socket having performed the same collectives; an exception in any socket reaches the caller (its peers
stop waiting), and a socket missing past the group's timeout is named. ``src/numatp/runtime/README.md``
walks one call end to end.

Each worker runs its socket's segments on its own weight shards. An all-reduce hands the worker's
partial sum to the group's collective (:mod:`numatp.runtime.collective`: C++, no GIL, reduce-scatter +
all-gather over the partials in place), from a compiled segment (``numatp::socket_all_reduce``, for the
socket the worker entered) or as a step of its own, and gets the total in a new tensor on its own node;
every socket holds the same bits. The partial is dropped as the call returns, so a call holds at most
the partials of the reduction in progress; a value is dropped from a worker's environment after its
last use. ``performed`` counts the collectives the workers completed, per kind, over all calls. Per
socket, ``sync_seconds`` adds up the time spent in all-reduces (waiting for the slowest socket
included; ``wait_seconds``: that waiting alone, the time from the socket's arrival at a reduction to
the last peer's) and ``gather_seconds`` the time spent gathering a column-sharded output (the copy of a shard
into the full tensor, whose fresh pages fault in as it is written; a matmul that writes its columns in
place counts as compute, not gather). No socket waits for another at a gather: the full tensor is
allocated before the workers start, and each writes its columns when it gets there.

With ``hosts`` (this process is one of several, :class:`numatp.runtime.hosts.Hosts`), each reduction is
a step (:func:`numatp.plan.lower.place_reductions`): the in-host sum, then socket 0 adds the other
hosts' through the process group while its peers wait at a barrier and then copy the total; a gathered
tensor starts as zeros, holds this host's columns when the workers are done, and is summed across the
hosts on the calling thread.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from numatp.runtime.collective import rehearsal
from numatp.runtime.gemm import GemmStep
from numatp.runtime.group import SocketGroup
from numatp.runtime.hosts import Hosts
from numatp.runtime.segments import Collective, Segment, place

__all__ = ["SocketProgram", "ShardedExecutor"]


@dataclass
class SocketProgram:
    """One socket's compiled program: its steps, what each step frees, and its bound arguments."""

    rank: int
    placeholders: list[str]
    steps: list[Any]
    outputs: list[Any]
    frees: list[list[str]] = field(default_factory=list)

    def finish(self) -> None:
        keep = {o for o in self.outputs if isinstance(o, str)}
        last: dict[str, int] = {}
        for i, s in enumerate(self.steps):
            for k in s.inputs:
                last[k] = i
        self.frees = [[] for _ in self.steps]
        for k, i in last.items():
            if k not in keep:
                self.frees[i].append(k)


class ShardedExecutor:
    """Runs the socket programs on a :class:`SocketGroup`.

    ``swaps``, ``reads`` and ``gemm_choices`` are what the build recorded for the caller, kept with the
    programs they belong to (:class:`numatp.plan.pipeline.Programs`): per rank ``{index: (plain,
    prepared)}`` (the caller passes the prepared operand from then on), per rank ``{index: weight}``
    (these programs read that weight as stored where the caller holds a prompt's copy of it), and per
    rank the GEMM providers the programs got."""

    def __init__(self, group: SocketGroup, programs: list[SocketProgram], *,
                 swaps: list[dict[int, tuple]] | None = None, reads: list[dict[int, torch.Tensor]] | None = None,
                 gemm_choices: list[Any] | None = None, hosts: Hosts | None = None):
        self.group = group
        self.hosts = hosts
        self.programs = programs
        self.sync_seconds = [0.0] * group.size     # per socket: in all-reduces
        self.wait_seconds = [0.0] * group.size     # per socket: of which waiting for the last peer
        self.gather_seconds = [0.0] * group.size   # per socket: in all-gathers
        self.swaps = swaps if swaps is not None else [{} for _ in programs]
        self.reads = reads if reads is not None else [{} for _ in programs]
        self.gemm_choices = gemm_choices or []
        self.performed = {"all_reduce": 0, "all_gather": 0}   # collectives completed by every socket
        # the all-gathers whose full tensor each call allocates (a decode step's program has a few hundred
        # steps, and an all-gather or two)
        self._gathers = [s for s in programs[0].steps if isinstance(s, Collective) and s.kind == "all_gather"
                         and (group.size > 1 or hosts is not None)] if programs else []

    @property
    def inline_reductions(self) -> bool:
        """Whether all-reduces run inside the compiled segments (every one after the first, where the C++
        collective sums its dtype: ``numatp::socket_all_reduce``, see :mod:`numatp.plan.lower`): no return
        to Python, no GIL, between a kernel and its reduction. With one socket there is nothing to sum."""
        return self.group.size > 1

    def warm(self, local_args: list[list[Any]]) -> None:
        """One call on the main thread per socket program, so that concurrent calls find everything loaded.
        Shapes only: a collective passes its input on (inside compiled segments too), values are not used."""
        with rehearsal() if self.inline_reductions else contextlib.nullcontext():
            for prog, args in zip(self.programs, local_args):
                env = dict(zip(prog.placeholders, args))
                for step in prog.steps:
                    if isinstance(step, Segment):
                        env.update(zip(step.outputs, step.compiled(*step.take(env))))
                    elif isinstance(step, GemmStep):
                        env[step.dst] = step(env)
                    elif step.matmul is not None:   # with several sockets only (numatp.plan.lower)
                        env[step.dst] = torch.empty(step.full[0], dtype=step.full[1])
                        step.matmul(env, env[step.dst], step.sets[prog.rank].intervals[0])
                    else:
                        env[step.dst] = env[step.src]

    def run(self, local_args: list[list[Any]]) -> list[Any]:
        size = self.group.size
        hosts = self.hosts
        # each all-gather's full tensor, allocated here and written by the sockets as they get there: no
        # socket waits for another (its pages are not touched here, so each fills in on its writer's node);
        # with other hosts, zeros where their columns go, summed across the hosts when the workers are done
        new = torch.empty if hosts is None else torch.zeros
        slots = {s.tag: new(s.full[0], dtype=s.full[1])  # type: ignore[index]  # an all-gather has full
                 for s in self._gathers}
        relay: dict[int, torch.Tensor] = {}   # with other hosts: socket 0's cross-host totals, by tag
        sync = self.sync_seconds
        gathered = self.gather_seconds
        performed = self.performed
        group = self.group

        def steps(rank: int) -> list[Any]:
            prog = self.programs[rank]
            env = dict(zip(prog.placeholders, local_args[rank]))
            for step, frees in zip(prog.steps, prog.frees):
                if isinstance(step, Segment):
                    env.update(zip(step.outputs, step.compiled(*step.take(env))))
                elif isinstance(step, GemmStep):
                    env[step.dst] = step(env)
                else:
                    t0 = time.perf_counter()
                    if size == 1 and hosts is None:   # a cut between layers (numatp.plan.lower): one socket's sum
                        env[step.dst] = env[step.src]
                    elif step.kind == "all_reduce":
                        total = group.all_reduce(rank, env[step.src]) if size > 1 else env[step.src].contiguous()
                        if hosts is not None:
                            total = self._across(rank, step.tag, total, relay)
                        env[step.dst] = total
                        if rank == 0:   # every socket returned from the collective with the same total
                            performed["all_reduce"] += 1
                        sync[rank] += time.perf_counter() - t0
                    else:
                        # every socket writes its own columns into the full tensor (its matmul's output,
                        # or a copy of its shard); run() returns only after every worker is done
                        full = slots[step.tag]
                        if step.matmul is not None:   # a matmul that writes in place is compute, not gather
                            step.matmul(env, full, step.sets[rank].intervals[0])
                        else:
                            place(full, env[step.src], step.dim, step.sets[rank])
                            gathered[rank] += time.perf_counter() - t0
                        env[step.dst] = full if rank == 0 else None
                        if rank == 0:
                            performed["all_gather"] += 1
                for k in frees:
                    env.pop(k, None)
            return [env[o] if isinstance(o, str) else o[1] for o in prog.outputs]

        def work(rank: int) -> list[Any]:
            if not self.inline_reductions:
                return steps(rank)
            waited = group.comm.waited_seconds
            w0 = waited[rank]
            try:
                with group.compiled_collectives(rank) as done:   # the reductions inside compiled segments
                    out = steps(rank)
            finally:
                self.wait_seconds[rank] += waited[rank] - w0
            sync[rank] += done[0]
            if rank == 0:
                performed["all_reduce"] += done[1]
            return out

        out = self.group.run(work)[0]
        if hosts is not None:
            for full in slots.values():   # every host's columns, in program order
                hosts.all_reduce(full)
        return out

    def _across(self, rank: int, tag: int, total: torch.Tensor, relay: dict[int, torch.Tensor]) -> torch.Tensor:
        """This host's sum ``total`` plus the other hosts': socket 0 takes it through the process group, its
        peers copy socket 0's total (onto their own node) after a barrier."""
        assert self.hosts is not None
        if self.group.size == 1:
            return self.hosts.all_reduce(total)
        if rank == 0:
            relay[tag] = self.hosts.all_reduce(total)
        self.group.barrier(rank)
        if rank != 0:
            total.copy_(relay[tag])
        return total
