"""The ``torch.compile`` backend: ``torch.compile(model, backend="numatp")`` and ``numatp.compile(model)``.

``options`` checks what a compile is asked to do, ``entry`` is the way in from both APIs (one backend per
compile), ``registry`` the backend ``torch.compile`` calls by name and the way back to it, ``core`` is the backend one compile shares, ``variants`` turns each Dynamo graph into socket
programs per input signature, ``policy`` says when a graph runs unsharded, ``weights`` holds the shards
on their sockets, ``states`` each socket's copy of what the programs write in place (a KV cache).
"""

from __future__ import annotations

from numatp.backend.core import GEMM_DEFAULT, NumaTPBackend, close_call, default_decider, runs_unsharded
from numatp.backend.entry import (BackendOptionError, CompiledModel, backend_of, compile, compiled_by_numatp, numatp_backend,
                                  placement_report, plans)
from numatp.backend.options import AUTO_MEASURE, Options, resolve_topology

__all__ = ["AUTO_MEASURE", "BackendOptionError", "CompiledModel", "GEMM_DEFAULT", "NumaTPBackend", "Options", "backend_of", "close_call",
           "compile", "compiled_by_numatp", "default_decider", "numatp_backend", "placement_report", "plans",
           "resolve_topology", "runs_unsharded"]
