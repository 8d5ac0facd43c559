"""Tests of numatp.zoo: tiny presets build and run, weights are seeded and tied, full configs match the papers."""

from __future__ import annotations

import pytest
import torch

from numatp.zoo import PRESETS, build, config, describe, example_inputs

pytestmark = pytest.mark.unit

HEAD_CLASSES = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Model"),
    "bert": ("BertForMaskedLM", "BertModel"),
    "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextModel"),
    "llama": ("LlamaForCausalLM", "LlamaModel"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Model"),
    "phi3": ("Phi3ForCausalLM", "Phi3Model"),
}

# Published parameter counts of the source checkpoints (model cards / config arithmetic).
PUBLISHED = {
    "gpt2": 124e6,
    "gpt2-medium": 355e6,
    "gpt2-large": 774e6,
    "bert-small": 29e6,
    "bert-large": 336e6,
    "gemma3-270m": 268e6,
    "llama": 1.1e9,
    "qwen2.5-0.5b": 494e6,
    "llama-3.2-1b": 1.24e9,
    "phi-3-mini": 3.82e9,
}


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_presets_are_the_ten_models():
    assert PRESETS == ("gpt2", "gpt2-medium", "gpt2-large", "bert-small", "bert-large", "gemma3-270m", "llama",
                       "qwen2.5-0.5b", "llama-3.2-1b", "phi-3-mini")


@pytest.mark.parametrize("head", [True, False], ids=["head", "base"])
@pytest.mark.parametrize("name", PRESETS)
def test_tiny_builds_and_runs(name: str, head: bool):
    model = build(name, tiny=True, head=head)
    cfg = model.config
    assert type(model).__name__ == HEAD_CLASSES[cfg.model_type][0 if head else 1]
    assert not model.training
    assert cfg._attn_implementation == "sdpa"
    assert cfg.use_cache is False
    assert cfg.num_hidden_layers == 2
    with torch.no_grad():
        out = model(**example_inputs(model, batch=2, seq=24))
    if head:
        assert out.logits.shape == (2, 24, cfg.vocab_size)
    else:
        assert out.last_hidden_state.shape == (2, 24, cfg.hidden_size)
    assert getattr(out, "past_key_values", None) is None


@pytest.mark.parametrize("name", ["gpt2", "bert-small", "gemma3-270m", "llama"])
def test_eager_and_bf16(name: str):
    model = build(name, tiny=True, dtype=torch.bfloat16, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with torch.no_grad():
        logits = model(**example_inputs(model, batch=1, seq=20)).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_bad_attn_implementation_is_refused():
    with pytest.raises(ValueError, match="'flash'.*'sdpa' or 'eager'"):
        build("gpt2", tiny=True, attn_implementation="flash")


@pytest.mark.parametrize("name", ["gpt2", "gemma3-270m", "llama"])
def test_weights_are_deterministic_by_seed(name: str):
    a, b, c = (build(name, tiny=True, seed=s) for s in (0, 0, 1))
    for (key, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=key)
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), key
    assert all(torch.isfinite(p).all() for p in a.parameters())


@pytest.mark.parametrize(("name", "tied"), [("gpt2", True), ("gemma3-270m", True), ("llama", False),
                                            ("qwen2.5-0.5b", True), ("llama-3.2-1b", True)])
def test_tied_embeddings_are_kept(name: str, tied: bool):
    model = build(name, tiny=True)
    same = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert same is tied


def test_tiny_configs_keep_structure():
    gemma, gemma_full = config("gemma3-270m", tiny=True), config("gemma3-270m")
    assert gemma.num_key_value_heads == 1
    assert set(gemma.layer_types) == {"sliding_attention", "full_attention"}
    assert gemma.sliding_window < 24
    assert gemma.hidden_activation == gemma_full.hidden_activation == "gelu_pytorch_tanh"
    assert gemma.rope_parameters == gemma_full.rope_parameters
    llama, llama_full = config("llama", tiny=True), config("llama")
    ratio = llama_full.num_attention_heads // llama_full.num_key_value_heads
    assert llama.num_attention_heads // llama.num_key_value_heads == ratio == 8
    assert llama.num_key_value_heads == llama_full.num_key_value_heads == 4
    assert llama.hidden_act == "silu" and llama.tie_word_embeddings is False
    for name in PRESETS:
        small, full = describe(name, tiny=True), describe(name)
        assert (small["family"], small["mlp"]) == (full["family"], full["mlp"])
        assert small["vocab"] == 512 and small["layers"] == 2


def test_gemma_tiny_exercises_the_sliding_window():
    model = build("gemma3-270m", tiny=True)
    window = model.config.sliding_window
    short, long = example_inputs(model, batch=1, seq=window), example_inputs(model, batch=1, seq=2 * window)
    with torch.no_grad():
        short_a, long_a = model(**short).logits, model(**long).logits
        model.config.sliding_window = 4 * window
        short_b, long_b = model(**short).logits, model(**long).logits
    torch.testing.assert_close(short_a, short_b)  # within the window nothing is masked
    assert not torch.allclose(long_a, long_b)  # beyond it the sliding layer sees fewer tokens


def test_example_inputs():
    bert = example_inputs(config("bert-small", tiny=True), batch=3, seq=7, seed=5)
    assert set(bert) == {"input_ids", "token_type_ids", "attention_mask"}
    assert all(t.shape == (3, 7) and t.dtype == torch.long for t in bert.values())
    assert bert["attention_mask"].eq(1).all()
    llama = example_inputs(config("llama"), batch=2, seq=64, seed=5)
    assert set(llama) == {"input_ids"}
    assert 0 <= llama["input_ids"].min() and llama["input_ids"].max() < 32000
    assert torch.equal(llama["input_ids"], example_inputs(config("llama"), batch=2, seq=64, seed=5)["input_ids"])
    with pytest.raises(ValueError, match="seq=200"):
        example_inputs(config("gpt2", tiny=True), batch=1, seq=200)


def test_unknown_name_error_names_value_presets_and_way_out():
    with pytest.raises(ValueError) as info:
        build("gpt-5")
    message = str(info.value)
    assert "'gpt-5'" in message
    assert all(name in message for name in PRESETS)
    assert "config.json" in message
    with pytest.raises(ValueError, match="'nope'"):
        config("nope")


@pytest.mark.parametrize("name", PRESETS)
def test_full_parameter_counts_match_published(name: str):
    # Counted on the meta device: nothing of the full model is allocated.
    assert describe(name)["parameters"] == pytest.approx(PUBLISHED[name], rel=0.02)


def test_full_config_numbers():
    assert describe("gpt2")["parameters"] == 124_439_808
    assert describe("llama")["parameters"] == 1_100_048_384
    g = describe("gemma3-270m")
    assert (g["layers"], g["hidden"], g["heads"], g["kv_heads"], g["head_dim"]) == (18, 640, 4, 1, 256)
    assert (g["intermediate"], g["vocab"], g["mlp"]) == (2048, 262144, "geglu")
    assert config("gemma3-270m").layer_types.count("full_attention") == 3
    assert config("gemma3-270m").sliding_window == 512
    ll = describe("llama")
    assert (ll["layers"], ll["hidden"], ll["heads"], ll["kv_heads"], ll["intermediate"]) == (22, 2048, 32, 4, 5632)
    assert ll["mlp"] == "swiglu"
    b = describe("bert-large")
    assert (b["layers"], b["hidden"], b["heads"], b["intermediate"], b["mlp"]) == (24, 1024, 16, 4096, "gelu")
    s = describe("bert-small")
    assert (s["layers"], s["hidden"], s["heads"], s["intermediate"]) == (4, 512, 8, 2048)
    assert [describe(n)["layers"] for n in ("gpt2", "gpt2-medium", "gpt2-large")] == [12, 24, 36]


@pytest.mark.parametrize("name", ["llama", "bert-small"])
def test_local_checkpoint_round_trip(name: str, tmp_path):
    original = build(name, tiny=True, seed=3)
    original.save_pretrained(tmp_path)
    loaded = build(str(tmp_path))
    assert type(loaded) is type(original) and not loaded.training
    inputs = example_inputs(loaded, batch=1, seq=12)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, original(**inputs).logits)
    base = build(str(tmp_path), head=False)
    assert type(base).__name__ == HEAD_CLASSES[original.config.model_type][1]
    assert describe(str(tmp_path))["parameters"] == describe(name, tiny=True)["parameters"]
    with pytest.raises(ValueError, match="tiny=True applies to presets only"):
        build(str(tmp_path), tiny=True)


def test_weights_that_do_not_fit_are_refused_with_the_way_out():
    # phi-3-mini's 3.8B parameters are 14.2 GiB in fp32: against 10 GiB free, building is refused before
    # anything is allocated, and the message names bf16 (7.1 GiB) and the tiny twin
    from dataclasses import replace

    from numatp.topology import MachineFacts

    small = replace(MachineFacts.detect(), memory_available=10 * 2**30)
    with pytest.raises(MemoryError, match=r"'phi-3-mini' in float32 needs 14.2 GiB.*10.0 GiB available.*bfloat16.*tiny"):
        build("phi-3-mini", machine=small)
    assert build("phi-3-mini", tiny=True, machine=small).config.num_hidden_layers == 2   # the tiny twin builds all the same


@pytest.mark.parametrize("source", ["preset", "checkpoint"])
def test_a_shards_only_model_runs_through_numatp_as_the_full_build(source, tmp_path):
    import numatp
    from tests.helpers import fresh_dynamo, shared_cpu_topology

    fresh_dynamo()
    full = build("llama", tiny=True)
    name = "llama"
    if source == "checkpoint":
        full.save_pretrained(tmp_path / "ckpt")
        name = str(tmp_path / "ckpt")
    lazy = build(name, tiny=name == "llama", shards_only=True)
    with torch.no_grad():   # numatp reads the sources, never the parameters: poison them
        for p in lazy.parameters():
            if p.dim() >= 2:
                p.fill_(float("nan"))
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    fast = numatp.compile(lazy, sockets=shared_cpu_topology(2), mode="eager")
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, full(ids).logits, atol=2e-5, rtol=1e-4)
    got = fast.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, full.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
    read = sum(s.read_elements for s in lazy.numatp_sources.values())
    matrices = sum(p.numel() for p in full.parameters() if p.dim() >= 2)
    assert matrices <= read <= 2 * matrices   # each socket's part (the replicated read once per socket)


def test_shards_only_needs_safetensors(tmp_path):
    full = build("llama", tiny=True)
    (tmp_path / "ckpt").mkdir()
    full.config.save_pretrained(tmp_path / "ckpt")
    torch.save(full.state_dict(), tmp_path / "ckpt" / "pytorch_model.bin")   # a checkpoint without safetensors
    with pytest.raises(ValueError, match="has no model.safetensors"):
        build(str(tmp_path / "ckpt"), shards_only=True)
