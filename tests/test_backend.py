"""The compiled model on socket groups equals eager; failures reach the caller and leave things usable."""

from __future__ import annotations

import threading

import pytest
import torch

import numatp
from numatp import zoo
from numatp.backend import NumaTPBackend, placement_report
from numatp.runtime import SocketError, SocketGroup
from numatp.topology import Topology
from tests.helpers import assert_close_to_eager, shared_cpu_topology

pytestmark = pytest.mark.filterwarnings("ignore:numatp. virtual sockets")


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
    gemm = compiled._numatp_backend.gemm
    assert gemm is not None and gemm.report()  # on by default: every weight matmul got a measured choice
    assert all(r["gflops"] for r in gemm.report())


@pytest.mark.parametrize("sockets", [1, 2])
def test_inductor_segments_equal_eager(sockets):
    # Inductor's own matmuls (gemm=False): the segment count below is exact, whatever this CPU's GEMM rates
    model, inputs, compiled, expected, actual = _eager_and_compiled("gpt2", torch.float32, sockets, "inductor",
                                                                    gemm=False)
    assert_close_to_eager(actual, expected, f"gpt2 inductor {sockets} sockets")
    backend = compiled._numatp_backend
    if sockets == 1:
        assert backend.compiler.compiled == 1  # no collectives: one segment
    else:
        assert backend.compiler.reused > 0  # identical layers and sockets share one compilation
    report = placement_report(compiled)
    assert [r["socket"] for r in report["ranks"]] == list(range(sockets))
    # a new shape recompiles correctly
    with torch.inference_mode():
        other = zoo.example_inputs(model, batch=1, seq=24)
        assert_close_to_eager(compiled(**other).logits, model(**other).logits, "new shape")


def test_torch_compile_backend_string():
    model = zoo.build("gpt2", tiny=True)
    inputs = zoo.example_inputs(model, batch=1, seq=16)
    with torch.inference_mode():
        out = torch.compile(model, backend="numatp")(**inputs).logits
        assert_close_to_eager(out, model(**inputs).logits, "backend='numatp'")


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


def test_concurrent_calls_are_a_clear_error_or_correct():
    group = SocketGroup(Topology.virtual(sockets=2))
    started = threading.Event()
    release = threading.Event()

    def slow(rank):
        started.set()
        release.wait(10)
        return rank

    errors = []
    with group:
        t = threading.Thread(target=lambda: group.run(slow))
        t.start()
        started.wait(10)
        try:
            group.run(lambda r: r)
        except RuntimeError as e:
            errors.append(str(e))
        release.set()
        t.join()
    assert errors and "one prefill at a time" in errors[0]


@pytest.mark.parametrize("policy", ["auto", "never"])
def test_unsharded_policies_run_plain_inductor(policy):
    # "never", and "auto" where no block pays for sharding, run the graph as plain torch.compile on
    # all cores, never replicated per socket
    model = zoo.build("gpt2", tiny=True)
    inputs = zoo.example_inputs(model, batch=1, seq=16)
    with torch.inference_mode():
        compiled = numatp.compile(model, sockets=Topology.virtual(sockets=2), policy=policy, mode="eager")
        assert_close_to_eager(compiled(**inputs).logits, model(**inputs).logits, policy)
    (plan,) = compiled._numatp_backend.plans
    decided = [b for b in plan.blocks if b.kind != "lm_head"]
    if policy == "auto":
        assert decided and all("predicted" in b.reason for b in decided)
    (variant,) = [v for g in compiled._numatp_backend.graphs for v in g.variants.values()]
    unsharded = not any(b.sharded for b in plan.blocks)
    assert unsharded or policy == "auto"
    assert (variant.baseline is not None) == unsharded and (variant.executor is None) == unsharded


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
