"""Real placement on >= 2 NUMA nodes: pages land where numa_clone/membind say, pinned threads stay put.

Run inside the numa-vm guest (software-emulated: keep tensors small and everything in one process).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from numatp.placement import _syscalls, membind, numa_clone, pages_by_node

pytestmark = [pytest.mark.numa, pytest.mark.timeout(2400)]   # under emulation; the guest run has 2400 s in all

PAGE = _syscalls.PAGE_SIZE


def _in_thread(fn):
    """Run ``fn`` in a fresh thread (so pinning and policy do not leak) and return or re-raise its result."""
    box: dict = {}

    def body():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _settled_pages(t: torch.Tensor) -> dict[int, int]:
    """pages_by_node after reading every page: automatic NUMA balancing briefly unmaps pages to sample
    accesses, and such a page reads as not present (-ENOENT, or -EFAULT for a huge page) until touched."""
    for _ in range(5):
        float(t.sum())
        counts = pages_by_node(t)
        if min(counts) >= 0:
            break
    return counts


def test_numa_clone_puts_every_page_on_the_node(topology, capsys):
    src = torch.arange(64 * 1024, dtype=torch.float32)  # 256 KiB = 64 pages
    expected_pages = src.numel() * 4 // PAGE
    placed = {}
    for node in topology.nodes_with_memory:  # the last node included
        out = numa_clone(src, node, strict=True)
        placed[node] = _settled_pages(out)
        assert torch.equal(out, src)
    with capsys.disabled():
        print(f"\n[numa] nodes={len(topology.nodes)} numa_clone pages by node: {placed}")
    assert placed == {node: {node: expected_pages} for node in topology.nodes_with_memory}


def test_pinned_thread_runs_only_on_its_node(topology, sched_getcpu):
    for socket in topology.sockets:
        def spin(cpus=frozenset(socket.cpus)):
            os.sched_setaffinity(0, cpus)
            seen = set()
            for _ in range(2000):
                seen.add(sched_getcpu())
                os.sched_yield()
            return seen

        seen = _in_thread(spin)
        assert seen and seen <= set(socket.cpus), (socket, seen)


def test_membind_puts_the_threads_new_tensors_on_its_node(topology, capsys):
    first, last = topology.sockets[0], topology.sockets[-1]
    assert first.node != last.node

    def allocate():
        # Run on the first node's CPUs but bind memory to the last node, so first-touch locality
        # cannot explain where the pages end up. Counted inside the block: once the thread policy is
        # back to default, automatic NUMA balancing may move these pages towards this thread's node.
        os.sched_setaffinity(0, first.cpus)
        with membind(last.node, strict=True):
            bound = torch.ones(10_000_000)  # 40 MB: above glibc's mmap threshold, so fresh pages
            bound_pages = _settled_pages(bound)
        after = torch.ones(10_000_000)  # policy restored: local (first) node again
        return bound_pages, _settled_pages(after), _syscalls.get_mempolicy()

    bound, after, policy = _in_thread(allocate)
    with capsys.disabled():
        print(f"\n[numa] membind({last.node}) from node {first.node}'s CPUs: {bound}; after exit: {after}")
    assert list(bound) == [last.node]
    assert list(after) == [first.node]
    assert policy == (_syscalls.MPOL_DEFAULT, [])


def test_calibrate_measures_remote_reads(topology, capsys):
    # On one node these are None ("not measurable"); here both the socket's and one core's reads of
    # another node's buffer are timed, the figures the cost model's remote stalls run at.
    from numatp.cost.calibrate import measure_profile

    p = measure_profile(topology, quick=True)
    with capsys.disabled():
        print(f"\n[numa] calibrate: local {p.local_bw_gbs} GB/s, remote {p.remote_bw_gbs} GB/s "
              f"(one core {p.remote_core_gbs} GB/s), barrier {p.barrier_us} us")
    assert p.sockets == len(topology.sockets)
    assert p.remote_bw_gbs is not None and p.remote_bw_gbs > 0
    assert p.remote_core_gbs is not None and p.remote_core_gbs > 0
    assert "another node" in p.sources["remote_core_gbs"]
