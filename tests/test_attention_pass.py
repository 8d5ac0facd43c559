"""Single-query attention rewritten as fused reductions equals CPU flash attention."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from numatp.plan.attention_pass import fuse_single_query_attention

from numatp.runtime.native import load_ops

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
load_ops()
DECODE = torch.ops.numatp.decode_attention.default

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


def _tol(dtype):
    # fp32 within rounding; bf16/fp16: both round the fp32 result once (flash's blocks sum in another order)
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "h", "hk"), [(1, 8, 8), (3, 14, 2), (2, 4, 1)])
@pytest.mark.parametrize("mask_kind", [None, "float", "per-head"])
def test_single_query_attention_equals_flash(dtype, b, h, hk, mask_kind):
    q, k, v, mask = _inputs(b, h, hk, 37, 16, dtype, mask_kind)
    gm, args = _program(q, k, v, mask, scale=0.3)
    with torch.inference_mode():
        want = gm(*args)[0]
        assert fuse_single_query_attention(gm) == 1
        assert not any(n.target is FLASH for n in gm.graph.nodes)
        # fp32 and bf16: numatp's C++ kernel; other dtypes: Inductor's fused loops
        native = any(n.target is DECODE for n in gm.graph.nodes)
        assert native == (dtype in (torch.float32, torch.bfloat16))
        got = gm(*args)[0]
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **_tol(dtype))


def _flash(q, k, v, mask, scale):
    return FLASH(q, k, v, attn_mask=mask, scale=scale)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("d", "s"), [(64, 224), (128, 37), (80, 1), (24, 300)])
@pytest.mark.parametrize(("h", "hk"), [(8, 8), (14, 2), (4, 1)])
def test_decode_attention_equals_flash_on_head_sizes_caches_and_groups(dtype, d, s, h, hk):
    """Head sizes with and without whole vector chunks, caches with and without whole vectors of
    positions, one position, grouped K/V heads: equal to CPU flash attention."""
    q, k, v, mask = _inputs(2, h, hk, s, d, dtype, "float", seed=d + s)
    got = DECODE(q, k, v, mask, 0.125)
    torch.testing.assert_close(got, _flash(q, k, v, mask, 0.125), **_tol(dtype))
    torch.testing.assert_close(DECODE(q, k, v, None, 0.125), _flash(q, k, v, None, 0.125), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_skips_positions_masked_for_every_head_and_reads_strided_caches(dtype):
    """A static cache: positions past the ones written hold the dtype's lowest mask value and are not read
    (NaN there changes nothing); the caches are a row of a larger batch (strided), the mask is one row for
    the whole batch."""
    g = torch.Generator().manual_seed(1)
    big_k, big_v = (torch.randn(4, 2, 96, 64, generator=g).to(dtype) for _ in range(2))
    k, v = big_k[1:3], big_v[1:3]   # batch stride of 4 rows' caches
    q = torch.randn(2, 6, 1, 64, generator=g).to(dtype)
    mask = torch.zeros(1, 1, 1, 96, dtype=dtype)
    mask[..., 70:] = torch.finfo(dtype).min
    want = _flash(q, k.contiguous(), v.contiguous(), mask, 0.2)
    k[:, :, 70:] = float("nan")
    v[:, :, 70:] = float("nan")
    got = DECODE(q, k, v, mask, 0.2)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_each_heads_span_only(dtype):
    """A mask per head whose unmasked positions sit in a different span for each head (leading and trailing
    positions masked, gaps inside), one head of a group with none at all: equal to flash attention, and
    positions outside every head's span of a group (NaN there) are not read."""
    g = torch.Generator().manual_seed(2)
    b, h, hk, s, d = 2, 4, 2, 50, 32
    q = torch.randn(b, h, 1, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hk, s, d, generator=g).to(dtype) for _ in range(2))
    low = torch.finfo(dtype).min
    mask = torch.full((b, h, 1, s), low, dtype=dtype)
    spans = {(0, 0): (5, 20), (0, 1): (12, 30), (0, 2): (0, 9), (0, 3): (40, 50),
             (1, 0): (3, 4), (1, 1): (7, 33), (1, 2): (20, 45)}   # (1, 3): every position masked
    for (i, j), (lo, hi) in spans.items():
        mask[i, j, 0, lo:hi] = torch.randn(hi - lo, generator=g).to(dtype)
        mask[i, j, 0, lo + 1:hi - 1:3] = low   # a gap inside the span
    want = _flash(q, k, v, mask, 0.3)
    k[0, 0, 30:], v[0, 0, 30:] = float("nan"), float("nan")   # past group (0, heads 0-1)'s spans
    k[0, 1, 9:40], v[0, 1, 9:40] = float("nan"), float("nan")  # between group (0, heads 2-3)'s two spans
    k[0, 0, :5], v[0, 0, :5] = float("nan"), float("nan")     # before group (0, heads 0-1)'s spans
    got = DECODE(q, k, v, mask, 0.3)
    assert not got[0].isnan().any()
    torch.testing.assert_close(got[0], want[0], **_tol(dtype))
    torch.testing.assert_close(got[1], want[1], **_tol(dtype))


def test_decode_attention_with_every_position_masked_is_what_flash_returns():
    """A head with no position left (an idle row of a batch): -inf everywhere gives zeros, the lowest value
    everywhere weighs every position alike, as CPU flash attention does."""
    q, k, v, _ = _inputs(2, 4, 2, 20, 64, torch.float32, None)
    for fill in (float("-inf"), torch.finfo(torch.float32).min):
        mask = torch.zeros(2, 1, 1, 20)
        mask[1] = fill   # row 1 entirely masked, row 0 not at all
        got = DECODE(q, k, v, mask, 0.125)
        torch.testing.assert_close(got, _flash(q, k, v, mask, 0.125), rtol=1e-5, atol=1e-5)
    assert got[1].abs().sum() > 0 and torch.equal(DECODE(q, k, v, mask.fill_(float("-inf")), 0.125),
                                                   torch.zeros_like(got))


def test_decode_attention_names_what_it_takes():
    q, k, v, mask = _inputs(1, 4, 4, 8, 16, torch.float32, "float")
    with pytest.raises(RuntimeError, match=r"q \(B, H, 1, D\)"):
        DECODE(q.expand(1, 4, 2, 16), k, v, mask, 1.0)
    with pytest.raises(RuntimeError, match="Hk dividing 4"):
        DECODE(q, k[:, :3], v[:, :3], mask, 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        DECODE(q.half(), k.half(), v.half(), None, 1.0)
    with pytest.raises(RuntimeError, match="the mask must be"):
        DECODE(q, k, v, mask[..., :5], 1.0)


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
