"""The C++ collective: sums equal torch's, every socket gets the same bits, failures and timeouts name
the socket, and a waiting socket does not hold the GIL."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from numatp.runtime import collective, native
from numatp.runtime.native import load_ops
from numatp.runtime.collective import FUSED_BYTES, CollectiveTimeout, CommAborted, SocketComm
from numatp.runtime.group import GroupAborted, SocketError, SocketGroup
from numatp.topology import Topology
from tests.helpers import shared_cpu_topology

pytestmark = pytest.mark.integration


def _on_threads(size: int, fn) -> list:
    """``[fn(0), ..., fn(size - 1)]``, each on its own thread at once; re-raises the first error."""
    out: list = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


# sizes on both sides of the fused threshold, and ones that do not split into whole cache lines
NUMELS = [1, 7, FUSED_BYTES // 4, FUSED_BYTES // 4 + 1, 768 * 512 + 13]


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_all_reduce_sums_like_torch_and_every_socket_gets_the_same_bits(size, dtype):
    comm = SocketComm(size)
    g = torch.Generator().manual_seed(size)
    for numel in NUMELS:
        parts = [torch.randn(numel, generator=g).to(dtype) for _ in range(size)]
        before = [p.clone() for p in parts]
        outs = _on_threads(size, lambda r: comm.all_reduce(r, parts[r]))
        # the reference: an fp32 sum in socket order, rounded once (bf16 is summed in fp32)
        expected = parts[0].float()
        for p in parts[1:]:
            expected = expected + p.float()
        expected = expected.to(dtype)
        for r, out in enumerate(outs):
            assert out.dtype == dtype and out.shape == parts[r].shape
            assert torch.equal(out, expected), f"{size} sockets, {numel} elements, socket {r}"
        assert all(torch.equal(p, b) for p, b in zip(parts, before)), "partials are read, never written"


def test_two_socket_bf16_equals_torch_add():
    # with two sockets, fp32 accumulation rounded once is exactly torch's bf16 add
    comm = SocketComm(2)
    a, b = torch.randn(10_000).bfloat16(), torch.randn(10_000).bfloat16()
    out = _on_threads(2, lambda r: comm.all_reduce(r, (a, b)[r]))
    assert torch.equal(out[0], a + b) and torch.equal(out[1], a + b)


def test_non_contiguous_partial_is_reduced_by_value():
    comm = SocketComm(2)
    parts = [torch.randn(64, 48).t() for _ in range(2)]
    outs = _on_threads(2, lambda r: comm.all_reduce(r, parts[r]))
    assert torch.equal(outs[0], parts[0] + parts[1])


@pytest.mark.parametrize("numel", [7, FUSED_BYTES])   # the fused sum and reduce-scatter + all-gather
def test_waiting_for_a_late_socket_is_counted_apart(numel):
    # the time an all-reduce spends waiting for the last socket to arrive is the peers' imbalance, not
    # the reduction's work: the socket that came first counts the delay, the late one almost nothing
    comm = SocketComm(2)

    def task(rank: int) -> torch.Tensor:
        if rank == 1:
            time.sleep(0.3)
        return comm.all_reduce(rank, torch.ones(numel))

    outs = _on_threads(2, task)
    assert all(torch.equal(o, torch.full((numel,), 2.0)) for o in outs)
    assert comm.waited_seconds[0] >= 0.25 and comm.waited_seconds[1] < 0.1, comm.waited_seconds


def test_timeout_names_the_socket_that_never_came():
    comm = SocketComm(3, timeout=0.3)
    start = time.perf_counter()
    # sockets 0 and 1 arrive, socket 2 never does: the first to time out names it and stops the other
    errors = _on_threads(2, lambda r: _catch(lambda: comm.barrier(r)))
    timeouts = [e for e in errors if isinstance(e, CollectiveTimeout)]
    assert timeouts and all(isinstance(e, (CollectiveTimeout, CommAborted)) for e in errors), errors
    assert timeouts[0].missing == [2]
    assert "socket 2 did not reach a barrier within 0.3 s" in str(timeouts[0])
    assert time.perf_counter() - start < 10
    comm.reset()
    _on_threads(3, comm.barrier)   # usable again after a reset


def test_abort_stops_a_waiting_socket_at_once():
    comm = SocketComm(2)
    errors: list = []
    waiting = threading.Thread(target=lambda: errors.append(_catch(lambda: comm.barrier(0))))
    waiting.start()
    time.sleep(0.2)
    comm.abort()
    waiting.join(5)
    assert not waiting.is_alive() and isinstance(errors[0], CommAborted)


def _catch(fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        return e
    return None


def test_a_socket_waiting_in_the_collective_does_not_hold_the_gil():
    # socket 0 waits in the barrier; socket 1 arrives only after the main thread has run Python code.
    # If the waiting call held the GIL, the main thread could not run until socket 0's barrier timed out
    # (20 s): socket 0 would end in CollectiveTimeout, not return
    comm = SocketComm(2, timeout=20)
    outcome: list = []
    start = time.perf_counter()
    worker = threading.Thread(target=lambda: outcome.append(_catch(lambda: comm.barrier(0))))
    worker.start()
    time.sleep(0.1)
    squares = sum(i * i for i in range(200_000))   # pure Python: needs the GIL
    comm.barrier(1)
    worker.join(5)
    assert not worker.is_alive() and outcome == [None], outcome
    assert time.perf_counter() - start < 10
    assert squares == 199_999 * 200_000 * 399_999 // 6


def test_group_reports_a_stuck_socket_by_name():
    with SocketGroup(Topology.virtual(sockets=2), timeout=0.5) as group:
        def task(rank):
            if rank == 1:
                time.sleep(2)   # longer than the timeout, then it arrives late
            group.barrier(rank)
            return rank

        with pytest.raises(SocketError, match=r"timed out: socket 1 did not reach a barrier within 0.5 s.*"
                                              r"socket 1: CPUs"):
            group.run(task)
        assert group.run(lambda r: r) == [0, 1]


def test_group_all_reduce_of_other_dtypes_goes_through_torch():
    with SocketGroup(Topology.virtual(sockets=2)) as group:
        parts = [torch.arange(10, dtype=torch.float64) * (r + 1) for r in range(2)]
        outs = group.run(lambda r: group.all_reduce(r, parts[r]))
    assert all(torch.equal(o, parts[0] + parts[1]) for o in outs)


def test_a_failed_peer_stops_the_collective_even_before_it_exists():
    # socket 1 fails before the group's collective was ever made; socket 0 then makes it and must not wait
    with SocketGroup(Topology.virtual(sockets=2), timeout=30) as group:
        def task(rank):
            if rank == 1:
                raise ValueError("boom")
            time.sleep(0.3)
            return group.all_reduce(rank, torch.ones(4))

        start = time.perf_counter()
        with pytest.raises(SocketError, match=r"socket 1 .*ValueError: boom"):
            group.run(task)
        assert time.perf_counter() - start < 10
        outs = group.run(lambda r: group.all_reduce(r, torch.ones(4)))
        assert all(torch.equal(o, torch.full((4,), 2.0)) for o in outs)


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler.*apt-get install g\\+\\+"):
        native.build()


def test_group_aborted_is_what_the_peers_of_a_failed_socket_see():
    with SocketGroup(Topology.virtual(sockets=2)) as group:
        seen = []

        def task(rank):
            if rank == 0:
                raise RuntimeError("first")
            try:
                group.barrier(rank)
            except GroupAborted as e:
                seen.append(str(e))
                raise

        with pytest.raises(SocketError, match="socket 0"):
            group.run(task)
    assert seen and "a peer socket failed" in seen[0]


# numatp::socket_all_reduce: the same collective, called from compiled code (here: from Python, which
# goes through the same dispatcher op) by a worker that entered its socket

def _op_reduce(group, rank, partial, after=None):
    with group.compiled_collectives(rank) as done:
        out, token = torch.ops.numatp.socket_all_reduce(partial, after)
    assert token.numel() == 1
    return out, done


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [7, FUSED_BYTES])   # the fused sum and reduce-scatter + all-gather
def test_op_sums_the_partials_of_the_sockets_that_entered(dtype, numel):
    load_ops()
    parts = [torch.randn(numel, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(3)]
    want = (parts[0].float() + parts[1].float() + parts[2].float()).to(dtype)
    with SocketGroup(shared_cpu_topology(3)) as group:
        results = group.run(lambda r: _op_reduce(group, r, parts[r]))
    for out, (seconds, count) in results:
        assert torch.equal(out, want) and count == 1 and seconds > 0


def test_op_counts_the_waiting_for_a_late_socket_at_leave():
    load_ops()
    with SocketGroup(Topology.virtual(sockets=2)) as group:
        def task(rank):
            if rank == 1:
                time.sleep(0.3)
            return _op_reduce(group, rank, torch.ones(4))

        results = group.run(task)
        waited = group.comm.waited_seconds
    assert [count for _, (_, count) in results] == [1, 1]
    assert waited[0] >= 0.25 and waited[1] < 0.1, waited
    assert results[0][1][0] >= waited[0]   # the waiting is part of the time in the reduction


def test_op_outside_a_socket_worker_says_so_and_rehearsal_copies():
    load_ops()
    x = torch.ones(3)
    with pytest.raises(RuntimeError, match="runs only inside a socket worker of numatp's executor"):
        torch.ops.numatp.socket_all_reduce(x, None)
    with collective.rehearsal():
        out, _ = torch.ops.numatp.socket_all_reduce(x, None)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    with pytest.raises(RuntimeError, match="runs only inside"):   # the rehearsal ended
        torch.ops.numatp.socket_all_reduce(x, None)


def test_op_peer_failure_reaches_the_caller_and_the_group_stays_usable():
    load_ops()
    with SocketGroup(Topology.virtual(sockets=2), timeout=30) as group:
        def task(rank):
            with group.compiled_collectives(rank):
                if rank == 1:
                    raise ValueError("boom")
                return torch.ops.numatp.socket_all_reduce(torch.ones(4), None)[0]   # would wait for socket 1

        start = time.perf_counter()
        with pytest.raises(SocketError, match=r"socket 1 .*ValueError: boom"):
            group.run(task)
        assert time.perf_counter() - start < 10
        outs = group.run(lambda r: _op_reduce(group, r, torch.ones(4))[0])
        assert all(torch.equal(o, torch.full((4,), 2.0)) for o in outs)


def test_op_names_a_stuck_socket():
    load_ops()
    with SocketGroup(Topology.virtual(sockets=2), timeout=0.5) as group:
        def task(rank):
            if rank == 1:
                time.sleep(2)
            return _op_reduce(group, rank, torch.ones(4))[0]

        with pytest.raises(SocketError, match=r"timed out: socket 1 did not reach an all-reduce within 0.5 s"):
            group.run(task)
        assert len(group.run(lambda r: _op_reduce(group, r, torch.ones(4))[0])) == 2
