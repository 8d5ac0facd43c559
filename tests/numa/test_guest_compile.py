"""numatp.compile on the real topology of the guest: shards on their socket's node, workers inside it."""

from __future__ import annotations

import os

import pytest
import torch

import numatp
from numatp import zoo
from numatp.backend import backend_of

pytestmark = [pytest.mark.numa, pytest.mark.timeout(2400)]   # under emulation; the guest run has 2400 s in all


def test_compiled_tiny_gpt2_places_shards_and_matches_eager(topology):
    model = zoo.build("gpt2", tiny=True)
    inputs = zoo.example_inputs(model, batch=1, seq=8)
    # uncompiled segments: Inductor's C++ build is too slow under emulation; placement and pinning are real
    compiled = numatp.compile(model, sockets=topology, mode="eager", strict_placement=True)
    with torch.inference_mode():
        expected = model(**inputs).logits
        actual = compiled(**inputs).logits
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
    report = numatp.placement_report(compiled)
    assert report["virtual"] is False
    for rank in report["ranks"]:
        assert set(rank["pages"]) == {rank["node"]}, f"socket {rank['socket']}: pages {rank['pages']}"
    assert report["local_fraction"] == 1.0
    group = backend_of(compiled).group
    cpus = group.run(lambda r: sorted(os.sched_getaffinity(0)))
    for rank, seen in enumerate(cpus):
        node_cpus = topology.node(topology.sockets[rank].node).cpus
        assert set(seen) <= set(node_cpus), f"socket {rank} worker runs on {seen}, outside node CPUs {node_cpus}"


@pytest.mark.parametrize("provider", ["onednn_packed", "mkl_packed"])
def test_packed_gemm_weight_is_made_in_its_socket_node(topology, provider):
    # oneDNN's packed operands are opaque (no data pointer for pages_by_node), so their node is read from the
    # process's anonymous resident bytes per node (numa_maps): packing must add the weight's size, and
    # freeing it must give those bytes back from the socket's own node. The free is what is measured, and
    # only totals elsewhere: the guest's kernel balances NUMA and moves other pages between nodes at any
    # time (seen on 4 nodes: 21 MB from node 1 to node 2 within one free), which changes no total.
    # Python's garbage is collected before each count, so the free is the packed weight's alone. 64 MiB:
    # above glibc's largest mmap threshold, so the buffer is its own pages, returned to the kernel.
    import gc

    from numatp.placement import process_bytes_by_node
    from numatp.runtime import SocketGroup
    from numatp.runtime.gemm import PROVIDERS
    from numatp.plan.gemm_pass import _prepare

    def change(before, after):
        return {n: after.get(n, 0) - before.get(n, 0) for n in set(after) | set(before)}

    w = torch.randn(4096, 4096)
    size = w.numel() * w.element_size()
    with SocketGroup(topology) as group:
        for rank, socket in enumerate(topology.sockets):
            gc.collect()
            before = process_bytes_by_node(anonymous=True)
            made = group.run(lambda r: _prepare(PROVIDERS[provider], w, 64, "nk", socket.node) if r == rank else None)
            assert made[rank][1].provider == provider   # what the operand is (the weight store records it)
            made = [m and m[0] for m in made]
            if made[rank].layout == torch.strided:   # MKL's packed weight is a plain tensor: its pages are read
                from numatp.placement import pages_by_node
                # on a node: the pages MKL wrote (-2: never written; -14: a huge page the kernel's NUMA
                # balancing has unmapped for a moment to sample accesses)
                pages = pages_by_node(made[rank])
                assert {n for n in pages if n >= 0} == {socket.node}, f"socket {rank}: packed weight's pages {pages}"
                placed = sum(c for n, c in pages.items() if n >= 0) * os.sysconf("SC_PAGE_SIZE")
                assert placed >= 0.75 * size, f"socket {rank}: {placed} bytes of {size} on a node: {pages}"
            gc.collect()
            packed = process_bytes_by_node(anonymous=True)
            grew = change(before, packed)
            assert sum(grew.values()) >= 0.9 * size, f"socket {rank} packed {size} bytes; grew per node {grew}"
            del made
            freed = change(process_bytes_by_node(anonymous=True), packed)
            assert freed.get(socket.node, 0) >= 0.9 * size, \
                f"socket {rank} (node {socket.node}) freed its {size}-byte packed weight; freed per node {freed}"
            assert sum(freed.values()) < 1.2 * size, \
                f"socket {rank} freed its {size}-byte packed weight; freed per node {freed}"


def test_dense_gemm_operand_is_copied_onto_its_socket_node(topology):
    # a Conv1D (K, N) weight gets an (N, K) copy for oneDNN's linear; made by the socket worker, the copy
    # could take pages its allocator recycles from another node unless it is placed explicitly
    from numatp.placement import pages_by_node
    from numatp.runtime import SocketGroup
    from numatp.runtime.gemm import PROVIDERS
    from numatp.plan.gemm_pass import _prepare

    w = torch.randn(128, 256)   # (K, N)
    with SocketGroup(topology) as group:
        nodes = [s.node for s in topology.sockets]
        made = group.run(lambda r: _prepare(PROVIDERS["onednn"], w, 8, "kn", nodes[r])[0])
    for rank, op in enumerate(made):
        assert torch.equal(op, w.t())
        assert set(pages_by_node(op)) == {nodes[rank]}, f"socket {rank}: pages {pages_by_node(op)}"


def test_quantized_shards_are_on_their_sockets_nodes_and_match_their_reference(topology):
    # int8 weights (and int8 tables): each socket quantizes its own shard; the buffers are placed on the
    # socket's node page by page, and the model equals the eager graph on the dequantized shards
    from numatp.backend.variants import CompiledGraph
    from numatp.plan.reference import dequantized_inputs

    calls = []
    original = CompiledGraph.__call__

    def record(self, *args):
        calls.append((self, args))
        return original(self, *args)

    model = zoo.build("gpt2", tiny=True)
    inputs = zoo.example_inputs(model, batch=1, seq=8)
    compiled = numatp.compile(model, sockets=topology, mode="eager", strict_placement=True, weights="int8",
                              gemm=numatp.GemmOptions(force="q_dequant"))
    CompiledGraph.__call__ = record
    try:
        with torch.inference_mode():
            actual = compiled(**inputs).logits
    finally:
        CompiledGraph.__call__ = original
    backend = backend_of(compiled)
    assert {r["storage"] for r in backend.gemm_report()} == {"int8"}
    report = numatp.placement_report(compiled)
    for rank in report["ranks"]:
        assert set(rank["pages"]) == {rank["node"]}, f"socket {rank['socket']}: pages {rank['pages']}"
    graph, args = calls[0]
    (variant,) = graph.variants.values()
    local = [type("P", (), {"bindings": variant.bindings[r], "rank": r})() for r in range(len(variant.bindings))]
    ref_args = dequantized_inputs(local, variant.weights, list(args), backend.weights.prepared)
    with torch.inference_mode():
        expected = graph.gm(*ref_args)
    expected = expected[0] if isinstance(expected, (tuple, list)) else expected
    torch.testing.assert_close(actual.reshape(expected.shape), expected, atol=2e-5, rtol=1e-4)


def test_all_reduce_result_is_on_each_sockets_node(topology):
    # the C++ collective writes each socket's total into a tensor its worker allocates under the
    # socket's memory binding: every socket reads the reduced activations from its own node
    from numatp.placement import pages_by_node
    from numatp.runtime import SocketGroup

    # both ways in: from Python (a cut of the program) and numatp::socket_all_reduce (inside a segment)
    from numatp.runtime.native import load_ops

    load_ops()
    parts = [torch.full((64, 1024), float(r + 1)) for r in range(topology.num_sockets)]   # 256 KiB each
    with SocketGroup(topology) as group:
        def reduce(rank):
            out = group.all_reduce(rank, parts[rank])
            with group.compiled_collectives(rank):
                op_out, _ = torch.ops.numatp.socket_all_reduce(parts[rank], None)
            return [(t, pages_by_node(t)) for t in (out, op_out)]

        seen = group.run(reduce)
    total = sum(range(1, topology.num_sockets + 1))
    for rank, results in enumerate(seen):
        for out, pages in results:
            assert torch.equal(out, torch.full((64, 1024), float(total)))
            assert set(pages) == {topology.sockets[rank].node}, f"socket {rank}: pages {pages}"


def test_grouped_query_attention_places_each_sockets_kv_heads_on_its_node(topology):
    # Qwen2's 14 query heads in 2 K/V groups: on 2 nodes each socket owns a group; on 4, two sockets share
    # each K/V head and both hold its columns of k_proj/v_proj, on their own node
    from numatp.plan import Colwise
    from tests.test_families import _model

    model = _model("qwen2")
    ids = torch.randint(0, 256, (1, 8))
    compiled = numatp.compile(model, sockets=topology, mode="eager", strict_placement=True)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits,
                                   atol=2e-5, rtol=1e-4)
    (plan,) = numatp.plans(compiled)
    assert all(b.sharded for b in plan.blocks if b.kind in ("attention", "mlp"))
    (k,) = plan.weights["model.layers.0.self_attn.k_proj.weight"]
    assert isinstance(k.placement, Colwise)
    report = numatp.placement_report(compiled)
    for rank in report["ranks"]:
        assert set(rank["pages"]) == {rank["node"]}, f"socket {rank['socket']}: pages {rank['pages']}"
