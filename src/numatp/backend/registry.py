"""The backend ``torch.compile`` calls by name, and the way back from a compiled model to its backend.

torch hands a registered backend no state of its own: it calls the entry point with ``(gm,
example_inputs, options=...)`` from the wrapper that ``torch.compile`` makes once per call
(``torch._TorchCompileWrapper``). The entry point keeps its backend on that wrapper, which lives at least
as long as the compiled model (Dynamo keeps it for the process, so the backend releases its workers and
shards when the compiled model is collected: ``NumaTPBackend.close``); Dynamo's
``_torchdynamo_orig_backend`` chain leads from the compiled model back to it. :func:`backend_of` follows
that chain for a model compiled either way (``numatp.compile`` or ``torch.compile(...,
backend="numatp")``); :mod:`numatp.generate` and :mod:`numatp.backend.entry` use it.
"""

from __future__ import annotations

import logging
import sys
import weakref
from types import FrameType
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.exc import ShortenTraceback

from numatp.backend.core import NumaTPBackend
from numatp.backend.options import Options

__all__ = ["NOT_RUN", "BackendOptionError", "backend_of", "compiled_by_numatp", "numatp_backend"]

log = logging.getLogger("numatp")

_ATTR = "_numatp_backend"


def numatp_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], *, options: dict[str, Any] | None = None,
                   mode: str | None = None) -> Callable:
    """Entry point of ``torch.compile(model, backend="numatp", options={...})``: the options of
    :func:`compile` (an unknown key is an error), one backend per ``torch.compile`` call."""
    if mode not in (None, "default"):
        raise _first_call_error(f"torch.compile(..., backend='numatp', mode={mode!r}): numatp takes no "
                                "torch.compile mode; drop mode= and pass numatp's own choices as "
                                "options={'policy': ..., 'gemm': ...}")
    wrapper = _calling_wrapper()
    backend = getattr(wrapper, _ATTR, None)
    if backend is None:
        try:
            checked = Options.from_dict(options)
        except (TypeError, ValueError) as e:
            raise _first_call_error(str(e)) from e
        backend = NumaTPBackend.from_options(checked)
        if wrapper is not None:
            setattr(wrapper, _ATTR, backend)
            compiled = _calling_module(backend)
            if compiled is not None:   # released with the compiled model, as numatp.compile's backend is
                weakref.finalize(compiled, backend.close)
        else:
            # called by Dynamo directly (torch._dynamo.optimize("numatp")): nothing outlives this graph
            # to hold a backend, so the graph gets its own
            log.info("numatp: backend called outside torch.compile; this graph gets a backend of its own")
    return backend(gm, example_inputs)


class BackendOptionError(ShortenTraceback, ValueError):
    """A bad ``options=`` or ``mode=`` of ``torch.compile(..., backend="numatp")``. torch hands a registered
    backend its options only when Dynamo compiles the first graph, at the model's first call, so they
    are checked then; Dynamo passes this error on as raised (a ``ShortenTraceback``), so its message is the
    first line the user reads, not a ``BackendCompilerFailed`` wrapper's."""

    def __init__(self, message: str):
        super().__init__(message, first_useful_frame=None)


def _first_call_error(message: str) -> BackendOptionError:
    return BackendOptionError(f"{message}; checked at the model's first call: torch.compile hands a registered "
                              "backend its options only then")


NOT_RUN = ("this model has not run yet: numatp builds a model's socket programs, and places their weights, "
           "on its first call, for that call's input shapes; call it once (compiled(input_ids)), then ask "
           "for its plans or placement")


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


def _calling_module(backend: NumaTPBackend) -> Any:
    """The compiled module (``torch.compile``'s ``OptimizedModule``) whose call is compiling its first graph
    with ``backend``, found on the stack, or None (a compiled function)."""
    from torch._dynamo.eval_frame import OptimizedModule

    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, OptimizedModule) and _find(owner)[0] is backend:
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
        raise ValueError(NOT_RUN)
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
