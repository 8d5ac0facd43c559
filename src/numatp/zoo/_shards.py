"""Models whose parameters hold no values: each value is read where numatp needs it, shard by shard.

``numatp.zoo.build(..., shards_only=True)`` builds the model's modules with their parameters allocated
but never written (no page touched, so none resident), and gives each parameter a source
(:data:`numatp.backend.weights.Source`) that ``numatp.compile`` reads each socket's shard from: a
checkpoint's tensor read slice by slice (safetensors' ``get_slice``: a process reads the rows or
columns its sockets hold, never the whole tensor), or a preset's random tensor made again from the
generator state it was drawn with (the same values as a full build; one parameter at a time). A
process of a compile across hosts then holds its own shards and nothing else.

Such a model computes nothing correct by itself: only ``numatp.compile`` reads its sources (a hook that
refused plain calls would break Dynamo's graph at every call, so there is none).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["SOURCES", "CheckpointSlices", "Regenerated", "checkpoint_sources"]

SOURCES = "numatp_sources"
"""The attribute of a shards-only model: ``{parameter name: source}``, where ``numatp.compile`` reads each
shard (:data:`numatp.backend.weights.Source`)."""


class Regenerated:
    """A random parameter drawn again from the generator state it was first drawn with."""

    def __init__(self, state: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, std: float):
        self.state, self.shape, self.dtype, self.std = state, shape, dtype, std
        self.read_elements = 0   # what the shards took (the whole is drawn each time, then cut)

    def __call__(self, dim: int | None, lo: int, hi: int) -> torch.Tensor:
        gen = torch.Generator()
        gen.set_state(self.state)
        full = torch.empty(self.shape, dtype=self.dtype).normal_(0.0, self.std, generator=gen)
        part = full if dim is None else full.narrow(dim, lo, hi - lo).clone()
        self.read_elements += part.numel()
        return part


class CheckpointSlices:
    """One tensor of a safetensors checkpoint, read slice by slice in ``dtype``."""

    def __init__(self, file: Path, key: str, dtype: torch.dtype):
        self.file, self.key, self.dtype = file, key, dtype
        self.read_elements = 0

    def __call__(self, dim: int | None, lo: int, hi: int) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.file), framework="pt") as f:
            sl = f.get_slice(self.key)
            if dim is None:
                part = sl[:]
            else:
                part = sl[(slice(None),) * dim + (slice(lo, hi),)]
        self.read_elements += part.numel()
        return part.to(self.dtype)


def checkpoint_sources(folder: Path, model: torch.nn.Module, dtype: torch.dtype) -> dict[str, CheckpointSlices]:
    """A source per parameter of ``model`` from the safetensors files of ``folder`` (one file, or an index of
    several); a parameter the checkpoint lacks (a tied head excepted) is an error naming it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    elif (folder / "model.safetensors").is_file():
        from safetensors import safe_open
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            files = {k: folder / "model.safetensors" for k in f.keys()}
    else:
        raise ValueError(f"shards_only=True reads safetensors slices, and {folder} has no model.safetensors (or "
                         "model.safetensors.index.json); save the model with save_pretrained(folder) "
                         "(safetensors is its default), or build it whole")
    prefix = getattr(model, "base_model_prefix", "")
    sources = {}
    for name, param in model.named_parameters():
        candidates = [name]
        if prefix and name.startswith(prefix + "."):
            candidates.append(name[len(prefix) + 1:])
        elif prefix:
            candidates.append(f"{prefix}.{name}")
        key = next((c for c in candidates if c in files), None)
        if key is None:
            raise ValueError(f"{folder}: no tensor for parameter {name} (looked for {', '.join(candidates)}); "
                             "the checkpoint's names differ from the model's: build it whole (shards_only=False)")
        sources[name] = CheckpointSlices(files[key], key, param.dtype)
    return sources
