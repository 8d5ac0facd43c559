"""What one numatp compile is asked to do: the options of ``numatp.compile`` and of
``torch.compile(model, backend="numatp", options={...})``, checked in one place.

Both entry points turn their arguments into one :class:`Options` value and build the backend from it, so
an option means the same thing, and a bad one fails the same way, whichever way a model was compiled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from numatp.plan.gemm_pass import GemmOptions
from numatp.runtime.hosts import HOST_TIMEOUT
from numatp.topology import Topology, resolve_sockets

__all__ = ["AUTO_MEASURE", "OPTION_NAMES", "POLICIES", "RECOMPILE_LIMIT", "Options", "resolve_topology",
           "unknown_names"]

AUTO_MEASURE = 0.15
"""policy "auto": where the cost model predicts the sharded and unsharded plans within this fraction of
each other, build both and keep the one measured faster on the first call (0: trust the model alone)."""

RECOMPILE_LIMIT = 64
"""Dynamo entries (input shapes) one ``numatp.compile`` may make, where torch takes a per-compile
``recompile_limit`` (2.13 on): Dynamo's default of 8 is meant to catch a model that recompiles by
mistake, while a model that generates compiles a prompt program per bucket and a decode program per
cache length and batch, each a program numatp runs. The global limit stays as it is for other compiles."""

POLICIES = ("always", "never", "auto")
MODES = ("inductor", "eager")


@dataclass(frozen=True, kw_only=True)
class Options:
    """The options of one compile; every field is also a key of ``torch.compile``'s ``options=``."""

    sockets: None | int | Topology = None
    """None: the detected sockets, or 2 virtual sockets on a one-node machine with 2 or more usable CPUs
    (:func:`numatp.topology.default_topology`); N: the first N sockets (N virtual sockets on a one-node
    machine); or a :class:`numatp.Topology`."""
    policy: str = "always"
    """"always" shards every block numatp understands, "never" none (one program on all cores), "auto"
    asks the cost model and shards the whole graph or none of it."""
    mode: str = "inductor"
    """"inductor" compiles the socket programs with Inductor's C++ backend; "eager" runs them uncompiled."""
    strict_placement: bool = False
    """Raise instead of warning where a shard cannot be bound to its socket's node."""
    gemm: bool | GemmOptions | None = None
    """Measured GEMM providers: None (numatp's default, on), True, False (Inductor's own matmuls) or a
    :class:`numatp.GemmOptions`."""
    auto_measure: float = AUTO_MEASURE
    """policy "auto": build and time both plans where the model's predictions lie within this fraction."""
    plan: Any = None
    """Decisions that override the pass per module, in the tp_plan vocabulary (:mod:`numatp.plan.tp_plan`):
    a dict of module patterns to "colwise", "rowwise", "replicate" or "vocab", or "hf" for the model's own
    tp_plan (``numatp.compile`` only: it needs the model)."""
    weights: str | None = None
    """Quantized weights: "int8" (one scale per output channel), "int4" or "int4:gG" (G = 32, 64, 128:
    groups along the input dimension; "int4" is "int4:g64"), each socket quantizing its own shard
    (:mod:`numatp.runtime.gemm.quant`); None keeps the model's dtype. Needs the measured GEMM providers
    (``gemm`` not False)."""
    keep_head: bool = False
    """With ``weights``: keep the LM head and the embedding tables in the model's dtype (by default they
    are int8, whatever ``weights`` says of the other matmuls)."""
    process_group: Any = None
    """More than one host: a ``torch.distributed`` process group of one process per host (each with its
    own sockets, :mod:`numatp.runtime.hosts`). None: the default group where ``torch.distributed`` is
    initialized with more than one process (logged), else this process alone."""
    host_timeout: float = HOST_TIMEOUT
    """Seconds a cross-host collective waits for the other processes before it fails, naming the process
    that stopped."""
    check: bool = False
    """Check the contracts between the pipeline's steps after each step (:mod:`numatp.plan.contracts`:
    the same collectives on every socket, one reduction per sharded block, shard shapes, no foreign
    reads); slower to build, for debugging (``numatp explain --check`` checks the same)."""

    def __post_init__(self) -> None:
        _check_sockets(self.sockets)
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: choose 'always', 'never' or 'auto'")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: choose 'inductor' (compiled socket programs) or 'eager' "
                             "(uncompiled, for debugging)")
        if not isinstance(self.strict_placement, bool):
            raise ValueError(f"strict_placement={self.strict_placement!r}: pass True or False")
        if not isinstance(self.check, bool):
            raise ValueError(f"check={self.check!r}: pass True or False")
        if not (self.gemm is None or isinstance(self.gemm, (bool, GemmOptions))):
            raise ValueError(f"gemm={self.gemm!r}: pass None (default), True, False or a numatp.GemmOptions")
        if self.weights is not None:
            from numatp.runtime.gemm.quant import QuantFormat
            object.__setattr__(self, "weights", QuantFormat.parse(self.weights).name)
            if self.gemm is False:
                raise ValueError(f"weights={self.weights!r} with gemm=False: quantized weights are read by numatp's "
                                 "GEMM providers; drop gemm=False (or weights=)")
        if not isinstance(self.keep_head, bool):
            raise ValueError(f"keep_head={self.keep_head!r}: pass True or False")
        if self.plan is not None and self.plan != "hf":
            from numatp.plan.tp_plan import parse
            object.__setattr__(self, "plan", parse(self.plan))
        if self.plan is not None and self.policy == "never":
            raise ValueError("plan=... with policy='never': 'never' runs the graph unsharded on all cores, so a "
                             "plan has nothing to decide; drop one of them")
        if self.process_group is not None:
            import torch.distributed as dist
            if not isinstance(self.process_group, dist.ProcessGroup):
                raise ValueError(f"process_group={self.process_group!r}: pass a torch.distributed ProcessGroup "
                                 "(torch.distributed.group.WORLD, or one from new_group), or None")
        t = self.host_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ValueError(f"host_timeout={t!r}: pass the seconds (> 0) a cross-host collective waits for the "
                             f"other processes (default {HOST_TIMEOUT:g})")
        a = self.auto_measure
        if isinstance(a, bool) or not isinstance(a, (int, float)) or a < 0:
            raise ValueError(f"auto_measure={a!r}: pass a fraction >= 0 (0 trusts the cost model alone; "
                             f"default {AUTO_MEASURE})")

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> Options:
        """``torch.compile``'s ``options=``; a key that is not an option is an error naming the valid ones."""
        options = dict(options or {})
        unknown = sorted((k for k in options if k not in OPTION_NAMES), key=str)
        if unknown:
            raise ValueError(f"backend 'numatp' got unknown option(s) {unknown_names(unknown)}; its options are "
                             f"{', '.join(OPTION_NAMES)} (see help(numatp.compile))")
        return cls(**options)


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Options))
"""Every option of a compile, in the order ``help(numatp.compile)`` gives them."""


def unknown_names(unknown: list[str]) -> str:
    """``['polcy'] (did you mean 'policy'?)``: the unknown keys, each with the closest option where one is close."""
    import difflib

    hints = [f"{k!r} -> {m[0]!r}" for k in unknown
             for m in [difflib.get_close_matches(str(k), OPTION_NAMES, n=1, cutoff=0.6)] if m]
    if not hints:
        return str(unknown)
    if len(unknown) == 1:
        return f"{unknown} (did you mean {hints[0].split(' -> ')[1]}?)"
    return f"{unknown} (did you mean {', '.join(hints)}?)"


def _check_sockets(s: object) -> None:
    if not (s is None or isinstance(s, Topology) or (isinstance(s, int) and not isinstance(s, bool) and s >= 1)):
        raise ValueError(f"sockets={s!r}: pass None (detect), a positive int or a numatp.Topology")


def resolve_topology(sockets: None | int | Topology) -> Topology:
    """The topology to run on (:func:`numatp.topology.resolve_sockets`, the rule every entry point shares):
    None gives the detected sockets, or 2 virtual sockets on a one-node machine with 2 or more CPUs; N the
    first N sockets, or N virtual sockets on a one-node machine."""
    _check_sockets(sockets)
    return resolve_sockets(sockets)
