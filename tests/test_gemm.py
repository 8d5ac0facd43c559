"""GEMM providers: rewritten programs equal eager, packed weights replace shards, rates are cached per CPU/threads.

The default run keeps one end-to-end case of each kind (each provider on one family per dtype, one under
Inductor at 2 sockets); the other families, Inductor's template provider, the generation choice and the
calibrate subprocess are slow (``-m slow``)."""

from __future__ import annotations

import json
import operator
import time
from dataclasses import replace

import pytest
import torch

import numatp
from numatp import zoo
from numatp.runtime import gemm as gemm_mod
from numatp.runtime.gemm import PROVIDERS, GemmShape, GemmTable, ceilings, measure
from numatp.runtime.native import load_ops
from numatp.runtime.segments import Collective, Segment
from numatp.backend import backend_of
from numatp.plan.gemm_pass import GemmOptions
from numatp.topology import MachineFacts, Topology
from tests.helpers import all_gathers, assert_close_to_eager

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:numatp. virtual sockets")]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


def _measures_a_rate(provider: str, dtype: torch.dtype) -> bool:
    """Whether a provider measures a rate on this CPU (a provider that cannot run measures 0 GFLOP/s)."""
    return measure(PROVIDERS[provider], GemmShape(4, 8, 8, str(dtype)[6:], "nk", 1), min_seconds=0, max_calls=2) > 0


def _runs_here(provider: str, dtype: torch.dtype) -> bool:
    """Whether this CPU has the provider's kernels, by ATen's own CPU check (nothing is measured at
    collection): oneDNN's bf16 kernels need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; the fp32 providers and
    the fp32 MKL path of bf16 run on every x86-64 CPU torch supports.
    test_provider_runs_exactly_where_the_cpu_has_its_kernels checks that a measurement agrees."""
    if dtype == torch.bfloat16 and provider.startswith("onednn"):
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if provider == "amx":   # bf16 only, on a CPU whose flags name AMX's tiles and their bf16 products
        return dtype == torch.bfloat16 and {"amx_tile", "amx_bf16"} <= _cpu_flags()
    if provider == "dpbf16":   # bf16 only, on a CPU whose flags name AVX512-BF16
        return dtype == torch.bfloat16 and "avx512_bf16" in _cpu_flags()
    return True


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (/proc/cpuinfo), read without numatp's own checks."""
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


_KEPT: list = []
"""The compiled models of the current test: a backend is released when its compiled model is collected,
and these tests read the backends ``_run`` returns."""


@pytest.fixture(autouse=True)
def _release_after_each_test():
    yield
    _KEPT.clear()


def _run(family, dtype, sockets, options, seqs=(16,), mode="eager"):
    """Compile and compare with eager; ``mode="eager"`` runs the segments uncompiled (fast), the GEMM
    steps and packed weights are the same as under Inductor."""
    model = zoo.build(family, tiny=True, dtype=dtype)
    with torch.inference_mode():
        compiled = numatp.compile(model, sockets=Topology.virtual(sockets=sockets), gemm=options, mode=mode)
        for seq in seqs:
            inputs = zoo.example_inputs(model, batch=2, seq=seq)
            assert_close_to_eager(compiled(**inputs).logits, model(**inputs).logits, f"{family} seq {seq}")
    _KEPT.append(compiled)
    return backend_of(compiled)


ALL_CASES = [(torch.float32, "onednn"), (torch.float32, "onednn_packed"), (torch.float32, "mkl_packed"),
             (torch.bfloat16, "onednn"), (torch.bfloat16, "onednn_packed"), (torch.bfloat16, "mkl_packed_f32"),
             (torch.bfloat16, "amx"), (torch.float32, "amx"), (torch.bfloat16, "dpbf16"), (torch.float32, "dpbf16")]
# only what this CPU runs (oneDNN bf16 needs AVX-512 or AVX-NE-CONVERT, amx AMX-BF16, dpbf16 AVX512-BF16); the
# rest is checked below
CASES = [(d, p) for d, p in ALL_CASES if _runs_here(p, d)]


def _one_family_per_dtype(dtype: torch.dtype, family: str) -> tuple:
    """By default gpt2 (Conv1D weights stored (K, N)) runs fp32 and llama ((N, K) weights) bf16; the other
    pairs are slow. Both layouts of every provider are also checked at the op: test_native_linear_*."""
    return () if (family == "gpt2") == (dtype == torch.float32) else (pytest.mark.slow,)


@pytest.mark.parametrize(("dtype", "provider"), ALL_CASES, ids=[f"{str(d)[6:]}-{p}" for d, p in ALL_CASES])
def test_provider_runs_exactly_where_the_cpu_has_its_kernels(dtype, provider):
    """A provider this CPU cannot run measures 0 GFLOP/s, so a measured choice never picks it; one it can
    run measures a rate. Which is which comes from ATen's own CPU check, not from measuring: oneDNN's
    bf16 kernels need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; amx (bf16 only) AMX-BF16 tiles and dpbf16
    (bf16 only) AVX512-BF16, as the CPU's flags list them; the fp32 providers and the fp32 MKL path of bf16
    run on every x86-64 CPU torch supports."""
    runs = _runs_here(provider, dtype)
    rate = measure(PROVIDERS[provider], GemmShape(32, 64, 64, str(dtype)[6:], "nk", 1), min_seconds=0,
                   max_calls=2)
    assert (rate > 0) == runs, f"{provider} {dtype}: {rate} GFLOP/s where ATen says supported={runs}"


@pytest.mark.parametrize(("dtype", "provider", "family"), [
    pytest.param(d, p, f, marks=_one_family_per_dtype(d, f), id=f"{str(d)[6:]}-{p}-{f}")
    for d, p in CASES for f in ("gpt2", "llama")])
def test_forced_provider_equals_eager(family, dtype, provider, tmp_path):
    # seq 8 after seq 16: the second variant reuses the operands packed for M = 32 at M = 16
    backend = _run(family, dtype, 2, GemmOptions(force=provider, cache_dir=str(tmp_path)), seqs=(16, 8))
    _check_forced(backend, provider)
    # every weight matmul got the provider, the LM head included: GPT-2's is tied to the vocabulary
    # table, whose lookup keeps its own plain rows while the LM head reads the packed ones
    per_layer = {"gpt2": 4, "llama": 7}[family]
    for rank in (0, 1):
        assert len({r["weight"] for r in backend.gemm_report() if r["rank"] == rank}) == 2 * per_layer + 1


# Under Inductor a provider runs inside the compiled segment (numatp::linear, called from its C++
# wrapper), as it does uncompiled in eager mode (test_forced_provider_equals_eager covers every provider
# there): one socket and two, fp32 and bf16, packed oneDNN and MKL operands
@pytest.mark.parametrize(("family", "dtype", "provider", "sockets"), [
    pytest.param("gpt2", torch.float32, "onednn_packed", 1, marks=pytest.mark.slow),
    ("llama", torch.bfloat16, "mkl_packed_f32", 2),
    pytest.param("gpt2", torch.bfloat16, "amx", 2, marks=pytest.mark.skipif(
        not _runs_here("amx", torch.bfloat16), reason="this CPU has no AMX-BF16 tiles")),
    pytest.param("gpt2", torch.bfloat16, "dpbf16", 2, marks=pytest.mark.skipif(
        not _runs_here("dpbf16", torch.bfloat16), reason="this CPU has no AVX512-BF16"))])
def test_forced_provider_under_inductor(family, dtype, provider, sockets, tmp_path):
    assert _measures_a_rate(provider, dtype), f"{provider} is expected to run {dtype} here"
    backend = _run(family, dtype, sockets, GemmOptions(force=provider, cache_dir=str(tmp_path)), mode="inductor")
    _check_forced(backend, provider)
    _check_no_cuts(backend, sockets)


def _ends_with_a_reduction(seg):
    body = [n for n in seg.gm.graph.nodes if n.op == "call_function"]
    return bool(body) and body[-1].target is operator.getitem and \
        body[-1].args[0].target is torch.ops.numatp.socket_all_reduce.default


def _check_no_cuts(backend, sockets):
    """Every weight matmul is a numatp::linear inside a segment: the programs are cut only at collectives
    and, with several sockets, after a reduction run inside a segment (a layer's end)."""
    weights = {rank: {r["weight"] for r in backend.gemm_report() if r["rank"] == rank} for rank in range(sockets)}
    for graph in backend.graphs:
        for variant in graph.variants.values():
            for prog in variant.executor.programs:
                assert all(isinstance(s, (Segment, Collective)) for s in prog.steps)
                calls = [n for s in prog.steps if isinstance(s, Segment) for n in s.gm.graph.nodes
                         if n.target is torch.ops.numatp.linear.default]
                assert len(calls) >= len(weights[prog.rank]) > 0
                segments = sum(isinstance(s, Segment) for s in prog.steps)
                collectives = sum(isinstance(s, Collective) for s in prog.steps)
                ends = sum(isinstance(s, Segment) and _ends_with_a_reduction(s) for s in prog.steps)
                assert segments <= collectives + ends + 1
                # with several sockets only the first reduction is a cut; the others run inside segments
                # (a layer's last ends one; in a decode step's program every fourth layer's)
                cuts = sum(isinstance(s, Collective) and s.kind == "all_reduce" for s in prog.steps)
                inside = sum(n.target is torch.ops.numatp.socket_all_reduce.default for s in prog.steps
                             if isinstance(s, Segment) for n in s.gm.graph.nodes)
                assert (cuts, inside > 0) == ((1, True) if sockets > 1 else (cuts, False))


def _assert_is_the_matmul(got, x, w_nk, bias, what):
    """``got`` is ``x @ w_nk^T (+ bias)`` within the rounding its dtype allows: every summation order of K
    products keeps within (K + 2) units of fp32 roundoff of the sum of their magnitudes; a bf16 result
    adds up to two roundings to bf16 (the product's, then the bias's: 2 x 2^-9 of it), so bf16 gets 2^-8
    of the magnitudes on top. A float64 matmul of the same inputs is the reference."""
    k = x.shape[1]
    exact = x.double() @ w_nk.double().t() + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w_nk.double().abs().t() + (0 if bias is None else bias.double().abs())
    unit = (k + 2) * 2.0 ** -24 + (2.0 ** -8 if got.dtype == torch.bfloat16 else 0.0)
    err = (got.double() - exact).abs()
    worst = (err / (unit * scale)).max().item()
    assert worst <= 1.0, f"{what}: max |diff| {err.max().item():.3g}, {worst:.2f}x the rounding bound"


def test_native_linear_takes_each_providers_operand():
    """numatp::linear (C++) on each provider's operand, as a program passes it (the GEMM pass's _prepare),
    and the provider's Python call both compute the matmul: each equals a float64 matmul of the same
    inputs within the rounding of its dtype, on both weight layouts, with and without bias."""
    from numatp.plan.gemm_pass import _prepare

    load_ops()
    g = torch.Generator().manual_seed(0)
    for dtype, provider in CASES + [(torch.float32, "gemv"), (torch.bfloat16, "gemv")]:
        for layout in ("nk", "kn"):
            x = torch.randn(5, 24, generator=g).to(dtype)
            w_nk = torch.randn(40, 24, generator=g).to(dtype)
            stored = w_nk if layout == "nk" else w_nk.t().contiguous()
            w = w_nk if layout == "nk" else stored.t()
            bias = torch.randn(40, generator=g).to(dtype)
            p = PROVIDERS[provider]
            op = p.prepare(w, 5)
            operand, _ = _prepare(p, stored, 5, layout)
            for b in (bias, None):
                what = f"{provider} {dtype} {layout} {'bias' if b is not None else 'no bias'}"
                python = p.call(x, op, b, 40, 24)
                native = torch.ops.numatp.linear(x, operand, b, gemm_mod.native_code(provider, layout), 40, 24)
                for name, got in (("numatp::linear", native), ("Python call", python)):
                    assert got.dtype == dtype and got.shape == (5, 40), f"{name} {what}"
                    _assert_is_the_matmul(got, x, w_nk, b, f"{name} {what}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_equals_a_float64_matmul_for_up_to_16_rows(dtype):
    """numatp's GEMV on both weight layouts, with and without bias, for row counts around its blocks of
    4 and passes of 8 (and so its 1-16 weight rows at once) and sizes around its vector widths (16 fp32
    lanes, 32 bf16 pairs, 64- and 512-column blocks)."""
    p = PROVIDERS["gemv"]
    g = torch.Generator().manual_seed(1)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16):
        for k, n in ((1, 1), (7, 3), (33, 70), (64, 600), (1000, 5), (130, 1100)):
            for layout in ("nk", "kn"):
                x = torch.randn(m, k, generator=g).to(dtype)
                w = torch.randn(n, k, generator=g).to(dtype) if layout == "nk" else \
                    torch.randn(k, n, generator=g).to(dtype).t()
                for b in (torch.randn(n, generator=g).to(dtype), None):
                    y = p.call(x, p.prepare(w, m), b, n, k)
                    want = x.double() @ w.double().t() + (0 if b is None else b.double())
                    # fp32 sums either way; bf16 adds one rounding of the result
                    tol = dict(rtol=1e-5, atol=1e-5 * k) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
                    assert y.dtype == dtype and y.shape == (m, n)
                    torch.testing.assert_close(y.double(), want, **tol, msg=f"m={m} k={k} n={n} {layout}")


def test_gemv_takes_at_most_16_rows():
    """Past 16 rows gemv refuses with the limit named (the C++ op) and measures 0 (so never chosen)."""
    load_ops()
    x, w = torch.randn(17, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="up to 16 rows"):
        torch.ops.numatp.linear(x, w, None, gemm_mod.native_code("gemv", "nk"), 4, 8)
    assert measure(PROVIDERS["gemv"], GemmShape(17, 8, 4, "float32", "nk", 1), min_seconds=0, max_calls=2) == 0
    assert measure(PROVIDERS["gemv"], GemmShape(16, 8, 4, "float32", "nk", 1), min_seconds=0, max_calls=2) > 0


_TILE_LAYOUT = [pytest.param("amx", marks=pytest.mark.skipif(not _runs_here("amx", torch.bfloat16),
                                                            reason="this CPU has no AMX-BF16 tiles")),
                pytest.param("dpbf16", marks=pytest.mark.skipif(not _runs_here("dpbf16", torch.bfloat16),
                                                               reason="this CPU has no AVX512-BF16"))]
_PACK_OP = {"amx": "amx_pack", "dpbf16": "dot_pack"}


@pytest.mark.parametrize("provider", _TILE_LAYOUT)
def test_tile_layout_providers_equal_a_float64_matmul_for_any_rows(provider):
    """numatp's AMX kernel and its AVX512-BF16 dot-product kernel on a weight packed into the tiles'
    layout, both layouts packed from the weight as stored, with and without bias: a decode step's 1-16
    rows (amx: one tile of x, four blocks of channels at once; dpbf16: 8, 4, 2 and 1 rows at a time), a
    prompt's rows past 16 (amx: tiles of 16 rows two at a time, the last one partly zero; dpbf16: 6 rows
    at a time, then the rest), and sizes around the layout (16 channels, 32 k values, groups of 64
    channels; the edges padded with zeros)."""
    p = PROVIDERS[provider]
    g = torch.Generator().manual_seed(2)
    for m in (1, 2, 3, 7, 8, 9, 15, 16, 17, 32, 33, 50):
        for k, n in ((1, 1), (31, 17), (32, 16), (33, 65), (100, 130), (64, 200)):
            for layout in ("nk", "kn"):
                x = torch.randn(m, k, generator=g).bfloat16()
                w = torch.randn(n, k, generator=g).bfloat16() if layout == "nk" else \
                    torch.randn(k, n, generator=g).bfloat16().t()
                op = p.prepare(w, m)
                assert op.dtype == torch.bfloat16 and op.dim() == 1
                for b in (torch.randn(n, generator=g).bfloat16(), None):
                    y = p.call(x, op, b, n, k)
                    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
                    _assert_is_the_matmul(y, x, w, b, f"{provider} m={m} k={k} n={n} {layout}")


@pytest.mark.parametrize("provider", _TILE_LAYOUT)
def test_tile_layout_providers_refuse_what_they_cannot_run(provider):
    """A float32 weight or x, a packed weight called for another shape and a buffer that is not a packed
    weight are refused with the rule named, not computed."""
    load_ops()
    code = gemm_mod.native_code(provider, "nk")
    pack = getattr(torch.ops.numatp, _PACK_OP[provider])
    with pytest.raises(RuntimeError, match="bfloat16"):
        pack(torch.randn(4, 8), -1)
    packed = pack(torch.randn(4, 8).bfloat16(), -1)
    with pytest.raises(RuntimeError, match=r"packed as \(N, K\) = \(4, 8\)"):
        torch.ops.numatp.linear(torch.randn(2, 16).bfloat16(), packed, None, code, 4, 16)
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        torch.ops.numatp.linear(torch.randn(2, 8), packed, None, code, 4, 8)
    with pytest.raises(RuntimeError, match="amx_pack or numatp::dot_pack"):
        torch.ops.numatp.linear(torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16(), None, code, 4, 8)


@pytest.mark.skipif(not _runs_here("amx", torch.bfloat16), reason="this CPU has no AMX-BF16 tiles")
def test_amx_and_onednn_take_turns_on_one_thread():
    """oneDNN's bf16 GEMM configures the same tiles (AMX) for its own kernels: calls of the two in turn on
    one thread, as a prompt on a oneDNN packed weight and decode steps on amx run, each stay exact."""
    load_ops()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 160, generator=g).bfloat16()
    dnn = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    amx = PROVIDERS["amx"].prepare(w, 4)
    for m in (64, 4, 64, 1, 33, 4):
        x = torch.randn(m, 160, generator=g).bfloat16()
        _assert_is_the_matmul(torch.ops.mkldnn._linear_pointwise(x, dnn, None, "none", [], ""), x, w, None,
                              f"onednn m={m}")
        _assert_is_the_matmul(PROVIDERS["amx"].call(x, amx, None, 96, 160), x, w, None, f"amx m={m}")


def test_amx_usable_agrees_with_the_cpu_flags():
    """Where the CPU lists AMX-BF16 the library has the kernel (it is built for this CPU) and Linux grants
    the tiles; elsewhere the provider fails to prepare with the way out named (and so measures 0). The
    same for dpbf16 and AVX512-BF16."""
    assert gemm_mod.amx_usable() == _runs_here("amx", torch.bfloat16)
    if not gemm_mod.amx_usable():
        with pytest.raises(RuntimeError, match="leave it out of GemmOptions.providers"):
            PROVIDERS["amx"].prepare(torch.randn(4, 8).bfloat16(), 1)
    assert gemm_mod.dot_usable() == _runs_here("dpbf16", torch.bfloat16)
    if not gemm_mod.dot_usable():
        with pytest.raises(RuntimeError, match="leave it out of GemmOptions.providers"):
            PROVIDERS["dpbf16"].prepare(torch.randn(4, 8).bfloat16(), 1)


def _check_forced(backend, provider):
    rows = backend.gemm_report()
    assert rows and {r["provider"] for r in rows} == {provider}
    assert backend.gemm.table.measured == 0  # forced: nothing measured
    if PROVIDERS[provider].packed:
        # every rewritten weight is held once, as its packed operand, however many input shapes the
        # model was compiled for
        report = backend.weights.report()
        assert report["packed_tensors"] == len({(r["rank"], r["weight"]) for r in rows})
        # MKL's packed weights are plain tensors, read page by page; oneDNN's are opaque
        assert report["opaque_tensors"] == (0 if PROVIDERS[provider].places else report["packed_tensors"])
        # no page under a negative errno (-ENOENT: never written): those are counted apart, not as a node
        assert all(node >= 0 for r in report["ranks"] for node in r["pages"])


def test_gemv_leaves_the_socket_workers_thread_count_alone():
    """A socket worker keeps its own thread count through gemv's first call on that thread, whatever count
    another thread set since (the first at::parallel_for of a library on a thread would reset it to that)."""
    from numatp.runtime import SocketGroup
    from numatp.runtime.group import callers_threads

    load_ops()
    x, w = torch.randn(2, 64), torch.randn(64, 256)   # (K, N): the band split and its sum of partials
    with callers_threads(), SocketGroup(Topology.virtual(sockets=1)) as group:
        group.run(lambda r: torch.set_num_threads(2))
        torch.set_num_threads(1)   # as generate does on the calling thread for its token loop
        got = group.run(lambda r: (torch.ops.numatp.linear(x, w, None, gemm_mod.native_code("gemv", "kn"), 256, 64),
                                   torch.get_num_threads()))
    y, threads = got[0]
    assert threads == 2
    torch.testing.assert_close(y, x @ w)


@pytest.mark.parametrize(("dtype", "family"), [
    pytest.param(d, f, marks=_one_family_per_dtype(d, f), id=f"{str(d)[6:]}-{f}")
    for d in (torch.float32, torch.bfloat16) for f in ("gpt2", "llama")])
def test_forced_gemv_runs_the_matmuls_of_few_rows_and_leaves_more_to_aten(family, dtype, tmp_path):
    # batch 2: 4 tokens are 8 rows (gemv, on GPT-2's (K, N) and Llama's (N, K) weights as stored), 16
    # tokens 32 rows (past gemv's 16: ATen, on the same plain weights)
    backend = _run(family, dtype, 2, GemmOptions(force="gemv", cache_dir=str(tmp_path)), seqs=(4, 16))
    rows = backend.gemm_report()
    assert {r["provider"] for r in rows if r["m"] <= 16} == {"gemv"}
    assert {r["provider"] for r in rows if r["m"] > 16} == {"aten"}
    assert backend.weights.report()["packed_tensors"] == 0


@pytest.mark.slow
def test_forced_gemv_under_inductor(tmp_path):
    backend = _run("gpt2", torch.bfloat16, 2, GemmOptions(force="gemv", cache_dir=str(tmp_path)), seqs=(4,),
                   mode="inductor")
    _check_forced(backend, "gemv")
    _check_no_cuts(backend, 2)


@pytest.mark.slow
def test_generation_chooses_each_weights_providers_for_the_prompt_and_the_decode_steps(tmp_path):
    """With the decode steps to come in view, a weight whose prompt runs fastest packed but whose decode
    steps run fastest on gemv keeps its plain weight (ATen for the prompt, gemv for the steps) when the
    steps outweigh the prompt, and is packed for both when they do not; with GemmOptions(first_token=True)
    the prompt chooses alone; with room for second copies (GemmOptions.decode_copies) it gets both, the
    packed copy for the prompt and the plain weight for the steps; every way, tokens equal eager."""
    from numatp.runtime.gemm import GemmTable

    model = zoo.build("gpt2", tiny=True)
    ids = torch.randint(5, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    opts = GemmOptions(providers=("onednn_packed", "gemv"), cache_dir=str(tmp_path), decode_copies=0.0)

    def generate(new_tokens, options=opts):
        torch._dynamo.reset()
        fast = numatp.compile(model, sockets=Topology.virtual(sockets=2), gemm=options, mode="eager")
        got = fast.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        want = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want)
        _KEPT.append(fast)
        return backend_of(fast)

    generate(4)   # measures every shape of the prompt (32 rows) and of a decode step (1 row)
    keys = [GemmShape.from_key(k) for k in GemmTable(tmp_path).entries]
    assert {s.m for s in keys} == {1, 32}
    # rates that make the prompt 2x faster packed and a decode step 10x faster on gemv
    GemmTable(tmp_path).put({s: {"aten": 1.0, "onednn_packed": 2.0, "gemv": 0.0} if s.m > 1 else
                             {"aten": 1.0, "onednn_packed": 1.0, "gemv": 10.0} for s in keys})
    # time in GFLOP / rate: the prompt's 32 rows cost 32 decode rows; packed saves 16 of them, gemv 0.9
    # per step: 63 steps want gemv, 3 want packing
    many = generate(64)
    rows = many.gemm_report()
    assert many.gemm.table.measured == 0
    assert {r["provider"] for r in rows if r["m"] > 1} == {"aten"}
    assert {r["provider"] for r in rows if r["m"] == 1} == {"gemv"}
    assert many.weights.report()["packed_tensors"] == 0
    few = generate(4)
    rows = few.gemm_report()
    assert {r["provider"] for r in rows if r["m"] > 1} == {"onednn_packed"}
    # the decode step reads the packed operands; the LM head has one row in the prompt too (its last
    # position): gemv for both
    assert {r["provider"] for r in rows if r["m"] == 1} == {"onednn_packed", "gemv"}
    # GemmOptions(first_token=True): the prompt's own choice, whatever the steps
    first = generate(64, replace(opts, first_token=True))
    assert {r["provider"] for r in first.gemm_report() if r["m"] > 1} == {"onednn_packed"}
    # room for second copies: packed for the prompt and gemv on the plain weight for the steps, both
    # ways (a copy saves the margin over one operand for 3 steps too)
    for new_tokens in (64, 4):
        both = generate(new_tokens, replace(opts, decode_copies=0.25))
        rows = both.gemm_report()
        prompt = {(r["rank"], r["weight"]) for r in rows if r["m"] > 1 and r["provider"] == "onednn_packed"}
        assert prompt and {r["provider"] for r in rows if r["m"] > 1} == {"onednn_packed"}
        assert {r["provider"] for r in rows if r["m"] == 1} == {"gemv"}
        # each packed prompt operand keeps the plain weight it was made from, which the decode step reads
        decode = [v for g in both.graphs for v in g.variants.values() if v.executor.reads and any(v.executor.reads)]
        assert len(decode) == 1
        for r, reads in enumerate(decode[0].executor.reads):
            for i, plain in reads.items():
                assert both.weights.prepared(plain) is None and decode[0].weights[r][i] is plain
        made = [both.weights.prepared(t) for t in both.weights._made.values()]
        kept = [info.plain for info in made if info is not None]
        assert len(kept) == len(prompt) and all(k is not None for k in kept)
        assert {id(p) for reads in decode[0].executor.reads for p in reads.values()} <= {id(k) for k in kept}
        report = both.weights.report()   # the kept weights' pages are the socket's too
        assert report["packed_tensors"] == len(prompt) and all(r["pages"] for r in report["ranks"])


@pytest.mark.slow
def test_decode_after_a_forward_compiled_alone_reads_the_weight_made_again_for_gemv(tmp_path):
    """A forward called before generate compiles its prompt without the decode steps in view and packs the
    weights; the decode programs then find gemv on the plain weight measured faster than the packed
    operand, and with room for second copies the store makes each plain shard again beside its packed
    operand (equal to the first, kept for the later steps); tokens equal eager. Without room the steps
    read the packed operands."""
    from numatp.runtime.gemm import GemmTable

    model = zoo.build("gpt2", tiny=True)
    ids = torch.randint(5, 100, (1, 32), generator=torch.Generator().manual_seed(0))
    opts = GemmOptions(providers=("onednn_packed", "gemv"), cache_dir=str(tmp_path))

    def forward_then_generate(options):
        torch._dynamo.reset()
        fast = numatp.compile(model, sockets=Topology.virtual(sockets=2), gemm=options, mode="eager")
        with torch.no_grad():
            fast(ids)
        got = fast.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        want = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want)
        _KEPT.append(fast)
        return backend_of(fast)

    forward_then_generate(opts)   # measures the prompt's shapes (32 rows) and a decode step's (1 row)
    keys = [GemmShape.from_key(k) for k in GemmTable(tmp_path).entries]
    assert {s.m for s in keys} == {1, 32}
    GemmTable(tmp_path).put({s: {"aten": 1.0, "onednn_packed": 2.0, "gemv": 0.0} if s.m > 1 else
                             {"aten": 1.0, "onednn_packed": 1.0, "gemv": 10.0} for s in keys})
    b = forward_then_generate(opts)
    rows = b.gemm_report()
    assert {r["provider"] for r in rows if r["m"] > 1} == {"onednn_packed"}
    assert {r["provider"] for r in rows if r["m"] == 1} == {"gemv"}
    made = {id(t): b.weights.prepared(t) for t in b.weights._made.values()}
    packed = [info for info in made.values() if info is not None]
    assert packed and all(info.plain is not None and info.later == "gemv" for info in packed)
    for key, t in b.weights._made.items():   # each shard made again equals the one the prompt packed
        info = b.weights.prepared(t)
        if info is not None:
            param, placement = b.weights._origin[key]
            assert torch.equal(info.plain, numatp.plan.reference.shard_tensor(param, placement, key[-1]))
    steps = [v for g in b.graphs for v in g.variants.values() if v.executor.reads and any(v.executor.reads)]
    assert steps and all(b.weights.prepared(p) is None for v in steps for reads in v.executor.reads
                         for p in reads.values())
    assert b.weights.report()["packed_tensors"] == len(packed)
    # no room for a second copy: the steps read the packed operands
    none = forward_then_generate(replace(opts, decode_copies=0.0))
    assert {r["provider"] for r in none.gemm_report() if r["m"] == 1} == {"onednn_packed"}
    assert all(info.plain is None for t in none.weights._made.values()
               if (info := none.weights.prepared(t)) is not None)


def test_options_refuse_unknown_providers_and_shares_past_the_memory():
    with pytest.raises(ValueError, match=r"unknown GEMM provider\(s\) \['blas9'\]; choose from"):
        GemmOptions(providers=("aten", "blas9"))
    with pytest.raises(ValueError, match=r"decode_copies=1.5 is a share of the available memory, from 0"):
        GemmOptions(decode_copies=1.5)


def test_cache_written_then_reused(tmp_path):
    opts = GemmOptions(providers=("aten", "mkl_packed"), cache_dir=str(tmp_path))
    first = _run("gpt2", torch.float32, 2, opts)
    assert first.gemm.table.measured > 0
    path = first.gemm.table.path
    assert path.parent == tmp_path and path.name.startswith("gemm-")
    rates = json.loads(path.read_text())["rates"]
    assert all(set(r) >= {"aten", "mkl_packed"} for r in rates.values())
    torch._dynamo.reset()
    second = _run("gpt2", torch.float32, 2, opts)
    assert second.gemm.table.measured == 0
    assert [r["provider"] for r in second.gemm_report()] == [r["provider"] for r in first.gemm_report()]


def test_choice_is_keyed_by_threads(tmp_path):
    opts = GemmOptions(providers=("aten", "onednn"), cache_dir=str(tmp_path))
    two = _run("gpt2", torch.float32, 2, opts)          # one CPU (thread) per socket
    threads = {r["threads"] for r in two.gemm_report()}
    torch._dynamo.reset()
    one = _run("gpt2", torch.float32, 1, opts)          # every CPU on one socket
    if {r["threads"] for r in one.gemm_report()} == threads:
        pytest.skip("this machine has one usable CPU: both topologies run one thread")
    assert one.gemm.table.measured > 0
    keys = json.loads(one.gemm.table.path.read_text())["rates"]
    assert {GemmShape.from_key(k).threads for k in keys} == threads | {r["threads"] for r in one.gemm_report()}


def test_table_is_per_cpu(tmp_path):
    shape = GemmShape(4, 8, 8, "float32", "nk", 1)
    GemmTable(tmp_path).put({shape: {"aten": 1.0}})
    assert GemmTable(tmp_path).get(shape) == {"aten": 1.0}
    assert GemmTable(tmp_path, signature="another-cpu").get(shape) is None
    assert GemmTable(tmp_path).signature == MachineFacts.detect().cpu_signature


def test_cache_folder_is_numatp_cache_dir_where_set(tmp_path, monkeypatch):
    from numatp._cache import cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "numatp"
    monkeypatch.setenv("NUMATP_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    assert GemmTable().path.parent == tmp_path / "mine"


def test_ceilings_best_rate_per_provider(tmp_path):
    t = GemmTable(tmp_path)
    t.put({GemmShape(4, 8, 8, "float32", "nk", 1): {"aten": 3.0, "onednn": 5.0},
           GemmShape(8, 8, 8, "float32", "kn", 2): {"aten": 7.0, "onednn": 4.0},
           GemmShape(8, 8, 8, "bfloat16", "kn", 2): {"aten": 1.0},
           GemmShape(8, 8, 8, "float32", "nk", 2, 16): {"aten": 99.0}})   # timed into a gather: not a ceiling
    assert ceilings("float32", cache_dir=tmp_path) == {"aten": 7.0, "onednn": 5.0}
    assert ceilings(torch.float32, cache_dir=tmp_path, threads=1) == {"aten": 3.0, "onednn": 5.0}
    assert ceilings("bfloat16", cache_dir=tmp_path) == {"aten": 1.0}


def test_aten_winner_leaves_graph_unchanged(tmp_path):
    backend = _run("gpt2", torch.float32, 2, GemmOptions(force="aten", cache_dir=str(tmp_path)))
    assert {r["provider"] for r in backend.gemm_report()} == {"aten"}
    assert backend.weights.report()["packed_tensors"] == 0
    assert not GemmTable(tmp_path).entries   # read after the run: forced, nothing was measured or written


def test_gemm_off_by_option(tmp_path):
    backend = _run("gpt2", torch.float32, 1, False)
    assert backend.gemm is None


def test_preview_chooses_like_apply_without_touching_the_programs(tmp_path):
    from numatp.plan import capture, plan_graph
    from numatp.plan.localize import localize
    from numatp.plan.reference import bind_inputs
    from numatp.runtime import SocketGroup
    from numatp.plan.gemm_pass import GemmSelector

    model = zoo.build("gpt2", tiny=True)
    ((ag, inputs),) = capture(model, **zoo.example_inputs(model, batch=1, seq=16))
    plan = plan_graph(ag, 2)
    programs = [localize(ag, plan, r) for r in range(2)]
    args = [bind_inputs(p.bindings, inputs, p.rank) for p in programs]
    weights = [p.weight_indices for p in programs]
    before = [p.gm.code for p in programs]
    selector = GemmSelector(GemmOptions(force="mkl_packed", cache_dir=str(tmp_path)))
    with SocketGroup(Topology.virtual(sockets=2)) as group:
        rows = selector.preview(group, [p.gm for p in programs], args, weights)
        assert rows and {r["provider"] for r in rows} == {"mkl_packed"}
        assert [p.gm.code for p in programs] == before      # nothing rewritten
        assert all(selector.stand_in(a) is a for r in args for a in r)  # nothing packed
        _, new_args, swaps, reads = selector.apply(group, [p.gm for p in programs], args, weights)
    # each packed operand is recorded as what it stands for (its plain weight's shape), not marked itself
    for r, rank_swaps in enumerate(swaps):
        for plain, op in rank_swaps.values():
            assert selector.stand_in(op).shape == plain.shape and not hasattr(op, "_numatp_gemm")
    assert [(r["rank"], r["weight"], r["provider"]) for r in selector.report()] == \
        [(r["rank"], r["weight"], r["provider"]) for r in rows]
    assert sum(len(s) for s in swaps) == len(rows) and not any(reads)   # nothing read in place of a copy


def test_shape_key_round_trip():
    for shape in (GemmShape(512, 768, 2304, "bfloat16", "kn", 8), GemmShape(512, 768, 2304, "float32", "nk", 1, 4608),
                  GemmShape(1, 768, 2304, "float32", "nk", 1, 4608, True), GemmShape(2, 768, 2304, "float32", "nk", 1,
                                                                                   stream=True)):
        assert GemmShape.from_key(shape.key) == shape


def test_a_few_row_matmul_streams_its_weight_only_in_a_program_past_the_cache():
    """A decode step's matmul is timed on a ring of weight copies (its weight comes from memory) only where
    the program's weights outgrow a quarter of the last-level cache; a tiny model's stays in cache, as in
    its real decode steps, and is timed on one weight."""
    from numatp.plan.gemm_pass import _find_sites
    from numatp.runtime.gemm import streamed_copies, streams

    llc = 32 << 20
    assert streams(1, llc, llc) and streams(16, llc, llc) and not streams(17, llc, llc)
    assert not streams(1, llc // 8, llc)
    big = MachineFacts(llc_bytes=llc, memory_available=64 << 30, cpu_signature="test")
    shape = GemmShape(1, 1024, 1024, "float32", "nk", 1, stream=True)   # a 4 MiB weight
    assert streamed_copies(replace(shape, stream=False), big) == 1
    assert streamed_copies(shape, big) == 2 * llc // (4 << 20)
    little = replace(big, memory_available=32 * (8 << 20))   # little memory: 8 MiB a ring
    assert streamed_copies(shape, little) == 2
    # a tiny gpt2's decode-sized program: no site streams; with the cache said to be 1 KiB, every one does
    from numatp.plan import capture, plan_graph
    from numatp.plan.localize import localize
    from numatp.plan.reference import bind_inputs

    model = zoo.build("gpt2", tiny=True)
    ((ag, inputs),) = capture(model, **zoo.example_inputs(model, batch=1, seq=4))
    prog = localize(ag, plan_graph(ag, 1), 0)
    args = bind_inputs(prog.bindings, inputs, 0)
    found = _find_sites(prog.gm, args, prog.weight_indices, 1, llc_bytes=llc)
    assert found and not any(s.shape.stream for ss in found.values() for s in ss)
    found = _find_sites(prog.gm, args, prog.weight_indices, 1, llc_bytes=1024)   # a cache of 1 KiB
    assert all(s.shape.stream for ss in found.values() for s in ss)


def test_a_gathered_lm_head_is_measured_into_the_full_logits_and_runs_in_place_where_aten_wins(tmp_path):
    """On 2 sockets gpt2's LM head (tied, column-parallel) is timed writing its columns of the full logits:
    ATen in place against each provider plus its copy. Where ATen wins, the gather runs the matmul in
    place; where another provider wins, it copies that provider's output. Both equal eager."""
    opts = GemmOptions(providers=("aten", "onednn"), cache_dir=str(tmp_path))
    first = _run("gpt2", torch.float32, 2, opts)
    into = [GemmShape.from_key(k) for k in GemmTable(tmp_path).entries if GemmShape.from_key(k).into]
    vocab = zoo.build("gpt2", tiny=True).config.vocab_size
    assert {s.into for s in into} == {vocab} and sorted(s.n for s in into) == sorted(
        {r["n"] for r in first.gemm_report() if r["n"] in (vocab // 2, vocab - vocab // 2)})
    for winner, in_place in (("aten", True), ("onednn", False)):
        GemmTable(tmp_path).put({s: {"aten": 1.0, "onednn": 1.0, winner: 1000.0} for s in into})
        torch._dynamo.reset()
        backend = _run("gpt2", torch.float32, 2, opts)
        assert backend.gemm.table.measured == 0
        assert [s.matmul is not None for s in all_gathers(backend)] == [in_place] * 2
    torch._dynamo.reset()
    one = _run("gpt2", torch.float32, 1, GemmOptions(providers=("aten", "onednn"), cache_dir=str(tmp_path / "one")))
    assert not any(GemmShape.from_key(k).into for k in GemmTable(tmp_path / "one").entries)   # no gather
    assert not all_gathers(one)


@pytest.mark.parametrize("bias", [False, True])
def test_mkl_packed_writes_its_columns_of_a_wider_tensor_in_place(bias):
    """numatp's MKL packing is a plain float32 tensor (placeable, its pages readable) and its GEMM writes an
    (M, N) block of a wider tensor itself: the block equals x @ W^T (+ b), every other column is untouched."""
    from numatp.runtime.gemm import NATIVE

    m, n, k = 24, 96, 64
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    b = b if bias else None
    op = PROVIDERS["mkl_packed"].prepare(w, m)
    assert op.layout == torch.strided and op.dtype == torch.float32 and op.dim() == 1
    expected = x @ w.t() + (b if bias else 0)
    torch.testing.assert_close(PROVIDERS["mkl_packed"].call(x, op, b, n, k), expected, rtol=1e-5, atol=1e-4)
    full = torch.full((m, n + 50), -3.0)
    torch.ops.numatp.linear_into(x, op, b, NATIVE["mkl_packed"], n, k, full[:, 30:30 + n])
    torch.testing.assert_close(full[:, 30:30 + n], expected, rtol=1e-5, atol=1e-4)
    assert (full[:, :30] == -3.0).all() and (full[:, 30 + n:] == -3.0).all()
    # another provider's output is copied into the block, with the same result
    full2 = torch.full((m, n + 50), -3.0)
    onednn = PROVIDERS["onednn"].prepare(w, m)
    torch.ops.numatp.linear_into(x, onednn, b, NATIVE["onednn"], n, k, full2[:, 30:30 + n])
    torch.testing.assert_close(full2, full, rtol=1e-5, atol=1e-4)


def test_mkl_packed_serves_other_rows_and_refuses_another_shape_or_a_bad_output():
    from numatp.runtime.gemm import NATIVE

    w = torch.randn(40, 16)
    op = PROVIDERS["mkl_packed"].prepare(w, 8)
    for rows in (1, 5, 33):   # packed for 8 rows, as a variant of another sequence length reuses it
        x = torch.randn(rows, 16)
        torch.testing.assert_close(PROVIDERS["mkl_packed"].call(x, op, None, 40, 16), x @ w.t(), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match=r"packed as \(N, K\) = \(40, 16\)"):
        PROVIDERS["mkl_packed"].call(torch.randn(8, 16), op, None, 41, 16)
    # one row: its row stride is any number (a size-1 dimension's), MKL is given at least N
    x1, y1 = torch.randn(1, 16), torch.empty(40, 1).t()   # (1, 40), row stride 1
    torch.ops.numatp.linear_into(x1, op, None, NATIVE["mkl_packed"], 40, 16, y1)
    torch.testing.assert_close(y1, x1 @ w.t(), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="unit column stride"):
        torch.ops.numatp.linear_into(torch.randn(8, 16), op, None, NATIVE["mkl_packed"], 40, 16,
                                     torch.empty(40, 8).t())


def test_measure_all_times_every_provider_in_rounds():
    from numatp.runtime.gemm import measure_all

    shape = GemmShape(64, 128, 96, "float32", "nk", 1)
    rates = measure_all(PROVIDERS, shape, min_seconds=0.01, max_calls=3)
    assert set(rates) == set(PROVIDERS)
    assert rates["mkl_packed_f32"] == 0.0                  # a bf16-only provider cannot run fp32
    assert all(rates[p] > 0 for p in ("aten", "onednn", "onednn_packed", "mkl_packed"))
    # written into a wider tensor (a gathered LM head): ATen and MKL's packed GEMM in place, the others by
    # a copy
    into = measure_all(PROVIDERS, GemmShape(64, 128, 96, "float32", "nk", 1, 200), min_seconds=0.01, max_calls=3)
    assert all(into[p] > 0 for p in ("aten", "onednn", "onednn_packed", "mkl_packed"))


def test_measure_all_times_each_provider_by_its_own_calls_in_rounds():
    from numatp.runtime.gemm import Provider, measure_all

    calls = []

    def provider(name, pause):
        def call(x, op, bias, n, k):
            calls.append(name)
            time.sleep(pause)
            return x.new_zeros(x.shape[0], n)
        return Provider(name, (torch.float32,), False, lambda w, m: w, call)

    shape = GemmShape(4, 8, 8, "float32", "nk", 1)
    rates = measure_all({"slow": provider("slow", 0.02), "fast": provider("fast", 0.0)}, shape,
                        min_seconds=10.0, max_calls=4)   # 4 calls each, the cap
    assert calls == ["slow", "fast"] * 5          # one warm-up call each, then 4 rounds of one call each
    assert 0 < rates["slow"] <= shape.flops / 0.02 / 1e9   # its calls sleep 20 ms: no faster than that
    assert rates["fast"] > 5 * rates["slow"]      # each rate is its own calls' time, not the round's


def test_a_streamed_rate_is_the_mean_over_the_rings_copies():
    """A program reads one prepared copy, fast or slow as its allocation fell: a streamed shape's rate is
    the expected time over the ring's copies, so a provider with one slow copy in four loses to a steady
    one whose every call is slower than its fast copies' (the median call would pick it)."""
    from numatp.runtime.gemm import Provider, measure_all

    # a 256-byte weight and a 512-byte cache: a ring of 4 copies passes twice the cache
    facts = MachineFacts(llc_bytes=512, memory_available=1 << 30, cpu_signature="test")

    def provider(name, pauses):
        made = []

        def prepare(w, m):
            made.append(pauses[len(made) % len(pauses)])
            return (w, made[-1])

        def call(x, op, bias, n, k):
            time.sleep(op[1])
            return x.new_zeros(x.shape[0], n)
        return Provider(name, (torch.float32,), False, prepare, call)

    shape = GemmShape(1, 8, 8, "float32", "nk", 1, 0, True)
    rates = measure_all({"lucky": provider("lucky", (0.04, 0.001, 0.001, 0.001)),
                         "steady": provider("steady", (0.005,))}, shape, min_seconds=100.0, max_calls=8,
                        facts=facts)
    # lucky: 3 of its 4 copies take 1 ms a call, one 40 ms: 10.75 ms expected; steady: 5 ms
    assert shape.flops / 0.02 / 1e9 < rates["lucky"] < shape.flops / 0.0105 / 1e9
    assert rates["steady"] > 1.5 * rates["lucky"]


def _poisoned_table(tmp_path):
    """A table whose every gpt2-tiny rate says onednn is 1000x faster than aten (no CPU does that)."""
    first = _run("gpt2", torch.float32, 2, GemmOptions(providers=("aten", "onednn"), cache_dir=str(tmp_path)))
    table = GemmTable(tmp_path)
    shapes = [GemmShape.from_key(k) for k in table.entries]
    table.put({s: {"aten": 1.0, "onednn": 1000.0} for s in shapes})
    torch._dynamo.reset()
    return first, shapes


def test_remeasure_option_replaces_rates_from_the_table(tmp_path):
    _, shapes = _poisoned_table(tmp_path)
    trusted = _run("gpt2", torch.float32, 2, GemmOptions(providers=("aten", "onednn"), cache_dir=str(tmp_path)))
    assert trusted.gemm.table.measured == 0
    assert {r["provider"] for r in trusted.gemm_report()} == {"onednn"}   # what the table says
    torch._dynamo.reset()
    again = _run("gpt2", torch.float32, 2,
                 GemmOptions(providers=("aten", "onednn"), cache_dir=str(tmp_path), remeasure=True))
    assert again.gemm.table.measured == len(shapes)
    fresh = GemmTable(tmp_path)
    for s in shapes:
        rates = fresh.get(s)
        assert rates["aten"] > 1.0 and rates["onednn"] < 1000.0, (s, rates)
        assert rates["onednn"] / rates["aten"] < 100


@pytest.mark.slow
def test_calibrate_remeasure_gemm_retimes_the_table(tmp_path):
    import os
    import subprocess
    import sys

    cpus = len(os.sched_getaffinity(0))
    small = GemmShape(32, 64, 64, "float32", "nk", 1)
    too_wide = GemmShape(32, 64, 64, "float32", "nk", cpus + 1)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    table_dir = tmp_path / "numatp"
    GemmTable(table_dir).put({small: {"aten": 1e6, "onednn": 1e6}, too_wide: {"aten": 5.0}})
    proc = subprocess.run([sys.executable, "-m", "numatp", "calibrate", "--remeasure-gemm"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "re-timed 1 GEMM shapes" in proc.stdout and "skipped 1 shapes" in proc.stdout
    assert "GEMM 1/1: float32 32 x 64 x 64" in proc.stderr
    rates = GemmTable(table_dir).get(small)
    assert set(rates) == {"aten", "onednn"} and 0 < rates["aten"] < 1e6 and 0 < rates["onednn"] < 1e6
    assert GemmTable(table_dir).get(too_wide) == {"aten": 5.0}


# bf16 template kernels: test_inductor_template_compiles_each_weight_for_itself (one compile per weight)
@pytest.mark.slow
@pytest.mark.parametrize(("family", "dtype", "sockets"), [("gpt2", torch.float32, 2)])
def test_inductor_template_provider_equals_eager(family, dtype, sockets, tmp_path):
    # Inductor's C++ GEMM template as a provider: one compile per weight, then any M (seq 16, then 8)
    from torch._dynamo.utils import counters

    counters.clear()
    backend = _run(family, dtype, sockets, GemmOptions(force="inductor_cpp", cache_dir=str(tmp_path)), seqs=(16, 8))
    _check_forced(backend, "inductor_cpp")
    # the template really generated the kernels (Inductor counts each templated kernel it emits)
    # (one per weight: the second input shape reuses the kernels compiled for the first)
    weights = {(r["rank"], r["weight"]) for r in backend.gemm_report()}
    assert counters["inductor"]["cpp_templated_kernel_counter"] >= len(weights)


def test_inductor_template_keeps_no_plain_weight():
    import gc
    import weakref

    w = torch.randn(48, 32)
    gone = weakref.ref(w)
    op = PROVIDERS["inductor_cpp"].prepare(w, 16)
    x, b = torch.randn(5, 32), torch.randn(48)
    expected = torch.addmm(b, x, w.t())
    del w
    gc.collect()
    assert gone() is None   # the compiled kernel holds its own packed copy, not the weight given
    torch.testing.assert_close(PROVIDERS["inductor_cpp"].call(x, op, b, 48, 32), expected)


@pytest.mark.slow
def test_inductor_template_is_measured_only_when_asked(tmp_path):
    assert "inductor_cpp" not in GemmOptions().providers
    opts = GemmOptions(providers=("aten", "inductor_cpp"), cache_dir=str(tmp_path))
    backend = _run("gpt2", torch.float32, 1, opts)
    rows = backend.gemm_report()
    assert rows and all(r["rates"]["inductor_cpp"] > 0 and r["rates"]["aten"] > 0 for r in rows)
    for r in rows:
        best = max(r["rates"], key=r["rates"].get)
        assert r["provider"] in ("aten", best)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_inductor_template_compiles_each_weight_for_itself(dtype):
    # two weights of one shape: each kernel computes with its own weight (no kernel comes back from a
    # cache with another weight's values), at M it was not traced for
    ops, weights = [], [torch.randn(96, 64).to(dtype) for _ in range(2)]
    for w in weights:
        ops.append(PROVIDERS["inductor_cpp"].prepare(w, 32))
    x = torch.randn(5, 64).to(dtype)
    for w, op in zip(weights, ops):
        torch.testing.assert_close(PROVIDERS["inductor_cpp"].call(x, op, None, 96, 64), torch.mm(x, w.t()))
