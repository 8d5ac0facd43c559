"""Compiled segments (numatp.runtime.segments.SegmentCompiler): a segment whose AOTAutograd runtime wrapper
has nothing to do is called without it, and gives what the wrapped call gives; one whose wrapper has work
(an output that is a view of an input) keeps it."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from numatp.runtime.segments import Segment, SegmentCompiler, _direct

pytestmark = pytest.mark.integration   # Inductor compiles (C++)


def _segment(fn, example) -> Segment:
    gm = make_fx(fn, tracing_mode="fake")(*example)
    return Segment(gm, [f"in{i}" for i in range(len(example))], [], example=list(example))


def _layer(x, w, b, cache, pos):
    h = torch.nn.functional.layer_norm(x, (x.shape[-1],)) @ w.t() + b
    cache.index_copy_(0, pos, h)   # a state written in place, as a KV cache is
    return torch.nn.functional.gelu(h), h.sum(-1)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 32, generator=g), torch.randn(48, 32, generator=g), torch.randn(48, generator=g),
            torch.zeros(8, 48), torch.tensor([3, 5])]


def test_a_segment_without_runtime_work_is_called_directly_and_equals_the_wrapped_call():
    from torch._inductor.compile_fx import compile_fx

    example = _inputs()
    compiler = SegmentCompiler()
    seg = _segment(_layer, example)
    direct = compiler.compile(seg, threads=1)
    assert getattr(direct, "_numatp_direct", False) and compiler.direct == 1
    wrapped = compile_fx(seg.gm, example, config_patches={"cpp_wrapper": True, "cpp.threads": 1})
    got_in, want_in = _inputs(), _inputs()
    with torch.inference_mode():
        got = direct(*got_in)
        want = wrapped(*want_in)
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(got_in[3], want_in[3], rtol=0, atol=0)   # the state written in place
    assert bool(got_in[3][3].ne(0).any()) and bool(got_in[3][0].eq(0).all())
    # the same code again: the compiled callable is shared, not compiled twice
    assert compiler.compile(_segment(_layer, example), threads=1) is direct and compiler.reused == 1


def test_a_segment_whose_output_is_a_view_of_an_input_keeps_the_wrapper():
    def viewing(x, w):
        return x.view(-1), x @ w

    example = [torch.randn(2, 16), torch.randn(16, 4)]
    compiler = SegmentCompiler()
    fn = compiler.compile(_segment(viewing, example), threads=1)
    assert not getattr(fn, "_numatp_direct", False) and compiler.direct == 0
    x = torch.randn(2, 16)
    with torch.inference_mode():
        flat, y = fn(x, example[1])
    assert flat.data_ptr() == x.data_ptr()   # the wrapper made the output a view of the input again
    torch.testing.assert_close(y, x @ example[1])


def test_the_direct_call_names_what_keeps_the_wrapper():
    class Meta:   # AOTAutograd's description of a graph, with the fields _direct reads
        input_info = [0, 1]
        num_mutated_inp_runtime_indices = 1
        num_outputs_aliased = 0
        num_intermediate_bases = 0
        tokens: dict = {}
        is_rng_op_functionalized = False
        subclass_inp_meta = [0, 1]
        grad_enabled_mutation = None

    class Code:
        current_callable = staticmethod(lambda args: args)

    kept = {"code": Code(), "meta": Meta()}
    assert _direct(kept, [torch.zeros(1), torch.zeros(1)]) is None
    assert kept["why"] == "an input is mutated outside the graph"
    kept = {"code": Code(), "meta": Meta()}
    assert _direct(kept, [torch.zeros(1), 3]) is None
    assert "an input is not a tensor" in kept["why"] and "inputs were deduplicated or merged" not in kept["why"]
    kept = {"code": Code()}
    assert _direct(kept, [torch.zeros(1)]) is None and kept["why"] == "no description of the graph"
