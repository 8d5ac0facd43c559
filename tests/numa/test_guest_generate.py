"""Generation on the real topology of the guest: tokens equal eager, each socket's KV cache on its node."""

from __future__ import annotations

import pytest
import torch

import numatp
from numatp.backend import backend_of
from numatp.placement import pages_by_node
from tests.test_families import _model

pytestmark = [pytest.mark.numa, pytest.mark.timeout(2400)]   # under emulation; the guest run has 2400 s in all


def test_generation_keeps_each_sockets_kv_heads_on_its_node(topology):
    # Qwen2's 2 K/V groups: on 2 nodes one group per socket; on 4, two sockets share each K/V head
    model = _model("qwen2")
    ids = torch.randint(5, 250, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    fast = numatp.compile(model, sockets=topology, mode="eager", strict_placement=True)
    got = fast.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
    states = backend_of(fast).states
    for rank, socket in enumerate(topology.sockets):
        kv = [t for t in states.tensors(rank) if t.dim() == 4]
        assert kv and all(t.shape[1] == 1 for t in kv), [tuple(t.shape) for t in kv]
        for t in states.tensors(rank):
            t.sum()   # touch: automatic NUMA balancing may have unmapped a page to sample it
            pages = pages_by_node(t)
            assert set(pages) == {socket.node}, f"socket {rank}: state pages {pages}"
