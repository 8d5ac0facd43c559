"""numatp: NUMA-aware tensor parallelism for ``torch.compile`` on multi-socket CPUs.

Each socket is a tensor-parallel rank inside one process: weight shards live in their socket's DRAM,
a thread group pinned to each socket computes on its local shards, and one all-reduce closes each
attention and MLP block.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from numatp.backend import compile, placement_report, plans
    from numatp.generate import generate
    from numatp.placement import membind, numa_clone, pages_by_node
    from numatp.plan.gemm_pass import GemmOptions
    from numatp.topology import Topology

from numatp.progress import install as _install_progress, set_progress  # torch-free

_install_progress()   # before anything logs: progress lines on stderr where it is a terminal

__all__ = ["GemmOptions", "Topology", "compile", "generate", "membind", "numa_clone", "pages_by_node",
           "placement_report", "plans", "set_progress"]
__version__ = "0.1.0"

# Public name -> the module that defines it. Loaded on first access (PEP 562) so that `numatp --help`
# and `numatp topo` start without importing torch (seconds); `import numatp` stays as cheap.
_LAZY: dict[str, str] = {
    "compile": "numatp.backend", "placement_report": "numatp.backend", "plans": "numatp.backend",
    "membind": "numatp.placement", "numa_clone": "numatp.placement",
    "pages_by_node": "numatp.placement", "GemmOptions": "numatp.plan.gemm_pass", "Topology": "numatp.topology",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        try:   # a subpackage, e.g. `numatp.backend` after a bare `import numatp`
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'numatp' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """``numatp.generate`` is a submodule and the function it defines. Importing the submodule (``from
    numatp.generate import generate_timed``) binds the module to the package's name; the function is what
    ``numatp.generate`` means, whichever was imported first."""

    @property
    def generate(self) -> Any:
        value = self.__dict__.get("generate")
        if value is None or isinstance(value, types.ModuleType):
            from numatp.generate import generate as value
        return value

    @generate.setter
    def generate(self, value: Any) -> None:
        self.__dict__["generate"] = value   # the submodule too: the getter looks through it


sys.modules[__name__].__class__ = _Package
