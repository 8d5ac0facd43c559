"""What one benchmark measurement is: a frozen ``Config`` per (model, batch, seq, dtype, mode, weights),
and the sweep that expands option lists into them.

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
    "WEIGHTS",
    "Config",
    "Point",
    "canonical_weights",
    "expand",
]

NUMATP_MODES: tuple[str, ...] = ("numatp", "numatp-auto")
"""Modes compiled by ``numatp.compile`` (policy "always" and "auto")."""

PROCESS_POLICY_MODES: tuple[str, ...] = ("interleave", "localalloc", "single-socket")
"""Modes that run the baseline under a process-level NUMA policy (the rows of the paper's Table IV)."""

MODES: tuple[str, ...] = ("baseline", *NUMATP_MODES, *PROCESS_POLICY_MODES)
"""Every mode, baseline first: speedups are taken against ``baseline`` (torch.compile, default backend)."""

DTYPES: tuple[str, ...] = ("float32", "bfloat16")

WEIGHTS: tuple[str, ...] = ("int8", "int8:a8", "int4", "int4:g32", "int4:g64", "int4:g128", "int4:a8", "int4:g32:a8",
                            "int4:g64:a8", "int4:g128:a8")
"""The quantized weight formats ``numatp.compile(weights=...)`` takes (:mod:`numatp.runtime.gemm.quant`),
spelled here without importing torch, for the command line's checks and the sweep's keys."""

_INT4_DEFAULT = "int4:g64"   # "int4" is int4 in groups of numatp.runtime.gemm.quant.DEFAULT_INT4_GROUP


def canonical_weights(weights: str | None) -> str | None:
    """One name per format (``"int4"`` -> ``"int4:g64"``, as ``QuantFormat.parse(...).name``), so that two
    spellings of one format are one configuration; None (the model's dtype) stays None. A name not in
    :data:`WEIGHTS` is a ValueError that lists them."""
    if weights is None:
        return None
    name = str(weights).strip().lower()
    if name not in WEIGHTS:
        raise ValueError(f"weights {weights!r} is not one of {', '.join(WEIGHTS)}; pick one of those "
                         "(or none for the model's dtype)")
    return _INT4_DEFAULT + name.removeprefix("int4") if name in ("int4", "int4:a8") else name

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
    weights: str | None = None
    """Quantized weights of the numatp modes (one of :data:`WEIGHTS`, kept in its canonical name: ``"int4"``
    is ``"int4:g64"``); None: the model's dtype. The other modes run torch.compile on the model as it is."""
    keep_head: bool = False
    """With ``weights``: the LM head and the embedding tables stay in the model's dtype (else int8)."""

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
        object.__setattr__(self, "weights", canonical_weights(self.weights))
        if self.weights is not None and self.mode not in NUMATP_MODES:
            raise ValueError(f"weights={self.weights!r} with mode {self.mode!r}: numatp quantizes the weights of "
                             f"its own modes ({', '.join(NUMATP_MODES)}) only; the other modes run torch.compile "
                             "on the model as it is: pass weights=None for them")
        if self.keep_head and self.weights is None:
            raise ValueError("keep_head=True without weights: it keeps the LM head in the model's dtype when the "
                             "other weights are quantized; pass weights= too, or keep_head=False")

    @property
    def key(self) -> str:
        """Identity for resuming: two runs with the same key measure the same thing the same way. A field at
        the default it had when it was added (``decode`` 0, ``weights`` None, ``keep_head`` False) is left out,
        so a configuration keeps the key it had before that field existed."""
        added = {"decode": 0, "weights": None, "keep_head": False}
        return "|".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                        if not (f.name in added and getattr(self, f.name) == added[f.name]))

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
    weights: Iterable[str | None] = (None,),
    keep_head: bool = False,
) -> list[Config]:
    """Every combination, ordered model, dtype, batch, seq, then mode and weights, so each configuration's
    modes run back to back and a partial sweep already gives complete speedup rows. ``weights`` (None: the
    model's dtype) multiply the numatp modes only: the other modes run once, on the model as it is;
    ``keep_head`` applies to the quantized ones."""
    modes = tuple(dict.fromkeys(modes))  # keep order, drop repeats
    formats = tuple(dict.fromkeys(canonical_weights(w) for w in weights)) or (None,)
    return [
        Config(model=m, batch=b, seq=s, dtype=d, mode=mode, sockets=sockets, warmup=warmup, iters=iters, tiny=tiny,
               decode=decode, weights=w, keep_head=keep_head and w is not None)
        for m, d, b, s, mode in itertools.product(
            dict.fromkeys(models), dict.fromkeys(dtypes), dict.fromkeys(batches), dict.fromkeys(seqs), modes
        )
        for w in (formats if mode in NUMATP_MODES else (None,))
    ]
