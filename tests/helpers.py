"""Shared test helpers: comparison against eager with dtype-appropriate tolerances, tiny topologies."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from numatp.topology import NumaNode, Socket, Topology

TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=6e-2, rtol=3e-2)}


def assert_close_to_eager(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> float:
    """assert_close with the dtype's tolerance; the message carries max and mean absolute difference."""
    diff = (actual.float() - expected.float()).abs()
    msg = f"{what}: max |diff| {diff.max().item():.3g}, mean {diff.mean().item():.3g}"
    torch.testing.assert_close(actual, expected, **TOLERANCES[expected.dtype], msg=msg)
    return diff.max().item()


def shared_cpu_topology(sockets: int) -> Topology:
    """A virtual topology of ``sockets`` sockets that may share CPUs (for correctness tests only)."""
    import os
    cpus = sorted(os.sched_getaffinity(0))
    groups = tuple(Socket(index=i, node=0, cpus=(cpus[i % len(cpus)],)) for i in range(sockets))
    node = NumaNode(0, frozenset(cpus), 1 << 30, {0: 10})
    return Topology((node,), groups, frozenset(cpus), is_virtual=True)


def fresh_dynamo():
    """Forget compiled frames, so a test's torch.compile is not served from (or limited by) earlier tests."""
    torch._dynamo.reset()


def all_gathers(backend) -> list:
    """Every all-gather step of every socket program a backend compiled."""
    from numatp.runtime.segments import Collective

    return [s for g in backend.graphs for v in g.variants.values() for p in v.executor.programs
            for s in p.steps if isinstance(s, Collective) and s.kind == "all_gather"]


@contextlib.contextmanager
def private_cache(folder: str, keep_given: bool = False) -> Iterator[None]:
    """numatp's cache (GEMM rates, profiles, the C++ library) under ``folder`` inside the block, never the
    user's; with ``keep_given``, a ``$NUMATP_CACHE_DIR`` already set stays (subprocesses inherit both)."""
    saved = {k: os.environ.get(k) for k in ("XDG_CACHE_HOME", "NUMATP_CACHE_DIR")}
    os.environ["XDG_CACHE_HOME"] = folder
    if not keep_given:
        os.environ.pop("NUMATP_CACHE_DIR", None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
