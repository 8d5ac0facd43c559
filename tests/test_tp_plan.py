"""The plan as input: transformers' tp_plan vocabulary in (``numatp.compile(model, plan=...)``) and out
(``Plan.to_tp_plan()``), overrides and the errors of decisions a graph cannot honour."""

from __future__ import annotations

import json

import pytest
import torch

import numatp
from numatp import zoo
from numatp.plan import capture, hf_tp_plan, localize, parse_tp_plan, plan_graph
from tests.helpers import assert_close_to_eager, fresh_dynamo, shared_cpu_topology
from tests.test_families import _model


def _graph(model, seq=8):
    (ag, _), = capture(model, input_ids=torch.randint(5, 200, (1, seq), generator=torch.Generator().manual_seed(0)))
    return ag


def _programs(ag, plan):
    return [localize(ag, plan, r).gm.code for r in range(plan.sockets)]


@pytest.mark.unit
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "phi3", "gemma3", "falcon", "bloom"])
def test_a_plan_written_out_and_read_back_gives_the_same_programs(family):
    model = zoo.build("gpt2", tiny=True) if family == "gpt2" else _model(family)
    ag = _graph(model)
    own = plan_graph(ag, 2)
    written = own.to_tp_plan()
    json.dumps(written)   # plain data: it can be saved, edited and passed back
    again = plan_graph(ag, 2, plan=parse_tp_plan(written))
    assert _programs(ag, again) == _programs(ag, own)   # each read from its own plan, not the graph's last
    assert again.weights == own.weights and again.reductions == own.reductions
    with pytest.raises(ValueError, match="this plan is for 2 socket"):
        localize(ag, own, 2)
    assert again.to_tp_plan() == written


@pytest.mark.unit
def test_gpt2_plan_reads_as_transformers_writes_one():
    plan = plan_graph(_graph(zoo.build("gpt2", tiny=True)), 2).to_tp_plan()
    assert plan == {"lm_head": "colwise", "transformer.h.*.attn.c_attn": "colwise",
                    "transformer.h.*.attn.c_proj": "rowwise", "transformer.h.*.mlp.c_fc": "colwise",
                    "transformer.h.*.mlp.c_proj": "rowwise", "transformer.wpe": "replicate",
                    "transformer.wte": "vocab"}


@pytest.mark.integration
@pytest.mark.parametrize("preset", ["llama"] + [pytest.param(p, marks=pytest.mark.slow)
                                               for p in ("qwen2.5-0.5b", "llama-3.2-1b", "phi-3-mini", "gemma3-270m")])
def test_the_models_own_tp_plan_agrees_with_the_pass_and_runs(preset, cli):
    fresh_dynamo()
    model = zoo.build(preset, tiny=True)
    ag = _graph(model)
    own = plan_graph(ag, 2)
    assert _programs(ag, plan_graph(ag, 2, plan=hf_tp_plan(model))) == _programs(ag, own)   # transformers' plan and the dataflow pass decide alike here
    ids = torch.randint(5, 200, (2, 8), generator=torch.Generator().manual_seed(1))
    fast = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager", plan="hf")
    with torch.inference_mode():
        assert_close_to_eager(fast(input_ids=ids).logits, model(input_ids=ids).logits, f"{preset} plan='hf'")
    code, out, _ = cli("explain", preset, "--tiny", "--seq", "8", "--plan", "hf", "--json")
    assert code == 0
    assert all(g["differs_from_pass"] == {} for g in json.loads(out)["graphs"])


@pytest.mark.integration
def test_overrides_replicate_a_block_and_one_projection_and_stay_equal_to_eager():
    fresh_dynamo()
    model = _model("llama")
    ids = torch.randint(5, 200, (2, 8), generator=torch.Generator().manual_seed(1))
    plan = {"model.layers.1.mlp.down_proj": "replicate", "layers.*.self_attn.k_proj": "replicate"}
    fast = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager", plan=plan)
    with torch.inference_mode():
        assert_close_to_eager(fast(input_ids=ids).logits, model(input_ids=ids).logits, "llama with overrides")
    (p,) = numatp.plans(fast)
    blocks = {b.module: b for b in p.blocks}
    mlp = blocks["model.layers.1.mlp"]
    assert not mlp.sharded and (mlp.reason.kind, mlp.reason.source, mlp.reason.pattern) == (
        "by_plan", "plan", "model.layers.1.mlp.down_proj")
    attn = blocks["model.layers.0.self_attn"]
    assert attn.sharded and attn.replicated_columns == ("model.layers.0.self_attn.k_proj.weight",)
    assert attn.reason.kind == "column_row" and attn.reason.by_plan == (
        ("model.layers.0.self_attn.k_proj.weight", "layers.*.self_attn.k_proj"),)
    assert p.reductions == 2 * 2 + 1 - 1   # the replicated MLP has no reduction
    assert p.to_tp_plan()["model.layers.1.mlp.gate_proj"] == "replicate"


@pytest.mark.unit
def test_a_plan_can_shard_where_the_policy_would_not():
    ag = _graph(_model("llama"))
    plan = plan_graph(ag, 2, policy="auto", decide=lambda cand, n: ({"sharded": 2.0, "unsharded": 1.0}, "slower"),
                      plan=parse_tp_plan({"model.layers.0.mlp.down_proj": "rowwise"}))
    sharded = {b.module for b in plan.blocks if b.sharded and b.kind in ("attention", "mlp")}
    assert sharded == {"model.layers.0.mlp"}


class _NormedMLP(torch.nn.Module):
    """A norm over the features between the up and down projections: the pass cannot shard it."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


@pytest.mark.unit
@pytest.mark.parametrize("plan, message", [
    ({"transformer.h.*.attn.q_proj": "colwise"}, r"matches no module of this graph; did you mean"),
    ({"transformer.h.*.attn.c_proj": "colwise"}, r"the output projection of .*it is 'rowwise'"),
    ({"transformer.h.*.attn.c_attn": "rowwise"}, r"reads .*replicated input: it is 'colwise'"),
    ({"transformer.h.*.ln_1": "colwise"}, r"neither a projection nor an embedding table here"),
    ({"transformer.wte": "colwise"}, r"an embedding table: a table is 'vocab'"),   # lm_head is the matmul
    ({"lm_head": "colwise", "transformer.wpe": "replicate"}, None),
    ({"h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_fc": "replicate"}, r"make the patterns agree"),
    ({"transformer.h.*.mlp.c_fc": "sideways"}, r"'sideways' is not a decision numatp takes; use one of colwise"),
])
def test_decisions_the_graph_cannot_honour_are_named(plan, message):
    ag = _graph(zoo.build("gpt2", tiny=True))
    if message is None:
        plan_graph(ag, 2, plan=parse_tp_plan(plan))
        return
    with pytest.raises(ValueError, match=message):
        plan_graph(ag, 2, plan=parse_tp_plan(plan))


@pytest.mark.unit
def test_a_block_the_pass_cannot_shard_is_an_error_when_the_plan_asks_for_it():
    graphs = capture(_NormedMLP(), torch.randn(4, 16))
    (ag, _), = graphs
    assert not any(b.sharded for b in plan_graph(ag, 2).blocks)
    with pytest.raises(ValueError, match=r"plan: 'up' asks colwise in .*which the pass cannot shard: .*reduces over"):
        plan_graph(ag, 2, plan=parse_tp_plan({"up": "colwise"}))


@pytest.mark.integration
def test_option_errors():
    model = zoo.build("gpt2", tiny=True)
    with pytest.raises(ValueError, match="ships no tp_plan"):
        numatp.compile(model, plan="hf")
    with pytest.raises(ValueError, match="policy='never'"):
        numatp.compile(model, plan={"lm_head": "colwise"}, policy="never")
    with pytest.raises(Exception, match="plan='hf' needs the model"):   # Dynamo wraps the backend's error
        torch.compile(model, backend="numatp", options={"plan": "hf"})(input_ids=torch.ones(1, 4, dtype=torch.long))


@pytest.mark.integration
def test_explain_json_plan_passes_back_through_a_file(cli, tmp_path):
    code, out, _ = cli("explain", "gpt2", "--tiny", "--seq", "8", "--json")
    assert code == 0
    (graph,) = json.loads(out)["graphs"]
    edited = dict(graph["tp_plan"], **{"transformer.h.1.mlp.c_proj": "replicate"})
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(edited))
    code, out, _ = cli("explain", "gpt2", "--tiny", "--seq", "8", "--plan", str(path))
    assert code == 0
    assert "transformer.h.1.mlp.c_proj: replicate (the pass: rowwise)" in out
    assert "transformer.h.1.mlp.c_fc: replicate (the pass: colwise)" in out


@pytest.mark.unit
@pytest.mark.parametrize("value, message", [
    ("colwise", r"in no attention or MLP block: outside a block numatp splits only an LM head"),
    ("rowwise", r"in no attention or MLP block: nothing before it splits its input"),
])
def test_a_projection_outside_the_blocks_is_an_lm_head_or_replicated(value, message):
    # BERT's MLM head transform: a 64 x 64 dense between the last layer and the decoder
    ag = _graph(zoo.build("bert-small", tiny=True))
    plan_graph(ag, 2, plan=parse_tp_plan({"cls.predictions.transform.dense": "replicate"}))
    with pytest.raises(ValueError, match=message):
        plan_graph(ag, 2, plan=parse_tp_plan({"cls.predictions.transform.dense": value}))
