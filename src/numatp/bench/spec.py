"""What one benchmark measurement is: a frozen ``Config`` per (model, batch, seq, dtype, mode), and
the sweep that expands option lists into them.

Plain data and the standard library only: the benchmark child imports this module before torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

__all__ = [
    "DTYPES",
    "MODES",
    "NUMATP_MODES",
    "PAPER_MODELS",
    "PROCESS_POLICY_MODES",
    "QUICK",
    "Config",
    "Point",
    "expand",
]

NUMATP_MODES: tuple[str, ...] = ("numatp", "numatp-auto")
"""Modes compiled by ``numatp.compile`` (policy "always" and "auto")."""

PROCESS_POLICY_MODES: tuple[str, ...] = ("interleave", "localalloc", "single-socket")
"""Modes that run the baseline under a process-level NUMA policy (the rows of the paper's Table IV)."""

MODES: tuple[str, ...] = ("baseline", *NUMATP_MODES, *PROCESS_POLICY_MODES)
"""Every mode, baseline first: speedups are taken against ``baseline`` (torch.compile, default backend)."""

DTYPES: tuple[str, ...] = ("float32", "bfloat16")

PAPER_MODELS: tuple[str, ...] = ("gpt2", "gpt2-medium", "gpt2-large", "bert-small", "bert-large", "gemma3-270m")
"""The six models of the paper's evaluation (Table III), as zoo presets."""

QUICK: Mapping[str, Any] = {
    "models": ("gpt2",),
    "batches": (1,),
    "seqs": (128,),
    "dtypes": ("float32",),
    "modes": ("baseline", *NUMATP_MODES),
    "warmup": 2,
    "iters": 5,
}
"""The ``--quick`` sweep: three child processes. On a 2-core machine each spends 30-80 s compiling
GPT-2 (Inductor, more for numatp-auto), so a second sequence length would take it past 5 minutes."""


class Point(NamedTuple):
    """One configuration of the sweep as the report and its figures key it; ``model`` is the label the
    figures show."""

    model: str
    dtype: str
    batch: int
    seq: int


@dataclass(frozen=True)
class Config:
    """One measurement, run in its own process."""

    model: str
    """Zoo preset name or local checkpoint folder."""
    batch: int
    """Batch size of the prefill inputs."""
    seq: int
    """Sequence length of the prefill inputs."""
    dtype: str
    """``"float32"`` or ``"bfloat16"``: the dtype of weights and activations."""
    mode: str
    """One of ``MODES``."""
    sockets: int
    """Sockets (ranks) numatp uses; also fixes which CPUs ``single-socket`` keeps (socket 0's)."""
    warmup: int = 10
    """Untimed calls after the compiling first call."""
    iters: int = 50
    """Timed calls."""
    tiny: bool = False
    """Use the zoo's shrunken twin of the preset (tests)."""
    decode: int = 0
    """Tokens to generate after the prefill timing (time to first token, decode tokens/s); 0: prefill only."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {', '.join(MODES)}; pick one of those")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}; pick one of those")
        for name in ("batch", "seq", "sockets", "iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1; pass a positive {name}")
        if self.decode < 0:
            raise ValueError(f"decode={self.decode} must be 0 (prefill only) or the tokens to generate")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be 0 or more; pass --warmup 0 to skip warm-up")

    @property
    def key(self) -> str:
        """Identity for resuming: two runs with the same key measure the same thing the same way. A prefill-only
        configuration (``decode`` 0) keeps the key it had before ``decode`` existed."""
        return "|".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                        if not (f.name == "decode" and self.decode == 0))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """The config named by the fields of a results line (other keys are ignored)."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def expand(
    *,
    models: Iterable[str],
    batches: Iterable[int],
    seqs: Iterable[int],
    dtypes: Iterable[str],
    modes: Iterable[str],
    sockets: int,
    warmup: int = 10,
    iters: int = 50,
    tiny: bool = False,
    decode: int = 0,
) -> list[Config]:
    """Every combination, ordered model, dtype, batch, seq, then mode, so each configuration's
    modes run back to back and a partial sweep already gives complete speedup rows."""
    modes = tuple(dict.fromkeys(modes))  # keep order, drop repeats
    return [
        Config(model=m, batch=b, seq=s, dtype=d, mode=mode, sockets=sockets, warmup=warmup, iters=iters, tiny=tiny,
               decode=decode)
        for m, d, b, s, mode in itertools.product(
            dict.fromkeys(models), dict.fromkeys(dtypes), dict.fromkeys(batches), dict.fromkeys(seqs), modes
        )
    ]
