"""Choose a GEMM provider per weight matmul of the socket programs, and pack weights on their sockets.

Before the programs are cut into segments, :meth:`GemmSelector.apply`
1. finds the weight matmuls: ``aten.mm(x, W)`` / ``aten.addmm(b, x, W)`` where ``W`` is a weight
   placeholder, or ``permute(W, [1, 0])`` / ``t(W)`` of one;
2. looks up each local shape's rates in the on-disk :class:`~numatp.runtime.gemm.GemmTable`, and measures
   the missing ones on the socket workers (pinned, all sockets at once, as they will run);
3. keeps ``aten`` (the graph unchanged) unless another provider is faster by the margin; a weight whose
   uses do not all agree stays ``aten``. A weight a program already reads as it is (its plain operand)
   keeps it: later programs choose among the providers that read it so (``Provider.keeps_plain``), never
   a second, packed copy. While a generation compiles (``GemmSelector.decode``), a prompt's weight is
   chosen with its decode steps: one operand for both, or the plain weight with one provider for the
   prompt's rows and another (``gemv``) for the steps', whichever takes less measured time in all, or,
   where second copies fit in ``GemmOptions.decode_copies`` of the available memory, a packed copy for
   the prompt beside the plain weight for the steps (the fastest first token and the fastest steps);
4. rewrites each chosen matmul to ``numatp::gemm(x, W, b, provider, layout)``; the split of the program
   (:mod:`numatp.runtime.segments`) makes it ``numatp::linear``, the provider's C++ op, inside its
   compiled segment (Inductor's own lowerings of the packed kernels want the weight as a graph constant,
   which would compile every layer apart);
5. prepares each weight's operand in its socket's worker, so a packed weight is allocated under that
   socket's memory binding; the caller swaps it for the plain shard (no second copy is kept, except the
   plain weight beside a prompt's copy: its ``PackInfo.plain``, which the decode programs read).

A packed operand carries its :class:`PackInfo` (``operand._numatp_gemm``), so a later variant of the same
graph (another sequence length) reuses it: oneDNN and MKL packed weights serve any M.

Contract. Takes: the socket programs of :func:`numatp.plan.localize`, their arguments, and per rank the
argument positions that are weights. Guarantees: each rewritten matmul computes what the ATen one did
(within the provider's rounding); an operand made by a socket's worker is on its node; the op itself
and the executor's step for it live in :mod:`numatp.runtime.gemm`. Refuses: nothing; a weight read by
anything but matmuls, or whose matmuls disagree on the provider, stays on ATen.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from numatp.progress import step as progress_step
from numatp.runtime.gemm import (GEMM_OP, PROVIDERS, GemmShape, GemmTable, PackInfo, Provider, best_provider,
                                 stand_in, streams)
from numatp.plan.lower import gather_in_place
from numatp.topology.resources import memory_available

__all__ = ["GemmChoice", "GemmOptions", "GemmSelector", "report_rows"]

log = logging.getLogger("numatp")
aten = torch.ops.aten


DEFAULT_PROVIDERS = ("aten", "onednn", "onednn_packed", "mkl_packed", "mkl_packed_f32", "gemv")


@dataclass(frozen=True)
class GemmOptions:
    """How numatp picks GEMM providers."""

    providers: tuple[str, ...] = DEFAULT_PROVIDERS
    """Candidates; ``aten`` (the unchanged graph) is always one. Add ``"inductor_cpp"`` to measure
    Inductor's C++ GEMM template too (one compile per weight shape and thread count)."""
    force: str | None = None
    """Use this provider wherever it supports the dtype, without measuring (tests, experiments)."""
    cache_dir: str | None = None
    """Folder of the measured-rate table; ``None``: ``~/.cache/numatp``."""
    margin: float = 1.05
    """A provider replaces ``aten`` only when measured faster by this factor."""
    first_token: bool = False
    """When generating, choose each weight for the prompt alone (the fastest time to first token), the
    decode steps taking what the prompt left, instead of for the prompt and its decode steps together (the
    least time for the whole generation, which may run the prompt slower, e.g. on ATen instead of a
    packed weight, to decode on ``gemv``)."""
    decode_copies: float = 0.25
    """When generating, a weight may be held twice: an operand made for the prompt's rows (a packed weight,
    the fastest first token) beside the weight as stored, which the decode steps read (``gemv``), as long
    as those second copies take at most this share of the memory available when the programs compile;
    0 never (one operand per weight, each chosen for the prompt and its decode steps together)."""
    remeasure: bool = False
    """Time every shape again (once per selector) instead of trusting the on-disk table, e.g. when its
    rates were taken on a busy machine; ``numatp calibrate --remeasure-gemm`` re-times the whole table."""

    def __post_init__(self) -> None:
        unknown = [p for p in (*self.providers, *([self.force] if self.force else [])) if p not in PROVIDERS]
        if unknown:
            raise ValueError(f"GemmOptions: unknown GEMM provider(s) {unknown}; choose from {sorted(PROVIDERS)}")
        if not 0.0 <= self.decode_copies <= 1.0:
            raise ValueError(f"GemmOptions: decode_copies={self.decode_copies} is a share of the available memory, "
                             "from 0 (no second copy of any weight) to 1")


@dataclass
class _Site:
    node: torch.fx.Node
    x: torch.fx.Node
    weight: torch.fx.Node      # the placeholder
    bias: torch.fx.Node | None
    shape: GemmShape
    weight_bytes: int = 0   # of the program's weights: whether a few-row call finds its weight in cache


@dataclass
class GemmChoice:
    """One rank's decisions: provider per weight placeholder, and the measured rates behind them."""

    rank: int
    providers: dict[str, str] = field(default_factory=dict)      # placeholder -> provider
    rates: dict[str, dict[str, float]] = field(default_factory=dict)  # placeholder -> provider -> GFLOP/s
    shapes: dict[str, GemmShape] = field(default_factory=dict)
    later: dict[str, str] = field(default_factory=dict)   # placeholder -> provider planned for decode steps
    copies: set[str] = field(default_factory=set)   # placeholders whose prompt operand is a second copy
    reads: dict[str, torch.Tensor] = field(default_factory=dict)   # placeholder -> the plain weight kept
    # beside a prompt's copy, which this (decode) program reads instead of the copy


class GemmSelector:
    """Applies :class:`GemmOptions` to socket programs; one per compiled model (it holds the rate table)."""

    def __init__(self, options: GemmOptions | None = None):
        self.options = options or GemmOptions()
        self.table = GemmTable(self.options.cache_dir)
        self.choices: list[GemmChoice] = []
        self._timed: set[GemmShape] = set()   # shapes this selector measured itself
        self.decode: tuple[int, int] | None = None
        """``(rows, steps)`` while programs compiled now will be followed by ``steps`` decode steps of
        ``rows`` rows each (:func:`numatp.generate` says so around a generation): a prompt's weight then
        keeps its plain operand where a provider of the prompt's rows and another of the decode step's
        (``gemv``) sharing it take less time in all than any one operand for both."""
        self._plain: dict[int, tuple[weakref.ref, str | None]] = {}
        """id of a plain weight operand that a program reads as it is -> (the operand, weakly: a plan built
        and then dropped frees its shards; the provider chosen for it in the decode steps to come, if
        any): later programs keep to the plain operand, so no weight is held twice unless asked
        (``GemmOptions.decode_copies``)."""
        self._copy_budget: int | None = None   # bytes each socket's second copies may take (set when first needed)
        self._copied: dict[int, int] = {}    # rank -> bytes of second copies made
        self._planned: dict[int, int] = {}   # rank -> bytes of second copies chosen by the programs being planned
        self._sockets = 1

    def apply(self, group: Any, gms: list[torch.fx.GraphModule], args: list[list[Any]],
              weights: list[set[int]]) -> tuple[list[torch.fx.GraphModule], list[list[Any]], list[dict[int, tuple]],
                                                 list[dict[int, torch.Tensor]]]:
        """Rewritten programs, their arguments (prepared operands in place of plain shards), per rank
        ``{argument index: (plain, operand)}`` for the weights whose operand is new (the caller passes it
        from then on), and per rank ``{argument index: plain}`` for the weights these programs read as
        stored where the caller holds a prompt's copy (:attr:`GemmChoice.reads`: for these programs only)."""
        sites = self._sites(group, gms, args, weights)
        self._measure(group, sites, args)
        swaps: list[dict[int, tuple]] = [{} for _ in gms]
        reads: list[dict[int, torch.Tensor]] = [{} for _ in gms]
        todo: list[dict[int, tuple[Provider, torch.Tensor, int, str, str | None]]] = [{} for _ in gms]
        self._planned, self._sockets = {}, len(gms)
        self.choices = [self._choose(rank, gm, rank_sites, args[rank])
                        for rank, (gm, rank_sites) in enumerate(zip(gms, sites))]
        new_args = [list(a) for a in args]
        for rank, (gm, rank_sites, choice) in enumerate(zip(gms, sites, self.choices)):
            names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            for ph, group_sites in rank_sites.items():
                prov = choice.providers[ph.name]
                idx = names.index(ph.name)
                arg = args[rank][idx]
                if ph.name in choice.reads:   # the plain weight kept beside a prompt's copy
                    arg = new_args[rank][idx] = reads[rank][idx] = choice.reads[ph.name]
                prepared = getattr(arg, "_numatp_gemm", None) is not None or ph.name in choice.reads
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
                                       choice.shapes[ph.name].layout, keep)
            gm.graph.lint()
            gm.recompile()
        nodes = [s.node if group.binds_memory else None for s in group.topology.sockets]
        made = group.run(lambda rank: {i: _prepare(p, w, m, lay, nodes[rank], keep)
                                       for i, (p, w, m, lay, keep) in todo[rank].items()})
        for rank, planned in self._planned.items():
            self._copied[rank] = self._copied.get(rank, 0) + planned
        self._planned = {}
        for rank, ops in enumerate(made):
            for i, op in ops.items():
                swaps[rank][i] = (args[rank][i], op)
                new_args[rank][i] = op
        return gms, new_args, swaps, reads

    def preview(self, group: Any, gms: list[torch.fx.GraphModule], args: list[list[Any]],
                weights: list[set[int]]) -> list[dict[str, Any]]:
        """What :meth:`apply` would choose (measuring what the table lacks), without rewriting the programs
        or preparing any operand: :meth:`report`'s rows."""
        sites = self._sites(group, gms, args, weights)
        self._measure(group, sites, args)
        self._planned, self._sockets = {}, len(gms)
        self.choices = [self._choose(rank, gm, rank_sites, args[rank])
                        for rank, (gm, rank_sites) in enumerate(zip(gms, sites))]
        self._planned = {}
        return self.report()

    @staticmethod
    def _sites(group: Any, gms: list[torch.fx.GraphModule], args: list[list[Any]],
               weights: list[set[int]]) -> list[dict[torch.fx.Node, list[_Site]]]:
        threads = [len(s.cpus) for s in group.topology.sockets]
        gathers = group.size > 1   # with one socket the gathers are dropped (numatp.runtime.segments)
        return [_find_sites(gm, a, w, t, gathers) for gm, a, w, t in zip(gms, args, weights, threads)]

    def _choose(self, rank: int, gm: torch.fx.GraphModule, rank_sites: dict[torch.fx.Node, list[_Site]],
                args: list[Any]) -> GemmChoice:
        """Provider per weight placeholder: the one an operand was already prepared for (or, where that
        operand is a prompt's copy, the one planned for the plain weight kept beside it, if measured
        faster at these rows: a decode step); on a plain weight another program reads as it is, the
        decode provider planned for it or one that also reads it as it is; else measured (with the
        decode steps to come, when :attr:`decode` says so)."""
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        choice = GemmChoice(rank)
        for ph, group_sites in rank_sites.items():
            arg = args[names.index(ph.name)]
            info = getattr(arg, "_numatp_gemm", None)
            s0 = group_sites[0].shape
            plain, planned = self._planned_for(arg)
            if (info and info.later and info.plain is not None and self._fits(info.later, group_sites, plain=True)
                    and self._seconds(info.later, group_sites) < self._seconds(info.provider, group_sites)):
                prov = info.later   # e.g. a decode step: the plain weight kept beside the copy, measured faster
                choice.reads[ph.name] = info.plain
            elif info:
                prov = info.provider
            elif plain:
                prov = planned if planned and self._fits(planned, group_sites) else \
                    self._decide(group_sites, plain=True)
            elif self._with_decode() and s0.m > self.decode[0]:
                prov, later, copy = self._decide_with_decode(rank, group_sites)
                if later:
                    choice.later[ph.name] = later
                if copy:
                    choice.copies.add(ph.name)
                    self._planned[rank] = self._planned.get(rank, 0) + s0.weight_bytes
            else:
                prov = self._decide(group_sites)
            choice.providers[ph.name] = prov
            choice.shapes[ph.name] = s0
            choice.rates[ph.name] = self.table.get(s0) or {}
        return choice

    def _with_decode(self) -> bool:
        """Whether a prompt's weights are chosen with the decode steps to come."""
        return self.decode is not None and not self.options.force and not self.options.first_token

    def _planned_for(self, arg: Any) -> tuple[bool, str | None]:
        """Whether a program reads ``arg`` as its plain operand, and the decode provider planned for it."""
        ref, later = self._plain.get(id(arg), (None, None))
        return (True, later) if ref is not None and ref() is arg else (False, None)

    def _allowed(self, sites: list[_Site], plain: bool = False) -> list[str]:
        """The candidates that take every site's shape (with ``plain``, on the weight as it is)."""
        return [p for p in ("aten", *self.options.providers) if self._fits(p, sites, plain)]

    @staticmethod
    def _fits(provider: str, sites: list[_Site], plain: bool = False) -> bool:
        """Whether ``provider`` takes every site's shape (with ``plain``, on the weight as it is)."""
        p = PROVIDERS[provider]
        return all(p.runs(s.shape) for s in sites) and (not plain or sites[0].shape.layout in p.keeps_plain)

    def _decide(self, sites: list[_Site], plain: bool = False) -> str:
        if self.options.force:
            return self.options.force if self._fits(self.options.force, sites, plain) else "aten"
        allowed = self._allowed(sites, plain)
        picks = {best_provider(self.table.get(s.shape) or {}, allowed, margin=self.options.margin) for s in sites}
        return picks.pop() if len(picks) == 1 else "aten"

    def _decide_with_decode(self, rank: int, sites: list[_Site]) -> tuple[str, str | None, bool]:
        """A prompt's provider for a weight, the decode steps' provider where they differ, and whether the
        prompt's operand is a second copy: the pair of least measured time for the prompt and
        :attr:`decode`'s steps. Either one provider for both (its operand made once), or two that each
        read the plain weight as it is, or, while second copies fit in ``GemmOptions.decode_copies``, a
        new operand for the prompt beside the plain weight for the steps. A pair replaces ATen-for-both
        only when faster by the margin; a second copy replaces the best pair when it takes less time in all
        and runs the prompt or the steps faster by the margin."""
        steps = self.decode[1]
        decode = [replace(s, shape=self._decode_shape(s)) for s in sites]
        seconds = self._seconds
        pairs = [(p, p) for p in self._allowed(sites) if self._fits(p, decode)]
        plain_prompt, plain_decode = self._allowed(sites, plain=True), self._allowed(decode, plain=True)
        pairs += [(p, q) for p in plain_prompt for q in plain_decode if p != q]
        cost = {pq: seconds(pq[0], sites) + steps * seconds(pq[1], decode) for pq in pairs}
        best = min(cost, key=cost.get)
        if cost[best] * self.options.margin >= cost.get(("aten", "aten"), float("inf")):
            best = ("aten", "aten")
        if self._copy_room(rank) >= sites[0].shape.weight_bytes:
            fresh = [p for p in self._allowed(sites) if p not in plain_prompt]
            copies = {(p, q): seconds(p, sites) + steps * seconds(q, decode) for p in fresh for q in plain_decode}
            if copies:
                p, q = min(copies, key=copies.get)
                # less time in all, and the prompt or the steps faster by the margin (a copy that gains on
                # the prompt alone gains little of the whole when the steps dominate it, yet is the
                # first token's gain)
                margin = self.options.margin
                if copies[p, q] < cost[best] and (seconds(p, sites) * margin < seconds(best[0], sites)
                                                  or seconds(q, decode) * margin < seconds(best[1], decode)):
                    return p, q, True
        return best[0], (best[1] if best[1] != best[0] else None), False

    def _seconds(self, provider: str, sites: list[_Site]) -> float:
        """Measured time of ``provider`` over ``sites`` (inf where it has no rate)."""
        total = 0.0
        for s in sites:
            rate = (self.table.get(s.shape) or {}).get(provider, 0.0)
            if rate <= 0:
                return float("inf")
            total += s.shape.flops / (rate * 1e9)
        return total

    def _copy_room(self, rank: int) -> int:
        """Bytes that more second copies of socket ``rank`` may take: its share of
        ``GemmOptions.decode_copies`` of the memory available when first asked (every socket the same, so
        that none runs its prompt slower for want of room), less its copies made and planned."""
        if self._copy_budget is None:
            self._copy_budget = int((memory_available() or 0) * self.options.decode_copies) // self._sockets
        return self._copy_budget - self._copied.get(rank, 0) - self._planned.get(rank, 0)

    def _decode_shape(self, site: _Site) -> GemmShape:
        """``site``'s shape in the decode steps to come (:attr:`decode`'s rows)."""
        rows = self.decode[0]
        return replace(site.shape, m=rows, stream=streams(rows, site.weight_bytes))

    def _measure(self, group: Any, sites: list[dict], args: list[list[Any]]) -> None:
        if self.options.force:
            return
        providers = ["aten", *[p for p in self.options.providers if p != "aten"]]
        wanted = [[s.shape for ss in rank_sites.values() for s in ss] for rank_sites in sites]
        if self._with_decode():   # a prompt's weights are chosen for the decode steps too: their shapes as well
            rows = self.decode[0]
            wanted = [w + [self._decode_shape(s) for ss in rank_sites.values() for s in ss if s.shape.m > rows]
                      for w, rank_sites in zip(wanted, sites)]
        again = {s for w in wanted for s in w} - self._timed if self.options.remeasure else set()
        if not again and not any(self.table.get(s) is None for w in wanted for s in w):
            return
        # every socket measures its own shapes at the same time, so each rate is taken under the load
        # of the other sockets, as in a real call
        shapes = len({s for w in wanted for s in w if s in again or self.table.get(s) is None})
        with progress_step("measuring GEMM providers for %d shapes on %d socket(s)", shapes, len(wanted)):
            found = group.run(lambda rank: self.table.measure_missing(wanted[rank], providers, again=again))
        self._timed |= {s for w in wanted for s in w}
        merged: dict[GemmShape, dict[str, float]] = {}
        for rates in found:
            for shape, r in rates.items():
                merged[shape] = {p: min(v, merged.get(shape, {}).get(p, v)) for p, v in r.items()}
        if merged:
            log.info("numatp: measured %d GEMM shapes (%s)", len(merged), self.table.path)
            self.table.put(merged)

    def report(self) -> list[dict[str, Any]]:
        """The rows of :func:`report_rows` for the last programs this selector rewrote or previewed."""
        return report_rows(self.choices)


def report_rows(choices: list[GemmChoice]) -> list[dict[str, Any]]:
    """Per rank and weight: the shape, the chosen provider and its measured rate (for ``explain``)."""
    rows = []
    for c in choices:
        for ph, prov in c.providers.items():
            s = c.shapes[ph]
            rows.append({"rank": c.rank, "weight": ph, "m": s.m, "k": s.k, "n": s.n, "dtype": s.dtype,
                         "threads": s.threads, "provider": prov, "gflops": c.rates[ph].get(prov),
                         "rates": c.rates[ph]})
    return rows


def _prepare(provider: Provider, w: torch.Tensor, m: int, layout: str, node: int | None = None,
             keep: str | None = None) -> torch.Tensor:
    """The provider's operand for ``w``, made by the calling (socket) thread. A new dense operand (the
    (N, K) copy of a Conv1D weight) is copied onto ``node`` when one is given: the worker's allocator
    may hand it pages recycled from another node, where its memory binding does not apply. A provider
    that ``places`` its operand (MKL's packing) allocates it on ``node`` itself: a copy would make
    resident the part of the buffer its packing never writes. With ``keep``
    (a decode provider), a new operand is a second copy: its :class:`PackInfo` holds ``w`` for the decode
    steps, which ``keep`` runs on."""
    w_nk = w if layout == "nk" else w.t()
    with torch.no_grad():
        op = provider.prepare(w_nk, m, node) if provider.places else provider.prepare(w_nk, m)
    if op is w_nk:  # dense providers keep the plain weight; nothing to swap
        op = w
    else:
        if node is not None and op.layout == torch.strided and not provider.places:
            from numatp.placement import numa_clone
            op = numa_clone(op, node)
        op._numatp_gemm = PackInfo(provider.name, tuple(w.shape), w.dtype, layout, m,
                                   plain=w if keep else None, later=keep)
    return op


def _find_sites(gm: torch.fx.GraphModule, args: list[Any], weights: set[int], threads: int,
                gathers: bool = False) -> dict[torch.fx.Node, list[_Site]]:
    """Weight matmuls grouped by weight placeholder; weights with any other use are left out. With
    ``gathers``, a matmul whose output is all-gathered is measured as written into the full tensor
    (``GemmShape.into``)."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    plain = [stand_in(a) for a in args]
    # the weight bytes one call reads: whether a few-row matmul finds its weight in cache (GemmShape.stream)
    weight_bytes = sum(plain[i].numel() * plain[i].element_size() for i in weights
                       if isinstance(plain[i], torch.Tensor))
    FakeTensorProp(gm, fake).propagate(*[fake.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in plain])
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: dict[torch.fx.Node, list[_Site]] = {}
    for i in sorted(weights):
        ph = placeholders[i]
        sites: list[_Site] = []
        ok = ph.meta["val"].dim() == 2 and ph.meta["val"].dtype in (torch.float32, torch.bfloat16)
        for u in list(ph.users) if ok else []:
            if u.target in (aten.permute.default, aten.t.default) and (u.target is aten.t.default
                                                                        or list(u.args[1]) == [1, 0]):
                for v in u.users:
                    site = _site(v, u, ph, "nk", threads, gathers, weight_bytes)
                    ok = ok and site is not None
                    sites.append(site)
            else:
                site = _site(u, ph, ph, "kn", threads, gathers, weight_bytes)
                ok = ok and site is not None
                sites.append(site)
        if ok and sites:
            out[ph] = sites
    return out


def _site(node: torch.fx.Node, w: torch.fx.Node, ph: torch.fx.Node, layout: str, threads: int,
          gathers: bool = False, weight_bytes: int = 0) -> _Site | None:
    if node.target is aten.mm.default and node.args[1] is w and node.args[0] is not w:
        x, bias = node.args[0], None
    elif (node.target is aten.addmm.default and node.args[2] is w and not node.kwargs
          and node.args[1] is not w and node.args[0].meta["val"].dim() == 1):
        bias, x = node.args[0], node.args[1]
    else:
        return None
    xv, wv = x.meta["val"], ph.meta["val"]
    if xv.dim() != 2 or xv.dtype != wv.dtype:
        return None
    n, k = (wv.shape[0], wv.shape[1]) if layout == "nk" else (wv.shape[1], wv.shape[0])
    shape = GemmShape(int(xv.shape[0]), int(k), int(n), str(wv.dtype).removeprefix("torch."), layout, threads,
                      _gathered_width(node) if gathers else 0, streams(int(xv.shape[0]), weight_bytes))
    return _Site(node, x, ph, bias, shape, weight_bytes)


def _gathered_width(node: torch.fx.Node) -> int:
    """The full width of the all-gather this matmul could write in place
    (:func:`numatp.runtime.segments.gather_in_place`), else 0."""
    g = gather_in_place(node)
    return 0 if g is None else int(g.meta["val"].shape[-1])


def _rewrite(gm: torch.fx.GraphModule, site: _Site, provider: str) -> None:
    with gm.graph.inserting_before(site.node):
        new = gm.graph.call_function(GEMM_OP, (site.x, site.weight, site.bias, provider, site.shape.layout))
    new.meta = dict(site.node.meta)
    site.node.replace_all_uses_with(new)
    gm.graph.erase_node(site.node)
