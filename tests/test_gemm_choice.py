"""GEMM choice as explicit state: a measurement that fails or reads nothing is no rate and never a choice
(ATen, the unchanged graph, is kept), the rate table keeps rates only and is written safely by processes
at once, and selection is a function of its arguments. No Inductor, no timing dependence."""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing
from dataclasses import dataclass, replace

import pytest
import torch

from numatp import zoo
from numatp.plan.gemm_choice import Decode, GemmOptions, best_provider, choose
from numatp.plan.gemm_pass import GemmSelector
from numatp.runtime.gemm import GEMM_OP, PROVIDERS, GemmShape, GemmTable, MachineFacts, Provider, measure_all
from numatp.runtime.gemm.table import stored_rate
from numatp.topology import Topology

pytestmark = [pytest.mark.unit,   # no Inductor, no timing: measurements are injected
              pytest.mark.filterwarnings("ignore:numatp. virtual sockets")]

NOT_RATES = [0.0, -3.0, math.nan, math.inf, None]   # None: no entry at all
SHAPE = GemmShape(32, 64, 64, "float32", "nk", 1)
FACTS = MachineFacts(llc_bytes=32 << 20, memory_available=8 << 30, cpu_signature="test-cpu")


@dataclass(frozen=True)
class _Site:
    shape: GemmShape
    weight_bytes: int = 0


def _rates(**by_provider: float | None) -> dict[str, float]:
    return {p: r for p, r in by_provider.items() if r is not None}


def _provider(name: str, call=None) -> Provider:
    def zeros(x, op, bias, n, k):
        return x.new_zeros(x.shape[0], n)
    return Provider(name, (torch.float32,), False, lambda w, m: w, call or zeros)


def test_a_call_that_raises_while_timed_measures_nothing():
    calls = []

    def fails_once_timed(x, op, bias, n, k):   # the warm-up call passes, the first timed one raises
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("out of memory")
        return x.new_zeros(x.shape[0], n)

    rates = measure_all({"aten": PROVIDERS["aten"], "flaky": _provider("flaky", fails_once_timed)}, SHAPE,
                        min_seconds=0.0, max_calls=3)
    assert rates["flaky"] == 0.0 and rates["aten"] > 0


@pytest.mark.parametrize("clock", ["still", "backwards"])
def test_a_clock_that_reads_nothing_gives_no_rate(clock):
    # a clock that does not move (every call 0 s: an infinite rate) or runs backwards (a negative one)
    ticks = itertools.repeat(5.0) if clock == "still" else itertools.count(0.0, -1.0)
    rates = measure_all({"aten": PROVIDERS["aten"], "other": _provider("other")}, SHAPE, min_seconds=0.0,
                        max_calls=3, clock=lambda: next(ticks))
    assert rates == {"aten": 0.0, "other": 0.0}


def test_the_table_keeps_rates_only(tmp_path):
    other = replace(SHAPE, n=128)
    GemmTable(tmp_path).put({SHAPE: {"aten": 2.5, "onednn": 0.0, "gemv": math.nan, "mkl_packed": math.inf,
                                     "onednn_packed": -1.0}, other: {"aten": 0.0}})
    table = GemmTable(tmp_path)
    assert table.get(SHAPE) == {"aten": 2.5} and table.get(other) is None
    assert json.loads(table.path.read_text())["rates"] == {SHAPE.key: {"aten": 2.5}}
    # a file that holds zeros (as older tables did for what could not run) is read without them
    table.path.write_text(json.dumps({"rates": {SHAPE.key: {"aten": 0.0, "onednn": 3.0}, other.key: {"aten": 0}}}))
    assert GemmTable(tmp_path).get(SHAPE) == {"onednn": 3.0} and GemmTable(tmp_path).get(other) is None
    # a slow but real rate (a tiny matmul on a loaded machine: 0.0041 GFLOP/s) is kept, not rounded to 0
    assert stored_rate(0.0041) == 0.0041 and stored_rate(12.3456) == 12.35


@pytest.mark.parametrize("bad", NOT_RATES, ids=str)
def test_only_a_measured_rate_becomes_a_choice(bad):
    """Where ATen's measurement failed, nothing is compared and ATen stays; where another provider's did,
    that provider is not chosen; with usable rates the faster wins (the control)."""
    opts = GemmOptions(providers=("aten", "onednn"))
    sites = {"w": [_Site(SHAPE)]}
    for rates in (_rates(aten=bad, onednn=50.0), _rates(aten=10.0, onednn=bad)):
        assert best_provider(rates, ["aten", "onednn"]) == "aten"
        choice, planned = choose(0, sites, {SHAPE: rates}, options=opts)
        assert choice.providers == {"w": "aten"} and planned == 0
        assert all(math.isfinite(r) and r > 0 for r in choice.rates["w"].values())   # reported: rates only
    choice, _ = choose(0, sites, {SHAPE: {"aten": 10.0, "onednn": 50.0}}, options=opts)
    assert choice.providers == {"w": "onednn"}


@pytest.mark.parametrize("bad", NOT_RATES, ids=str)
def test_a_prompt_chosen_with_its_decode_steps_keeps_aten_without_atens_rates(bad):
    opts = GemmOptions(providers=("aten", "onednn_packed", "gemv"))
    step = replace(SHAPE, m=1)
    sites = {"w": [_Site(SHAPE)]}
    good = {SHAPE: {"aten": 10.0, "onednn_packed": 40.0}, step: {"aten": 1.0, "gemv": 10.0}}
    for where in (SHAPE, step):   # ATen's rate for the prompt, or for a decode step, read nothing
        rates = {s: _rates(**{**r, "aten": bad}) if s == where else r for s, r in good.items()}
        choice, planned = choose(0, sites, rates, options=opts, room=1 << 30, decode=Decode(1, 64))
        assert choice.providers == {"w": "aten"} and not choice.later and not choice.copies and planned == 0
    # the control: with ATen measured, the steps outweigh the prompt: a packed copy for the prompt beside
    # the plain weight, which gemv reads in the steps
    choice, planned = choose(0, sites, good, options=opts, room=1 << 30, decode=Decode(1, 64))
    assert choice.providers == {"w": "onednn_packed"} and choice.later == {"w": "gemv"} and choice.copies == {"w"}
    assert planned == SHAPE.weight_bytes


def _programs(sockets: int):
    from numatp.plan import capture, plan_graph
    from numatp.plan.localize import localize
    from numatp.plan.reference import bind_inputs

    model = zoo.build("gpt2", tiny=True)
    ((ag, inputs),) = capture(model, **zoo.example_inputs(model, batch=1, seq=16))
    plan = plan_graph(ag, sockets)
    programs = [localize(ag, plan, r) for r in range(sockets)]
    return ([p.gm for p in programs], [bind_inputs(p.bindings, inputs, p.rank) for p in programs],
            [p.weight_indices for p in programs])


@pytest.mark.parametrize("bad", NOT_RATES[:4], ids=str)
def test_a_failed_measurement_keeps_the_graph_and_is_measured_again(bad, tmp_path):
    """Measurements injected into the selector (no timing): where ATen's read ``bad`` and onednn's 100
    GFLOP/s, or ATen's 10 and onednn's ``bad``, every weight stays on ATen (the programs unchanged,
    nothing prepared) and no such value is written to the table; a shape without ATen's rate is measured
    again by the next compile, whose good rates then choose onednn."""
    from numatp.runtime import SocketGroup

    timed = []

    def timer(rates):
        def measure(todo: dict[str, Provider], shape: GemmShape) -> dict[str, float]:
            timed.append(shape)
            return {p: rates[p] for p in todo}
        return measure

    with SocketGroup(Topology.virtual(sockets=1)) as group:
        for case, rates in enumerate(({"aten": bad, "onednn": 100.0}, {"aten": 10.0, "onednn": bad})):
            opts = GemmOptions(providers=("aten", "onednn"), cache_dir=str(tmp_path / str(case)))
            gms, args, weights = _programs(1)
            before = [gm.code for gm in gms]
            selector = GemmSelector(opts, facts=FACTS, timer=timer(rates))
            gms, new_args, swaps, reads = selector.apply(group, gms, args, weights)
            assert {r["provider"] for r in selector.report()} == {"aten"}
            assert [gm.code for gm in gms] == before and not any(swaps) and new_args == args
            stored = GemmTable(opts.cache_dir, signature=FACTS.cpu_signature).entries
            assert all(math.isfinite(r) and r > 0 for e in stored.values() for r in e.values())
            assert all("aten" not in e for e in stored.values()) == (case == 0)
        timed.clear()
        gms, args, weights = _programs(1)
        opts = GemmOptions(providers=("aten", "onednn"), cache_dir=str(tmp_path / "0"))   # ATen's read nothing
        selector = GemmSelector(opts, facts=FACTS, timer=timer({"aten": 10.0, "onednn": 100.0}))
        gms, *_ = selector.apply(group, gms, args, weights)
    assert timed and {r["provider"] for r in selector.report()} == {"onednn"}
    assert any(n.target is GEMM_OP for gm in gms for n in gm.graph.nodes)


def _write_rates(path: str, first: int, start) -> None:
    start.wait()   # both processes ready: their writes interleave
    for i in range(WRITES):   # a fresh table each time: every write reads the file and merges into it
        GemmTable(path, signature="test-cpu").put({replace(SHAPE, m=first + i): {"aten": float(i + 1)}})


WRITES = 150


def test_processes_writing_the_table_at_once_keep_each_others_rates(tmp_path):
    """Two processes each add 150 shapes, one write at a time, at once: none is lost (without the file
    lock, a write that read the file before the other's rename replaces it without the other's shape)."""
    ctx = multiprocessing.get_context("fork")   # torch is imported already: the writers start at once
    start = ctx.Barrier(2)
    writers = [ctx.Process(target=_write_rates, args=(str(tmp_path), first, start)) for first in (1000, 2000)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(300)
        assert w.exitcode == 0
    entries = GemmTable(tmp_path, signature="test-cpu").entries
    want = [*range(1000, 1000 + WRITES), *range(2000, 2000 + WRITES)]
    assert sorted(GemmShape.from_key(k).m for k in entries) == want
