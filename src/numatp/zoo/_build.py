"""Building the zoo's models: configs of the presets, random weights, local checkpoints, inputs.

The public names are re-exported by :mod:`numatp.zoo`; this module imports torch and transformers.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig
from transformers.initialization import no_init_weights

from numatp.topology.resources import MachineFacts
from numatp.zoo._presets import FULL, MLP_KIND, TINY
from numatp.zoo._source import PRESETS, resolve

__all__ = ["build", "can_generate", "config", "describe", "example_inputs"]

_INIT_STD = 0.02

# model_type -> (class with the LM / MLM head, base class)
_CLASSES: dict[str, tuple[str, str]] = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Model"),
    "bert": ("BertForMaskedLM", "BertModel"),
    "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextModel"),
    "llama": ("LlamaForCausalLM", "LlamaModel"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Model"),
    "phi3": ("Phi3ForCausalLM", "Phi3Model"),
}

_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def config(name: str, *, tiny: bool = False) -> PretrainedConfig:
    """The ``transformers`` config of preset ``name``, with ``use_cache=False`` (prefill only).

    ``tiny=True`` gives the shrunken twin (2 layers, vocab 512) of the same family and structure.
    Each call returns a fresh config that the caller may modify.
    """
    table = TINY if tiny else FULL
    if name not in table:
        source = resolve(name)  # raises the unknown-name or no-such-folder error
        raise ValueError(f"{name!r} is a checkpoint folder ({source.folder}), not a preset: config() takes one of "
                         f"{', '.join(PRESETS)}; read a folder's config with transformers.AutoConfig")
    cfg = table[name]()
    cfg.use_cache = False
    return cfg


def _checkpoint_folder(name_or_path: str, *, tiny: bool) -> Path | None:
    """The checkpoint folder ``name_or_path`` names, or None for a preset (:func:`numatp.zoo.resolve`
    decides; it raises for anything else)."""
    source = resolve(name_or_path)
    if source.folder is not None and tiny:
        raise ValueError(
            f"tiny=True applies to presets only, not to the checkpoint folder {name_or_path!r}; "
            f"drop tiny=True or pass one of {', '.join(PRESETS)}"
        )
    return source.folder


def _resolve_config(name_or_path: str, *, tiny: bool = False) -> PretrainedConfig:
    folder = _checkpoint_folder(name_or_path, tiny=tiny)
    if folder is None:
        return config(name_or_path, tiny=tiny)
    cfg = transformers.AutoConfig.from_pretrained(folder)
    cfg.use_cache = False
    return cfg


def _model_class(cfg: PretrainedConfig, *, head: bool) -> type[transformers.PreTrainedModel]:
    if cfg.model_type not in _CLASSES:
        raise ValueError(
            f"model type {cfg.model_type!r} is not in the zoo: supported types are "
            f"{', '.join(sorted(_CLASSES))}; build the model with transformers directly"
        )
    return getattr(transformers, _CLASSES[cfg.model_type][0 if head else 1])


def can_generate(name_or_path: str, *, tiny: bool = False) -> bool:
    """Whether :func:`build` gives a model that generates text (a decoder with an LM head, not BERT's
    masked-LM encoder)."""
    cfg = _resolve_config(name_or_path, tiny=tiny)
    if cfg.model_type == "bert" or getattr(cfg, "is_encoder_decoder", False):
        return False
    return cfg.model_type not in _CLASSES or _model_class(cfg, head=True).can_generate()


@torch.no_grad()
def _fill_random(model: torch.nn.Module, seed: int, draw: bool = True) -> dict[str, Any]:
    """Initialise every parameter deterministically, fast (one normal_ pass, no kaiming_uniform).

    Matrices and embeddings get N(0, 0.02); biases 0; LayerNorm scales 1. RMSNorm scales keep
    the value their constructor gave them (ones for Llama, zeros for Gemma's ``1 + weight``).
    Tied parameters appear once in ``named_parameters`` and so are filled once. ``draw=False`` leaves the
    matrices unwritten and returns, per matrix, a source that draws its values again (the generator
    advanced as the full draw advances it, one temporary matrix at a time).
    """
    from numatp.zoo._shards import Regenerated

    gen = torch.Generator().manual_seed(seed)
    layer_norms = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) and m.weight is not None}
    sources: dict[str, Any] = {}
    for name, param in model.named_parameters():
        if param.dim() >= 2 and not draw:
            sources[name] = Regenerated(gen.get_state(), tuple(param.shape), param.dtype, _INIT_STD)
            torch.empty(param.shape, dtype=param.dtype).normal_(0.0, _INIT_STD, generator=gen)
        elif param.dim() >= 2:
            param.normal_(0.0, _INIT_STD, generator=gen)
        elif name.endswith("bias"):
            param.zero_()
        elif id(param) in layer_norms:
            param.fill_(1.0)
    return sources


def _check_attn(attn_implementation: str) -> None:
    if attn_implementation not in _ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation={attn_implementation!r} is not supported: the zoo builds "
            f"{' or '.join(repr(a) for a in _ATTN_IMPLEMENTATIONS)}; pass one of those"
        )


def _check_memory(name: str, cfg: PretrainedConfig, *, head: bool, dtype: torch.dtype,
                  machine: MachineFacts | None) -> None:
    """Refuse, with the way out, to build random weights that would not fit in the machine's free memory
    (``machine``: this one now where None; building would be killed by the kernel instead)."""
    need = _count_parameters(cfg, head=head) * torch.empty(0, dtype=dtype).element_size()
    free = (machine or MachineFacts.detect()).memory_available
    if free is not None and need > 0.9 * free:
        raise MemoryError(
            f"{name!r} in {str(dtype).removeprefix('torch.')} needs {need / 2**30:.1f} GiB of weights and this "
            f"machine has {free / 2**30:.1f} GiB available; pass dtype=torch.bfloat16 (`--dtype bfloat16`: "
            "half the bytes, the same blocks and plan) or tiny=True (`--tiny`) for the 2-layer twin"
        )


def build(
    name_or_path: str,
    *,
    head: bool = True,
    tiny: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    machine: MachineFacts | None = None,
    shards_only: bool = False,
) -> transformers.PreTrainedModel:
    """Build a preset with random weights, or load a local checkpoint, in eval mode and ``dtype``.

    ``head=True`` gives the LM-head variant (``GPT2LMHeadModel``, ``BertForMaskedLM``,
    ``Gemma3ForCausalLM``, ``LlamaForCausalLM``); ``head=False`` the base model. Weights are
    deterministic by ``seed``; tied embeddings (GPT-2, Gemma) stay tied. KV caching is off.
    A folder with a ``config.json`` is loaded with ``from_pretrained`` (``AutoModelForCausalLM``,
    ``AutoModelForMaskedLM`` for BERT, or ``AutoModel`` when ``head=False``). Random weights that would
    not fit in the memory ``machine`` has available (this machine's now, where None) are refused first.

    ``shards_only=True``: the parameters are allocated and never written (none of their pages resident);
    ``numatp.compile`` reads each socket's shard from the checkpoint's safetensors slices, or draws a
    preset's again from its generator state (the same values as a full build): a process of a compile
    across hosts holds only its own shards (:mod:`numatp.zoo._shards`). Such a model runs only through
    ``numatp.compile``: a plain forward computes with unwritten parameters.
    """
    _check_attn(attn_implementation)
    folder = _checkpoint_folder(name_or_path, tiny=tiny)
    if folder is not None:
        cfg = transformers.AutoConfig.from_pretrained(folder)
        if not head:
            auto: Any = transformers.AutoModel
        elif cfg.model_type == "bert":
            auto = transformers.AutoModelForMaskedLM
        else:
            auto = transformers.AutoModelForCausalLM
        if shards_only:
            from numatp.zoo._shards import checkpoint_sources
            cfg.use_cache = False
            with no_init_weights():
                model = auto.from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
            model.tie_weights()
            return _shards_only(model, checkpoint_sources(folder, model, dtype))
        model = auto.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
        model.config.use_cache = False
        return model.eval()

    cfg = _resolve_config(name_or_path, tiny=tiny)
    cls = _model_class(cfg, head=head)
    if not shards_only:
        _check_memory(name_or_path, cfg, head=head, dtype=dtype, machine=machine)
    # Skip torch's and transformers' default init (slow kaiming_uniform over ~1B parameters);
    # _fill_random then writes every parameter once.
    with no_init_weights():
        model = cls._from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
    model.tie_weights()
    if shards_only:
        return _shards_only(model, _fill_random(model, seed, draw=False))
    _fill_random(model, seed)
    return model.eval()


def _shards_only(model: transformers.PreTrainedModel, sources: dict[str, Any]) -> transformers.PreTrainedModel:
    from numatp.zoo._shards import SOURCES

    setattr(model, SOURCES, sources)
    return model.eval()


def _config_of(model_or_config: torch.nn.Module | PretrainedConfig) -> PretrainedConfig:
    if isinstance(model_or_config, PretrainedConfig):
        return model_or_config
    cfg = getattr(model_or_config, "config", None)
    if not isinstance(cfg, PretrainedConfig):
        raise TypeError(
            f"example_inputs needs a transformers model or config, got {type(model_or_config).__name__} "
            f"without a .config; pass the model built by numatp.zoo.build or its config"
        )
    return cfg


def example_inputs(
    model_or_config: torch.nn.Module | PretrainedConfig, *, batch: int, seq: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random inputs for ``model(**inputs)``: ``input_ids`` (batch, seq) below the vocabulary size.

    BERT also gets ``token_type_ids`` (zeros) and an all-ones ``attention_mask``.
    """
    cfg = _config_of(model_or_config)
    limit = getattr(cfg, "max_position_embeddings", None)
    if batch < 1 or seq < 1 or (limit is not None and seq > limit):
        raise ValueError(
            f"batch={batch}, seq={seq}: both must be at least 1 and seq at most the model's "
            f"{limit} positions; pass smaller sizes"
        )
    gen = torch.Generator().manual_seed(seed)
    inputs = {"input_ids": torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)}
    if cfg.model_type == "bert":
        inputs["token_type_ids"] = torch.zeros(batch, seq, dtype=torch.long)
        inputs["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
    return inputs


def _count_parameters(cfg: PretrainedConfig, *, head: bool) -> int:
    """Unique parameters of the model, counted on the meta device (nothing allocated)."""
    with torch.device("meta"), no_init_weights():
        model = _model_class(copy.deepcopy(cfg), head=head)._from_config(copy.deepcopy(cfg))
    model.tie_weights()
    return sum(p.numel() for p in model.parameters())


def describe(name: str, *, tiny: bool = False, head: bool = True) -> dict[str, Any]:
    """Shape summary of a preset (or local checkpoint) for the CLI and the cost model.

    Keys: name, family, parameters (unique, ties counted once, of the ``head`` variant), layers,
    hidden, heads, kv_heads, head_dim, intermediate, vocab, mlp ("gelu", "geglu" or "swiglu").
    """
    cfg = _resolve_config(name, tiny=tiny)
    family = cfg.model_type
    if family not in MLP_KIND:
        raise ValueError(f"{name}: model type {family!r} is not one the zoo describes ({', '.join(sorted(MLP_KIND))}); "
                         "pass a preset or a checkpoint of one of those types")
    heads = cfg.num_attention_heads
    hidden = cfg.hidden_size
    intermediate = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * hidden
    return {
        "name": name,
        "family": family,
        "parameters": _count_parameters(cfg, head=head),
        "layers": cfg.num_hidden_layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or hidden // heads,
        "intermediate": intermediate,
        "vocab": cfg.vocab_size,
        "mlp": MLP_KIND[family],
    }
