"""numatp.quant.torchao: torchao's weight-only tensors read as numatp's int8/int4 values, exactly.

Reference for each tensor: torchao's own ``weight.dequantize()`` (Int8Tensor, IntxUnpackedToInt8Tensor;
bit-exact); for the CPU int4 tensor (no ``dequantize``) the weight ATen's ``_weight_int4pack_mm_for_cpu``
kernel multiplies by, read out of the kernel by multiplying the identity (bit-exact: one nonzero term per
output).

Forward comparisons, torchao's eager model against the ``dequantized`` plain one, use the dtype
tolerances of tests/helpers.py. Why they are not exact: torchao's int8 eager path is
``mm(x, q.to(dtype)) * scale.to(dtype)`` (the scale is rounded to bf16 and applied after the matmul) and
its int4 kernel multiplies by the float32 dequantized weight, while the plain model multiplies by the
weight rounded once to the model dtype. fp32: summation order and FMA only (measured ~1e-7 absolute);
bf16: a bf16 rounding of the weight or scale and one more of the output (a few bf16 ulps per layer).
torchao's intx linear is ``F.linear`` on its own ``dequantize()``: there the forward is compared exactly.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from numatp.quant.torchao import (_LAYOUTS, TorchaoFormatError, _cpu_pack_layout, _unpack_cpu_int4, dequantized,
                                  extract)
from tests.helpers import assert_close_to_eager

pytestmark = pytest.mark.integration

DTYPES = [torch.float32, torch.bfloat16]


def _configs() -> dict:
    """The supported configs by name (set_inductor_config=False: quantize_ would otherwise turn on
    Inductor's coordinate-descent tuning for the rest of the process)."""
    tq = pytest.importorskip("torchao.quantization")
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from torchao.quantization.granularity import PerGroup, PerTensor

    return {
        "int8": tq.Int8WeightOnlyConfig(set_inductor_config=False),
        "int8-per-tensor": tq.Int8WeightOnlyConfig(granularity=PerTensor(), set_inductor_config=False),
        **{f"int4:g{g}": PrototypeInt4WeightOnlyConfig(group_size=g, set_inductor_config=False) for g in (32, 64, 128)},
        "int4-hqq:g64": PrototypeInt4WeightOnlyConfig(group_size=64, int4_choose_qparams_algorithm="hqq",
                                                      set_inductor_config=False),
        "int8-intx": tq.IntxWeightOnlyConfig(),
        "int4-intx:g32": tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
    }


def _mlp(dtype: torch.dtype) -> torch.nn.Sequential:
    torch.manual_seed(0)
    # 160 output rows: two full AVX512 blocks of 64 and a tail of 32 (AVX2: five blocks of 32); inputs of 256,
    # 160 and 96: groups 64 and 128 leave the weights they do not divide in float (torchao skips them)
    return torch.nn.Sequential(torch.nn.Linear(256, 160), torch.nn.GELU(), torch.nn.Linear(160, 96, bias=False),
                               torch.nn.GELU(), torch.nn.Linear(96, 48)).to(dtype).eval()


def _reference(weight: torch.Tensor) -> torch.Tensor:
    """What torchao's eager forward multiplies by, in the weight's dtype."""
    if type(weight).__name__ != "Int4OpaqueTensor":
        return weight.dequantize()
    eye = torch.eye(weight.shape[1], dtype=weight.dtype)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, weight.qdata, weight.block_size[1],
                                                       weight.scale_and_zero).t()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", ["int8", "int8-per-tensor", "int4:g32", "int4:g64", "int4:g128", "int4-hqq:g64",
                                    "int8-intx", "int4-intx:g32"])
def test_extract_is_exact_and_dequantized_matches_eager(config, dtype):
    from torchao.quantization import quantize_

    model = _mlp(dtype)
    quantize_(model, _configs()[config])
    x = torch.randn(3, 5, 256, dtype=dtype)
    with torch.inference_mode():
        eager = model(x)
    params = dict(model.named_parameters())
    group = int(config.split(":g")[1]) if config.startswith("int4") else None
    source = {"int8": "Int8Tensor", "int4": "Int4OpaqueTensor"}[config[:4]] if "intx" not in config else (
        "IntxUnpackedToInt8Tensor")
    # int4 skips a weight whose K is not a multiple of the group (96 for groups 64 and 128): it stays float
    expected = {n for n in ("0.weight", "2.weight", "4.weight") if group is None or params[n].shape[1] % group == 0}

    weights = extract(model)
    assert set(weights) == expected
    for name, w in weights.items():
        n, k = params[name].shape
        assert (w.kind, w.group, w.dtype, w.source) == (config[:4], group, dtype, source)
        assert w.q.shape == (n, k)
        if w.kind == "int8":
            assert w.q.dtype == torch.int8 and w.zeros is None
            assert w.scales.shape == (n,) and w.scales.dtype == torch.float32
            if config == "int8-per-tensor":
                assert bool((w.scales == w.scales[0]).all())
        else:
            assert w.q.dtype == torch.uint8 and int(w.q.min()) >= 0 and int(w.q.max()) <= 15
            assert w.scales.shape == (n, k // group) and w.scales.dtype == dtype
            if "intx" in config:   # symmetric: no zero points
                assert w.zeros is None
            else:   # tinygemm's float zero points
                assert w.zeros.shape == (n, k // group) and w.zeros.dtype == dtype
            assert len(w.q.unique()) > 8   # the values were unpacked, not a constant
        assert torch.equal(w.dequantize(), _reference(params[name])), name

    assert dequantized(model).keys() == weights.keys()
    for name in weights:
        p = dict(model.named_parameters())[name]
        assert type(p) is torch.nn.Parameter and not p.requires_grad and p.dtype == dtype
        assert torch.equal(p, weights[name].dequantize())
        assert "weight=" not in model.get_submodule(name[:-len(".weight")]).extra_repr()   # torchao's went too
    with torch.inference_mode():
        plain = model(x)
    if "intx" in config:   # torchao's eager intx linear is F.linear on its dequantize(): the same op, bit for bit
        assert torch.equal(plain, eager)
    else:
        assert_close_to_eager(plain, eager, f"{config} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", ["int8", "int4:g32"])
def test_tiny_llama(config, dtype):
    transformers = pytest.importorskip("transformers")
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   max_position_embeddings=64, num_attention_heads=8, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).eval()
    quantize_(model, _configs()[config])
    ids = torch.randint(0, 256, (1, 12))
    with torch.inference_mode():
        eager = model(ids).logits

    weights = dequantized(model)
    projections = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert set(weights) == {f"model.layers.{i}.{p}.weight" for i in range(2) for p in projections} | {
        "lm_head.weight"}
    assert weights["model.layers.0.mlp.up_proj.weight"].q.shape == (128, 64)
    assert not any(type(p).__module__.startswith("torchao") for p in model.parameters())
    with torch.inference_mode():
        plain = model(ids).logits
    assert_close_to_eager(plain, eager, f"llama {config} {dtype}")


def test_unsupported_configs_are_refused_by_name():
    tq = pytest.importorskip("torchao.quantization")
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_primitives import MappingType

    cases = {
        "Int8DynamicActivationInt8WeightConfig": tq.Int8DynamicActivationInt8WeightConfig(set_inductor_config=False),
        "block size [1, 32]": tq.Int8WeightOnlyConfig(granularity=PerGroup(32), set_inductor_config=False),
        "Float8Tensor": tq.Float8WeightOnlyConfig(set_inductor_config=False),
        "IntxUnpackedToInt8Tensor (asymmetric": tq.IntxWeightOnlyConfig(
            weight_dtype=torch.int4, granularity=PerGroup(32), mapping_type=MappingType.ASYMMETRIC),
        "torch.int2 in blocks of [1, 32]": tq.IntxWeightOnlyConfig(weight_dtype=torch.int2,
                                                                   granularity=PerGroup(32)),
    }
    for what, config in cases.items():
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        tq.quantize_(model, config, filter_fn=lambda m, fqn: fqn == "0")
        with pytest.raises(TorchaoFormatError) as e:
            dequantized(model)
        message = str(e.value)
        for part in ("0.weight", what, "Int8WeightOnlyConfig", "PrototypeInt4WeightOnlyConfig", "IntxWeightOnlyConfig"):
            assert part in message, (part, message)
        if what.startswith("Int8DynamicActivation"):   # numatp's own int8 activations are named as the way out
            assert "weights='int8:a8'" in message, message
        assert type(model[0].weight).__module__.startswith("torchao")   # refused before anything changed

    # asymmetric int8 (zero points): made directly, no config quantizes weights that way
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    weight = tq.Int8Tensor.from_hp(model[0].weight.detach() + 0.05, tq.PerRow(), mapping_type=MappingType.ASYMMETRIC)
    assert bool(weight.zero_point.ne(0).any())
    model[0].weight = torch.nn.Parameter(weight, requires_grad=False)
    with pytest.raises(TorchaoFormatError, match=r"0\.weight: torchao Int8Tensor \(asymmetric int8"):
        extract(model)


def test_a_model_without_torchao_tensors_is_left_alone_without_importing_torchao():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    before = model[0].weight
    assert extract(model) == {} and dequantized(model) == {}
    assert model[0].weight is before
    code = ("import sys, torch; from numatp.quant.torchao import dequantized; "
            "assert dequantized(torch.nn.Linear(4, 4)) == {}; import numatp.backend; "
            "assert 'torchao' not in sys.modules, 'torchao was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- ATen's CPU int4 packing: every layout it has, not only this CPU's ----

def _pack_like_aten(q: torch.Tensor, layout: str) -> torch.Tensor:
    """aten/src/ATen/native/cpu/int4mm_kernel.cpp's weight_to_int4pack_kernel, written out per element."""
    block, _ = _LAYOUTS[layout]
    n, k = q.shape
    out = torch.zeros(n * k // 2, dtype=torch.uint8)
    for start in range(0, n, block):
        nb = min(block, n - start)
        base = start * k // 2
        for kk in range(k):
            col = [int(q[start + r, kk]) for r in range(nb)]
            if nb == block and layout == "avx512":
                for d in range(16):
                    out[base + kk * 32 + d] = col[d + 32] << 4 | col[d]
                    out[base + kk * 32 + 16 + d] = col[d + 48] << 4 | col[d + 16]
            elif nb == block and layout == "avx2":
                for d in range(16):
                    out[base + kk * 16 + d] = col[d + 16] << 4 | col[d]
            else:
                for r in range(0, nb, 2):
                    out[base + kk * nb // 2 + r // 2] = col[r + 1] << 4 | col[r]
    return out


@pytest.mark.parametrize("layout", ["avx512", "avx2", "scalar32"])
@pytest.mark.parametrize("rows", [16, 48, 64, 96, 112])
def test_unpack_inverts_each_aten_layout(layout, rows):
    q = torch.randint(0, 16, (rows, 6), generator=torch.Generator().manual_seed(rows))
    assert torch.equal(_unpack_cpu_int4(_pack_like_aten(q, layout), rows, 6, layout), q.to(torch.uint8))


@pytest.mark.parametrize("rows", [16, 32, 48, 64, 96, 160])
def test_this_cpus_layout_is_read_from_the_packing_op(rows):
    q = torch.randint(0, 16, (rows, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    layout = _cpu_pack_layout("w", q, rows)
    expected = {"AVX512": "avx512", "AVX2": "avx2", "DEFAULT": "scalar32"}.get(torch.backends.cpu.get_cpu_capability())
    if expected is not None and rows % 64 == 0:   # fewer rows pack alike in several layouts: any of them reads
        assert layout == expected
    assert torch.equal(_unpack_cpu_int4(packed.reshape(-1), rows, 64, layout), q.to(torch.uint8))


@pytest.mark.filterwarnings("ignore:numatp. virtual sockets")
@pytest.mark.slow   # two Inductor-free compiles with GEMM choice, ~15 s each here
@pytest.mark.parametrize("config", ["int4:g32", "int8"])
def test_numatp_compile_shards_torchao_values_and_matches_torchao(config, tmp_path):
    # numatp.compile reads torchao's values into its own quantized shards (never re-quantized): the model,
    # sharded on 2 sockets, equals torchao's eager forward within the kernels' rounding
    transformers = pytest.importorskip("transformers")
    import numatp
    from numatp.backend import backend_of
    from torchao.quantization import quantize_
    from tests.helpers import fresh_dynamo, private_cache, shared_cpu_topology

    fresh_dynamo()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   max_position_embeddings=64, num_attention_heads=8, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    quantize_(model, _configs()[config])
    ids = torch.randint(0, 256, (1, 12))
    with torch.inference_mode():
        eager = model(ids).logits
    with private_cache(str(tmp_path)):
        compiled = numatp.compile(model, sockets=shared_cpu_topology(2),
                                  gemm=numatp.GemmOptions(force="q_dequant"))
        with torch.inference_mode():
            assert_close_to_eager(compiled(ids).logits, eager, f"{config} llama on 2 sockets")
    rows = backend_of(compiled).gemm_report()
    # every linear's shard is torchao's values in numatp's format, the LM head included
    assert len(rows) == 2 * 15 and {r["storage"] for r in rows} == {config}   # 2 sockets x 15 linears
    sharded = [b.kind for b in numatp.plans(compiled)[-1].blocks if b.sharded]
    assert sharded.count("attention") == 2 and sharded.count("mlp") == 2 and "lm_head" in sharded


def test_the_registered_backend_refuses_torchao_weights_and_names_numatp_compile():
    tq = pytest.importorskip("torchao.quantization")
    from tests.helpers import fresh_dynamo

    fresh_dynamo()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    tq.quantize_(model, tq.Int8WeightOnlyConfig(set_inductor_config=False))
    compiled = torch.compile(model, backend="numatp")
    with pytest.raises(Exception, match=r"numatp.compile\(model\)"):
        compiled(torch.randn(2, 64))
