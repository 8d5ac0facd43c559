"""The compiled model on socket groups equals eager; failures reach the caller and leave things usable."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import torch

import numatp
from numatp import zoo
from numatp.backend import NumaTPBackend, backend_of, placement_report
from numatp.plan.gemm_pass import GemmOptions
from numatp.runtime import SocketError, SocketGroup
from numatp.runtime.gemm import NATIVE
from numatp.topology import Topology
from tests.helpers import all_gathers, assert_close_to_eager, shared_cpu_topology

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:numatp. virtual sockets")]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Dynamo caches frames per code object up to a limit, then silently runs eager: start each test clean
    torch._dynamo.reset()
    yield


def _eager_and_compiled(family, dtype, sockets, mode, batch=2, seq=16, gemm=None):
    model = zoo.build(family, tiny=True, dtype=dtype)
    inputs = zoo.example_inputs(model, batch=batch, seq=seq)
    topo = Topology.virtual(sockets=sockets) if sockets <= 2 else shared_cpu_topology(sockets)
    with torch.inference_mode():
        expected = model(**inputs).logits
        compiled = numatp.compile(model, sockets=topo, mode=mode, gemm=gemm)
        actual = compiled(**inputs).logits
    return model, inputs, compiled, expected, actual


@pytest.mark.parametrize("family", ["gpt2", "bert-small", "gemma3-270m", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sockets", [1, 2, 4])
def test_runtime_equals_eager(family, dtype, sockets):
    """Threaded runtime, every family, default GEMM providers (measured on this CPU); segments run
    uncompiled here (Inductor is covered below)."""
    *_, compiled, expected, actual = _eager_and_compiled(family, dtype, sockets, "eager")
    assert_close_to_eager(actual, expected, f"{family} {dtype} {sockets} sockets")
    rows = backend_of(compiled).gemm_report()
    assert rows  # on by default: every weight matmul got a choice
    # a provider other than ATen is chosen on a measured rate only; ATen, the graph unchanged, is also what
    # stays where a measurement failed (a loaded machine may time a tiny matmul at a few MFLOP/s: a rate
    # still, kept as measured, never 0)
    assert all(r["gflops"] > 0 for r in rows if r["provider"] != "aten")
    assert all(r["gflops"] is None or r["gflops"] > 0 for r in rows)


@pytest.mark.slow
def test_inductor_one_socket_is_cut_once_per_layer():
    # Inductor's own matmuls (gemm=False): the segment counts below are exact, whatever this CPU's GEMM rates.
    # Two sockets under Inductor: tests/test_entry.py::test_dynamic_true_specialises_each_length_under_inductor
    model, inputs, compiled, expected, actual = _eager_and_compiled("gpt2", torch.float32, 1, "inductor",
                                                                    gemm=False)
    assert_close_to_eager(actual, expected, "gpt2 inductor 1 socket")
    backend = backend_of(compiled)
    (variant,) = [v for g in backend.graphs for v in g.variants.values()]
    (prog,) = variant.executor.programs
    # cut after the embedding and after each layer (the identity with one socket): a layer is a segment
    kinds = [type(s).__name__ for s in prog.steps]
    layers = model.config.n_layer
    assert kinds == ["Segment", "Collective"] * (layers + 1) + ["Segment"]
    assert backend.compiler.compiled + backend.compiler.reused == layers + 2
    assert variant.executor.performed == {"all_reduce": 0, "all_gather": 0}   # nothing to sum on one socket
    assert [r["socket"] for r in placement_report(compiled)["ranks"]] == [0]


@pytest.mark.parametrize(("family", "gemm", "in_place", "bias"), [
    ("gpt2", False, True, False),         # tied head: mm(x, permute(wte)) on ATen
    ("bert-small", False, True, True),    # MLM decoder: addmm(bias, x, permute(W))
    ("gpt2", GemmOptions(force="mkl_packed"), True, False),   # MKL's packed GEMM writes its columns itself
    ("llama", GemmOptions(force="onednn_packed"), False, False)])   # oneDNN's numatp::linear: copied
def test_the_logits_gather_writes_each_sockets_matmul_in_place(family, gemm, in_place, bias, tmp_path):
    """On 2 sockets the LM head's columns are written by each socket's matmul straight into the full
    logits where the head is an ATen matmul or MKL's packed GEMM; another provider's op keeps the shard
    and its copy. All equal eager."""
    if isinstance(gemm, GemmOptions):
        gemm = GemmOptions(force=gemm.force, cache_dir=str(tmp_path))
    *_, compiled, expected, actual = _eager_and_compiled(family, torch.float32, 2, "eager", gemm=gemm)
    assert_close_to_eager(actual, expected, f"{family} 2 sockets")
    gathers = all_gathers(backend_of(compiled))
    assert len(gathers) == 2   # one per socket program
    for step in gathers:
        assert (step.matmul is not None) == in_place
        if in_place:
            assert (step.matmul.bias is not None) == bias
            forced = gemm.force if isinstance(gemm, GemmOptions) else None
            assert step.matmul.provider == (NATIVE[forced] if forced else None)
            assert step.full == (tuple(expected.shape), expected.dtype)
    assert sum(v.executor.performed["all_gather"] for g in backend_of(compiled).graphs
               for v in g.variants.values()) == 1


def test_the_executor_counts_the_waiting_for_a_late_socket_apart():
    """A socket whose program runs late makes the other wait at the next reduction: the executor's
    wait_seconds say so per socket, inside its time in the reductions (sync_seconds)."""
    _, inputs, compiled, expected, _ = _eager_and_compiled("gpt2", torch.float32, 2, "eager")
    (executor,) = [v.executor for g in backend_of(compiled).graphs for v in g.variants.values()]
    late = next(s for s in executor.programs[1].steps if hasattr(s, "compiled"))
    run = late.compiled

    def slow(*args):
        time.sleep(0.3)
        return run(*args)

    late.compiled = slow
    executor.sync_seconds[:] = [0.0, 0.0]
    executor.wait_seconds[:] = [0.0, 0.0]
    with torch.inference_mode():
        assert_close_to_eager(compiled(**inputs).logits, expected, "a late socket")
    sync, wait = executor.sync_seconds, executor.wait_seconds
    assert wait[0] >= 0.25 and wait[1] < 0.1, (sync, wait)
    assert all(0 <= w <= s for w, s in zip(wait, sync)), (sync, wait)


def test_graph_breaks_give_several_graphs():
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
            self.b = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))

        def forward(self, x):
            x = x + self.a(x)
            torch._dynamo.graph_break()
            return x + self.b(x)

    model = Broken().eval()
    x = torch.randn(2, 8, 32)
    backend = NumaTPBackend(Topology.virtual(sockets=2), mode="eager")
    with torch.inference_mode():
        out = torch.compile(model, backend=backend, dynamic=False)(x)
        assert_close_to_eager(out, model(x), "graph break")
    assert len(backend.plans) == 2 and all(p.reductions == 1 for p in backend.plans)


def test_worker_error_names_socket_and_next_call_works():
    group = SocketGroup(Topology.virtual(sockets=2))
    with group:
        def fail_on_1(rank):
            if rank == 1:
                raise ValueError("boom")
            group.barrier(rank)  # socket 0 would wait forever without the abort path
            return rank

        with pytest.raises(SocketError, match=r"socket 1 .*ValueError: boom"):
            group.run(fail_on_1)
        assert group.run(lambda r: r * 10) == [0, 10]
        names = group.thread_names
        assert len(names) == 2
    alive = {t.name for t in threading.enumerate()}
    assert not alive & set(names), "closing the group stops its workers"


def test_workers_are_pinned_and_sized():
    topo = Topology.virtual(sockets=2)
    import os
    with SocketGroup(topo) as group:
        seen = group.run(lambda r: (sorted(os.sched_getaffinity(0)), torch.get_num_threads(),
                                    torch.is_inference_mode_enabled()))
    for rank, (cpus, threads, inference) in enumerate(seen):
        assert cpus == sorted(topo.sockets[rank].cpus)
        assert threads == len(topo.sockets[rank].cpus)
        assert inference


def test_workers_keep_their_thread_count_when_another_group_starts():
    # ATen copies its process-wide thread count into a thread at the thread's first parallel loop; a
    # socket worker whose first loop came after a wider group had started took that group's count
    topo = Topology.virtual(sockets=2)
    whole = topo.whole()
    with SocketGroup(topo) as sockets, SocketGroup(whole) as everything:
        assert everything.run(lambda r: torch.get_num_threads()) == [len(whole.sockets[0].cpus)]
        assert sockets.run(lambda r: torch.get_num_threads()) == [len(s.cpus) for s in topo.sockets]


def test_group_leaves_the_callers_thread_count_to_threads_started_later():
    topo = Topology.virtual(sockets=2)
    before = torch.get_num_threads()
    wide = len(topo.whole().sockets[0].cpus)
    torch.set_num_threads(wide)
    try:
        with SocketGroup(topo):
            seen = []
            t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
            t.start()
            t.join()
        assert seen == [wide] and torch.get_num_threads() == wide
        assert wide > max(len(s.cpus) for s in topo.sockets)  # else this could not tell the two apart
    finally:
        torch.set_num_threads(before)


def test_concurrent_calls_run_one_after_another():
    # a call from a second thread waits for the call in progress, then runs: both get their own results
    group = SocketGroup(Topology.virtual(sockets=2))
    started = threading.Event()
    release = threading.Event()
    order: list[str] = []
    first: list = []

    def slow(rank):
        started.set()
        release.wait(10)
        order.append("slow")
        return rank

    with group:
        t = threading.Thread(target=lambda: first.append(group.run(slow)))
        t.start()
        started.wait(10)
        threading.Timer(0.3, release.set).start()
        second = group.run(lambda r: order.append("fast") or r + 10)
        t.join()
    assert first == [[0, 1]] and second == [10, 11]
    assert order == ["slow", "slow", "fast", "fast"]


def _numatp_workers() -> dict[str, list[int]]:
    """numatp's live worker threads, each with the CPUs it is pinned to (as the kernel reports them)."""
    return {t.name: sorted(os.sched_getaffinity(t.native_id)) for t in threading.enumerate()
            if t.name.startswith("numatp-") and t.is_alive()}


def _started_during(fn) -> tuple[object, dict[str, list[int]]]:
    before = _numatp_workers()
    result = fn()
    return result, {k: v for k, v in _numatp_workers().items() if k not in before}


@pytest.mark.parametrize("gemm", [True, False], ids=["gemm", "no-gemm"])
@pytest.mark.parametrize("policy", ["auto", "never"])
def test_unsharded_policies_run_on_all_cores(policy, gemm):
    # "never", and "auto" where no block pays for sharding, run the graph unsharded on all cores, never
    # replicated per socket: as one program on one worker pinned to every CPU (so that it keeps the
    # measured GEMM providers), or as plain torch.compile on the caller's thread when GEMM providers are off
    topo = Topology.virtual(sockets=2)
    model = zoo.build("gpt2", tiny=True)
    inputs = zoo.example_inputs(model, batch=1, seq=16)

    def run():
        with torch.inference_mode():
            # auto_measure=0: the cost model's choice alone (test_auto_measures_both_plans_when_close below)
            compiled = numatp.compile(model, sockets=topo, policy=policy, mode="eager", gemm=gemm, auto_measure=0)
            assert_close_to_eager(compiled(**inputs).logits, model(**inputs).logits, policy)
            return compiled

    compiled, workers = _started_during(run)
    (plan,) = numatp.plans(compiled)
    decided = [b for b in plan.blocks if b.kind != "lm_head"]
    assert not any(b.sharded for b in decided) and plan.reductions == 0
    if policy == "auto":
        assert decided and all(b.reason.kind == "cost" and b.reason.predicted_ms for b in decided)
    rows = backend_of(compiled).gemm_report()
    if not gemm:
        assert workers == {} and rows == []   # no socket worker was started: Inductor on the caller's thread
        return
    all_cpus = sorted(topo.allowed_cpus)
    assert list(workers.values()) == [all_cpus], workers   # one worker, on every CPU, no per-socket ones
    # every weight matmul of the one program got a measured provider at the whole machine's thread count
    assert rows and all(r["rank"] == 0 and r["threads"] == len(all_cpus) and r["gflops"] > 0 for r in rows)


@pytest.mark.parametrize("gemm", [True, False], ids=["gemm", "no-gemm"])
def test_auto_measures_both_plans_when_close(gemm):
    # the built-in model predicts sharding on one memory node within a few percent of unsharded: with
    # auto_measure covering that margin both plans are built, timed on the first call, the faster kept
    topo = Topology.virtual(sockets=2)
    model = zoo.build("gpt2", tiny=True)
    inputs = zoo.example_inputs(model, batch=1, seq=16)
    with torch.inference_mode():
        compiled = numatp.compile(model, sockets=topo, policy="auto", mode="eager", gemm=gemm, auto_measure=10.0)
        assert_close_to_eager(compiled(**inputs).logits, model(**inputs).logits, "auto, measured")
        assert_close_to_eager(compiled(**inputs).logits, model(**inputs).logits, "auto, second call")
    (plan,) = numatp.plans(compiled)
    decided = [b for b in plan.blocks if b.kind != "lm_head"]
    assert all(b.reason.kind == "measured" for b in decided)
    notes = {b.reason.detail for b in decided}
    assert len(notes) == 1
    (note,) = notes
    m = re.search(r"timed on the first call: sharded ([\d.]+) ms, unsharded ([\d.]+) ms: (\w+)$", note)
    assert m, note
    sharded_ms, unsharded_ms, pick = float(m[1]), float(m[2]), m[3]
    assert pick == ("sharded" if sharded_ms < unsharded_ms else "unsharded")
    # the kept plan's blocks: every attention and MLP block sharded where sharding won (a small table such
    # as GPT-2's position embedding stays replicated in the sharded plan too), none where it lost
    layers = [b for b in decided if b.kind in ("attention", "mlp")]
    assert layers and all(b.sharded == (pick == "sharded") for b in layers)
    assert pick == "sharded" or not any(b.sharded for b in decided)
    assert plan.predicted and set(plan.predicted) == {"sharded", "unsharded"}
    # only the kept plan's socket shards stay: the placement report lists them only when sharding won
    assert (numatp.placement_report(compiled)["tensors"] > 0) == (pick == "sharded")
    backend = backend_of(compiled)
    performed = dict(backend.performed)
    with torch.inference_mode():
        compiled(**inputs)
    done = {k: backend.performed[k] - performed[k] for k in performed}
    # the kept program is what runs: the sharded one reduces twice per layer and once for the vocabulary-
    # parallel lookup, and gathers the logits; the unsharded one never
    want = {"all_reduce": 2 * 2 + 1, "all_gather": 1} if pick == "sharded" else {"all_reduce": 0, "all_gather": 0}
    assert done == want and (pick != "sharded" or plan.reductions == 5), (done, plan.reductions)
    if gemm:
        # the GEMM report is that of the kept program (whichever was built last), at its workers' thread
        # counts: 1 CPU per virtual socket sharded, every CPU unsharded
        rows = backend.gemm_report()
        ranks = topo.num_sockets if pick == "sharded" else 1
        cpus = [len(s.cpus) for s in topo.sockets] if pick == "sharded" else [len(topo.allowed_cpus)]
        assert rows and {r["rank"] for r in rows} == set(range(ranks))
        assert all(r["threads"] == cpus[r["rank"]] for r in rows)


def test_auto_trusts_the_model_when_predictions_are_far_apart():
    topo = Topology.virtual(sockets=2)
    model = zoo.build("gpt2", tiny=True)
    inputs = zoo.example_inputs(model, batch=1, seq=16)
    backend = NumaTPBackend(topo, policy="auto", mode="eager", auto_measure=0.15,
                            decide=lambda cand, n: ({"sharded": 1.0, "unsharded": 2.0}, "test: sharding halves it"))

    def run():
        with torch.inference_mode():
            compiled = torch.compile(model, backend=backend, dynamic=False)
            assert_close_to_eager(compiled(**inputs).logits, model(**inputs).logits, "auto, model only")
            return compiled

    compiled, workers = _started_during(run)
    (plan,) = numatp.plans(compiled)
    decided = [b for b in plan.blocks if b.kind not in ("lm_head", "embedding")]
    assert all(b.sharded and b.reason.kind == "column_row" for b in decided)
    # the unsharded plan was never built: only the two socket workers started, none on every CPU
    assert sorted(workers.values()) == sorted(sorted(s.cpus) for s in topo.sockets)


@pytest.mark.parametrize("bad", [-0.1, "0.1", True])
def test_auto_measure_must_be_a_fraction(bad):
    with pytest.raises(ValueError, match="auto_measure"):
        NumaTPBackend(Topology.virtual(sockets=2), policy="auto", auto_measure=bad)


def test_keyboard_interrupt_leaves_the_group_usable():
    import signal
    import time

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    group = SocketGroup(Topology.virtual(sockets=2))
    with group:
        def task(rank):
            if rank == 1:
                time.sleep(0.5)
            group.barrier(rank)
            return rank

        old = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            with pytest.raises(KeyboardInterrupt):
                group.run(task)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert group.run(lambda r: r + 1) == [1, 2]


def test_a_call_with_the_same_parameters_finds_its_variant_by_the_other_arguments(monkeypatch):
    # the variant lookup checks the parameters by identity and keys the rest by shape; other parameter
    # objects (same shapes) take the full lookup and find the same variant (several variants of one graph,
    # under dynamic=True: tests/test_entry.py)
    from numatp.backend.variants import CompiledGraph

    calls = []
    real = CompiledGraph.__call__
    monkeypatch.setattr(CompiledGraph, "__call__", lambda self, *a: calls.append(a) or real(self, *a))
    model = zoo.build("gpt2", tiny=True)
    compiled = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")
    with torch.inference_mode():
        first = compiled(**zoo.example_inputs(model, batch=1, seq=16)).logits
        graph = backend_of(compiled).graphs[0]
        params = sum(isinstance(a, torch.nn.Parameter) for a in calls[0])
        assert params == len(list(model.parameters())) and len(graph._fast.others) == len(calls[0]) - params
        assert torch.equal(compiled(**zoo.example_inputs(model, batch=1, seq=16)).logits, first)
        assert len(calls) == 2 and len(graph.variants) == 1 and len(graph._fast.variants) == 1
        args = list(calls[0])
        i = next(i for i, a in enumerate(args) if isinstance(a, torch.nn.Parameter))
        args[i] = torch.nn.Parameter(args[i].detach().clone(), requires_grad=False)
        again = real(graph, *args)
    assert len(graph.variants) == 1 and graph._fast.objects[0] is args[i]
    assert torch.equal(again[0], first)
