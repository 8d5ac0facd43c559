"""numatp.compile on the real topology of the guest: shards on their socket's node, workers inside it."""

from __future__ import annotations

import os

import pytest
import torch

import numatp
from numatp import zoo

pytestmark = pytest.mark.numa


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
    group = compiled._numatp_backend.group
    cpus = group.run(lambda r: sorted(os.sched_getaffinity(0)))
    for rank, seen in enumerate(cpus):
        node_cpus = topology.node(topology.sockets[rank].node).cpus
        assert set(seen) <= set(node_cpus), f"socket {rank} worker runs on {seen}, outside node CPUs {node_cpus}"
