"""What a model argument names: a preset or a checkpoint folder, decided in one place and without torch.

Every command and :func:`numatp.zoo.build` ask :func:`resolve`, so the same string means the same thing
everywhere, and a bad one is refused (with the way out) before anything is imported or built.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PRESETS", "ModelSource", "resolve"]

PRESETS: tuple[str, ...] = ("gpt2", "gpt2-medium", "gpt2-large", "bert-small", "bert-large", "gemma3-270m", "llama",
                            "qwen2.5-0.5b", "llama-3.2-1b", "phi-3-mini")


@dataclass(frozen=True)
class ModelSource:
    """A model argument resolved: exactly one of ``preset`` and ``folder`` is set."""

    given: str
    """The argument as the user wrote it (for messages)."""
    preset: str | None = None
    """The preset's name, when the argument names one."""
    folder: Path | None = None
    """The checkpoint folder (``~`` expanded), which holds a ``config.json``."""


def _looks_like_path(arg: str) -> bool:
    return os.sep in arg or "/" in arg or arg.startswith((".", "~"))


def resolve(name_or_path: str | os.PathLike[str]) -> ModelSource:
    """Decide what a model argument names, or raise ``ValueError`` saying why it names nothing usable.

    In order: a preset name (``./gpt2`` reaches a folder of that name); an existing folder, which must
    hold a ``config.json``; a string that looks like a path (has a ``/``, starts with ``.`` or ``~``) is
    a folder that does not exist; anything else is an unknown name, and the error lists the presets and
    the closest one (``resolve("gpt-2")`` suggests ``gpt2``). Checks the file system only: cheap.
    """
    given = os.fspath(name_or_path)
    if given in PRESETS:
        return ModelSource(given, preset=given)
    path = Path(given).expanduser()
    presets = ", ".join(PRESETS)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{given}: the folder holds no config.json, so it is not a Hugging Face checkpoint; pass a folder "
                f"that save_pretrained wrote (config.json and the weights), or a preset ({presets})")
        return ModelSource(given, folder=path)
    if path.exists():
        raise ValueError(f"{given} is a file, not a folder; pass the folder that holds the checkpoint's config.json "
                         f"and weights, or a preset ({presets})")
    if _looks_like_path(given):
        raise ValueError(f"{given}: no such folder; check the path, or pass a preset ({presets})")
    close = difflib.get_close_matches(given.lower(), PRESETS, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"unknown model {given!r}{hint}: a model is one of the presets {presets} or a local folder holding a "
        "Hugging Face checkpoint with a config.json; pick a preset or pass the path of such a folder")
