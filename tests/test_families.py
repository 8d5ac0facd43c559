"""Block coverage of today's model families: tiny configs through ``numatp.compile`` on 2 and 4 sockets.

Each family brings a form of attention or projection the pass must shard: grouped-query attention through
SDPA's native grouping (Llama, Qwen2 with 14 query heads in 2 K/V groups, Mistral with a sliding window),
one K/V head (Gemma 3), fused QKV and gate/up projections cut by slices (Phi-3), eager math attention
with soft-capping (Gemma 2), per-head interleaved fused QKV with an ALiBi bias (Bloom), one fused
projection for the query heads and a single K and V head read by slice and index, attention and MLP in
parallel (Falcon), an encoder
with a masked-LM head (RoBERTa). Every attention and MLP block must be sharded, two reductions per layer,
and the result must equal eager, with no mask and with a padding mask. The threaded runtime runs the
socket programs (uncompiled segments: what is checked is the pass and the runtime, not Inductor). By
default every family runs on 2 sockets; 4 sockets are slow (``-m slow``), the GQA split over 4 stays.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import numatp
from numatp import zoo
from numatp.plan import Colwise, IndexSet, capture, plan_graph
from numatp.plan.propagate import kv_head_sets
from numatp.plan.propagate import group_head_sets
from tests.helpers import assert_close_to_eager, fresh_dynamo, shared_cpu_topology

LAYERS = 2
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
               max_position_embeddings=64)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON, num_attention_heads=8, num_key_value_heads=2),
    "qwen2": lambda: transformers.Qwen2Config(**{**_COMMON, "hidden_size": 112}, num_attention_heads=14,
                                              num_key_value_heads=2, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, num_attention_heads=8, num_key_value_heads=2,
                                                  sliding_window=6),
    "phi3": lambda: transformers.Phi3Config(**_COMMON, num_attention_heads=8, num_key_value_heads=4,
                                            pad_token_id=0),
    "gemma2": lambda: transformers.Gemma2Config(**_COMMON, num_attention_heads=8, num_key_value_heads=4,
                                                head_dim=8),
    "gemma3": lambda: transformers.Gemma3TextConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=1,
                                                    head_dim=16, sliding_window=6),
    "bloom": lambda: transformers.BloomConfig(vocab_size=256, hidden_size=64, n_layer=LAYERS, n_head=8),
    "falcon": lambda: transformers.FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=LAYERS,
                                                num_attention_heads=8, multi_query=True, parallel_attn=True,
                                                new_decoder_architecture=False, bias=False),
    "roberta": lambda: transformers.RobertaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=LAYERS,
                                                  num_attention_heads=4, intermediate_size=128,
                                                  max_position_embeddings=66),
}


def _model(family: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    cls = transformers.AutoModelForMaskedLM if family == "roberta" else transformers.AutoModelForCausalLM
    cfg = CONFIGS[family]()
    # transformers runs Gemma 2 and Bloom with their eager (math) attention only
    attn = "eager" if family in ("gemma2", "bloom") else "sdpa"
    return cls.from_config(cfg, attn_implementation=attn, dtype=dtype).eval()


@pytest.mark.integration
@pytest.mark.parametrize("sockets", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_every_block_sharded_and_equal_to_eager(family, sockets):
    fresh_dynamo()
    model = _model(family)
    ids = torch.randint(5, 250, (2, 12), generator=torch.Generator().manual_seed(1))
    padded = torch.ones_like(ids)
    padded[0, :3] = 0   # left padding of the first row
    compiled = numatp.compile(model, sockets=shared_cpu_topology(sockets), mode="eager")
    masks = (None, padded) if sockets == 2 else (None,)
    with torch.inference_mode():
        for mask in masks:
            kw = {"input_ids": ids} if mask is None else {"input_ids": ids, "attention_mask": mask}
            assert_close_to_eager(compiled(**kw).logits, model(**kw).logits,
                                  f"{family} on {sockets} sockets, {'no' if mask is None else 'padding'} mask")
            plan = numatp.plans(compiled)[-1]
            sharded = [b.kind for b in plan.blocks if b.sharded]
            replicated = [(b.kind, b.module, b.reason) for b in plan.blocks if not b.sharded]
            assert sharded.count("attention") == LAYERS and sharded.count("mlp") >= LAYERS, replicated
            assert "lm_head" in sharded, replicated
            assert plan.reductions == 2 * LAYERS + 1   # and one for the vocabulary-parallel embedding


@pytest.mark.integration
@pytest.mark.parametrize("family", list(CONFIGS))
def test_bf16_equal_to_eager_within_rounding(family):
    fresh_dynamo()
    model = _model(family, torch.bfloat16)
    ids = torch.randint(5, 250, (1, 12), generator=torch.Generator().manual_seed(2))
    compiled = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")
    with torch.inference_mode():
        assert_close_to_eager(compiled(input_ids=ids).logits, model(input_ids=ids).logits, f"{family} bf16")
    sharded = [b.kind for b in numatp.plans(compiled)[0].blocks if b.sharded]
    assert sharded.count("attention") == LAYERS and "embedding" in sharded


@pytest.mark.integration
def test_gqa_with_fewer_kv_heads_than_sockets_computes_each_sockets_own_kv_head():
    # Qwen2's 14 query heads in 2 K/V groups on 4 sockets: two sockets share each K/V head and split its
    # 7 query heads 4 + 3; each computes its one K/V head from its own column slice of k_proj
    fresh_dynamo()
    model = _model("qwen2")
    compiled = numatp.compile(model, sockets=shared_cpu_topology(4), mode="eager")
    ids = torch.randint(0, 256, (2, 10))
    padded = torch.ones_like(ids)
    padded[1, :4] = 0
    with torch.inference_mode():
        # without a mask transformers hands SDPA the 2 K/V heads (its own grouping); with one it expands
        # them per query head first (repeat_kv): two graphs, both split along the groups
        for kw in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": padded}):
            assert_close_to_eager(compiled(**kw).logits, model(**kw).logits, f"qwen2 on 4 sockets, {list(kw)}")
    plans = numatp.plans(compiled)
    assert len(plans) == 2
    head_dim = 112 // 14
    for plan in plans:
        (k,) = plan.weights["model.layers.0.self_attn.k_proj.weight"]
        (q,) = plan.weights["model.layers.0.self_attn.q_proj.weight"]
        assert isinstance(k.placement, Colwise) and isinstance(q.placement, Colwise)
        assert [str(s) for s in k.placement.splits] == [f"0:{head_dim}"] * 2 + [f"{head_dim}:{2 * head_dim}"] * 2
        assert [len(s) // head_dim for s in q.placement.splits] == [4, 3, 4, 3]


@pytest.mark.unit
def test_group_head_sets():
    assert group_head_sets(8, 8, 4, 2) == (IndexSet.range(0, 4), IndexSet.range(4, 8))     # whole groups
    assert group_head_sets(4, 8, 4, 2) == (IndexSet.range(0, 2), IndexSet.range(2, 4))
    assert group_head_sets(4, 4, 1, 4) == tuple(IndexSet.range(r, r + 1) for r in range(4))  # MQA
    assert group_head_sets(1, 4, 1, 4) == (IndexSet.range(0, 1),) * 4
    assert group_head_sets(6, 6, 3, 2) is None   # 3 groups cannot be split evenly over 2 sockets
    assert group_head_sets(4, 4, 2, 8) is None   # fewer query heads per group than sockets sharing it


@pytest.mark.unit
def test_kv_head_sets_finds_each_sockets_kv_heads_or_refuses():
    q = (IndexSet.range(0, 4), IndexSet.range(4, 7), IndexSet.range(7, 11), IndexSet.range(11, 14))
    assert kv_head_sets(q, 14, 2) == (IndexSet.range(0, 1),) * 2 + (IndexSet.range(1, 2),) * 2
    # an even split of 14 heads: socket 1 would hold heads 4-7, of both groups, 3 + 1: no local GQA layout
    uneven = (IndexSet.range(0, 4), IndexSet.range(4, 8), IndexSet.range(8, 11), IndexSet.range(11, 14))
    assert kv_head_sets(uneven, 14, 2) is None


@pytest.mark.unit
@pytest.mark.parametrize("sockets", [2, 4])
@pytest.mark.parametrize("name", zoo.PRESETS)
def test_every_preset_shards_every_layer_block(name, sockets):
    # plan only, at the tiny twins' shapes (the full presets: tests/test_full_presets.py, slow)
    model = zoo.build(name, tiny=True)
    (ag, _), = capture(model, **zoo.example_inputs(model, batch=1, seq=16))
    plan = plan_graph(ag, sockets)
    layer_blocks = [b for b in plan.blocks if b.kind == "attention" or ".layer" in b.module or ".h." in b.module]
    assert len(layer_blocks) == 2 * model.config.num_hidden_layers
    assert all(b.sharded for b in layer_blocks), [(b.module, b.reason) for b in layer_blocks if not b.sharded]
    assert plan.reductions == 2 * model.config.num_hidden_layers + 1


@pytest.mark.integration
@pytest.mark.parametrize("sockets", [2, 4])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_vocabulary_parallel_embedding(family, sockets):
    # GPT-2 ties its LM head to the table: one shard per socket serves both; Llama's are separate
    fresh_dynamo()
    model = zoo.build(family, tiny=True)
    vocab = model.config.vocab_size
    compiled = numatp.compile(model, sockets=shared_cpu_topology(sockets), mode="eager")
    # the first and last row of every quarter of the table: both edges of each socket's range
    edges = [q * vocab // 4 + d for q in range(4) for d in (0, vocab // 4 - 1)]
    ids = torch.tensor([edges + [7, 300, 129, 511 % vocab]])
    with torch.inference_mode():
        assert_close_to_eager(compiled(input_ids=ids).logits, model(input_ids=ids).logits,
                              f"{family} on {sockets} sockets")
    plan = numatp.plans(compiled)[0]
    table = "lm_head.weight" if family == "gpt2" else "model.embed_tokens.weight"
    uses = plan.weights[table]
    assert len(uses) == 1 and isinstance(uses[0].placement, Colwise), uses
    splits = uses[0].placement.splits
    assert [len(s.intervals) for s in splits] == [1] * sockets
    assert sorted(i for s in splits for i in s.indices()) == list(range(vocab))
    (block,) = [b for b in plan.blocks if b.kind == "embedding" and b.sharded]
    assert block.reason.kind == "vocab_rows" and block.reason.tied == (family == "gpt2")
    # each socket holds its rows only: the table's bytes are split, not copied
    row_bytes = uses[0].nbytes // vocab
    assert [uses[0].local_bytes(r) for r in range(sockets)] == [len(s) * row_bytes for s in splits]
    assert plan.reductions == 2 * model.config.num_hidden_layers + 1
