"""Measure a ``MachineProfile`` of this host: GEMM rate, bandwidth, barrier and all-reduce per socket.

Every measurement runs in a worker thread pinned (``os.sched_setaffinity``) to one socket's CPUs,
with ``len(cpus)`` torch threads set inside that thread after pinning (``numatp.runtime.group.pin_threads``),
so torch's pool for that thread stays on the socket. Buffers are placed with ``numa_clone`` on the socket's node.
"""

from __future__ import annotations

import functools
import os
import socket as _socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from numatp.cost.profile import MachineProfile
from numatp.runtime.group import callers_threads, pin_threads
from numatp.topology import Topology

__all__ = ["measure_profile", "measure_gemm_ceilings", "remeasure_gemm_table"]

T = TypeVar("T")
_SIZES = {"full": (256, 512, 1024), "quick": (128, 256)}


def _pinned(cpus: tuple[int, ...], fn: Callable[[], T]) -> T:
    """Run ``fn`` in a thread pinned to ``cpus`` with that many torch threads; return its result."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            pin_threads(cpus)
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller, with its traceback
            box["error"] = e

    t = threading.Thread(target=body, name=f"numatp-calibrate-{cpus[0]}")
    with callers_threads():
        t.start()
        t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _best(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: first touch, pool start
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _place(t: torch.Tensor, node: int) -> torch.Tensor:
    from numatp.placement import numa_clone

    return numa_clone(t, node)


def _gemm_rows(cpus: tuple[int, ...], sizes: tuple[int, ...], repeat: int) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in sizes:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            sec = _pinned(cpus, functools.partial(_best, functools.partial(torch.mm, a, b), repeat))
            rows.append([str(dtype).removeprefix("torch."), n, n, n, round(2.0 * n**3 / sec / 1e9, 2)])
    return rows


def _read_bw(cpus: tuple[int, ...], buf: torch.Tensor, repeat: int) -> float:
    sec = _pinned(cpus, lambda: _best(lambda: buf.sum(), repeat))
    return buf.numel() * buf.element_size() / sec / 1e9


def _barrier_us(topo: Topology, rounds: int) -> float:
    n = len(topo.sockets)
    if n < 2:
        return 0.0
    barrier = threading.Barrier(n)
    times: list[float] = []

    def worker(cpus: tuple[int, ...]) -> None:
        os.sched_setaffinity(0, cpus)
        barrier.wait()
        t0 = time.perf_counter()
        for _ in range(rounds):
            barrier.wait()
        times.append((time.perf_counter() - t0) / rounds)

    threads = [threading.Thread(target=worker, args=(s.cpus,)) for s in topo.sockets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(times) * 1e6


def measure_profile(
    topo: Topology, *, quick: bool = False, progress: Callable[[str], None] = lambda _: None
) -> MachineProfile:
    """Measure each quantity of a ``MachineProfile`` on ``topo`` (detected or virtual)."""
    repeat = 3 if quick else 5
    buf_mib = 64 if quick else 256
    s0 = topo.sockets[0]
    progress(f"GEMM throughput on socket 0 (CPUs {list(s0.cpus)})")
    rows = _gemm_rows(s0.cpus, _SIZES["quick" if quick else "full"], repeat)
    progress(f"local read bandwidth, {buf_mib} MiB buffer on node {s0.node}")
    buf = _place(torch.ones(buf_mib * (1 << 20) // 4), s0.node)
    local = _read_bw(s0.cpus, buf, repeat)
    nodes = sorted({s.node for s in topo.sockets})
    remote: float | None = None
    remote_core: float | None = None
    if len(nodes) > 1 and not topo.is_virtual:
        far = next(s for s in topo.sockets if s.node != s0.node)
        progress(f"remote read bandwidth: socket 0 reading node {far.node}, all its CPUs then one")
        far_buf = _place(buf, far.node)
        remote = _read_bw(s0.cpus, far_buf, repeat)
        remote_core = _read_bw(s0.cpus[:1], far_buf, repeat)
    progress(f"barrier latency across {len(topo.sockets)} pinned threads")
    barrier = _barrier_us(topo, 200 if quick else 1000)
    n = len(topo.sockets)
    progress(f"{n}-way all-reduce: sum {n} partial buffers into a local one")
    part = max(buf.numel() // 8, 1)
    partials = [_place(torch.ones(part), s.node) for s in topo.sockets]
    out = torch.empty(part)

    def reduce() -> None:
        torch.sum(torch.stack(partials), dim=0, out=out)

    ar_sec = _pinned(s0.cpus, lambda: _best(reduce, repeat))
    l3 = _l3_mib(s0.cpus[0])
    fp32 = max(r[4] for r in rows if r[0] == "float32")
    how = f"measured by numatp calibrate{' --quick' if quick else ''} on {_socket.gethostname()}"
    alone = "not measurable on a single-node machine (virtual topology or one NUMA node)"
    return MachineProfile(
        name=_socket.gethostname(),
        sockets=n,
        cores_per_socket=len(s0.cpus),
        peak_gflops={r[0]: max(x[4] for x in rows if x[0] == r[0]) for r in rows},
        gemm_efficiency={"float32": 1.0, "bfloat16": 1.0},
        gemm_half_flops=1e6,
        gemm_tile=128,
        local_bw_gbs=round(local, 2),
        remote_bw_gbs=None if remote is None else round(remote, 2),
        remote_core_gbs=None if remote_core is None else round(remote_core, 2),
        l3_mib=l3,
        barrier_us=round(barrier, 2),
        allreduce_ns_per_byte=round(ar_sec / (part * 4) * 1e9, 4),
        gemm_table=tuple(tuple(r) for r in rows),
        sources={
            "gemm_table": f"{how}: torch.mm of n x n x n, best of {repeat}, one socket's threads",
            "peak_gflops": f"best measured GEMM rate (fp32 {fp32} GFLOP/s), not the hardware peak",
            "local_bw_gbs": f"{how}: torch.sum over a {buf_mib} MiB buffer numa_clone'd to node {s0.node}",
            "remote_bw_gbs": f"{how}: socket 0 summing a buffer on another node" if remote is not None else alone,
            "remote_core_gbs": (f"{how}: one CPU of socket 0 summing the same buffer on another node"
                                if remote_core is not None else alone),
            "barrier_us": f"{how}: threading.Barrier among {n} pinned threads, mean round",
            "allreduce_ns_per_byte": f"{how}: sum of {n} partial buffers into a local one, per byte of the result",
            "l3_mib": "sysfs cache index3 size of CPU " + str(s0.cpus[0]),
            "gemm_tile": "default for a BLAS GEMM (torch.mm): operand panels kept in cache",
            "gemm_half_flops": "default: measured rows replace the efficiency curve",
        },
    )


def measure_gemm_ceilings(topo: Topology, *, progress: Callable[[str], None] = lambda _: None
                          ) -> dict[str, dict[str, float]]:
    """Every GEMM provider's rate on socket 0's pinned threads (``numatp.runtime.gemm.measure_ceilings``):
    ``{dtype: {provider: GFLOP/s}}``, also written to the GEMM table that ``numatp.compile`` reads."""
    from numatp.runtime.gemm import measure_ceilings

    s0 = topo.sockets[0]
    return _pinned(s0.cpus, lambda: measure_ceilings(len(s0.cpus), progress=progress))


def remeasure_gemm_table(topo: Topology, *, progress: Callable[[str], None] = lambda _: None,
                         cache_dir: str | None = None) -> tuple[int, list[str]]:
    """Time again every shape of this CPU's GEMM table, every provider it lists, replacing the old rates.

    A shape measured for T threads runs on T pinned CPUs: socket 0's first T where it has that many,
    else the first T of all sockets' CPUs in socket order. Returns how many shapes were re-timed and the
    keys skipped because the topology has fewer CPUs than their thread count.
    """
    from numatp.runtime.gemm import PROVIDERS, GemmShape, GemmTable, measure_all, usable_rates
    from numatp.runtime.gemm.table import stored_rate

    table = GemmTable(cache_dir)
    every = [c for sock in topo.sockets for c in sock.cpus]
    by_threads: dict[int, list[tuple[GemmShape, list[str]]]] = {}
    skipped: list[str] = []
    for key, rates in sorted(table.entries.items()):
        shape = GemmShape.from_key(key)
        if shape.threads > len(every):
            skipped.append(key)
            continue
        by_threads.setdefault(shape.threads, []).append((shape, [p for p in rates if p in PROVIDERS]))
    total, done = sum(len(v) for v in by_threads.values()), 0
    for threads, shapes in sorted(by_threads.items()):
        s0 = topo.sockets[0].cpus
        cpus = tuple(s0[:threads] if len(s0) >= threads else every[:threads])

        def work(shapes: list[tuple[GemmShape, list[str]]] = shapes) -> dict[GemmShape, dict[str, float]]:
            nonlocal done
            found = {}
            for shape, names in shapes:
                done += 1
                progress(f"GEMM {done}/{total}: {shape.dtype} {shape.m} x {shape.k} x {shape.n} "
                         f"({shape.layout}), {shape.threads} threads")
                # a measurement that failed or read nothing is left out (the table keeps rates only)
                timed = usable_rates(measure_all({p: PROVIDERS[p] for p in names}, shape))
                found[shape] = {p: stored_rate(r) for p, r in timed.items()}
            return found

        table.put(_pinned(cpus, work))
    return total, skipped


def _l3_mib(cpu: int) -> float:
    base = f"/sys/devices/system/cpu/cpu{cpu}/cache"
    try:
        for idx in sorted(os.listdir(base)):
            with open(f"{base}/{idx}/level") as f:
                if f.read().strip() != "3":
                    continue
            with open(f"{base}/{idx}/size") as f:
                text = f.read().strip()
            mult = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}.get(text[-1], 1 / (1 << 20))
            return round(float(text.rstrip("KMG")) * mult, 2)
    except OSError:
        pass
    return 8.0  # no sysfs cache info (some VMs): a typical client/VM L3
