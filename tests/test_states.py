"""The sockets' copies of the tensors the programs write in place (numatp.backend.states)."""

from __future__ import annotations

import pytest
import torch

from numatp.backend.states import StateStore
from numatp.plan.localize import Binding
from numatp.plan.schema import Colwise, IndexSet
from tests.helpers import shared_cpu_topology

pytestmark = pytest.mark.unit

HEADS = Colwise(dim=1, splits=(IndexSet(((0, 2),)), IndexSet(((2, 4),))))   # 4 heads, 2 per socket


def _kv(batch: int = 4) -> torch.Tensor:
    return torch.arange(batch * 4 * 6 * 3, dtype=torch.float32).view(batch, 4, 6, 3)


def test_rows_of_a_cache_share_the_sockets_copy_of_the_whole():
    # the server's width-1 programs read a cache over row 0 of the full cache's tensors; Dynamo may hand
    # them over as tensors of their own (not views of the caller's), so the store finds rows by memory
    store = StateStore(shared_cpu_topology(2))
    whole = _kv()
    b = Binding(index=0, placement=HEADS, state=True)
    copies = [store.get(whole, b, r) for r in range(2)]
    rows = [store.get(torch.as_strided(whole, (1, 4, 6, 3), whole.stride(), 0), b, r) for r in range(2)]
    for r in range(2):
        assert rows[r].data_ptr() == copies[r].data_ptr() and rows[r].shape == (1, 2, 6, 3)
        torch.testing.assert_close(rows[r], whole[:1, 2 * r:2 * r + 2])
        rows[r].fill_(-1.0)   # a narrow program writes row 0 of the socket's copy...
        assert (copies[r][0] == -1).all() and (copies[r][1:] != -1).all()   # ...which the wide one reads
    middle = torch.as_strided(whole, (2, 4, 6, 3), whole.stride(), whole.stride(0))   # rows 1 and 2
    assert store.get(middle, b, 1).data_ptr() == copies[1][1:3].data_ptr()
    assert store.nbytes == [whole.numel() * 4 // 2] * 2   # the rows hold no memory of their own


def test_memory_shared_other_than_as_rows_is_an_error():
    store = StateStore(shared_cpu_topology(2))
    whole = _kv()
    b = Binding(index=0, placement=HEADS, state=True)
    store.get(whole, b, 0)
    heads = torch.as_strided(whole, (4, 2, 6, 3), whole.stride(), 0)   # the first 2 heads of every row
    with pytest.raises(RuntimeError, match=r"shares memory with another of shape \(4, 4, 6, 3\)"):
        store.get(heads, b, 0)
    # the wide cache after a cache of its rows: the rows already have copies of their own
    late = StateStore(shared_cpu_topology(2))
    base = _kv()
    first_row = torch.as_strided(base, (1, 4, 6, 3), base.stride(), 0)
    late.get(first_row, b, 0)
    with pytest.raises(RuntimeError, match="run the wide cache before any cache of a range of its rows"):
        late.get(base, b, 0)


def test_tensors_in_disjoint_parts_of_one_buffer_are_separate_states():
    # a cache that slices one buffer into its layers: each layer is a state of its own
    store = StateStore(shared_cpu_topology(2))
    buffer = torch.arange(2 * 4 * 4 * 6 * 3, dtype=torch.float32)
    layers = [buffer[i * 288:(i + 1) * 288].view(4, 4, 6, 3) for i in range(2)]
    b = Binding(index=0, placement=HEADS, state=True)
    copies = [store.get(t, b, 0) for t in layers]
    assert copies[0].data_ptr() != copies[1].data_ptr()
    for t, c in zip(layers, copies):
        torch.testing.assert_close(c, t[:, :2])


class _Recorder:
    """An executor that records the per-socket arguments it is given and writes each socket's length."""

    def __init__(self) -> None:
        self.calls: list[list[list]] = []

    def run(self, local: list[list]) -> list:
        self.calls.append(local)
        for args in local:
            args[2].add_(1)   # every socket's program increments its copy of the length
        return []


def test_a_variant_reuses_its_state_lookups_until_a_state_tensor_is_dropped():
    # a decode step passes the same cache tensors at every call: the variant looks their sockets' copies up
    # once, and looks again when other tensors come or when the store forgets one (its id may come back)
    import gc

    from numatp.backend.variants import Variant
    from numatp.plan.schema import Replicate

    store = StateStore(shared_cpu_topology(2))
    weights = [[torch.full((2,), float(r)), None, None, None] for r in range(2)]
    bindings = [[Binding(index=0, placement=Colwise(dim=0, splits=(IndexSet(((0, 1),)), IndexSet(((1, 2),))))),
                 Binding(index=1, placement=None),
                 Binding(index=2, placement=Replicate(), state=True),
                 Binding(index=3, placement=HEADS, state=True)] for _ in range(2)]
    rec = _Recorder()
    variant = Variant(plan=None, executor=rec, bindings=bindings, weights=weights, states=store)  # type: ignore[arg-type]
    length, kv = torch.zeros(1), _kv()
    for step in range(3):
        x = torch.full((1,), float(step))
        variant(None, x, length, kv)
        local = rec.calls[-1]
        for r in range(2):
            assert local[r][0] is weights[r][0] and local[r][1] is x
            assert local[r][3].data_ptr() == store.get(kv, bindings[r][3], r).data_ptr()
        assert float(length) == step + 1   # socket 0's length written back after every call
    assert variant.bound is not None and all(a[2] is b[2] for a, b in zip(rec.calls[0], rec.calls[2]))
    other = _kv(2)   # another cache: its own copies
    variant(None, torch.zeros(1), length, other)
    assert rec.calls[-1][0][3].shape == (2, 2, 6, 3) and variant.bound[0][1] == id(other)
    bytes_before = sum(store.nbytes)
    del kv, other
    gc.collect()
    assert variant.bound is None   # the store forgot tensors: nothing it looked up is kept
    assert sum(store.nbytes) < bytes_before
