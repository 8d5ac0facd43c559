"""The two ways in: ``numatp.compile(model, ...)`` and ``torch.compile(model, backend="numatp", options={...})``.

Both check their options as one :class:`~numatp.backend.options.Options` and build one
:class:`~numatp.backend.core.NumaTPBackend` per compile: two models compiled in one process never share
a topology, a policy or socket workers. ``plans`` and ``placement_report`` find that backend again from
the compiled model, whichever way it was made.

torch hands a registered backend no state of its own: it calls the entry point with ``(gm,
example_inputs, options=...)`` from the wrapper that ``torch.compile`` makes once per call
(``torch._TorchCompileWrapper``). The entry point keeps its backend on that wrapper, the one object
that lives exactly as long as the compiled model; Dynamo's ``_torchdynamo_orig_backend`` chain leads
from the compiled model back to it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch._dynamo.eval_frame import OptimizedModule

from numatp.backend.core import NumaTPBackend
from numatp.backend.options import AUTO_MEASURE, Options
from numatp.plan.schema import Plan
from numatp.plan.gemm_pass import GemmOptions
from numatp.topology import Topology

__all__ = ["CompiledModel", "backend_of", "compile", "compiled_by_numatp", "numatp_backend", "placement_report",
           "plans"]

log = logging.getLogger("numatp")

_ATTR = "_numatp_backend"


def compile(model: torch.nn.Module, *, sockets: None | int | Topology = None, policy: str = "always",
            mode: str = "inductor", strict_placement: bool = False,
            gemm: bool | GemmOptions | None = None, auto_measure: float = AUTO_MEASURE,
            plan: Any = None) -> torch.nn.Module:
    """``torch.compile(model)`` with NUMA-aware tensor parallelism over ``sockets``.

    ``sockets``: None uses the detected topology; an int N its first N sockets (N virtual sockets on a
    single-node machine); or a :class:`numatp.Topology`. ``policy``: "always" shards every block numatp
    understands, "never" none (the graph runs unsharded on all cores), "auto" asks the cost
    model per block and shards the whole graph or none of it; where its two predictions lie within
    ``auto_measure`` (a fraction) of each other, both plans are built and the first call keeps the one
    it measures faster. ``mode="eager"`` skips Inductor (debugging). ``gemm``: pick each weight matmul's
    kernel (MKL, oneDNN, packed or not) by measuring it on this CPU (``True``, or :class:`GemmOptions`),
    keep Inductor's (``False``), or numatp's default (``None``). ``plan``: decisions that override the pass
    per module, in transformers' tp_plan vocabulary (``{"model.layers.*.mlp.down_proj": "rowwise", ...}``,
    values colwise, rowwise, replicate, vocab; see :mod:`numatp.plan.tp_plan`), or ``"hf"`` for the model's
    own tp_plan; ``numatp.plans(compiled)[i].to_tp_plan()`` gives a plan back in the same form.

    The same options work as ``torch.compile(model, backend="numatp", options={"sockets": 2, ...})``.
    Input shapes are static here (``dynamic=False``): each new shape compiles its own programs.
    """
    if plan == "hf":
        from numatp.plan.tp_plan import hf_tp_plan
        plan = hf_tp_plan(model)
    options = Options(sockets=sockets, policy=policy, mode=mode, strict_placement=strict_placement, gemm=gemm,
                      auto_measure=auto_measure, plan=plan)
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    backend = NumaTPBackend.from_options(options, names=names)
    # the backend stays reachable from the result through Dynamo's chain of wrappers (backend_of); an
    # attribute on the result would land on ``model`` itself, and on every later compile of it
    compiled = torch.compile(model, backend=backend, dynamic=False)
    if type(compiled) is OptimizedModule:
        compiled.__class__ = CompiledModel
    return compiled  # type: ignore[return-value]  # torch.compile of a Module is an OptimizedModule


class CompiledModel(OptimizedModule):
    """What :func:`compile` returns for a module: ``torch.compile``'s module, plus ``generate`` through
    NUMA-TP (the model's own ``generate`` stays eager)."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.Tensor:
        """transformers-style ``generate`` whose prefill and decode steps run as socket programs:
        :func:`numatp.generate.generate_timed` lists the options."""
        from numatp.generate import generate
        return generate(self, input_ids, attention_mask, **kwargs)


def numatp_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], *, options: dict[str, Any] | None = None,
                   mode: str | None = None) -> Callable:
    """Entry point of ``torch.compile(model, backend="numatp", options={...})``: the options of
    :func:`compile` (an unknown key is an error), one backend per ``torch.compile`` call."""
    if mode not in (None, "default"):
        raise ValueError(f"torch.compile(..., backend='numatp', mode={mode!r}): numatp takes no torch.compile "
                         "mode; drop mode= and pass numatp's own choices as options={'policy': ..., 'gemm': ...}")
    wrapper = _calling_wrapper()
    backend = getattr(wrapper, _ATTR, None)
    if backend is None:
        backend = NumaTPBackend.from_options(Options.from_dict(options))
        if wrapper is not None:
            setattr(wrapper, _ATTR, backend)
        else:
            # called by Dynamo directly (torch._dynamo.optimize("numatp")): nothing outlives this graph
            # to hold a backend, so the graph gets its own
            log.info("numatp: backend called outside torch.compile; this graph gets a backend of its own")
    return backend(gm, example_inputs)


def _calling_wrapper() -> Any:
    """The ``torch.compile`` wrapper whose call reached :func:`numatp_backend`, or None."""
    frame: FrameType | None = sys._getframe(2)   # 0: here, 1: numatp_backend, 2: the wrapper's __call__
    for _ in range(4):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch._TorchCompileWrapper) and getattr(owner, "compiler_fn", None) is numatp_backend:
            return owner
        frame = frame.f_back
    return None


def backend_of(compiled: Any) -> NumaTPBackend:
    """The backend of a model (or function) compiled by :func:`compile` or by ``torch.compile(...,
    backend="numatp")``."""
    found, registered = _find(compiled)
    if found is not None:
        return found
    if registered:
        raise ValueError("this model was compiled with backend='numatp' but has not run yet: call it once, "
                         "then ask for its plans or placement")
    raise ValueError(f"{type(compiled).__name__} was not compiled by numatp: pass the model returned by "
                     "numatp.compile(model) or torch.compile(model, backend='numatp')")


def compiled_by_numatp(compiled: Any) -> bool:
    """Whether ``compiled`` runs through numatp's backend (before its first call too)."""
    found, registered = _find(compiled)
    return found is not None or registered


def _find(compiled: Any) -> tuple[NumaTPBackend | None, bool]:
    """(the backend, whether the registered backend was named) along Dynamo's chain of callbacks."""
    link = _dynamo_callback(compiled)
    registered = False
    for _ in range(16):
        if link is None:
            break
        if isinstance(link, NumaTPBackend):
            return link, True
        found = getattr(link, _ATTR, None)
        if isinstance(found, NumaTPBackend):
            return found, True
        registered = registered or getattr(link, "compiler_fn", None) is numatp_backend
        link = getattr(link, "_torchdynamo_orig_backend", None) or getattr(link, "compiler_fn", None)
    return None, registered


def _dynamo_callback(compiled: Any) -> Any:
    ctx = getattr(compiled, "dynamo_ctx", None)   # torch.compile of an nn.Module: an OptimizedModule
    if ctx is not None:
        return getattr(ctx, "callback", None)
    for cell in getattr(compiled, "__closure__", None) or ():   # torch.compile of a function
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if hasattr(value, "_torchdynamo_orig_backend"):
            return value
    return None


def plans(compiled: Any) -> list[Plan]:
    """The plan of every program a compiled model has run: one per Dynamo graph and input signature,
    in the order they were built (``explain`` prints the same plans without compiling)."""
    return backend_of(compiled).plans


def placement_report(compiled: Any) -> dict[str, Any]:
    """Where each socket's weights are: ``{"ranks": [{"socket", "node", "pages": {node: n}}], "local_fraction"}``."""
    return backend_of(compiled).weights.report()
