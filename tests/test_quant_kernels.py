"""Quantized weights: the buffer format (quant.py) and the kernels that read it (quant.cpp through
``numatp::linear``'s qgemv, q8dot, qtile and q8_aten codes), each against ``x @ dequantize(buf).T + b``.

fp32 activations must match the fp32 reference to fp32 summation rounding; bf16 ones within bf16 rounding
(qtile rounds the dequantized weight to bf16 first, q8_aten the scales, and adds the bias after rounding).
The AVX2 and scalar fallbacks are compiled apart (the library itself is built for this CPU) and checked
the same way through ctypes."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from numatp.runtime.gemm import NATIVE, PROVIDERS, GemmShape, measure_all, quant
from numatp.runtime.gemm.providers import dot_usable as numatp_dot_usable
from numatp.runtime.gemm.quant import QuantFormat
from numatp.runtime.native import _HERE, compiler, library_path, load_ops

FORMATS = ["int8", "int4:g32", "int4:g64", "int4:g128", "int4:g32+zeros"]
# the q8dot provider's CPUs, by the flags Linux lists (numatp's own check is what the tests exercise)
NEEDS_BF16_DOT = pytest.mark.skipif(
    "avx512_bf16" not in Path("/proc/cpuinfo").read_text(), reason="q8dot needs AVX512-BF16")
# K per format: int8 with a tail past the vectors; int4 with a partial last chunk of 128 where the group allows
K_OF = {"int8": 296, "int4:g32": 352, "int4:g64": 320, "int4:g128": 384, "int4:g32+zeros": 352}


def _buffer(fmt: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    if fmt.endswith("+zeros"):   # torchao-style asymmetric values: random q, scales and float zeros
        f = QuantFormat.parse(fmt.removesuffix("+zeros"))
        groups = f.groups(k)
        q = torch.randint(0, 16, (n, k), generator=gen)
        return quant.from_values(q, torch.rand(n, groups, generator=gen) * 0.1 + 0.01,
                                 torch.randn(n, groups, generator=gen) * 0.1, f)
    return quant.quantize(torch.randn(n, k, generator=gen), fmt)


def _check(y: torch.Tensor, x: torch.Tensor, buf: torch.Tensor, bias: torch.Tensor | None, what: str,
           *, x_read: torch.Tensor | None = None) -> None:
    """``y`` against ``x @ dequantize(buf).T + b`` (``x_read`` in place of x where the kernel reads other
    values: the :a8 formats' quantized x), to the tolerance of x's dtype."""
    w = quant.dequantize(buf)
    xf = (x if x_read is None else x_read).float()
    ref = xf @ w.T + (bias.float() if bias is not None else 0)
    mag = xf.abs() @ w.abs().T + (bias.float().abs() if bias is not None else 0)
    k = x.shape[1]
    # fp32: summation rounding (K terms); bf16: rounded weights/scales/output, a few bf16 ulps of the magnitude
    tol = mag * (2 * k * torch.finfo(torch.float32).eps if x.dtype == torch.float32 else 2.0 ** -7)
    err = (y.float() - ref).abs()
    assert y.dtype == x.dtype and y.shape == ref.shape, f"{what}: {y.dtype} {tuple(y.shape)}"
    assert bool((err <= tol + 1e-30).all()), \
        f"{what}: max error {err.max().item():.3g}, worst error/tolerance {(err / (tol + 1e-30)).max().item():.3g}"


@pytest.mark.unit
@pytest.mark.parametrize("fmt", ["int8", "int4:g32", "int4:g64", "int4:g128"])
def test_format_round_trip(fmt):
    gen = torch.Generator().manual_seed(0)
    n, k = 24, 256
    w = torch.randn(n, k, generator=gen)
    v = quant.quantize_values(w, fmt)
    buf = quant.from_values(v.q, v.scales, v.zeros, fmt)
    assert buf.numel() == quant.nbytes(n, k, fmt) and buf.numel() % 64 == 0
    h = quant.header(buf)
    f = QuantFormat.parse(fmt)
    assert (h["bits"], h["n"], h["k"], h["group"], h["zeros"]) == (f.bits, n, k, f.group or k, 0)
    back = quant.unpack(buf)
    assert torch.equal(back.q, v.q) and torch.equal(back.scales, v.scales.reshape(n, -1))
    # the quantizer's error: half a step of the scale (int8); int4 maps the largest magnitude to -8 steps,
    # so the other side's end clamps at 7 steps: a whole step there
    step = back.scales.repeat_interleave(k // back.scales.shape[1], dim=1).abs()
    most = 0.5 if f.bits == 8 else 1.0
    assert bool(((quant.dequantize(buf) - w).abs() <= step * most * (1 + 1e-5)).all())
    # a transposed view quantizes the same values
    assert torch.equal(quant.quantize(w.t().contiguous().t(), fmt), buf)


@pytest.mark.unit
def test_int4_packing_order_and_zeros():
    n, k = 2, 64
    q = torch.arange(n * k).reshape(n, k) % 16
    s = torch.full((n, 2), 0.5)
    z = torch.tensor([[1.0, -1.0], [0.25, 0.0]])
    buf = quant.from_values(q, s, z, "int4:g32")
    packed, s_view, z_view = quant.views(buf)
    # block of 32 values: byte i holds value i (low nibble) and value i + 16 (high nibble)
    assert int(packed[0, 3]) == int(q[0, 3]) | (int(q[0, 19]) << 4)
    assert int(packed[1, 16 + 5]) == int(q[1, 32 + 5]) | (int(q[1, 32 + 21]) << 4)
    assert torch.equal(z_view, z) and torch.equal(s_view, s)
    want = (q.float() - 8) * 0.5 + z.repeat_interleave(32, dim=1)
    assert torch.equal(quant.dequantize(buf), want)


@pytest.mark.unit
def test_format_errors():
    with pytest.raises(ValueError, match="int4:g32"):
        quant.quantize(torch.randn(4, 96), "int4:g64")   # 96 is no multiple of 64; 32 fits
    with pytest.raises(ValueError, match="'int8'"):
        QuantFormat.parse("int3")
    with pytest.raises(ValueError, match="bad magic"):
        quant.header(torch.zeros(256, dtype=torch.uint8))


@pytest.mark.integration   # prepare loads numatp's library (compiled on first use)
def test_shape_and_provider_fields():
    s = GemmShape(1, 1024, 4096, "bfloat16", "nk", 2, stream=True, weights="int4:g64")
    assert s.key.endswith("|stream|w=int4:g64") and GemmShape.from_key(s.key) == s
    assert GemmShape.from_key(GemmShape(4, 8, 8, "float32", "kn", 1).key).weights == ""
    assert s.weight_bytes == quant.nbytes(4096, 1024, "int4:g64") and s.bits == 4
    plain = GemmShape(1, 1024, 4096, "bfloat16", "nk", 2)
    q8 = GemmShape(1, 1024, 4096, "bfloat16", "nk", 2, weights="int8")
    assert PROVIDERS["qgemv"].runs(s) and PROVIDERS["qgemv"].runs(q8) and not PROVIDERS["qgemv"].runs(plain)
    assert PROVIDERS["q8_aten"].runs(q8) and not PROVIDERS["q8_aten"].runs(s)
    assert not PROVIDERS["gemv"].runs(q8) and not PROVIDERS["aten"].runs(s) and PROVIDERS["gemv"].runs(plain)
    assert not PROVIDERS["qgemv"].runs(GemmShape(17, 64, 64, "float32", "nk", 1, weights="int8"))
    assert PROVIDERS["qtile"].runs(GemmShape(512, 64, 64, "float32", "nk", 1, weights="int4:g32"))
    assert PROVIDERS["q8dot"].runs(q8) and not PROVIDERS["q8dot"].runs(s)   # int8 weights, bf16 activations
    assert not PROVIDERS["q8dot"].runs(GemmShape(1, 1024, 4096, "float32", "nk", 2, weights="int8"))
    assert {NATIVE[p] for p in ("qgemv", "qtile", "q8_aten", "q8dot")} == {5, 6, 7, 10}
    buf = quant.quantize(torch.randn(8, 64), "int8")
    assert all(PROVIDERS[p].prepare(buf, 4) is buf for p in ("qgemv", "qtile", "q8_aten"))
    with pytest.raises(ValueError, match="quantize the weight first"):
        PROVIDERS["qgemv"].prepare(torch.randn(8, 64), 4)


PROVIDER_FORMATS = [(p, f) for p in ("qgemv", "qtile", "q8_aten") for f in FORMATS if p != "q8_aten" or f == "int8"]
PROVIDER_FORMATS.append(pytest.param("q8dot", "int8", marks=NEEDS_BF16_DOT))


@pytest.mark.integration
@pytest.mark.parametrize("provider,fmt", PROVIDER_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_dequantized_reference(provider, fmt, dtype):
    load_ops()
    gen = torch.Generator().manual_seed(1)
    # ATen's bf16 int8pack kernel needs K % 16 == 0 (numatp's check refuses others)
    k = 304 if provider == "q8_aten" else K_OF[fmt]
    p = PROVIDERS[provider]
    for n in (72, 200):
        buf = _buffer(fmt, n, k, gen)
        for m in (1, 3, 8, 11, 16, 40):
            if p.max_rows is not None and m > p.max_rows:
                continue
            x = torch.randn(m, k, generator=gen).to(dtype)
            for bias in (None, torch.randn(n, generator=gen).to(dtype)):
                if dtype not in p.dtypes:   # q8dot: bf16 activations only, and says so
                    with pytest.raises(RuntimeError, match="takes bf16 activations"):
                        p.call(x, buf, bias, n, k)
                    continue
                y = p.call(x, buf, bias, n, k)
                _check(y, x, buf, bias, f"{provider} {fmt} {dtype} m={m} n={n} bias={bias is not None}")


@pytest.mark.integration
@pytest.mark.parametrize("fmt", FORMATS)
def test_qembedding_is_the_dequantized_rows(fmt):
    # numatp::qembedding (C++): the rows of ids, dequantized as quant.dequantize, in the asked dtype
    gen = torch.Generator().manual_seed(3)
    k = K_OF[fmt]
    buf = _buffer(fmt, 96, k, gen)
    table = quant.dequantize(buf)
    for ids in (torch.tensor([7]), torch.tensor([[0, 95, 7], [7, 3, 3]]), torch.tensor([], dtype=torch.long),
                torch.tensor([[5, 1]], dtype=torch.int32)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            y = quant.qembedding(buf, ids, k, dtype)
            assert y.shape == (*ids.shape, k) and y.dtype == dtype
            assert torch.equal(y, table[ids.long()].to(dtype)), (fmt, ids.tolist(), dtype)
    with pytest.raises(RuntimeError, match="id 96 is outside the table's 96 rows"):
        quant.qembedding(buf, torch.tensor([3, 96]), k, torch.float32)
    with pytest.raises(RuntimeError, match=f"the call asks for K = {k - 32}"):
        quant.qembedding(buf, torch.tensor([3]), k - 32, torch.float32)
    with pytest.raises(RuntimeError, match="ids are int64 or int32"):
        quant.qembedding(buf, torch.tensor([3.0]), k, torch.float32)


@pytest.mark.integration
@pytest.mark.parametrize("provider", ["qgemv", "qtile", pytest.param("q8dot", marks=NEEDS_BF16_DOT)])
def test_kernels_on_two_threads(provider):
    load_ops()
    gen = torch.Generator().manual_seed(2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    p = PROVIDERS[provider]
    try:
        for fmt in ("int8", "int4:g64"):
            if not p.runs(GemmShape(5, 256, 328, "bfloat16", "nk", 2, weights=fmt)):
                continue
            buf = _buffer(fmt, 328, 256, gen)
            for dtype in p.dtypes:
                x = torch.randn(5, 256, generator=gen).to(dtype)
                _check(PROVIDERS[provider].call(x, buf, None, 328, 256), x, buf, None, f"{provider} {fmt} {dtype}")
    finally:
        torch.set_num_threads(before)


@pytest.mark.integration
def test_kernel_errors():
    load_ops()
    buf = quant.quantize(torch.randn(8, 64), "int4:g32")
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"is \(N, K\) = \(8, 64\), the call asks for \(16, 64\)"):
        torch.ops.numatp.linear(x, buf, None, NATIVE["qgemv"], 16, 64)
    with pytest.raises(RuntimeError, match="not a 4-bit weight|reads int8 weights"):
        torch.ops.numatp.linear(x, buf, None, NATIVE["q8_aten"], 8, 64)
    if numatp_dot_usable():
        with pytest.raises(RuntimeError, match="q8dot: reads int8 weights without zero points, got a 4-bit weight"):
            torch.ops.numatp.linear(x.bfloat16(), buf, None, NATIVE["q8dot"], 8, 64)
    else:
        with pytest.raises(RuntimeError, match="q8dot: this CPU has no AVX512-BF16"):
            torch.ops.numatp.linear(x.bfloat16(), buf, None, NATIVE["q8dot"], 8, 64)
    with pytest.raises(RuntimeError, match="up to 16 rows"):
        torch.ops.numatp.linear(torch.randn(17, 64), buf, None, NATIVE["qgemv"], 8, 64)
    with pytest.raises(RuntimeError, match="not a numatp quantized buffer"):
        torch.ops.numatp.linear(x, torch.zeros(buf.numel(), dtype=torch.uint8), None, NATIVE["qtile"], 8, 64)
    with pytest.raises(RuntimeError, match="quantized buffer"):
        torch.ops.numatp.linear(x, torch.randn(8, 64), None, NATIVE["qgemv"], 8, 64)


@pytest.mark.integration
def test_measure_all_times_quantized_providers():
    shape = GemmShape(2, 128, 64, "float32", "nk", 1, weights="int8")
    rates = measure_all({p: PROVIDERS[p] for p in ("qgemv", "qtile", "q8_aten", "gemv")}, shape,
                        min_seconds=0.0, max_calls=2)
    assert rates["gemv"] == 0.0 and all(rates[p] > 0 for p in ("qgemv", "qtile", "q8_aten"))


def _fallback_library(tmp: Path, flags: list[str]) -> ctypes.CDLL:
    out = tmp / f"quant{abs(hash(tuple(flags)))}.so"
    subprocess.run([compiler(), "-O2", "-march=native", *flags, "-fopenmp", "-fPIC", "-shared", "-std=c++20",
                    str(_HERE / "quant.cpp"), "-o", str(out)], check=True, capture_output=True)
    return ctypes.CDLL(str(out))


@pytest.mark.integration
@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_fallback_paths(tmp_path, isa):
    flags = ["-mno-avx512f"] + (["-mno-avx2", "-mno-fma"] if isa == "scalar" else [])
    lib = _fallback_library(tmp_path, flags)
    ptr = ctypes.c_void_p
    i64 = ctypes.c_int64
    lib.numatp_qgemv.argtypes = [ptr, ptr, ptr, ctypes.c_int, i64, i64, i64, ptr, ctypes.c_int, ptr, ptr, i64,
                                 ctypes.c_int, ctypes.c_int]
    lib.numatp_qdequant.argtypes = [ptr, ptr, ptr, ctypes.c_int, i64, i64, i64, i64, i64, ptr, ctypes.c_int]
    gen = torch.Generator().manual_seed(3)
    for fmt in FORMATS:
        n, k = 40, K_OF[fmt]
        buf = _buffer(fmt, n, k, gen)
        h = quant.header(buf)
        base = buf.data_ptr()
        sections = (base + h["q_off"], base + h["s_off"], base + h["z_off"] if h["zeros"] else None)
        for dtype in (torch.float32, torch.bfloat16):
            for m in (1, 5):
                x = torch.randn(m, k, generator=gen).to(dtype)
                b = torch.randn(n, generator=gen).to(dtype)
                y = torch.empty(m, n, dtype=dtype)
                lib.numatp_qgemv(*sections, h["bits"], n, k, h["group"], x.data_ptr(), int(dtype == torch.bfloat16),
                                 b.data_ptr(), y.data_ptr(), m, 0, 0)
                _check(y, x, buf, b, f"{isa} qgemv {fmt} {dtype} m={m}")
            wd = torch.empty(n - 3, k, dtype=dtype)
            lib.numatp_qdequant(*sections, h["bits"], n, k, h["group"], 3, n, wd.data_ptr(),
                                int(dtype == torch.bfloat16))
            assert torch.equal(wd, quant.dequantize(buf)[3:].to(dtype)), f"{isa} dequantize {fmt} {dtype}"
    # int8 activations (AVX2: vpmaddubsw on |q| and qx with q's sign, on int4's nibbles and qx; scalar: int32
    # sums)
    # (int4: runs of 4 blocks, then a pair, then an odd block: K of 1 to 33 blocks covers each ending)
    for fmt, ks in (("int8:a8", (32, 96, 224, 1056)), ("int4:g32:a8", (32, 96, 160, 224, 1056)),
                    ("int4:g64:a8", (64, 192)), ("int4:g128:a8", (128, 384))):
        for k in ks:
            n = 24
            buf = quant.quantize(torch.randn(n, k, generator=gen), fmt)
            h = quant.header(buf)
            base = buf.data_ptr()
            for dtype in (torch.float32, torch.bfloat16):
                for m in (1, 3, 4, 7):
                    x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k // 32).repeat_interleave(32))
                    x = x.to(dtype)
                    y = torch.empty(m, n, dtype=dtype)
                    lib.numatp_qgemv(base + h["q_off"], base + h["s_off"], None, h["bits"], n, k, h["group"],
                                     x.data_ptr(), int(dtype == torch.bfloat16), None, y.data_ptr(), m, 0, 1)
                    _check_a8(y, x, buf, None, f"{isa} qgemv {fmt} {dtype} k={k} m={m}")


def _act8_inputs(gen: torch.Generator) -> list[torch.Tensor]:
    """x for the activations' quantizer: blocks from 1e-3 to 1e2, a block of zeros, values on rounding ties
    (multiples of d / 2), one row of 40 for the team's split."""
    xs = []
    for m, k in ((1, 32), (3, 96), (40, 1056)):
        x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, k // 32).repeat_interleave(32)
        x[0, :32] = 0.0
        if k >= 96:   # 127 at the block's end sets d = 1 / 2: (2j + 1) / 4 are ties of x / d = j + 1/2
            x[-1, 32:64] = torch.arange(32) * 0.5 + 0.25
            x[-1, 63] = 63.5
        xs.append(x)
    return xs


@pytest.mark.integration
@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
def test_act8_pass_equals_quantize_activations(tmp_path, isa):
    # numatp_qact8 (the :a8 prompt providers' x) is quantize_activations exactly, rounded once to x's dtype
    if isa == "native":
        lib = ctypes.CDLL(str(library_path()))
    else:
        lib = _fallback_library(tmp_path, ["-mno-avx512f"] + (["-mno-avx2", "-mno-fma"] if isa == "scalar" else []))
    lib.numatp_qact8.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    gen = torch.Generator().manual_seed(11)
    for x32 in _act8_inputs(gen):
        for dtype in (torch.float32, torch.bfloat16):
            x = x32.to(dtype)
            out = torch.empty_like(x)
            lib.numatp_qact8(x.data_ptr(), int(dtype == torch.bfloat16), x.shape[0], x.shape[1], out.data_ptr())
            ref = quant.quantize_activations(x).to(dtype)
            assert torch.equal(out, ref), f"{isa} {dtype} {tuple(x.shape)}: {(out.float() - ref.float()).abs().max()}"
    x = torch.ones(2, 64)
    x[1, 40] = float("nan")   # a NaN block: NaN throughout, as the reference; the other blocks unchanged
    out = torch.empty_like(x)
    lib.numatp_qact8(x.data_ptr(), 0, 2, 64, out.data_ptr())
    ref = quant.quantize_activations(x)
    assert torch.equal(out.isnan(), ref.isnan()) and out[1, 32:].isnan().all()
    assert torch.equal(out.nan_to_num(), ref.nan_to_num())


@pytest.mark.integration
def test_q8dot_is_measured_where_the_cpu_has_it_and_refuses_zero_points():
    # int8 weights and bf16 activations only; a CPU without AVX512-BF16 measures 0 (never chosen)
    load_ops()
    shape = GemmShape(8, 128, 64, "bfloat16", "nk", 1, weights="int8")
    rates = measure_all({p: PROVIDERS[p] for p in ("qgemv", "q8dot")}, shape, min_seconds=0.0, max_calls=2)
    assert rates["qgemv"] > 0 and (rates["q8dot"] > 0) == numatp_dot_usable()
    with_zeros = quant.from_values(torch.randint(-8, 8, (8, 64)), torch.rand(8, 1) + 0.1, torch.rand(8, 1), "int8")
    if numatp_dot_usable():
        with pytest.raises(ValueError, match="q8dot provider reads int8 weights without zero points"):
            PROVIDERS["q8dot"].prepare(with_zeros, 4)
    else:
        with pytest.raises(RuntimeError, match="q8dot provider needs AVX512-BF16"):
            PROVIDERS["q8dot"].prepare(with_zeros, 4)


# ---- int8:a8: int8 weights, activations quantized in blocks of 32 ----

def _values(buf: torch.Tensor) -> tuple:
    v = quant.unpack(buf)
    return v.q, v.scales, v.zeros


def _check_a8(y: torch.Tensor, x: torch.Tensor, buf: torch.Tensor, bias: torch.Tensor | None, what: str,
              *, rounded: bool = False) -> None:
    """:func:`_check` with x's blocks quantized as the kernels read them (``rounded``: then rounded to x's
    dtype, as the prompt providers multiply them)."""
    xq = quant.quantize_activations(x)
    _check(y, x, buf, bias, what, x_read=xq.to(x.dtype) if rounded else xq)


@pytest.mark.unit
def test_activation_quantization_reference():
    # blocks of 32 along the last dimension: d = max|x| / 127, q = round(x / d) (ties to even), x^ = q d
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-2.54, 2.54, 32)
    x[0, 5] = 0.015   # 0.75 steps of d = 0.02: one step
    x[1, 32:] = 3.0
    got = quant.quantize_activations(x)
    d = 2.54 / 127
    assert torch.allclose(got[0, :32].view(-1)[[0, 31]], torch.tensor([-2.54, 2.54]))
    assert torch.equal(got[0, 32:], torch.zeros(32)) and torch.equal(got[1, :32], torch.zeros(32))
    assert torch.equal(got[1, 32:], torch.full((32,), 3.0))
    assert abs(got[0, 5].item() - d) < 1e-7
    assert ((got[0, :32] - x[0, :32]).abs() <= d / 2 + 1e-7).all()
    with pytest.raises(ValueError, match="blocks of 32; an input of 40 features"):
        quant.quantize_activations(torch.zeros(1, 40))


@pytest.mark.integration
def test_a_buffer_with_other_int4_groups_is_refused():
    # the kernels are built for groups of 32, 64 and 128: a header saying 256 is an error, not a wrong sum
    load_ops()
    buf = quant.quantize(torch.randn(8, 256), "int4:g128").clone()
    buf[:128].view(torch.int64)[5] = 256
    with pytest.raises(RuntimeError, match="cannot have groups of 256 \\(int4 takes groups of 32, 64 or 128"):
        torch.ops.numatp.linear(torch.randn(1, 256), buf, None, NATIVE["qgemv"], 8, 256)


@pytest.mark.unit
def test_a8_format_and_its_errors():
    f = QuantFormat.parse("int8:a8")
    assert (f.bits, f.group, f.act, f.name) == (8, None, 8, "int8:a8")
    buf = quant.quantize(torch.randn(4, 64), f)
    assert quant.header(buf)["act"] == 8 and quant.format_of(buf) == f
    assert quant.header(quant.quantize(torch.randn(4, 64), "int8"))["act"] == 0
    w = torch.randn(4, 64)
    a8, w8 = quant.unpack(quant.quantize(w, "int8:a8")), quant.unpack(quant.quantize(w, "int8"))
    assert torch.equal(a8.q, w8.q) and torch.equal(a8.scales, w8.scales)   # the weight is int8's
    f4 = QuantFormat.parse("int4:a8")
    assert (f4.bits, f4.group, f4.act, f4.name) == (4, 64, 8, "int4:g64:a8")
    assert quant.format_of(quant.quantize(torch.randn(4, 128), "int4:g128:a8")) == QuantFormat(4, 128, 8)
    with pytest.raises(ValueError, match="activations to int8 \\(':a8'\\), not to 4 bits"):
        QuantFormat.parse("int8:a4")
    with pytest.raises(ValueError, match="not 48"):
        QuantFormat.parse("int4:g48:a8")
    with pytest.raises(ValueError, match="input size of 48, not a multiple of the activations' blocks of 32"):
        quant.quantize(torch.randn(4, 48), "int8:a8")
    with pytest.raises(ValueError, match="no zero points"):
        quant.from_values(torch.zeros(2, 32), torch.ones(2, 1), torch.zeros(2, 1), "int8:a8")


A8_CASES = [(p, "int8:a8") for p in ("qgemv", "qtile", "q8_aten", "q_dequant")] + \
    [pytest.param("q8dot", "int8:a8", marks=NEEDS_BF16_DOT)] + \
    [(p, f) for p in ("qgemv", "qtile", "q_dequant") for f in ("int4:g32:a8", "int4:g64:a8", "int4:g128:a8")]
# K per format: one block; K % 64 == 32 and K % 128 == 32 or 96 (int8's masked tails, int4's odd last block)
A8_K = {"int8:a8": (32, 96, 160, 1056), "int4:g32:a8": (32, 96, 160, 1056), "int4:g64:a8": (64, 192, 1088),
        "int4:g128:a8": (128, 384, 1152)}


@pytest.mark.integration
@pytest.mark.parametrize("provider,fmt", A8_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a8_kernels_equal_the_activation_quantized_reference(provider, fmt, dtype):
    load_ops()
    gen = torch.Generator().manual_seed(5)
    p = PROVIDERS[provider]
    weight_only = fmt.removesuffix(":a8")
    for k in A8_K[fmt]:
        for n in (9, 72):
            buf = quant.quantize(torch.randn(n, k, generator=gen), fmt)
            for m in (1, 2, 3, 4, 5, 16, 40):
                if p.max_rows is not None and m > p.max_rows:
                    continue
                # blocks of very different scales, and one of zeros
                x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, k // 32).repeat_interleave(32)
                if k > 32:
                    x[:, :32] = 0
                x = x.to(dtype)
                for bias in (None, torch.randn(n, generator=gen).to(dtype)):
                    if dtype not in p.dtypes:   # q8dot: bf16 activations only, and says so
                        with pytest.raises(RuntimeError, match="takes bf16 activations"):
                            p.call(x, buf, bias, n, k)
                        continue
                    y = p.call(x, buf, bias, n, k)
                    # qgemv sums qx q as integers; the others multiply qx d rounded to x's dtype
                    _check_a8(y, x, buf, bias, f"{provider} {fmt} {dtype} k={k} m={m} n={n}",
                              rounded=provider != "qgemv")
                    if provider == "qgemv" and m == 1 and bias is None:   # not the weight-only product
                        plain = p.call(x, quant.from_values(*_values(buf), weight_only), None, n, k)
                        assert not torch.equal(y, plain)
