"""Measuring GEMM providers: GFLOP/s per provider at a shape, on the calling thread (its thread count and
pinning), in rounds so that every provider meets the same load.

A measurement that fails or reads nothing (the provider cannot run here, a call raises, a clock reads no
time or runs backwards, a rate that is not a positive finite number, too few timed calls) reports 0.0 and
is never written to the table (:mod:`numatp.runtime.gemm.table`), so it never becomes a choice. Rates are
GFLOP/s (``2 M K N`` per call).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

import torch

from numatp.runtime.gemm import quant
from numatp.runtime.gemm.providers import GEMV_MAX_ROWS, PROVIDERS, GemmShape, Provider, call_into
from numatp.runtime.gemm.table import GemmTable, is_rate, stored_rate, usable_rates
from numatp.topology.resources import MachineFacts

log = logging.getLogger("numatp")

__all__ = ["CEILING_SHAPE", "STREAM_MAX_BYTES", "Measure", "decode_shape", "measure", "measure_all", "measure_ceilings",
           "measure_missing", "streamed_copies", "streams"]

Measure = Callable[[dict[str, Provider], GemmShape], dict[str, float]]
"""How :func:`measure_missing` times providers at a shape: :func:`measure_all` unless a test injects one."""


def measure(provider: Provider, shape: GemmShape, *, min_seconds: float = 0.15, max_calls: int = 20,
            seed: int = 0, max_call_seconds: float = 5.0, facts: MachineFacts | None = None,
            clock: Callable[[], float] = time.perf_counter) -> float:
    """GFLOP/s of ``provider`` at ``shape`` on the calling thread (its thread count and pinning).

    One warm-up call, then calls until ``min_seconds`` or ``max_calls``; the median time counts. Returns
    0.0 where the provider does not support the dtype or the CPU (e.g. oneDNN bf16 reorders need
    AVX-512 or AVX-NE-CONVERT) or the measurement fails. A provider that a 32-row probe shows would take
    over ``max_call_seconds`` per call (torch's reference bf16 loops on AVX2 run near 1 GFLOP/s) gets the
    probe's rate instead.
    """
    return measure_all({provider.name: provider}, shape, min_seconds=min_seconds, max_calls=max_calls,
                       seed=seed, max_call_seconds=max_call_seconds, facts=facts, clock=clock)[provider.name]


def measure_all(providers: Mapping[str, Provider], shape: GemmShape, *, min_seconds: float = 0.15,
                max_calls: int = 20, seed: int = 0, max_call_seconds: float = 5.0,
                facts: MachineFacts | None = None,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """GFLOP/s of each provider at ``shape``, as :func:`measure`, timed in rounds: every round calls each
    provider once, so a change of load on the machine slows all of them alike and the comparison that
    picks one stays fair. Rounds go on until each provider has had ``min_seconds`` or ``max_calls``.

    A :attr:`GemmShape.stream` shape (a decode step's few rows, its weight read from memory at every call
    as a decode step reads every weight in turn) would sit in cache if timed on one weight, and the rate
    would be the cache's: each call reads the next of a ring of copies past the last-level cache
    (:func:`streamed_copies`, of ``facts``: this machine's where None). Each copy is prepared apart, as a
    program's own operand is, and a prepared copy's speed may depend on where it was allocated (measured
    on an AVX-512/AMX Xeon, one thread, a 1 x 1024 x 25128 bf16 LM head: six oneDNN-packed copies of one
    weight in one process ran at 4.2-4.8 or 10.7-11.7 GFLOP/s, copy by copy, where numatp's gemv on the
    plain weight ran at 8.2-9.1); a program reads one copy, whichever it got, so a streamed rate is the
    mean over the copies of each copy's median time: the time the program can expect, not the luckiest
    copy's. A provider whose call raises while timed, or whose times read nothing (``clock``), reports 0.0.

    A quantized shape (:attr:`GemmShape.weights`) is run by the quantized providers only: the weight is
    quantized once (:func:`numatp.runtime.gemm.quant.quantize`) and the ring holds copies of the buffer,
    each provider's ``prepare`` handing it back as it is."""
    dtype = getattr(torch, shape.dtype)
    rates: dict[str, float] = {name: 0.0 for name in providers}
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape.m, shape.k, generator=g).to(dtype)
    w = torch.randn(shape.n, shape.k, generator=g).to(dtype) if shape.layout == "nk" else \
        torch.randn(shape.k, shape.n, generator=g).to(dtype).t()
    bias = torch.randn(shape.n, generator=g).to(dtype)
    if shape.stream and facts is None:
        facts = MachineFacts.detect()
    copies = streamed_copies(shape, facts)
    if shape.weights:
        # a quantized weight: quantized once, the buffer copied (only quantized providers run the shape)
        qw = quant.quantize(w, shape.weights)
        ring = [qw] + [qw.clone() for _ in range(copies - 1)]
    else:
        ring = [w] + [w.clone() if shape.layout == "nk" else w.t().clone().t() for _ in range(copies - 1)]
    timed: dict[str, tuple[Provider, list[torch.Tensor]]] = {}
    with torch.inference_mode():
        for name, provider in providers.items():
            if not provider.runs(shape):
                continue
            if shape.m > 32 and not provider.compiles:
                probe = GemmShape(32, shape.k, shape.n, shape.dtype, shape.layout, shape.threads,
                                  weights=shape.weights)
                rate = measure(provider, probe, min_seconds=0.0, max_calls=1, seed=seed, facts=facts, clock=clock)
                if rate == 0.0 or shape.flops / (rate * 1e9) > max_call_seconds:
                    rates[name] = rate
                    continue
            try:
                ops = [provider.prepare(c, shape.m) for c in ring]
                provider.call(x, ops[0], bias, shape.n, shape.k)
            except Exception as e:  # noqa: BLE001  (a kernel this CPU or torch cannot run measures 0)
                log.debug("numatp: GEMM provider %s cannot run %s: %s", name, shape.key, e)
                continue
            timed[name] = (provider, ops)
        by_copy: dict[str, dict[int, list[float]]] = {name: {} for name in timed}   # call times per copy
        made = dict.fromkeys(timed, 0)
        spent = dict.fromkeys(timed, 0.0)
        # providers that read the plain weight share the ring's copies: each starts at its own place in
        # it, so none reads a copy another has just brought into cache
        start = {name: i * len(ring) // len(timed) for i, name in enumerate(timed)}
        calls = 0
        while timed and any(made[n] < max_calls and (made[n] < 2 or spent[n] < min_seconds) for n in timed):
            calls += 1
            for name, (provider, ops) in list(timed.items()):
                if made[name] >= max_calls:
                    continue
                at = (start[name] + calls) % len(ops)
                op = ops[at]
                t0 = clock()
                try:
                    if shape.into:   # a fresh full tensor per call, as per gather: its pages fault in
                        call_into(provider, x, op, bias, shape.n, shape.k, x.new_empty(shape.m, shape.into))
                    else:
                        provider.call(x, op, bias, shape.n, shape.k)
                except Exception as e:  # noqa: BLE001  (a call that fails under way is no measurement)
                    log.debug("numatp: GEMM provider %s failed while timed at %s: %s", name, shape.key, e)
                    del timed[name], by_copy[name]
                    continue
                dt = clock() - t0
                by_copy[name].setdefault(at, []).append(dt)
                made[name] += 1
                spent[name] += dt
    for name, per_copy in by_copy.items():
        rates[name] = _rate(shape, per_copy, min(2, max_calls))
    return rates


def _rate(shape: GemmShape, per_copy: dict[int, list[float]], min_calls: int) -> float:
    """GFLOP/s from the call times per copy (the mean of each copy's median), or 0.0 where they are no
    measurement: fewer than ``min_calls`` calls, a copy whose median time is not positive, or a rate that
    is not a positive finite number."""
    if sum(len(ts) for ts in per_copy.values()) < max(min_calls, 1):
        return 0.0
    medians = [statistics.median(ts) for ts in per_copy.values()]
    if not all(m > 0 for m in medians):   # a clock that read nothing, or ran backwards
        return 0.0
    rate = shape.flops / statistics.fmean(medians) / 1e9
    return rate if is_rate(rate) else 0.0


STREAM_MAX_BYTES = 512 << 20
"""The most weight bytes in :func:`measure_all`'s ring of copies (:func:`streamed_copies`); each packed
provider holds its own ring while the shape is measured (MKL's fp32 one for bf16, twice the bytes)."""


def streams(m: int, weight_bytes: int, llc_bytes: int) -> bool:
    """Whether a matmul of ``m`` rows in a program reading ``weight_bytes`` of weights per call takes its
    weight from memory: few rows (at most ``GEMV_MAX_ROWS``: nothing reuses a weight within the call) and
    weights past a quarter of the last-level cache of ``llc_bytes`` (between two reads of one weight, all
    the others pass through; a quarter, not all, because a cache shared with other cores and tenants keeps
    less than its size, and a virtual machine may report the host's)."""
    return m <= GEMV_MAX_ROWS and weight_bytes > llc_bytes // 4


def streamed_copies(shape: GemmShape, facts: MachineFacts | None) -> int:
    """How many copies of the weight :func:`measure_all` cycles through at ``shape``: 1 unless it streams;
    else enough to pass twice the last-level cache, within :data:`STREAM_MAX_BYTES`, 1/32 of the memory
    available (every provider holds a ring, and every socket measures at once), and 1024 copies."""
    if not shape.stream:
        return 1
    assert facts is not None, "a streamed shape's ring is sized by the machine's facts"
    free = facts.memory_available
    want = min(2 * facts.llc_bytes, STREAM_MAX_BYTES, STREAM_MAX_BYTES if free is None else free // 32)
    return max(1, min(1024, -(-want // max(shape.weight_bytes, 1))))


def measure_missing(known: Callable[[GemmShape], Mapping[str, float] | None], shapes: list[GemmShape],
                    providers: list[str], *, again: Collection[GemmShape] = (), facts: MachineFacts | None = None,
                    timer: Measure | None = None) -> dict[GemmShape, dict[str, float]]:
    """Measure on the calling thread the shapes (or the providers that run them) that ``known`` lacks, and
    those in ``again`` whatever it holds; returns each such shape's rates as the table should keep them
    (usable rates only). ``timer``: :func:`measure_all` on ``facts``, unless injected."""
    time_them: Measure = timer or (lambda todo, shape: measure_all(todo, shape, facts=facts))
    out: dict[GemmShape, dict[str, float]] = {}
    for s in dict.fromkeys(shapes):
        have = {} if s in again else usable_rates(known(s))
        todo = [p for p in providers if p not in have and PROVIDERS[p].runs(s)]
        if todo:
            found = usable_rates(time_them({p: PROVIDERS[p] for p in todo}, s))
            out[s] = {**have, **{p: stored_rate(r) for p, r in found.items()}}
    return out


CEILING_SHAPE = (512, 1024, 4096)
"""``(M, K, N)`` at which ``measure_ceilings`` times every provider: a 512-token prefill through a
1024 -> 4096 weight (GPT-2 medium's MLP up-projection), large enough for each kernel's steady rate."""


def measure_ceilings(threads: int, dtypes: tuple[str, ...] = ("float32", "bfloat16"), *,
                     cache_dir: str | os.PathLike | None = None,
                     progress: Callable[[str], None] = lambda _: None) -> dict[str, dict[str, float]]:
    """Every provider's GFLOP/s at ``CEILING_SHAPE`` per dtype, on the calling thread, which must run
    ``threads`` torch threads pinned where they should be measured; the usable rates join the on-disk
    table. A provider that cannot run the dtype here (or whose measurement failed) reports 0.0; one slower
    than a second per call (torch's bf16 loops on CPUs without bf16 instructions) is timed on a 32-row
    probe instead."""
    m, k, n = CEILING_SHAPE
    found: dict[GemmShape, dict[str, float]] = {}
    for dt in dtypes:
        shape = GemmShape(m, k, n, dt, "kn", threads)
        progress(f"GEMM providers, {dt}, {m} x {k} x {n}, {threads} threads")
        found[shape] = {name: stored_rate(r) if is_rate(r) else 0.0
                        for name, r in measure_all(PROVIDERS, shape, max_call_seconds=1.0).items()}
    GemmTable(cache_dir).put(found)
    return {s.dtype: r for s, r in found.items()}


def decode_shape(shape: GemmShape, rows: int, weight_bytes: int, llc_bytes: int) -> GemmShape:
    """``shape`` with ``rows`` rows, as a decode step runs it in a program of ``weight_bytes`` of weights."""
    return replace(shape, m=rows, stream=streams(rows, weight_bytes, llc_bytes))
