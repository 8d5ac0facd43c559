"""numa_clone, pages_by_node and membind on this (single-node is enough) machine.

Placement on a second node is tested in tests/numa/ inside the multi-node VM.
"""

from __future__ import annotations

import errno
import mmap
import threading
import weakref

import pytest
import torch

import numatp.placement
from numatp.placement import PlacementError, _common, _syscalls, membind, memory, numa_clone, pages_by_node

PAGE = _syscalls.PAGE_SIZE

pytestmark = pytest.mark.unit


def _pages(t: torch.Tensor) -> int:
    return max(1, -(-t.numel() * t.element_size() // PAGE))


SOURCES = {
    "f32 2d": lambda: torch.randn(33, 70),
    "bf16": lambda: torch.randn(4, 5, 6).to(torch.bfloat16),
    "f64 scalar": lambda: torch.tensor(3.5, dtype=torch.float64),
    "int8": lambda: torch.randint(-100, 100, (4097,), dtype=torch.int8),
    "bool": lambda: torch.rand(3, 7) > 0.5,
    "complex64": lambda: torch.randn(9, dtype=torch.complex64),
    "transposed": lambda: torch.randn(40, 300).t(),
    "strided slice": lambda: torch.arange(10_000, dtype=torch.int64).view(100, 100)[1::3, ::7],
    "expanded": lambda: torch.randn(5, 1).expand(5, 4000),
    "empty": lambda: torch.empty(0, 3),
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_numa_clone_copies_into_fresh_node_pages(name):
    src = SOURCES[name]()
    out = numa_clone(src, 0, strict=True)
    assert out.shape == src.shape and out.dtype == src.dtype and out.is_contiguous()
    assert torch.equal(out, src)
    if out.numel():  # an empty tensor has no address
        assert out.data_ptr() % PAGE == 0 and out.data_ptr() != src.data_ptr()
    assert not out.requires_grad
    expected = {0: _pages(out)} if out.numel() else {}
    assert pages_by_node(out) == expected


def test_numa_clone_of_a_parameter_is_a_detached_copy():
    param = torch.nn.Parameter(torch.randn(8, 8))
    out = numa_clone(param, 0)
    assert not out.requires_grad and torch.equal(out, param.detach())
    out.add_(1)
    assert not torch.equal(out, param.detach())


def test_numa_clone_keeps_its_buffer_alive_until_the_last_view_dies(monkeypatch):
    alive: list[weakref.ref] = []

    class SpyBuffer(memory._NodeBuffer):
        def __init__(self, *args, **kwargs):
            alive.append(weakref.ref(self))

    monkeypatch.setattr(memory, "_NodeBuffer", SpyBuffer)
    src = torch.arange(5000, dtype=torch.float32)
    out = numa_clone(src, 0)
    view = out[100:200]
    del out, src
    torch.randn(1 << 16)  # churn the allocator
    assert alive[0]() is not None
    assert torch.equal(view, torch.arange(100, 200, dtype=torch.float32))
    assert pages_by_node(view) == {0: 1}
    del view
    assert alive[0]() is None  # unmapped with the last tensor


def test_pages_by_node_reports_untouched_pages_under_negative_errno():
    buf = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    untouched = torch.frombuffer(buf, dtype=torch.uint8)
    assert pages_by_node(untouched) == {-errno.ENOENT: 4}
    untouched[PAGE] = 1  # touch the second page only
    assert pages_by_node(untouched) == {-errno.ENOENT: 3, 0: 1}
    assert pages_by_node(untouched[:0]) == {}
    del untouched


@pytest.mark.parametrize("bad", [99, -1])
def test_missing_node_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match=rf"NUMA node {bad} does not exist; this machine has nodes 0"):
        numa_clone(torch.ones(3), bad)
    with pytest.raises(ValueError, match=rf"node {bad}"):
        with membind(bad):
            pass


@pytest.mark.parametrize("bad", [True, 1.0, "0"])
def test_node_must_be_an_int(bad):
    with pytest.raises(ValueError, match=r"node must be an int NUMA node id, got"):
        numa_clone(torch.ones(3), bad)  # type: ignore[arg-type]


def test_node_without_memory_is_refused(monkeypatch):
    monkeypatch.setattr(_common, "_memory_nodes", lambda: ((0, 1), (0,)))
    with pytest.raises(ValueError, match="NUMA node 1 has no memory.*one of 0"):
        numa_clone(torch.ones(3), 1)


def test_non_cpu_tensors_are_refused():
    with pytest.raises(ValueError, match="dense CPU tensors, got device=meta"):
        numa_clone(torch.empty(3, device="meta"), 0)
    with pytest.raises(TypeError, match="takes a torch.Tensor"):
        pages_by_node([1, 2])  # type: ignore[arg-type]


def _refuse(code: int):
    def syscall(*args, **kwargs):
        raise OSError(code, "refused by test")

    return syscall


def test_refused_mbind_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setattr(_common, "_warned", False)
    monkeypatch.setattr(_syscalls, "mbind", _refuse(errno.EPERM))
    src = torch.randn(100, 100)
    with pytest.warns(RuntimeWarning, match="once per process") as record:
        first = numa_clone(src, 0)
        second = numa_clone(src, 0)
    assert len(record) == 1
    assert torch.equal(first, src) and torch.equal(second, src) and first.data_ptr() % PAGE == 0


@pytest.mark.parametrize("code", [errno.EPERM, errno.ENOSYS])
def test_refused_mbind_in_strict_mode_raises(monkeypatch, code):
    monkeypatch.setattr(_syscalls, "mbind", _refuse(code))
    with pytest.raises(PlacementError, match="does not allow NUMA memory policy.*strict=False"):
        numa_clone(torch.ones(4), 0, strict=True)


def test_unexpected_mbind_error_is_not_swallowed(monkeypatch):
    monkeypatch.setattr(_syscalls, "mbind", _refuse(errno.EINVAL))
    with pytest.raises(PlacementError, match="mbind to NUMA node 0 failed.*EINVAL"):
        numa_clone(torch.ones(4), 0)


def test_membind_sets_and_restores_the_thread_policy():
    assert _syscalls.get_mempolicy() == (_syscalls.MPOL_DEFAULT, [])
    seen_by_other_thread = []
    bound = threading.Event()

    def other():
        bound.wait()
        seen_by_other_thread.append(_syscalls.get_mempolicy())

    # Started before the binding: a thread started inside it would inherit the policy at clone().
    worker = threading.Thread(target=other)
    worker.start()
    with membind(0, strict=True) as node:
        assert node == 0 and _syscalls.get_mempolicy() == (_syscalls.MPOL_BIND, [0])
        bound.set()
        worker.join()
        with pytest.raises(KeyError):
            with membind(0, strict=True):
                raise KeyError("body fails")
        assert _syscalls.get_mempolicy() == (_syscalls.MPOL_BIND, [0])  # nested exit restored BIND
    assert _syscalls.get_mempolicy() == (_syscalls.MPOL_DEFAULT, [])
    assert seen_by_other_thread == [(_syscalls.MPOL_DEFAULT, [])]  # the policy is per thread


def test_membind_refused(monkeypatch):
    monkeypatch.setattr(_common, "_warned", False)
    monkeypatch.setattr(_syscalls, "set_mempolicy", _refuse(errno.EPERM))
    ran = []
    with pytest.warns(RuntimeWarning, match="set_mempolicy to NUMA node 0 failed"):
        with membind(0):
            ran.append(True)
    assert ran == [True]
    with pytest.raises(PlacementError):
        with membind(0, strict=True):
            pass


def test_custom_op_runs_and_traces():
    x = torch.randn(6, 10).t()
    out = torch.ops.numatp.numa_clone(x, 0)
    assert torch.equal(out, x) and out.is_contiguous() and out.data_ptr() % PAGE == 0
    torch.library.opcheck(torch.ops.numatp.numa_clone.default, (x, 0))

    def f(t):
        return torch.ops.numatp.numa_clone(t * 2, 0) + 1

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(x)
    assert [n.target for n in gm.graph.nodes].count(torch.ops.numatp.numa_clone.default) == 1
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), x * 2 + 1, rtol=0, atol=0)


def test_public_names():
    assert sorted(numatp.placement.__all__) == ["PlacementError", "membind", "numa_clone", "numa_empty",
                                                "pages_by_node", "process_bytes_by_node"]


@pytest.mark.parametrize("shape", [(3, 5), (0,), (4097,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_numa_empty_is_a_writable_page_aligned_tensor(shape, dtype):
    from numatp.placement import numa_empty

    t = numa_empty(shape, dtype, 0)
    assert t.shape == torch.Size(shape) and t.dtype == dtype and t.is_contiguous()
    if t.numel():
        assert t.data_ptr() % 4096 == 0
        t.fill_(3)
        assert torch.equal(t, torch.full(shape, 3, dtype=dtype))
        assert set(pages_by_node(t)) == {0}


def test_numa_empty_names_a_bad_node():
    from numatp.placement import numa_empty

    with pytest.raises(ValueError, match="node"):
        numa_empty((4,), torch.float32, 99)


def test_process_bytes_by_node_sums_every_mapping(tmp_path):
    from numatp.placement import process_bytes_by_node

    maps = tmp_path / "numa_maps"
    maps.write_text(
        "7f0000000000 bind:1 anon=512 dirty=512 N1=512 kernelpagesize_kB=4\n"
        "7f1000000000 default file=/usr/lib/libc.so.6 mapped=10 mapmax=3 N0=7 N1=3 kernelpagesize_kB=4\n"
        "7f2000000000 default huge anon=2 dirty=2 N0=2 kernelpagesize_kB=2048\n"
        "7f3000000000 default\n")
    assert process_bytes_by_node(maps) == {0: 7 * 4096 + 2 * (2 << 20), 1: 515 * 4096}
    assert process_bytes_by_node(maps, anonymous=True) == {0: 2 * (2 << 20), 1: 512 * 4096}
    assert set(process_bytes_by_node()) <= set(range(1024))  # this process, on this machine
    with pytest.raises(PlacementError, match="no NUMA memory map"):
        process_bytes_by_node(tmp_path / "missing")
