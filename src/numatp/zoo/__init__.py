"""Model zoo: the transformer models numatp is measured on, built from configs with random weights.

The presets (:data:`PRESETS`) cover the three MLP kinds the planner handles (GELU, GeGLU, SwiGLU),
multi-head, grouped-query and multi-query attention, sliding-window layers, and tied embeddings::

    model = build("llama", tiny=True)             # LlamaForCausalLM, 2 layers, random weights
    out = model(**example_inputs(model, batch=2, seq=32))
    describe("gpt2")["parameters"]                 # 124_439_808, counted without allocating

Weights are random and deterministic by ``seed``; no checkpoint is downloaded. A local folder
holding a Hugging Face checkpoint (``config.json`` + weights) may be passed in place of a preset;
:func:`resolve` decides which of the two a string names, without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from numatp.zoo._source import PRESETS, ModelSource, resolve

if TYPE_CHECKING:
    from numatp.zoo._build import build, can_generate, config, describe, example_inputs

__all__ = ["PRESETS", "ModelSource", "build", "can_generate", "config", "describe", "example_inputs", "resolve"]

# Loaded on first use (PEP 562): they import torch and transformers, which a command line that only
# checks a model name should not wait for.
_BUILD = frozenset({"build", "can_generate", "config", "describe", "example_inputs"})


def __getattr__(name: str) -> Any:
    if name in _BUILD:
        from numatp.zoo import _build

        return getattr(_build, name)
    raise AttributeError(f"module 'numatp.zoo' has no attribute {name!r}")
