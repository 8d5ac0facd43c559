"""The NUMA-TP pass against eager, through the reference executor: every preset family, 1-4 sockets."""

from __future__ import annotations

import pytest
import torch

from numatp import zoo
from numatp.plan import Colwise, Replicate, Rowwise, capture, localize, plan_graph, run_reference
from tests.helpers import assert_close_to_eager

FAMILIES = ["gpt2", "bert-small", "gemma3-270m", "llama"]
SHAPES = [(1, 16), (2, 24)]

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", params=[(f, d, s) for f in FAMILIES for d in (torch.float32, torch.bfloat16)
                                        for s in SHAPES], ids=lambda p: f"{p[0]}-{str(p[1])[6:]}-{p[2][0]}x{p[2][1]}")
def traced(request):
    family, dtype, (batch, seq) = request.param
    model = zoo.build(family, tiny=True, dtype=dtype)
    inputs = zoo.example_inputs(model, batch=batch, seq=seq)
    with torch.no_grad():
        out = model(**inputs)
    graphs = capture(model, **inputs)
    assert len(graphs) == 1, "tiny presets compile to one graph"
    return family, model, graphs[0], out.logits


@pytest.mark.parametrize("sockets", [1, 2, 3, 4])
def test_reference_equals_eager(traced, sockets):
    family, model, (ag, real), expected = traced
    plan = plan_graph(ag, sockets)
    programs = [localize(ag, plan, r) for r in range(sockets)]
    (logits,) = run_reference(programs, real)
    assert_close_to_eager(logits, expected, f"{family} on {sockets} sockets")
    layers = model.config.num_hidden_layers
    # two per layer and one for the vocabulary-parallel embedding lookup
    assert plan.reductions == 2 * layers + 1
    reduce_nodes = [n for n in programs[0].gm.graph.nodes if n.target is torch.ops.numatp.all_reduce.default]
    assert len(reduce_nodes) == 2 * layers + 1
    assert plan.gathers == 1  # the LM head's logits
    sharded = [b for b in plan.blocks if b.sharded]
    assert sum(b.kind == "attention" for b in sharded) == layers
    assert sum(b.kind == "mlp" for b in sharded) == layers
    assert sum(b.kind == "lm_head" for b in sharded) == 1
    assert sum(b.kind == "embedding" for b in sharded) == 1


@pytest.mark.parametrize("sockets", [2, 3])
def test_weight_bytes_add_up(traced, sockets):
    family, model, (ag, real), _ = traced
    plan = plan_graph(ag, sockets)
    replicated = 0
    sharded_extra = 0
    for name, uses in plan.weights.items():
        if any(isinstance(u.placement, Replicate) for u in uses):
            replicated += uses[0].nbytes
            # a sharded use of a replicated parameter (tied LM head) reads the replica: no extra bytes
        else:
            assert all(isinstance(u.placement, (Colwise, Rowwise)) for u in uses)
            for u in uses:
                covered = {i for s in u.placement.splits for i in s.indices()}
                assert covered == set(range(u.shape[u.placement.dim])), f"{name}: shards must cover the weight"
                # rows that several sockets hold (a K/V head they share) count once per holder
                sharded_extra += sum(u.local_bytes(r) for r in range(sockets)) - u.nbytes
            sharded_extra += sum(u.nbytes for u in uses[1:])
    total = sum(plan.socket_bytes(r) for r in range(sockets))
    assert total == plan.model_bytes + (sockets - 1) * replicated + sharded_extra
    params = {id(p): p for p in model.parameters()}
    assert plan.model_bytes == sum(p.numel() * p.element_size() for p in params.values())


def test_single_kv_head_is_computed_by_each_socket_from_its_own_rows():
    # Gemma 3's one K/V head, expanded per query head by transformers (the example inputs carry a mask):
    # both sockets hold all of k_proj's rows, as a column shard on their own node, not a replica
    model = zoo.build("gemma3-270m", tiny=True)
    (ag, real), = capture(model, **zoo.example_inputs(model, batch=1, seq=16))
    plan = plan_graph(ag, 2)
    attn = [b for b in plan.blocks if b.kind == "attention"]
    assert attn and all(b.sharded and not b.replicated_columns for b in attn)
    (k,) = plan.weights["model.layers.0.self_attn.k_proj.weight"]
    rows = k.shape[0]
    assert isinstance(k.placement, Colwise) and [str(s) for s in k.placement.splits] == [f"0:{rows}"] * 2


def test_uneven_splits_are_legal():
    # tiny GPT-2 on 3 sockets: its 512 vocabulary rows, 256 MLP units and 4 heads (16 wide) do not split
    # into 3 evenly; the first sockets take one more row, unit or head, the shards cover each weight, and
    # the programs' logits (gathered from unequal column blocks) equal eager
    model = zoo.build("gpt2", tiny=True)
    cfg = model.config
    inputs = zoo.example_inputs(model, batch=1, seq=16)
    (ag, real), = capture(model, **inputs)
    plan = plan_graph(ag, 3)

    def sizes(name: str, placement: type) -> list[int]:
        use = next(u for u in plan.weights[name] if isinstance(u.placement, placement))
        return [len(s) for s in use.placement.splits]

    assert (cfg.vocab_size, 4 * cfg.n_embd, cfg.n_head, cfg.n_embd // cfg.n_head) == (512, 256, 4, 16)
    assert sizes("lm_head.weight", Colwise) == [171, 171, 170]
    assert sizes("transformer.h.0.mlp.c_fc.weight", Colwise) == [86, 85, 85]
    assert sizes("transformer.h.1.mlp.c_proj.weight", Rowwise) == [86, 85, 85]
    assert sizes("transformer.h.0.attn.c_proj.weight", Rowwise) == [32, 16, 16]   # 2 + 1 + 1 heads
    assert sizes("transformer.h.1.attn.c_attn.weight", Colwise) == [96, 48, 48]   # their q, k and v columns
    (logits,) = run_reference([localize(ag, plan, r) for r in range(3)], real)
    with torch.no_grad():
        assert_close_to_eager(logits, model(**inputs).logits, "gpt2 on 3 sockets, uneven shards")


def test_bad_socket_counts_raise():
    model = zoo.build("gpt2", tiny=True)
    (ag, real), = capture(model, **zoo.example_inputs(model, batch=1, seq=16))
    with pytest.raises(ValueError, match="sockets=0"):
        plan_graph(ag, 0)
    heads = model.config.n_head
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn.*cannot split over"):
        plan_graph(ag, heads + 1)
    with pytest.raises(ValueError, match="policy="):
        plan_graph(ag, 2, policy="sometimes")


def test_never_policy_shards_nothing():
    model = zoo.build("gpt2", tiny=True)
    inputs = zoo.example_inputs(model, batch=1, seq=16)
    (ag, real), = capture(model, **inputs)
    plan = plan_graph(ag, 2, policy="never")
    assert plan.reductions == 0 and not any(b.sharded for b in plan.blocks)
    (logits,) = run_reference([localize(ag, plan, r) for r in range(2)], real)
    with torch.no_grad():
        assert_close_to_eager(logits, model(**inputs).logits, "never")


def test_unrecognised_block_runs_replicated_and_says_why():
    class Odd(torch.nn.Module):
        """A block whose intermediate is normalised over its features: not column/row shardable."""

        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(32, 64)
            self.down = torch.nn.Linear(64, 32)

        def forward(self, x):
            h = torch.nn.functional.layer_norm(self.up(x), (64,))
            return self.down(h) + x

    model = Odd().eval()
    x = torch.randn(2, 8, 32)
    (ag, real), = capture(model, x)
    plan = plan_graph(ag, 2)
    (blk,) = [b for b in plan.blocks if not b.sharded]
    assert blk.reason.kind == "reduction" and blk.reason.module == blk.module
    assert "reduces over the sharded dimension" in str(blk.reason)   # what explain prints names the op
    (out,) = run_reference([localize(ag, plan, r) for r in range(2)], real)
    with torch.no_grad():
        assert_close_to_eager(out, model(x), "odd")


class _Between(torch.nn.Module):
    """up -> ``op`` over the features -> down: a block whose middle op decides whether it can be sharded."""

    def __init__(self, op):
        super().__init__()
        self.up, self.down, self.op = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32), op

    def forward(self, x):
        return self.down(self.op(self.up(x))) + x


def test_an_op_without_a_sharding_rule_replicates_its_block():
    # cumsum is in no rule of the table and is not elementwise: the fallback refuses it
    model = _Between(lambda h: torch.cumsum(h, dim=-1)).eval()
    x = torch.randn(2, 8, 32)
    (ag, real), = capture(model, x)
    plan = plan_graph(ag, 2)
    (blk,) = plan.blocks
    assert not blk.sharded and blk.reason.kind == "no_rule" and "cumsum" in blk.reason.op
    assert plan.reductions == 0
    (out,) = run_reference([localize(ag, plan, r) for r in range(2)], real)
    with torch.no_grad():
        assert_close_to_eager(out, model(x), "cumsum between the projections")


def test_relaxing_is_bounded_and_exceeding_the_bound_names_the_graph(monkeypatch):
    # a norm over the sharded features takes one relaxation (replicate the block) and a second round;
    # with the bound at one round that is an internal error that names the graph by its parameters
    from numatp.plan.state import PlanState

    model = _Between(lambda h: torch.nn.functional.layer_norm(h, (64,))).eval()
    (ag, _), = capture(model, torch.randn(2, 8, 32))
    assert plan_graph(ag, 2).blocks[0].reason.kind == "reduction"
    monkeypatch.setattr(PlanState, "max_rounds", staticmethod(lambda matmuls: 1))
    with pytest.raises(RuntimeError, match=r"internal error: planning the graph of up\.weight \.\. down\.bias "
                                           r"\(4 parameters\) did not settle in 1 rounds"):
        plan_graph(ag, 2)


@pytest.mark.parametrize("sharded_wins", [True, False])
def test_auto_policy_follows_the_graph_total(sharded_wins):
    model = zoo.build("gpt2", tiny=True)
    (ag, real), = capture(model, **zoo.example_inputs(model, batch=1, seq=16))
    seen = []

    def decide(block, sockets):
        seen.append(block.kind)
        fast, slow = 1.0, 2.0
        return ({"sharded": fast if sharded_wins else slow, "unsharded": slow if sharded_wins else fast},
                f"test decider for {block.module}")

    plan = plan_graph(ag, 2, policy="auto", decide=decide)
    assert sorted(seen) == ["attention", "attention", "mlp", "mlp"]
    blocks = [b for b in plan.blocks if b.kind not in ("lm_head", "embedding")]
    assert all(b.sharded == sharded_wins for b in blocks)
    # the vocabulary table is sharded with the graph (GPT-2's position table stays replicated)
    tables = {b.module: b.sharded for b in plan.blocks if b.kind == "embedding"}
    assert tables == ({"lm_head": True, "transformer.wpe": False} if sharded_wins else {})
    assert all(b.reason.kind == ("column_row" if sharded_wins else "cost") for b in blocks)
    assert all(b.reason.cost == f"test decider for {b.module}" for b in blocks)
    assert all(b.reason.predicted_ms == ((4e3, 8e3) if sharded_wins else (8e3, 4e3)) for b in blocks)
    assert plan.reductions == (5 if sharded_wins else 0)


def test_auto_policy_counts_only_blocks_the_pass_can_shard():
    # a block the pass must replicate (its norm reduces over the sharded features) is not a candidate:
    # even a decider that predicts a huge gain for it cannot tip the graph into sharding
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
            self.up, self.norm, self.down = torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 32)

        def forward(self, x):
            x = x + self.mlp(x)
            return x + self.down(self.norm(self.up(x)))

    model = Net().eval()
    x = torch.randn(2, 8, 32)
    (ag, real), = capture(model, x)
    seen = []

    def decide(block, sockets):
        seen.append(block.module)
        return {"sharded": 1.0, "unsharded": 1.1}, f"test decider for {block.module}"

    plan = plan_graph(ag, 2, policy="auto", decide=decide)
    assert seen == ["mlp"], seen  # the norm block was never offered
    by_module = {b.module: b for b in plan.blocks}
    assert by_module["mlp"].sharded and by_module["mlp"].reason.kind == "column_row"
    assert by_module["mlp"].reason.cost == "test decider for mlp"
    assert {b.reason.kind for m, b in by_module.items() if m != "mlp"} == {"reduction"}
    assert not any(b.sharded for m, b in by_module.items() if m != "mlp")
    (out,) = run_reference([localize(ag, plan, r) for r in range(2)], real)
    with torch.no_grad():
        assert_close_to_eager(out, model(x), "auto with a replicated block")


class _HeadSplitAttention(torch.nn.Module):
    """Multi-query attention as transformers (5.25 and later) writes Falcon's: the fused projection viewed
    as heads of head_dim, then split by heads into 8 query heads, one key and one value head."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(64, (8 + 2) * 8, bias=False)
        self.dense = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, 8).split([8, 1, 1], dim=-2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.dense(o.transpose(1, 2).reshape(b, s, 64)) + x


@pytest.mark.parametrize("sockets", [2, 4])
def test_a_projection_split_by_heads_is_cut_at_whole_heads(sockets):
    # the split's sizes count heads: the cuts fall at features 64 and 72 (q | k | v), so the query heads are
    # sharded and the single key and value heads are computed by every socket
    model = _HeadSplitAttention().eval()
    x = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(0))
    (ag, real), = capture(model, x)
    plan = plan_graph(ag, sockets)
    (attn,) = [b for b in plan.blocks if b.kind == "attention"]
    assert attn.sharded, attn.reason
    (qkv,) = plan.weights["qkv.weight"]
    per = 64 // sockets
    held = [[i for lo, hi in s.intervals for i in range(lo, hi)] for s in qkv.placement.splits]
    assert held == [[*range(r * per, (r + 1) * per), *range(64, 80)] for r in range(sockets)]
    (out,) = run_reference([localize(ag, plan, r) for r in range(sockets)], real)
    with torch.no_grad():
        assert_close_to_eager(out, model(x), "head split")
