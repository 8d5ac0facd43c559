"""Configuration tables for the zoo's presets: real sizes and their tiny test twins.

Every full preset copies the numbers of a public checkpoint's ``config.json`` (the model id is
named beside it); the tiny twin keeps the family, head layout, MLP kind, norms, activation and
RoPE of the full one, and shrinks depth, width and vocabulary so tests run in milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from transformers import (BertConfig, Gemma3TextConfig, GPT2Config, LlamaConfig, Phi3Config, PretrainedConfig,
                          Qwen2Config)

__all__: list[str] = []  # private module: the public surface is numatp.zoo

_C = TypeVar("_C", bound=PretrainedConfig)


def _gpt2(*, layers: int, hidden: int, heads: int, vocab: int = 50257, positions: int = 1024) -> GPT2Config:
    # GPT-2's MLP is 4 x hidden with gelu_new, and its LM head is tied to wte.
    return GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        # GPT-2's <|endoftext|> is the last token; tiny vocabularies keep it in range.
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
    )


def _bert(
    *, layers: int, hidden: int, heads: int, intermediate: int, vocab: int = 30522, positions: int = 512
) -> BertConfig:
    return BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        hidden_act="gelu",
        max_position_embeddings=positions,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
    )


def _gemma3(
    *,
    layer_types: list[str],
    hidden: int,
    heads: int,
    head_dim: int,
    intermediate: int,
    sliding_window: int,
    vocab: int = 262144,
    positions: int = 32768,
) -> Gemma3TextConfig:
    # One KV head shared by all query heads (MQA), q/k RMSNorm, GeGLU with gelu_pytorch_tanh;
    # local (sliding) layers use RoPE base 1e4, global (full) layers 1e6.
    return Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=len(layer_types),
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=head_dim,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=positions,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=head_dim,
        sliding_window=sliding_window,
        layer_types=layer_types,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        tie_word_embeddings=True,
    )


def _swiglu_decoder(
    cls: Callable[..., _C], *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
    vocab: int, positions: int, eps: float, rope: dict, tied: bool, **extra,
) -> _C:
    # The Llama layout that Llama, Qwen2 and their kin share: GQA, SwiGLU (silu gate), RMSNorm, RoPE.
    return cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_act="silu",
        max_position_embeddings=positions,
        rms_norm_eps=eps,
        rope_parameters=rope,
        tie_word_embeddings=tied,
        **extra,
    )


def _llama(*, vocab: int = 32000, positions: int = 2048, **sizes) -> LlamaConfig:
    # TinyLlama: RoPE base 1e4, untied LM head.
    return _swiglu_decoder(LlamaConfig, vocab=vocab, positions=positions, eps=1e-5,
                           rope={"rope_type": "default", "rope_theta": 10000.0}, tied=False, **sizes)


def _qwen2(*, vocab: int = 151936, positions: int = 32768, **sizes) -> Qwen2Config:
    # Qwen2.5: biased q/k/v projections, RoPE base 1e6, tied embeddings.
    return _swiglu_decoder(Qwen2Config, vocab=vocab, positions=positions, eps=1e-6,
                           rope={"rope_type": "default", "rope_theta": 1000000.0}, tied=True,
                           use_sliding_window=False, **sizes)


def _llama3(*, vocab: int = 128256, positions: int = 131072, **sizes) -> LlamaConfig:
    # Llama 3.2: RoPE base 5e5 with Llama 3's frequency scaling, tied embeddings.
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return _swiglu_decoder(LlamaConfig, vocab=vocab, positions=positions, eps=1e-5, rope=rope, tied=True,
                           head_dim=sizes["hidden"] // sizes["heads"], **sizes)


def _phi3(*, vocab: int = 32064, positions: int = 4096, window: int = 2047, pad: int = 32000,
          **sizes) -> Phi3Config:
    # Phi-3-mini: fused qkv_proj and gate_up_proj (each cut into its parts by slices), MHA, RoPE base 1e4,
    # untied LM head, a sliding window one short of the context.
    return _swiglu_decoder(Phi3Config, vocab=vocab, positions=positions, eps=1e-5,
                           rope={"rope_type": "default", "rope_theta": 10000.0}, tied=False,
                           sliding_window=window, pad_token_id=pad, eos_token_id=pad, **sizes)


# google/gemma-3-270m: 18 layers as three blocks of 5 sliding + 1 full.
_GEMMA3_270M_LAYERS = (["sliding_attention"] * 5 + ["full_attention"]) * 3

FULL: dict[str, Callable[[], PretrainedConfig]] = {
    # openai-community/gpt2 (124M)
    "gpt2": lambda: _gpt2(layers=12, hidden=768, heads=12),
    # openai-community/gpt2-medium (355M)
    "gpt2-medium": lambda: _gpt2(layers=24, hidden=1024, heads=16),
    # openai-community/gpt2-large (774M)
    "gpt2-large": lambda: _gpt2(layers=36, hidden=1280, heads=20),
    # prajjwal1/bert-small (L=4, H=512)
    "bert-small": lambda: _bert(layers=4, hidden=512, heads=8, intermediate=2048),
    # google-bert/bert-large-uncased (336M)
    "bert-large": lambda: _bert(layers=24, hidden=1024, heads=16, intermediate=4096),
    # google/gemma-3-270m
    "gemma3-270m": lambda: _gemma3(
        layer_types=list(_GEMMA3_270M_LAYERS), hidden=640, heads=4, head_dim=256, intermediate=2048, sliding_window=512
    ),
    # TinyLlama/TinyLlama-1.1B-Chat-v1.0
    "llama": lambda: _llama(layers=22, hidden=2048, heads=32, kv_heads=4, intermediate=5632),
    # Qwen/Qwen2.5-0.5B: 14 query heads in 2 K/V groups
    "qwen2.5-0.5b": lambda: _qwen2(layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864),
    # meta-llama/Llama-3.2-1B: 32 query heads in 8 K/V groups
    "llama-3.2-1b": lambda: _llama3(layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192),
    # microsoft/Phi-3-mini-4k-instruct (3.8B: 15.3 GB in fp32, 7.6 GB in bf16)
    "phi-3-mini": lambda: _phi3(layers=32, hidden=3072, heads=32, kv_heads=32, intermediate=8192),
}

# Tiny twins: 2 layers, vocab 512, 128 positions. Head layouts keep the full ones: gemma 1 KV
# head; llama TinyLlama's 32 query / 4 KV heads (8 per KV head, head_dim 8). Gemma keeps one
# sliding and one full layer with a window of 16, so sequences past 16 use the sliding mask.
TINY: dict[str, Callable[[], PretrainedConfig]] = {
    "gpt2": lambda: _gpt2(layers=2, hidden=64, heads=4, vocab=512, positions=128),
    "gpt2-medium": lambda: _gpt2(layers=2, hidden=64, heads=4, vocab=512, positions=128),
    "gpt2-large": lambda: _gpt2(layers=2, hidden=80, heads=5, vocab=512, positions=128),
    "bert-small": lambda: _bert(layers=2, hidden=64, heads=4, intermediate=256, vocab=512, positions=128),
    "bert-large": lambda: _bert(layers=2, hidden=64, heads=4, intermediate=256, vocab=512, positions=128),
    "gemma3-270m": lambda: _gemma3(
        layer_types=["sliding_attention", "full_attention"],
        hidden=64,
        heads=4,
        head_dim=16,
        intermediate=256,
        sliding_window=16,
        vocab=512,
        positions=128,
    ),
    "llama": lambda: _llama(layers=2, hidden=256, heads=32, kv_heads=4, intermediate=704, vocab=512, positions=128),
    # 14 / 2 heads as the full model (head_dim 8), so 4 sockets share each K/V head
    "qwen2.5-0.5b": lambda: _qwen2(layers=2, hidden=112, heads=14, kv_heads=2, intermediate=256, vocab=512,
                                   positions=128),
    "llama-3.2-1b": lambda: _llama3(layers=2, hidden=256, heads=32, kv_heads=8, intermediate=512, vocab=512,
                                    positions=128),
    # a window of 16 so that sequences past it use the sliding mask
    "phi-3-mini": lambda: _phi3(layers=2, hidden=128, heads=8, kv_heads=8, intermediate=256, vocab=512,
                                positions=128, window=16, pad=0),
}

# Short tags for describe(): which MLP each family uses.
MLP_KIND: dict[str, str] = {"gpt2": "gelu", "bert": "gelu", "gemma3_text": "geglu", "llama": "swiglu",
                            "qwen2": "swiglu", "phi3": "swiglu"}
