"""Choosing a GEMM provider per weight: a function of the weight's matmul sites, the measured rates, the
room left for second copies of weights and the decode steps to come (a hint passed in), nothing else.

:func:`choose` keeps ``aten`` (the graph unchanged) unless another provider is measured faster than a
measured ``aten`` by ``GemmOptions.margin``; a weight whose uses do not all agree stays ``aten``, and a
provider without a usable rate (never measured, or a measurement that failed or read nothing) is never
chosen. A weight a program already reads as it is (its plain operand) keeps it: later programs choose
among the providers that read it so (``Provider.keeps_plain``), never a second, packed copy. With
:class:`Decode` (a generation's prompt, compiled knowing its decode steps), a prompt's weight is chosen
with its decode steps: one operand for both, or the plain weight with one provider for the prompt's rows
and another (``gemv``) for the steps', whichever takes less measured time in all, or, where a second copy
fits in the room given, a packed copy for the prompt beside the plain weight for the steps (the fastest
first token and the fastest steps). :mod:`numatp.plan.gemm_pass` applies the choice to the programs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from numatp.runtime.gemm import PROVIDERS, GemmShape, PackInfo, decode_shape, usable_rates

__all__ = ["DEFAULT_PROVIDERS", "Decode", "GemmChoice", "GemmOptions", "Prior", "best_provider", "choose",
           "measured_seconds"]


DEFAULT_PROVIDERS = ("aten", "onednn", "onednn_packed", "mkl_packed", "mkl_packed_f32", "gemv", "amx", "dpbf16",
                     "qgemv", "q8dot", "qtile", "q8_aten", "q_dequant")


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


@dataclass(frozen=True)
class Decode:
    """The decode steps that follow the prompt programs being compiled (:func:`numatp.generate` says so):
    ``steps`` steps of ``rows`` rows each."""

    rows: int
    steps: int


class Site(Protocol):
    """A weight matmul as selection sees it: its shape, and the weight bytes of its program (whether a
    decode step's call finds its weight in cache)."""

    @property
    def shape(self) -> GemmShape: ...

    @property
    def weight_bytes(self) -> int: ...


@dataclass(frozen=True)
class _At:
    shape: GemmShape
    weight_bytes: int


@dataclass(frozen=True)
class Prior:
    """What a weight's argument already is: a prepared operand (``info``, as the weight store recorded
    it), or a plain weight another program reads as it is (``plain``, with the decode provider planned
    for it, if any), or neither."""

    info: PackInfo | None = None
    plain: bool = False
    planned: str | None = None
    restorable: bool = False
    """Whether the owner of ``info``'s operand can make the plain weight again (beside it, as a second
    copy), for programs that read it faster as stored."""


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
    weights: dict[str, str] = field(default_factory=dict)   # placeholder -> its quantized format, if quantized
    nbytes: dict[str, int] = field(default_factory=dict)   # placeholder -> bytes of its quantized shard
    restores: set[str] = field(default_factory=set)   # placeholders whose plain weight is made again, as a
    # second copy beside the prepared operand, for this program and the later ones that read it as stored


def measured_seconds(rates: Mapping[GemmShape, Any], provider: str, sites: Sequence[Any], *,
                     runnable: bool = False) -> float:
    """The time ``provider`` takes over ``sites`` (each with a ``shape``) at the rates of the table
    ``rates``: inf where a site's shape has no usable rate for it, or (``runnable``) one it cannot run."""
    total = 0.0
    for s in sites:
        rate = usable_rates(rates.get(s.shape)).get(provider)
        if rate is None or (runnable and not PROVIDERS[provider].runs(s.shape)):
            return float("inf")
        total += s.shape.flops / (rate * 1e9)
    return total


def best_provider(rates: Mapping[str, float], allowed: Sequence[str], *, margin: float = 1.05) -> str:
    """The fastest allowed provider; ``aten`` (the unchanged graph) unless another beats a measured ``aten``
    by ``margin``. Only usable rates count (positive, finite): without one for ``aten`` nothing is
    compared, and ``aten`` stays."""
    usable = usable_rates(rates)
    timed = [(p, usable[p]) for p in allowed if p in usable]
    if "aten" not in usable or not timed:
        return "aten"
    name, rate = max(timed, key=lambda pr: pr[1])
    return name if name != "aten" and rate > usable["aten"] * margin else "aten"


def choose(rank: int, sites: Mapping[str, Sequence[Site]], rates: Mapping[GemmShape, Mapping[str, float]], *,
           options: GemmOptions, priors: Mapping[str, Prior] | None = None, room: int = 0,
           decode: Decode | None = None, llc_bytes: int = 32 << 20) -> tuple[GemmChoice, int]:
    """Provider per weight (``sites``: weight name -> its matmuls) and the bytes of second copies planned.

    Per weight: the provider its prepared operand was made for (or, where that operand is a prompt's
    copy, the one planned for the plain weight kept beside it, if measured faster at these rows: a decode
    step; or, where its owner can make the plain weight again and a second copy fits in ``room``, a
    provider that reads it as stored, if measured faster by the margin: :attr:`GemmChoice.restores`); on
    a plain weight another program reads as it is, the decode provider planned for it or one
    that also reads it as it is; else measured (with the ``decode`` steps to come, unless the options
    force a provider or ask for the first token). ``room``: bytes this rank's second copies may still
    take; ``llc_bytes``: the last-level cache, whether a decode step streams its weight."""
    c = _Chooser(options, rates, None if options.force or options.first_token else decode, llc_bytes)
    priors = priors or {}
    choice = GemmChoice(rank)
    planned = 0
    for name, group_sites in sites.items():
        prior = priors.get(name, Prior())
        info = prior.info
        s0 = group_sites[0].shape
        if (info and info.later and info.plain is not None and c.fits(info.later, group_sites, plain=True)
                and c.seconds(info.later, group_sites) < c.seconds(info.provider, group_sites)):
            prov = info.later   # e.g. a decode step: the plain weight kept beside the copy, measured faster
            choice.reads[name] = info.plain
        elif info:
            prov = info.provider
            if prior.restorable and room - planned >= s0.weight_bytes:
                plain = c.restore(info.provider, group_sites)
                if plain is not None:   # e.g. a decode step after a prompt compiled alone packed the weight
                    prov = plain
                    choice.restores.add(name)
                    planned += s0.weight_bytes
        elif prior.plain:
            prov = prior.planned if prior.planned and c.fits(prior.planned, group_sites) else \
                c.decide(group_sites, plain=True)
        elif c.decode is not None and s0.m > c.decode.rows:
            prov, later, copy = c.decide_with_decode(group_sites, room - planned)
            if later:
                choice.later[name] = later
            if copy:
                choice.copies.add(name)
                planned += s0.weight_bytes
        else:
            prov = c.decide(group_sites)
        choice.providers[name] = prov
        choice.shapes[name] = s0
        choice.rates[name] = usable_rates(rates.get(s0))
    return choice, planned


def decode_shapes(sites: Mapping[Any, Sequence[Site]], decode: Decode, llc_bytes: int) -> list[GemmShape]:
    """The shapes the decode steps run of the prompt's matmuls (those of more rows than a step's)."""
    return [decode_shape(s.shape, decode.rows, s.weight_bytes, llc_bytes)
            for ss in sites.values() for s in ss if s.shape.m > decode.rows]


@dataclass(frozen=True)
class _Chooser:
    options: GemmOptions
    rates: Mapping[GemmShape, Mapping[str, float]]
    decode: Decode | None
    llc_bytes: int

    def allowed(self, sites: Sequence[Site], plain: bool = False) -> list[str]:
        """The candidates that take every site's shape (with ``plain``, on the weight as it is)."""
        return [p for p in ("aten", *self.options.providers) if self.fits(p, sites, plain)]

    @staticmethod
    def fits(provider: str, sites: Sequence[Site], plain: bool = False) -> bool:
        """Whether ``provider`` takes every site's shape (with ``plain``, on the weight as it is)."""
        p = PROVIDERS[provider]
        return all(p.runs(s.shape) for s in sites) and (not plain or sites[0].shape.layout in p.keeps_plain)

    def decide(self, sites: Sequence[Site], plain: bool = False) -> str:
        if self.options.force:
            return self.options.force if self.fits(self.options.force, sites, plain) else "aten"
        allowed = self.allowed(sites, plain)
        picks = {best_provider(self.rates.get(s.shape) or {}, allowed, margin=self.options.margin) for s in sites}
        return picks.pop() if len(picks) == 1 else "aten"

    def restore(self, packed: str, sites: Sequence[Site]) -> str | None:
        """A provider that reads the weight as stored and runs ``sites`` faster than ``packed`` (the provider
        of the weight's prepared operand) by the margin, measured; None where none does, or where the
        options force a provider."""
        if self.options.force:
            return None
        plain = self.decide(sites, plain=True)
        return plain if plain != packed and self.seconds(plain, sites) * self.options.margin < \
            self.seconds(packed, sites) else None

    def seconds(self, provider: str, sites: Sequence[Site]) -> float:
        """Measured time of ``provider`` over ``sites`` (inf where it has no usable rate)."""
        return measured_seconds(self.rates, provider, sites)

    def decide_with_decode(self, sites: Sequence[Site], room: int) -> tuple[str, str | None, bool]:
        """A prompt's provider for a weight, the decode steps' provider where they differ, and whether the
        prompt's operand is a second copy: the pair of least measured time for the prompt and the decode
        steps. Either one provider for both (its operand made once), or two that each read the plain
        weight as it is, or, while a second copy fits in ``room``, a new operand for the prompt beside the
        plain weight for the steps. A pair replaces ATen-for-both only when faster by the margin (and ATen
        has usable rates to compare with); a second copy replaces the best pair when it takes less time in
        all and runs the prompt or the steps faster by the margin."""
        assert self.decode is not None
        steps, seconds = self.decode.steps, self.seconds
        decode = [_At(decode_shape(s.shape, self.decode.rows, s.weight_bytes, self.llc_bytes), s.weight_bytes)
                  for s in sites]
        aten = seconds("aten", sites) + steps * seconds("aten", decode)
        if aten == float("inf"):   # nothing to compare with: the graph stays as it is
            return "aten", None, False
        pairs = [(p, p) for p in self.allowed(sites) if self.fits(p, decode)]
        plain_prompt, plain_decode = self.allowed(sites, plain=True), self.allowed(decode, plain=True)
        pairs += [(p, q) for p in plain_prompt for q in plain_decode if p != q]
        cost = {pq: seconds(pq[0], sites) + steps * seconds(pq[1], decode) for pq in pairs}
        best = min(cost, key=lambda pq: cost[pq])
        if cost[best] * self.options.margin >= cost.get(("aten", "aten"), float("inf")):
            best = ("aten", "aten")
        if room >= sites[0].shape.weight_bytes:
            fresh = [p for p in self.allowed(sites) if p not in plain_prompt]
            copies = {(p, q): seconds(p, sites) + steps * seconds(q, decode) for p in fresh for q in plain_decode}
            if copies:
                p, q = min(copies, key=lambda pq: copies[pq])
                # less time in all, and the prompt or the steps faster by the margin (a copy that gains on
                # the prompt alone gains little of the whole when the steps dominate it, yet is the
                # first token's gain)
                margin = self.options.margin
                if copies[p, q] < cost[best] and (seconds(p, sites) * margin < seconds(best[0], sites)
                                                  or seconds(q, decode) * margin < seconds(best[1], decode)):
                    return p, q, True
        return best[0], (best[1] if best[1] != best[0] else None), False
