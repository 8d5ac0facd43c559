"""Single-query attention rewritten as fused reductions equals CPU flash attention."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from numatp.plan.attention_pass import fuse_single_query_attention

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

pytestmark = pytest.mark.unit


def _program(q, k, v, mask, **kw):
    """An FX program calling CPU flash attention as the trace shows it (output 0 read by getitem)."""
    g = torch.fx.Graph()
    ins = [g.placeholder(n) for n in ("q", "k", "v")]
    m = g.placeholder("mask") if mask is not None else None
    if m is not None:
        kw["attn_mask"] = m
    out = g.call_function(FLASH, tuple(ins) + tuple(kw.pop("args", ())), kw)
    first = g.call_function(__import__("operator").getitem, (out, 0))
    g.output((g.call_function(torch.ops.aten.mul.Tensor, (first, 2.0)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    args = [q, k, v] + ([mask] if mask is not None else [])
    fake = FakeTensorMode()
    FakeTensorProp(gm, fake).propagate(*[fake.from_tensor(a) for a in args])
    return gm, args


def _inputs(b, h, hk, s, d, dtype, mask_kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, L, d, generator=g).to(dtype) for n, L in ((h, 1), (hk, s), (hk, s)))
    keep = torch.rand(b, 1, 1, s, generator=g) > 0.3
    keep[..., -1] = True   # the new token sees itself
    if mask_kind == "float":
        mask = torch.zeros(b, 1, 1, s, dtype=dtype).masked_fill(~keep, float("-inf"))
    elif mask_kind == "per-head":
        mask = torch.randn(b, h, 1, s, generator=g).to(dtype)
    else:
        mask = None
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "h", "hk"), [(1, 8, 8), (3, 14, 2), (2, 4, 1)])
@pytest.mark.parametrize("mask_kind", [None, "float", "per-head"])
def test_single_query_attention_equals_flash(dtype, b, h, hk, mask_kind):
    q, k, v, mask = _inputs(b, h, hk, 37, 16, dtype, mask_kind)
    gm, args = _program(q, k, v, mask, scale=0.3)
    with torch.inference_mode():
        want = gm(*args)[0]
        assert fuse_single_query_attention(gm) == 1
        assert not any(n.target is FLASH for n in gm.graph.nodes)
        got = gm(*args)[0]
    assert got.shape == want.shape and got.dtype == dtype
    # fp32 within rounding; bf16: both round the fp32 result once (flash's blocks sum in another order)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)


def test_default_scale_is_one_over_root_head_dim():
    q, k, v, mask = _inputs(1, 2, 2, 9, 25, torch.float32, "float")
    gm, args = _program(q, k, v, mask)
    want = gm(*args)[0]
    assert fuse_single_query_attention(gm) == 1
    torch.testing.assert_close(gm(*args)[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["two queries", "causal", "dropout", "logsumexp read"])
def test_other_attention_is_left_to_flash(case):
    q, k, v, mask = _inputs(1, 4, 4, 12, 8, torch.float32, None)
    kw = {}
    if case == "two queries":
        q = torch.randn(1, 4, 2, 8)
    elif case == "causal":
        kw["args"] = (0.0, True)
    elif case == "dropout":
        kw["args"] = (0.1, False)
    gm, args = _program(q, k, v, mask, **kw)
    if case == "logsumexp read":
        flash = next(n for n in gm.graph.nodes if n.target is FLASH)
        with gm.graph.inserting_after(flash):
            lse = gm.graph.call_function(__import__("operator").getitem, (flash, 1))
        out = next(n for n in gm.graph.nodes if n.op == "output")
        out.args = ((out.args[0][0], lse),)
        gm.recompile()
    assert fuse_single_query_attention(gm) == 0
    assert sum(n.target is FLASH for n in gm.graph.nodes) == 1
