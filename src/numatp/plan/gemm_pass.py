"""Choose a GEMM provider per weight matmul of the socket programs, and pack weights on their sockets.

Before the programs are cut into segments, :meth:`GemmSelector.apply`
1. finds the weight matmuls (:func:`numatp.plan.gemm_sites.find_sites`);
2. looks up each local shape's rates in the on-disk :class:`~numatp.runtime.gemm.GemmTable`, and measures
   the missing ones on the socket workers (pinned, all sockets at once, as they will run);
3. chooses a provider per weight (:func:`numatp.plan.gemm_choice.choose`: a function of the sites, the
   rates, the room for second copies and the decode steps to come, given as an argument);
4. rewrites each chosen matmul to ``numatp::gemm(x, W, b, provider, layout)``; the split of the program
   (:mod:`numatp.plan.lower`) makes it ``numatp::linear``, the provider's C++ op, inside its
   compiled segment (Inductor's own lowerings of the packed kernels want the weight as a graph constant,
   which would compile every layer apart);
5. prepares each weight's operand in its socket's worker, so a packed weight is allocated under that
   socket's memory binding, and records what it is (:class:`~numatp.runtime.gemm.PackInfo`) with the
   operands' owner (the weight store, :meth:`GemmSelector.bind`); the caller swaps it for the plain
   shard (no second copy is kept, except the plain weight beside a prompt's copy: its
   ``PackInfo.plain``, which the decode programs read). A program that reads a packed weight slower than
   the weight as stored (a decode step after a prompt compiled without the decode steps in view, e.g. a
   forward called before ``generate``) has the store make the plain shard again beside the packed one,
   within the same room for second copies, and it becomes that operand's ``PackInfo.plain``.

A later variant of the same graph (another sequence length) finds its operand recorded and reuses it:
oneDNN and MKL packed weights serve any M.

Contract. Takes: the socket programs of :func:`numatp.plan.localize`, their arguments, and per rank the
argument positions that are weights. Guarantees: each rewritten matmul computes what the ATen one did
(within the provider's rounding); an operand made by a socket's worker is on its node; the op itself
and the executor's step for it live in :mod:`numatp.runtime.gemm`. Refuses: nothing; a weight read by
anything but matmuls, or whose matmuls disagree on the provider, or without a usable measured rate,
stays on ATen.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.fx

from numatp.progress import step as progress_step
from numatp.plan.gemm_choice import Decode, GemmChoice, GemmOptions, Prior, choose, decode_shapes, measured_seconds
from numatp.plan.gemm_sites import Site, find_sites
from numatp.runtime.gemm import (GEMM_OP, PROVIDERS, GemmShape, GemmTable, MachineFacts, PackInfo,
                                 PreparedOperands, Provider, measure_missing, stand_in, streams, usable_rates)
from numatp.runtime.gemm.measurement import Measure
from numatp.runtime.gemm.quant import QuantFormat, nbytes as quant_nbytes, qembedding_op, quantize

__all__ = ["BoundSelector", "Decode", "GemmChoice", "GemmOptions", "GemmSelector", "OperandRecord", "QuantWeights",
           "report_rows"]

log = logging.getLogger("numatp")
aten = torch.ops.aten

_find_sites = find_sites   # the name tests and the guest suite import


class OperandRecord(Protocol):
    """Who holds the prepared operands (a weight store): what an argument is, and a new one recorded."""

    def prepared(self, t: Any) -> PackInfo | None: ...

    def record(self, operand: Any, info: PackInfo) -> None: ...

    def plain_of(self, operand: Any, rank: int) -> Callable[[], torch.Tensor] | None: ...


@dataclass(frozen=True)
class QuantWeights:
    """Which weight matmuls read quantized shards (:mod:`numatp.runtime.gemm.quant`), and in which format:
    ``body`` for every weight matmul but the LM head, ``head`` for the LM head (a matmul whose product is
    the program's output; int8 by default, None keeps it in the model's dtype). Each socket quantizes its
    own shard, after sharding, so a row-parallel shard's groups never straddle two sockets."""

    body: QuantFormat
    head: QuantFormat | None = QuantFormat(8)

    @classmethod
    def of(cls, weights: str | QuantFormat | None, *, keep_head: bool = False) -> QuantWeights | None:
        """``weights`` as ``numatp.compile`` takes it ("int8", "int4", "int4:g32", None)."""
        if weights is None:
            return None
        body = QuantFormat.parse(weights)
        # the head's int8 quantizes its activations where the body's do
        return cls(body, None if keep_head else QuantFormat(8, act=body.act))

    def format_for(self, head: bool) -> QuantFormat | None:
        return self.head if head else self.body


class GemmSelector:
    """Applies :class:`GemmOptions` to socket programs; one per compiled model (it holds the rate table).

    ``facts``: the machine (:meth:`MachineFacts.detect` at each apply where None); ``timer``: how a
    shape's providers are timed (``measure_all``; a test injects its own)."""

    def __init__(self, options: GemmOptions | None = None, *, facts: MachineFacts | None = None,
                 timer: Measure | None = None, quant: QuantWeights | None = None):
        self.options = options or GemmOptions()
        self.quant = quant
        if quant is not None and not self.options.force and not self._quant_providers():
            raise ValueError("quantized weights need a quantized GEMM provider among GemmOptions.providers "
                             f"(e.g. {', '.join(p for p, v in PROVIDERS.items() if v.weights)}); "
                             f"got {list(self.options.providers)}")
        self.facts = facts
        self.table = GemmTable(self.options.cache_dir, signature=facts.cpu_signature if facts else None)
        self.choices: list[GemmChoice] = []
        self._timer = timer
        self._timed: set[GemmShape] = set()   # shapes this selector measured itself
        self._operands = PreparedOperands()   # where no owner is given (explain, tests)
        self._plain: dict[int, tuple[weakref.ref, str | None]] = {}
        """id of a plain weight operand that a program reads as it is -> (the operand, weakly: a plan built
        and then dropped frees its shards; the provider chosen for it in the decode steps to come, if
        any): later programs keep to the plain operand, so no weight is held twice unless asked
        (``GemmOptions.decode_copies``)."""
        self._copy_budget: int | None = None   # bytes each socket's second copies may take (set when first needed)
        self._copied: dict[int, int] = {}    # rank -> bytes of second copies made

    def bind(self, operands: OperandRecord, *, decode: Decode | None = None) -> BoundSelector:
        """This selector for programs whose operands ``operands`` holds, followed by ``decode`` steps."""
        return BoundSelector(self, operands, decode)

    def stand_in(self, a: Any, operands: OperandRecord | None = None) -> Any:
        """``a``, or the plain weight's stand-in where ``a`` is a prepared operand (shape propagation)."""
        return stand_in(a, (operands or self._operands).prepared(a))

    def apply(self, group: Any, gms: list[torch.fx.GraphModule], args: list[list[Any]], weights: list[set[int]],
              *, decode: Decode | None = None, operands: OperandRecord | None = None,
              ) -> tuple[list[torch.fx.GraphModule], list[list[Any]], list[dict[int, tuple]],
                         list[dict[int, torch.Tensor]]]:
        """Rewritten programs, their arguments (prepared operands in place of plain shards), per rank
        ``{argument index: (plain, operand)}`` for the weights whose operand is new (the caller passes it
        from then on; ``operands`` has recorded it), and per rank ``{argument index: plain}`` for the
        weights these programs read as stored where the caller holds a prompt's copy
        (:attr:`GemmChoice.reads`: for these programs only)."""
        operands = operands or self._operands
        facts = self.facts or MachineFacts.detect()
        sites = self._sites(group, gms, args, weights, operands, facts)
        quantized = self._take_quantized(gms, sites, args, operands, facts)
        planned = self._choose(group, gms, sites, args, decode, operands, facts)
        self._choose_quantized(group, gms, quantized, facts)
        swaps: list[dict[int, tuple]] = [{} for _ in gms]
        reads: list[dict[int, torch.Tensor]] = [{} for _ in gms]
        todo: list[dict[int, tuple[Provider, torch.Tensor, int, str, str | None, str]]] = [{} for _ in gms]
        new_args = [list(a) for a in args]
        for rank, (gm, rank_sites, choice) in enumerate(zip(gms, quantized, self.choices)):
            names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            for ph, (fmt, group_sites) in rank_sites.items():
                prov = choice.providers[ph.name]
                idx = names.index(ph.name)
                for site in group_sites:
                    _rewrite(gm, site, prov)
                for u in list(ph.users):  # transposes only the rewritten matmuls read
                    if u.target in (aten.permute.default, aten.t.default) and not u.users:
                        gm.graph.erase_node(u)
                if operands.prepared(args[rank][idx]) is None:   # quantized once, by its socket's worker
                    todo[rank][idx] = (PROVIDERS[prov], args[rank][idx], group_sites[0].shape.m,
                                       group_sites[0].shape.layout, None, fmt.name)
            gm.graph.lint()
            gm.recompile()
        shared = self._quantize_tables(gms, args, weights, operands, quantized, todo)
        for rank, (gm, rank_sites, choice) in enumerate(zip(gms, sites, self.choices)):
            names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            for ph, group_sites in rank_sites.items():
                prov = choice.providers[ph.name]
                idx = names.index(ph.name)
                arg = args[rank][idx]
                if ph.name in choice.restores:   # made again beside the prepared operand, kept with it from now on
                    info = operands.prepared(arg)
                    make = operands.plain_of(arg, rank)
                    assert info is not None and make is not None, ph.name
                    choice.reads[ph.name] = make()
                    operands.record(arg, replace(info, plain=choice.reads[ph.name], later=prov))
                if ph.name in choice.reads:   # the plain weight kept beside a prompt's copy
                    arg = new_args[rank][idx] = reads[rank][idx] = choice.reads[ph.name]
                prepared = operands.prepared(arg) is not None or ph.name in choice.reads
                if not prepared and choice.shapes[ph.name].layout in PROVIDERS[prov].keeps_plain:
                    later = choice.later.get(ph.name) or self._planned_for(arg)[1]
                    self._plain[id(arg)] = (weakref.ref(arg), later)
                if prov == "aten":
                    continue
                for site in group_sites:
                    _rewrite(gm, site, prov)
                for u in list(ph.users):  # transposes only the rewritten matmuls read
                    if u.target in (aten.permute.default, aten.t.default) and not u.users:
                        gm.graph.erase_node(u)
                if not prepared:
                    keep = choice.later.get(ph.name) if ph.name in choice.copies else None
                    todo[rank][idx] = (PROVIDERS[prov], arg, choice.shapes[ph.name].m,
                                       choice.shapes[ph.name].layout, keep, "")
            gm.graph.lint()
            gm.recompile()
        nodes = [s.node if group.binds_memory else None for s in group.topology.sockets]
        made = group.run(lambda rank: {i: _prepare(p, w, m, lay, nodes[rank], keep, fmt)
                                       for i, (p, w, m, lay, keep, fmt) in todo[rank].items()})
        for rank, bytes_ in planned.items():
            self._copied[rank] = self._copied.get(rank, 0) + bytes_
        for rank, ops in enumerate(made):
            for i, (op, info) in ops.items():
                if info is not None:
                    operands.record(op, info)
                swaps[rank][i] = (args[rank][i], op)
                new_args[rank][i] = op
            for table, head in shared[rank].items():   # a tied head's lookup reads the head's quantized shard
                swaps[rank][table] = (args[rank][table], new_args[rank][head])
                new_args[rank][table] = new_args[rank][head]
        return gms, new_args, swaps, reads

    def preview(self, group: Any, gms: list[torch.fx.GraphModule], args: list[list[Any]], weights: list[set[int]],
                *, decode: Decode | None = None, operands: OperandRecord | None = None) -> list[dict[str, Any]]:
        """What :meth:`apply` would choose (measuring what the table lacks), without rewriting the programs
        or preparing any operand: :meth:`report`'s rows."""
        operands = operands or self._operands
        facts = self.facts or MachineFacts.detect()
        sites = self._sites(group, gms, args, weights, operands, facts)
        quantized = self._take_quantized(gms, sites, args, operands, facts)
        self._choose(group, gms, sites, args, decode, operands, facts)
        self._choose_quantized(group, gms, quantized, facts)
        return self.report()

    def report(self) -> list[dict[str, Any]]:
        """The rows of :func:`report_rows` for the last programs this selector rewrote or previewed."""
        return report_rows(self.choices)

    def _sites(self, group: Any, gms: list[torch.fx.GraphModule], args: list[list[Any]], weights: list[set[int]],
               operands: OperandRecord, facts: MachineFacts) -> list[dict[torch.fx.Node, list[Site]]]:
        threads = [len(s.cpus) for s in group.topology.sockets]
        gathers = group.size > 1   # with one socket the gathers are dropped (numatp.plan.lower)
        return [find_sites(gm, [stand_in(x, operands.prepared(x)) for x in a], w, t, gathers, facts.llc_bytes)
                for gm, a, w, t in zip(gms, args, weights, threads)]

    def _choose(self, group: Any, gms: list[torch.fx.GraphModule], sites: list[dict[torch.fx.Node, list[Site]]],
                args: list[list[Any]], decode: Decode | None, operands: OperandRecord,
                facts: MachineFacts) -> dict[int, int]:
        """Measure what the table lacks, then set :attr:`choices`; returns per rank the bytes of second
        copies the choices plan."""
        if self.options.force or self.options.first_token:
            decode = None   # a prompt's weights are chosen alone
        self._measure(group, sites, decode, facts)
        if self._copy_budget is None:
            # every socket the same share, so that none runs its prompt slower for want of room
            self._copy_budget = int((facts.memory_available or 0) * self.options.decode_copies) // len(gms)
        shapes = [s.shape for rank_sites in sites for ss in rank_sites.values() for s in ss]
        if decode is not None:
            shapes += [s for rank_sites in sites for s in decode_shapes(rank_sites, decode, facts.llc_bytes)]
        rates = {s: self.table.get(s) or {} for s in shapes}
        planned: dict[int, int] = {}
        self.choices = []
        for rank, (gm, rank_sites) in enumerate(zip(gms, sites)):
            names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            priors = {}
            for ph in rank_sites:
                arg = args[rank][names.index(ph.name)]
                plain, later = self._planned_for(arg)
                info = operands.prepared(arg)
                restorable = info is not None and info.plain is None and operands.plain_of(arg, rank) is not None
                priors[ph.name] = Prior(info, plain, later, restorable)
            room = (self._copy_budget or 0) - self._copied.get(rank, 0)
            choice, planned[rank] = choose(rank, {ph.name: ss for ph, ss in rank_sites.items()}, rates,
                                           options=self.options, priors=priors, room=room, decode=decode,
                                           llc_bytes=facts.llc_bytes)
            self.choices.append(choice)
        return planned

    def _quant_providers(self) -> list[str]:
        return [p for p in self.options.providers if PROVIDERS[p].weights]

    def _take_quantized(self, gms: list[torch.fx.GraphModule], sites: list[dict[torch.fx.Node, list[Site]]],
                        args: list[list[Any]], operands: OperandRecord, facts: MachineFacts,
                        ) -> list[dict[torch.fx.Node, tuple[QuantFormat, list[Site]]]]:
        """Per rank, the weights that read quantized shards (taken out of ``sites``), with their format
        and their sites at the quantized shapes: those already quantized (a recorded operand), and with
        :attr:`quant`, every weight matmul's weight not yet prepared. A shard whose input size the
        format's groups do not divide is an error naming the weight."""
        out: list[dict[torch.fx.Node, tuple[QuantFormat, list[Site]]]] = []
        for gm, rank_sites, rank_args in zip(gms, sites, args):
            names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            taken: dict[torch.fx.Node, tuple[QuantFormat, list[Site]]] = {}
            for ph, group_sites in list(rank_sites.items()):
                info = operands.prepared(rank_args[names.index(ph.name)])
                if info is not None and info.weights:
                    fmt: QuantFormat | None = QuantFormat.parse(info.weights)
                elif info is None and self.quant is not None:
                    fmt = self.quant.format_for(any(_feeds_output(s.node) for s in group_sites))
                else:
                    fmt = None
                if fmt is None:
                    continue
                s0 = group_sites[0].shape
                why = fmt.misfit(s0.k)
                if why:
                    raise ValueError(f"weights='{fmt}': {_weight_name(ph)} has a shard of input size {s0.k} on a "
                                     f"socket, {why}")
                q_bytes = quant_nbytes(s0.n, s0.k, fmt)
                scaled = [replace(s, shape=replace(
                    s.shape, weights=fmt.name,
                    stream=streams(s.shape.m, s.weight_bytes * q_bytes // max(s.shape.weight_bytes, 1),
                                   facts.llc_bytes))) for s in group_sites]
                taken[ph] = (fmt, scaled)
                del rank_sites[ph]
            out.append(taken)
        return out

    def _choose_quantized(self, group: Any, gms: list[torch.fx.GraphModule],
                          quantized: list[dict[torch.fx.Node, tuple[QuantFormat, list[Site]]]],
                          facts: MachineFacts) -> None:
        """Measure the quantized shapes the table lacks and add each quantized weight's provider to
        :attr:`choices`: of the quantized providers that read its format and take its rows, the one of
        least measured time over its sites (all of them read the same shard, so a prompt's program and a
        decode step's each take their own)."""
        if not any(quantized):
            return
        providers = self._quant_providers()
        wanted = [[s.shape for _, ss in rank.values() for s in ss] for rank in quantized]
        if not self.options.force:
            self._measure_shapes(group, wanted, providers, None)
        for rank, choice in zip(quantized, self.choices):
            for ph, (fmt, group_sites) in rank.items():
                s0 = group_sites[0].shape
                rates = usable_rates(self.table.get(s0))
                if self.options.force:
                    prov = self.options.force if PROVIDERS[self.options.force].weights and \
                        all(PROVIDERS[self.options.force].runs(s.shape) for s in group_sites) else "q_dequant"
                else:
                    timed = {p: measured_seconds(self.table, p, group_sites, runnable=True) for p in providers}
                    prov = min(timed, key=lambda p: timed[p])
                    if timed[prov] == float("inf"):
                        # nothing measured usable: the reference kernel reads any format at any rows
                        prov = "q_dequant"
                choice.providers[ph.name] = prov
                choice.shapes[ph.name] = s0
                choice.rates[ph.name] = rates
                choice.weights[ph.name] = fmt.name
                choice.nbytes[ph.name] = quant_nbytes(s0.n, s0.k, fmt)

    def _quantize_tables(self, gms: list[torch.fx.GraphModule], args: list[list[Any]], weights: list[set[int]],
                         operands: OperandRecord,
                         quantized: list[dict[torch.fx.Node, tuple[QuantFormat, list[Site]]]],
                         todo: list[dict[int, tuple[Provider, torch.Tensor, int, str, str | None, str]]],
                         ) -> list[dict[int, int]]:
        """Embedding tables (weights read only by ``aten.embedding``) become ``numatp::qembedding`` of a
        quantized table: one already quantized (a recorded operand) as it is; the lookup of a tied LM head
        being quantized here reads the head's new shard (returned per rank as ``{table index: head
        index}``, for the caller to swap once the head is made); with :attr:`quant` (and its ``head``
        format: the LM head's, int8 unless kept in the model's dtype), any other table quantized by its
        socket's worker (added to ``todo``)."""
        shared: list[dict[int, int]] = [{} for _ in gms]
        for rank, (gm, rank_args) in enumerate(zip(gms, args)):
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            heads = {id(rank_args[placeholders.index(ph)]): placeholders.index(ph) for ph in quantized[rank]
                     if operands.prepared(rank_args[placeholders.index(ph)]) is None}
            choice = self.choices[rank]
            for i in sorted(weights[rank]):
                ph, arg = placeholders[i], rank_args[i]
                uses = list(ph.users)
                if not uses or not all(u.target is aten.embedding.default and u.args[0] is ph for u in uses):
                    continue
                info = operands.prepared(arg)
                if info is not None and info.weights:
                    fmt = info.weights
                elif info is None and id(arg) in heads:
                    fmt = choice.weights[placeholders[heads[id(arg)]].name]
                    shared[rank][i] = heads[id(arg)]
                elif info is None and self.quant is not None and self.quant.head is not None:
                    fmt = self.quant.head.name
                    todo[rank][i] = (PROVIDERS["q_dequant"], arg, 0, "nk", None, fmt)
                else:
                    continue
                plain = stand_in(arg, info)
                rows, width = int(plain.shape[0]), int(plain.shape[1])
                for u in uses:
                    with gm.graph.inserting_before(u):
                        new = gm.graph.call_function(qembedding_op(), (ph, u.args[1], width, plain.dtype))
                    new.meta = dict(u.meta)
                    u.replace_all_uses_with(new)
                    gm.graph.erase_node(u)
                choice.providers[ph.name] = "qembedding"
                choice.shapes[ph.name] = GemmShape(0, width, rows, str(plain.dtype).removeprefix("torch."), "nk",
                                                   0, weights=fmt)
                choice.rates[ph.name] = {}
                choice.weights[ph.name] = fmt
                choice.nbytes[ph.name] = quant_nbytes(rows, width, fmt)
            gm.graph.lint()
            gm.recompile()
        return shared

    def _planned_for(self, arg: Any) -> tuple[bool, str | None]:
        """Whether a program reads ``arg`` as its plain operand, and the decode provider planned for it."""
        ref, later = self._plain.get(id(arg), (None, None))
        return (True, later) if ref is not None and ref() is arg else (False, None)

    def _measure(self, group: Any, sites: list[dict[torch.fx.Node, list[Site]]], decode: Decode | None,
                 facts: MachineFacts) -> None:
        """Time on the socket workers the shapes the table has no usable ``aten`` rate for (the baseline
        every choice is measured against), or every shape once with ``GemmOptions.remeasure``."""
        if self.options.force:
            return
        providers = ["aten", *[p for p in self.options.providers if p != "aten"]]
        wanted = [[s.shape for ss in rank_sites.values() for s in ss] for rank_sites in sites]
        if decode is not None:   # a prompt's weights are chosen for the decode steps too: their shapes as well
            wanted = [w + decode_shapes(rank_sites, decode, facts.llc_bytes) for w, rank_sites in zip(wanted, sites)]
        self._measure_shapes(group, wanted, providers, "aten")

    def _measure_shapes(self, group: Any, wanted: list[list[GemmShape]], providers: list[str],
                        baseline: str | None) -> None:
        """Time on the socket workers (each socket its own ``wanted`` shapes, all at once) the providers
        the table lacks where it has no usable rate of ``baseline`` (the provider every choice is
        compared with: a provider that cannot run here is not timed again at every compile; None: where
        any provider that takes the shape has none), or every shape once with ``GemmOptions.remeasure``;
        the rates join the table."""
        facts = self.facts or MachineFacts.detect()
        again = {s for w in wanted for s in w} - self._timed if self.options.remeasure else set()
        if baseline:
            known = all(baseline in (self.table.get(s) or {}) for w in wanted for s in w)
        else:   # every provider that takes the shape (one that cannot run here is timed again: it fails fast)
            known = all(all(p in (self.table.get(s) or {}) for p in providers if PROVIDERS[p].runs(s))
                        for w in wanted for s in w)
        if not again and known:
            return
        # every socket measures its own shapes at the same time, so each rate is taken under the load
        # of the other sockets, as in a real call
        shapes = len({s for w in wanted for s in w if s in again or self.table.get(s) is None})
        with progress_step("measuring GEMM providers for %d shapes on %d socket(s)", shapes, len(wanted)):
            found = group.run(lambda rank: measure_missing(self.table.get, wanted[rank], providers, again=again,
                                                           facts=facts, timer=self._timer))
        self._timed |= {s for w in wanted for s in w}
        merged: dict[GemmShape, dict[str, float]] = {}
        for rates in found:   # per shape the slowest socket's rate, of the providers every socket timed
            for shape, r in rates.items():
                prev = merged.get(shape)
                merged[shape] = dict(r) if prev is None else {p: min(v, prev[p]) for p, v in r.items() if p in prev}
        if merged:
            log.info("numatp: measured %d GEMM shapes (%s)", len(merged), self.table.path)
            self.table.put(merged)


@dataclass(frozen=True)
class BoundSelector:
    """A :class:`GemmSelector` for the programs of one weight store (which records their operands),
    followed by ``decode`` steps or not: what an executor calls (``apply``, ``choices``, ``stand_in``)."""

    selector: GemmSelector
    operands: OperandRecord
    decode: Decode | None = None

    @property
    def choices(self) -> list[GemmChoice]:
        return self.selector.choices

    @property
    def table(self) -> GemmTable:
        return self.selector.table

    def apply(self, group: Any, gms: list[torch.fx.GraphModule], args: list[list[Any]],
              weights: list[set[int]]) -> tuple[list[torch.fx.GraphModule], list[list[Any]], list[dict[int, tuple]],
                                                list[dict[int, torch.Tensor]]]:
        return self.selector.apply(group, gms, args, weights, decode=self.decode, operands=self.operands)

    def preview(self, group: Any, gms: list[torch.fx.GraphModule], args: list[list[Any]],
                weights: list[set[int]]) -> list[dict[str, Any]]:
        return self.selector.preview(group, gms, args, weights, decode=self.decode, operands=self.operands)

    def stand_in(self, a: Any) -> Any:
        return self.selector.stand_in(a, self.operands)

    def report(self) -> list[dict[str, Any]]:
        return self.selector.report()


def report_rows(choices: list[GemmChoice]) -> list[dict[str, Any]]:
    """Per rank and weight: the shape, the chosen provider and its measured rate (for ``explain``)."""
    rows = []
    for c in choices:
        for ph, prov in c.providers.items():
            s = c.shapes[ph]
            rows.append({"rank": c.rank, "weight": ph, "m": s.m, "k": s.k, "n": s.n, "dtype": s.dtype,
                         "threads": s.threads, "provider": prov, "gflops": c.rates[ph].get(prov),
                         "rates": c.rates[ph], "storage": c.weights.get(ph, s.dtype),
                         "bytes": c.nbytes.get(ph, s.k * s.n * getattr(torch, s.dtype).itemsize)})
    return rows


def _prepare(provider: Provider, w: torch.Tensor, m: int, layout: str, node: int | None = None,
             keep: str | None = None, weights: str = "") -> tuple[torch.Tensor, PackInfo | None]:
    """The provider's operand for ``w``, made by the calling (socket) thread, and what it is (None where
    it is ``w`` itself). A new dense operand (the (N, K) copy of a Conv1D weight) is copied onto ``node``
    when one is given: the worker's allocator may hand it pages recycled from another node, where its
    memory binding does not apply. A provider that ``places`` its operand (MKL's packing) allocates it on
    ``node`` itself: a copy would make resident the part of the buffer its packing never writes. With
    ``keep`` (a decode provider), a new operand is a second copy: its :class:`PackInfo` holds ``w`` for
    the decode steps, which ``keep`` runs on."""
    w_nk = w if layout == "nk" else w.t()
    if weights:   # the socket's own shard quantized, on its node: the operand of every provider of the format
        with torch.no_grad():
            op = quantize(w_nk, weights)
        if node is not None:
            from numatp.placement import numa_clone
            op = numa_clone(op, node)
        return op, PackInfo(provider.name, tuple(w.shape), w.dtype, layout, m, weights=weights)
    with torch.no_grad():
        op = provider.prepare(w_nk, m, node) if provider.places else provider.prepare(w_nk, m)
    if op is w_nk:  # dense providers keep the plain weight; nothing to swap
        return w, None
    if node is not None and op.layout == torch.strided and not provider.places:
        from numatp.placement import numa_clone
        op = numa_clone(op, node)
    return op, PackInfo(provider.name, tuple(w.shape), w.dtype, layout, m, plain=w if keep else None, later=keep)


def _rewrite(gm: torch.fx.GraphModule, site: Site, provider: str) -> None:
    with gm.graph.inserting_before(site.node):
        new = gm.graph.call_function(GEMM_OP, (site.x, site.weight, site.bias, provider, site.shape.layout))
    new.meta = dict(site.node.meta)
    site.node.replace_all_uses_with(new)
    gm.graph.erase_node(site.node)


def _feeds_output(node: torch.fx.Node, depth: int = 4) -> bool:
    """Whether a matmul's product is the program's output (an LM head's logits), through at most ``depth``
    views, copies or all-gathers."""
    if depth < 0:
        return False
    for u in node.users:
        if u.op == "output":
            return True
        name = getattr(u.target, "__name__", str(u.target))
        if any(k in name for k in ("view", "reshape", "all_gather", "clone", "_to_copy", "contiguous")) and \
                _feeds_output(u, depth - 1):
            return True
    return False


def _weight_name(placeholder: torch.fx.Node) -> str:
    """The parameter a weight placeholder binds (its name as the traced graph knew it), for messages."""
    return str(placeholder.meta.get("numatp_param") or placeholder.name)
