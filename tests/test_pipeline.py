"""The build pipeline (numatp.plan.pipeline) step by step, with the contracts between the steps checked
after each (numatp.plan.contracts), and each contract failing on a program broken on purpose."""

from __future__ import annotations

import pytest
import torch

from numatp import zoo
from numatp.plan import capture, contracts, pipeline
from numatp.plan.contracts import ContractError
from numatp.plan.gemm_pass import GemmOptions, GemmSelector
from numatp.plan.reference import bind_inputs
from numatp.runtime import SegmentCompiler, ShardedExecutor, SocketGroup
from numatp.runtime.segments import Collective, Segment
from tests.helpers import assert_close_to_eager, shared_cpu_topology

pytestmark = pytest.mark.integration   # threaded socket groups, the C++ collective

ALL_REDUCE = torch.ops.numatp.all_reduce.default


def _traced(family: str, seq: int = 16):
    model = zoo.build(family, tiny=True)
    inputs = zoo.example_inputs(model, batch=1, seq=seq)
    with torch.no_grad():
        expected = model(**inputs).logits
    ((ag, real),) = capture(model, **inputs)
    return ag, real, expected


def _bind(real):
    return lambda local: [bind_inputs(p.bindings, real, p.rank) for p in local]


def test_the_pipeline_lists_its_steps_in_order():
    assert pipeline.STEPS == ("trace", "plan", "localize", "choose_gemms", "fuse_attention", "lower", "gather",
                              "split", "compile")
    assert all(callable(getattr(pipeline, step)) for step in pipeline.STEPS)


@pytest.mark.parametrize(("family", "sockets", "gemm"), [
    ("gpt2", 1, None), ("gpt2", 2, None), ("gpt2", 3, None), ("gpt2", 2, "mkl_packed"),
    ("llama", 2, None), ("gemma3-270m", 2, None), ("bert-small", 2, None)])
def test_contracts_hold_after_every_step_and_the_programs_equal_eager(family, sockets, gemm, tmp_path):
    ag, real, expected = _traced(family)
    plan = pipeline.plan(ag, sockets)
    selector = GemmSelector(GemmOptions(force=gemm, cache_dir=str(tmp_path))) if gemm else None
    with SocketGroup(shared_cpu_topology(sockets)) as group:
        built = pipeline.build(ag, plan, group=group, compiler=SegmentCompiler(mode="eager"), bind=_bind(real),
                               gemm=selector, check=True)
        assert [p.rank for p in built.programs] == list(range(sockets))
        if gemm:
            assert any(c.providers for c in built.choices) and all(built.swaps)
        executor = ShardedExecutor(group, built.programs)
        (logits,) = executor.run(built.args)
    assert_close_to_eager(logits, expected, f"{family} on {sockets} sockets")
    if sockets > 1:
        assert executor.performed["all_reduce"] == plan.reductions and executor.performed["all_gather"] == 1


@pytest.fixture
def localized():
    """gpt2 (tiny) on 2 sockets, localized and bound: the contracts hold before each test breaks one."""
    ag, real, _ = _traced("gpt2")
    plan = pipeline.plan(ag, 2)
    local = pipeline.localize(ag, plan)
    done = pipeline.Programs(plan, local, _bind(real)(local))
    shapes = contracts.global_shapes(ag)
    contracts.check("localize", done, shapes, sockets=2)
    return done, shapes


def _reductions(gm):
    return [n for n in gm.graph.nodes if n.target is ALL_REDUCE]


def test_a_socket_that_skips_a_reduction_breaks_the_same_collectives(localized):
    done, shapes = localized
    gm = done.local[1].gm
    last = _reductions(gm)[-1]
    last.replace_all_uses_with(last.args[0])
    gm.graph.erase_node(last)
    with pytest.raises(ContractError, match="socket 1 performs 5 collectives and socket 0 6.*same collectives in the same order"):
        contracts.same_collectives(done)
    with pytest.raises(ContractError, match="after pipeline step 'localize'"):
        contracts.check("localize", done, shapes, sockets=2)


def test_a_block_reduced_twice_breaks_one_reduction_per_block(localized):
    done, shapes = localized
    for p in done.local:   # every socket alike: the collectives still agree
        first = _reductions(p.gm)[0]
        with p.gm.graph.inserting_after(first):
            again = p.gm.graph.call_function(ALL_REDUCE, (first, 99))
        first.replace_all_uses_with(again, delete_user_cb=lambda u: u is not again)
    contracts.same_collectives(done)
    with pytest.raises(ContractError, match="6 all-reduces .* plan has 5 reductions.*reduced exactly once"):
        contracts.one_reduction_per_block(done)


def test_a_whole_weight_bound_where_a_shard_belongs_breaks_shard_shapes(localized):
    done, shapes = localized
    rank = 1
    i = next(i for i, bd in enumerate(done.local[rank].bindings) if type(bd.placement).__name__ == "Colwise")
    full = torch.zeros(shapes[done.local[rank].bindings[i].index])
    done.args[rank][i] = full
    with pytest.raises(ContractError, match=rf"socket 1: argument {i} .* has shape {tuple(full.shape)}".replace("(", r"\(")
                       .replace(")", r"\)")):
        contracts.shard_shapes(done, shapes)


def test_reading_a_partial_sum_breaks_local_reads(localized):
    done, shapes = localized
    gm = done.local[0].gm
    # the bias add after a row matmul's reduction reads the socket's partial sum instead of the total
    red = next(r for r in _reductions(gm) if any(u.target is torch.ops.aten.add.Tensor for u in r.users))
    add = next(u for u in red.users if u.target is torch.ops.aten.add.Tensor)
    add.replace_input_with(red, red.args[0])
    with pytest.raises(ContractError, match="a partial sum whose other parts the other sockets hold"):
        contracts.local_reads(done)


def test_a_step_reading_a_value_its_program_never_made_breaks_local_reads():
    ag, real, _ = _traced("gpt2")
    plan = pipeline.plan(ag, 2)
    with SocketGroup(shared_cpu_topology(2)) as group:
        done = pipeline.lower_programs(ag, plan, group=group, bind=_bind(real), check=True)
    prog = done.programs[1]
    seg = next(s for s in prog.steps[1:] if isinstance(s, Segment))
    assert any(isinstance(s, Collective) for s in prog.steps)
    seg.inputs[0] = "a_value_of_socket_0"
    with pytest.raises(ContractError, match=r"socket 1: step \d+ \(Segment\) reads \['a_value_of_socket_0'\]"):
        contracts.local_reads(done, stepped=True)


def test_the_check_option_runs_the_contracts_when_compiling():
    import numatp
    from tests.helpers import fresh_dynamo

    model = zoo.build("gpt2", tiny=True)
    inputs = zoo.example_inputs(model, batch=1, seq=16)
    fresh_dynamo()
    with torch.inference_mode():
        expected = model(**inputs).logits
        compiled = torch.compile(model, backend="numatp", options={"sockets": 2, "mode": "eager", "check": True})
        got = compiled(**inputs).logits
    assert_close_to_eager(got, expected, "gpt2 checked")
    assert numatp.backend.backend_of(compiled).check is True
    with pytest.raises(ValueError, match="check='yes': pass True or False"):
        numatp.backend.Options(check="yes")
