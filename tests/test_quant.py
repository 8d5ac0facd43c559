"""Quantized weights through the pipeline: each socket's shard quantized after sharding, equal to an eager
reference that dequantizes the same values (float32 rounding only), at 1, 2 and 4 sockets; the options, the
errors, the bytes each socket holds."""

from __future__ import annotations

import copy

import pytest
import torch

import numatp
from numatp import zoo
from numatp.backend import backend_of
from numatp.backend.variants import CompiledGraph
from numatp.plan import capture, pipeline
from numatp.plan.gemm_pass import GemmOptions, GemmSelector, QuantWeights
from numatp.plan.reference import bind_inputs, dequantized_inputs
from numatp.runtime import SegmentCompiler, ShardedExecutor, SocketGroup
from numatp.runtime.gemm import quant
from tests.helpers import fresh_dynamo, private_cache, shared_cpu_topology


def _traced(family: str, seq: int = 16):
    model = zoo.build(family, tiny=True)
    inputs = zoo.example_inputs(model, batch=1, seq=seq)
    ((ag, real),) = capture(model, **inputs)
    return ag, real


def _run_quantized(ag, real, sockets: int, weights: str, tmp_path, *, force: str | None = "q_dequant",
                   keep_head: bool = False):
    plan = pipeline.plan(ag, sockets)
    selector = GemmSelector(GemmOptions(force=force, cache_dir=str(tmp_path)),
                            quant=QuantWeights.of(weights, keep_head=keep_head))
    with SocketGroup(shared_cpu_topology(sockets)) as group:
        built = pipeline.build(ag, plan, group=group, compiler=SegmentCompiler(mode="eager"), check=True,
                               bind=lambda local: [bind_inputs(p.bindings, real, p.rank) for p in local],
                               gemm=selector)
        (logits,) = ShardedExecutor(group, built.programs).run(built.args)
    return logits, built, selector


def _reference(ag, inputs):
    with torch.no_grad():
        out = ag.gm(*inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.integration
@pytest.mark.parametrize(("family", "sockets", "weights"), [
    pytest.param("gpt2", 1, "int8", marks=pytest.mark.slow), ("gpt2", 2, "int4:g32"),
    pytest.param("gpt2", 4, "int8", marks=pytest.mark.slow),
    pytest.param("llama", 1, "int4:g32", marks=pytest.mark.slow),
    pytest.param("llama", 2, "int8", marks=pytest.mark.slow), ("llama", 4, "int8")])
def test_quantized_programs_equal_the_dequantized_reference(family, sockets, weights, tmp_path):
    ag, real = _traced(family)
    logits, built, selector = _run_quantized(ag, real, sockets, weights, tmp_path)
    rows = selector.report()
    fmt = quant.QuantFormat.parse(weights)
    # every weight matmul reads a quantized shard: the body in the asked format, the LM head in int8
    assert rows and all(r["storage"] in (fmt.name, "int8") for r in rows)
    assert any(r["storage"] == fmt.name and r["provider"] != "qembedding" for r in rows)
    assert any(r["provider"] == "qembedding" for r in rows)   # the embedding tables too
    expected = _reference(ag, dequantized_inputs(built.local, built.args, real, selector._operands.prepared))
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)
    plain = _reference(ag, real)
    assert not torch.equal(logits, plain)   # the reference is not the unquantized model


@pytest.mark.integration
@pytest.mark.slow
def test_a_measured_quantized_provider_reads_the_same_values(tmp_path):
    ag, real = _traced("gpt2")
    logits, built, selector = _run_quantized(ag, real, 2, "int8", tmp_path, force=None)
    assert all(r["rates"] for r in selector.report() if r["provider"] != "qembedding")   # measured, in the table
    expected = _reference(ag, dequantized_inputs(built.local, built.args, real, selector._operands.prepared))
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.integration
@pytest.mark.slow
def test_keep_head_leaves_the_head_and_tables_in_the_model_dtype(tmp_path):
    ag, real = _traced("gpt2")
    _, built, selector = _run_quantized(ag, real, 2, "int4:g32", tmp_path, keep_head=True)
    rows = selector.report()
    assert {r["storage"] for r in rows} == {"int4:g32", "float32"}
    assert not any(r["provider"] == "qembedding" for r in rows)


@pytest.mark.unit
def test_a_shard_the_groups_do_not_divide_is_an_error_naming_it_and_the_groups_that_fit(tmp_path):
    ag, real = _traced("gpt2")   # tiny gpt2: 64 features, 4 heads of 16: the attention output's shards are 32 wide
    with pytest.raises(ValueError, match=r"weights='int4:g64': \S*(attn|proj)\S* has a shard of input size 32 .* not a "
                                         r"multiple of the int4 group 64; groups that fit: int4:g32"):
        _run_quantized(ag, real, 2, "int4:g64", tmp_path)


@pytest.mark.unit
@pytest.mark.parametrize(("given", "message"), [
    ("int3", "the quantized formats are 'int8'"), ("int4:g48", "not 48"), ("int8:g32", "no group")])
def test_bad_weights_options_name_the_value_and_the_formats(given, message):
    with pytest.raises(ValueError, match=message):
        numatp.compile(torch.nn.Linear(4, 4), weights=given)


@pytest.mark.unit
def test_weights_need_the_gemm_providers():
    with pytest.raises(ValueError, match="gemm=False"):
        numatp.compile(torch.nn.Linear(4, 4), weights="int8", gemm=False)


@pytest.fixture
def recorded_calls(monkeypatch):
    """The arguments of every numatp graph call (the Dynamo graph's inputs: parameters included)."""
    calls: list[tuple] = []
    original = CompiledGraph.__call__

    def record(self, *args):
        calls.append((self, args))
        return original(self, *args)

    monkeypatch.setattr(CompiledGraph, "__call__", record)
    return calls


def _dequantized_twin(model, compiled, calls):
    """A float32 copy of ``model`` whose quantized weights hold the values the compiled model's sockets hold."""
    graph, args = calls[0]
    backend = backend_of(compiled)
    (variant,) = graph.variants.values()
    local = [type("P", (), {"bindings": variant.bindings[r], "rank": r})() for r in range(len(variant.bindings))]
    merged = dequantized_inputs(local, variant.weights, list(args), backend.weights.prepared)
    twin = copy.deepcopy(model).float()
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    params = dict(twin.named_parameters(remove_duplicate=False))
    changed = 0
    for given, value in zip(args, merged):
        if value is not given and id(given) in names:
            with torch.no_grad():
                params[names[id(given)]].copy_(value)
            changed += 1
    assert changed
    return twin


def _quantizing_activations(twin: torch.nn.Module) -> torch.nn.Module:
    """``twin`` with every weight matmul's input quantized as int8:a8's kernels read it (blocks of 32)."""
    from transformers.pytorch_utils import Conv1D

    def hook(module, args):
        return (quant.quantize_activations(args[0]).to(args[0].dtype), *args[1:])

    for m in twin.modules():
        if isinstance(m, (torch.nn.Linear, Conv1D)):
            m.register_forward_pre_hook(hook)
    return twin


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("weights", ["int8", "int4:g32", "int8:a8"])
def test_greedy_tokens_of_a_quantized_model_equal_its_dequantized_twin(weights, recorded_calls, tmp_path):
    fresh_dynamo()
    torch.manual_seed(0)
    model = zoo.build("llama", tiny=True).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    with private_cache(str(tmp_path)):
        compiled = numatp.compile(model, sockets=2, weights=weights, gemm=GemmOptions(force="q_dequant"))
        out = compiled.generate(ids, max_new_tokens=6)
    twin = _dequantized_twin(model, compiled, recorded_calls)
    if weights == "int8:a8":
        twin = _quantizing_activations(twin)
    expected = twin.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, expected)
    rep = numatp.placement_report(compiled)
    plain_bytes = sum(p.nbytes for p in model.parameters())
    # int8 (or int4) shards and int8 tables: each socket holds well under half of the fp32 model's bytes
    assert all(r["bytes"] < 0.5 * plain_bytes for r in rep["ranks"])


@pytest.mark.integration
@pytest.mark.parametrize(("sockets", "weights"), [
    (1, "int8:a8"), pytest.param(2, "int8:a8", marks=pytest.mark.slow), (4, "int8:a8"), (2, "int4:g32:a8"),
    pytest.param(4, "int4:g32:a8", marks=pytest.mark.slow)])
def test_int8_activations_equal_a_twin_that_quantizes_each_matmuls_input(sockets, weights, recorded_calls,
                                                                         tmp_path):
    # The plumbing (which matmuls quantize their input, in which blocks, the head's too, at any socket count:
    # a shard's input is whole blocks) with q_dequant, which quantizes x as the twin does; the kernels are
    # checked against the same reference call by call (test_quant_kernels.py). Quantizing makes the model
    # step-wise: one fp32 rounding of difference (a sum over sockets in another order, Inductor's norm) can
    # move a value across a rounding boundary of its block, and the logits of that position and the ones
    # after it (attention) by about 1e-2 (measured: positions 4-9 of 10 at 4 sockets). So: the positions
    # before the first such step equal the twin's to fp32 rounding (the first one at least: every matmul of
    # every layer and the head read it), where the weight-only product matches none, and no position is
    # further off than one step moves it.
    fresh_dynamo()
    torch.manual_seed(0)
    # (tiny llama's MLP of 704 splits into shards of 176 at 4 sockets: not whole blocks of 32)
    model = zoo.build("llama-3.2-1b", tiny=True).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    with private_cache(str(tmp_path)), torch.no_grad():
        compiled = numatp.compile(model, sockets=shared_cpu_topology(sockets), weights=weights,
                                  gemm=GemmOptions(force="q_dequant"))
        out = compiled(ids).logits
        rows = backend_of(compiled).gemm_report()
        assert rows and {r["storage"] for r in rows} == {weights, "int8:a8"}   # the head's activations too
        twin = _dequantized_twin(model, compiled, recorded_calls)
        weight_only = twin(ids).logits
        expected = _quantizing_activations(twin)(ids).logits

    def equal(a, b):   # per position: equal to fp32 rounding
        return [torch.allclose(a[0, p], b[0, p], atol=2e-5, rtol=1e-4) for p in range(a.shape[1])]

    same = equal(out, expected)
    first_off = same.index(False) if False in same else len(same)
    assert first_off >= 1, same
    assert not any(equal(out, weight_only))
    assert (out - expected).abs().max() < 0.05


@pytest.mark.unit
def test_a_shard_the_int4_a8_groups_do_not_divide_names_the_a8_groups_that_fit(tmp_path):
    ag, real = _traced("gpt2")
    with pytest.raises(ValueError, match=r"not a multiple of the int4 group 64; groups that fit: int4:g32:a8"):
        _run_quantized(ag, real, 2, "int4:g64:a8", tmp_path)


@pytest.mark.unit
def test_int8_activations_refuse_a_shard_that_is_not_whole_blocks(tmp_path):
    ag, real = _traced("gpt2")   # tiny gpt2: 64 features; at 4 sockets the attention output's shards are 16 wide
    with pytest.raises(ValueError, match=r"weights='int8:a8': \S*(attn|proj)\S* has a shard of input size 16 .* not a "
                                         r"multiple of the activations' blocks of 32 \(int8:a8\); use 'int8'"):
        _run_quantized(ag, real, 4, "int8:a8", tmp_path)
