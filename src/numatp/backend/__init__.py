"""The ``torch.compile`` backend: ``torch.compile(model, backend="numatp")`` and ``numatp.compile(model)``.

``options`` checks what a compile is asked to do, ``entry`` is the way in from both APIs (one backend per
compile), ``registry`` the backend ``torch.compile`` calls by name and the way back to it, ``core`` is
the backend one compile shares, ``variants`` turns each Dynamo graph into socket programs per input
signature, ``policy`` says when a graph runs unsharded, ``weights`` holds the shards
on their sockets, ``states`` each socket's copy of what the programs write in place (a KV cache).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from numatp.backend.core import GEMM_DEFAULT, NumaTPBackend, close_call, default_decider, runs_unsharded
    from numatp.backend.entry import CompiledModel, compile, placement_report, plans
    from numatp.backend.options import AUTO_MEASURE, Options, resolve_topology
    from numatp.backend.registry import BackendOptionError, backend_of, compiled_by_numatp, numatp_backend

__all__ = ["AUTO_MEASURE", "BackendOptionError", "CompiledModel", "GEMM_DEFAULT", "NumaTPBackend", "Options",
           "backend_of", "close_call", "compile", "compiled_by_numatp", "default_decider", "numatp_backend",
           "placement_report", "plans", "resolve_topology", "runs_unsharded"]

# Public name -> its module, loaded on first access (PEP 562). Importing one submodule (``numatp.generate``
# reads ``numatp.backend.registry``) then loads that module alone, not ``entry``, which imports
# ``numatp.generate`` for ``CompiledModel.generate``.
_WHERE = {"GEMM_DEFAULT": "core", "NumaTPBackend": "core", "close_call": "core", "default_decider": "core",
          "runs_unsharded": "core", "CompiledModel": "entry", "compile": "entry", "placement_report": "entry",
          "plans": "entry", "AUTO_MEASURE": "options", "Options": "options", "resolve_topology": "options",
          "BackendOptionError": "registry", "backend_of": "registry", "compiled_by_numatp": "registry",
          "numatp_backend": "registry"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'numatp.backend' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"numatp.backend.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
