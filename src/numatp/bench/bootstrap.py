"""First stage of a benchmark child, run as a script: ``python -P .../bootstrap.py JOB RESULT``.

Importing ``numatp`` imports torch, and torch must load after the process policy is in place:
OpenMP sizes its pool from the affinity it sees when it loads, and pages allocated before
``set_mempolicy`` keep the old policy. So this file uses the standard library only, takes the
syscall wrappers from ``numatp/placement/_syscalls.py`` by path (a standard-library module, loaded
without its torch-importing package), applies the policy when the sweep chose the ``syscall``
mechanism (``numactl`` has already applied it otherwise), reads back what the kernel granted, and
only then hands over to ``numatp.bench.child``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["apply", "main", "observe"]

# Kernel memory-policy modes (uapi/linux/mempolicy.h).
_MPOL = {"bind": 2, "interleave": 3, "local": 4}
_MPOL_NAMES = {0: "default", 1: "preferred", 2: "bind", 3: "interleave", 4: "local",
               5: "preferred_many", 6: "weighted_interleave"}
_MPOL_MODE_MASK = 0xFF  # strips MPOL_F_STATIC_NODES / MPOL_F_RELATIVE_NODES


def _syscalls() -> ModuleType:
    # A private module name: the placement package, imported later, loads its own copy; the
    # policy set here is process state, not module state, so the two never disagree.
    name = "_numatp_bench_syscalls"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "placement" / "_syscalls.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def apply(policy: dict[str, Any]) -> None:
    """Set a ``ProcessPolicy.to_dict()`` on this process: affinity first, then the memory policy.

    ``set_mempolicy`` acts on the calling thread and is inherited by threads it creates later,
    which is every OpenMP worker, since torch is not loaded yet. Raises OSError naming the policy
    when the kernel refuses it (a seccomp filter, or a CPU that does not exist).
    """
    try:
        if policy["cpus"] is not None:
            os.sched_setaffinity(0, policy["cpus"])
        if policy["memory"] in _MPOL:
            _syscalls().set_mempolicy(_MPOL[policy["memory"]], list(policy["nodes"]))
    except OSError as e:
        raise OSError(
            e.errno,
            f"sched_setaffinity(cpus={policy['cpus']}) / set_mempolicy({policy['memory']}, nodes={policy['nodes']}) "
            f"for mode {policy['mode']!r} was refused: {e.strerror}; check the CPUs and nodes against "
            "`numatp topo`, or install numactl and pass --mechanism numactl",
        ) from e


def observe() -> dict[str, Any]:
    """What the kernel says this process got: ``Cpus_allowed_list`` and ``Mems_allowed_list`` from
    /proc/self/status (affinity and cpuset), and the thread's memory policy, which
    ``Mems_allowed_list`` does not show (``numactl --membind`` and ``set_mempolicy`` leave the
    cpuset as it is). Read before torch loads: once OpenMP starts, libgomp pins its master thread
    and the affinity seen from here can shrink to one CPU."""
    status: dict[str, str] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Cpus_allowed_list", "Mems_allowed_list"):
            status[key] = value.strip()
    try:
        raw_mode, nodes = _syscalls().get_mempolicy()
        mempolicy: dict[str, Any] = {"mode": _MPOL_NAMES.get(raw_mode & _MPOL_MODE_MASK, str(raw_mode)), "nodes": nodes}
    except OSError as e:
        mempolicy = {"mode": None, "nodes": [], "error": str(e)}
    return {
        "cpus_allowed_list": status.get("Cpus_allowed_list"),
        "mems_allowed_list": status.get("Mems_allowed_list"),
        "mempolicy": mempolicy,
        "policy_before_torch": "torch" not in sys.modules,
        "pid": os.getpid(),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -P bootstrap.py JOB.json RESULT.json (written by numatp bench)", file=sys.stderr)
        return 2
    job = json.loads(Path(args[0]).read_text())
    if job["mechanism"] == "syscall":
        apply(job["policy"])
    granted = observe()
    from numatp.bench import child  # imports torch: from here on the policy is in force

    child.run(job, Path(args[1]), granted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
