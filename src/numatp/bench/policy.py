"""Process-level NUMA policies for the baseline (the paper's Table IV), applied by ``numactl`` when it
is installed, otherwise by the benchmark child itself through ``sched_setaffinity`` and
``set_mempolicy`` before it imports torch; and what the child then actually got, read back from the
kernel.

Standard library only (plus ``numatp.topology``, which is too): the child imports this module
before torch so that OpenMP sizes its pool from the restricted affinity and no page of the run is
allocated under the wrong policy.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numatp
from numatp.bench.spec import PROCESS_POLICY_MODES
from numatp.topology import Topology, format_cpulist

__all__ = ["MECHANISMS", "ProcessPolicy", "apply", "choose_mechanism", "launch_prefix", "observe", "policy_for"]

MECHANISMS: tuple[str, ...] = ("auto", "numactl", "syscall")
"""``--mechanism`` choices: ``auto`` takes numactl when it is on PATH, else the in-child syscalls."""

# Kernel memory-policy modes (uapi/linux/mempolicy.h).
_MPOL_BIND, _MPOL_INTERLEAVE, _MPOL_LOCAL = 2, 3, 4
_MPOL_NAMES = {0: "default", 1: "preferred", 2: "bind", 3: "interleave", 4: "local",
               5: "preferred_many", 6: "weighted_interleave"}
_MPOL_MODE_MASK = 0xFF  # strips MPOL_F_STATIC_NODES / MPOL_F_RELATIVE_NODES


@dataclass(frozen=True)
class ProcessPolicy:
    """CPU affinity and memory policy for a whole benchmark process."""

    mode: str
    """The benchmark mode: a ``PROCESS_POLICY_MODES`` entry, or ``"default"`` (first touch, all CPUs)."""
    memory: str
    """Kernel memory policy: ``"default"``, ``"interleave"``, ``"local"`` or ``"bind"``."""
    nodes: tuple[int, ...] = ()
    """Nodes of an ``interleave`` or ``bind`` policy."""
    cpus: tuple[int, ...] | None = None
    """CPUs to restrict the process to; None keeps the inherited affinity."""
    numactl_args: tuple[str, ...] = ()
    """The same policy as ``numactl`` options; empty for the default policy."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "memory": self.memory,
            "nodes": list(self.nodes),
            "cpus": None if self.cpus is None else list(self.cpus),
            "numactl_args": list(self.numactl_args),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProcessPolicy:
        cpus = data.get("cpus")
        return cls(data["mode"], data["memory"], tuple(data.get("nodes", ())),
                   None if cpus is None else tuple(cpus), tuple(data.get("numactl_args", ())))


def _syscalls() -> ModuleType:
    """``numatp.placement._syscalls`` (libc ``syscall`` wrappers, standard library only), loaded
    without running ``numatp/placement/__init__.py``, which imports torch: the policy has to be in
    place before torch loads, or OpenMP sizes its pool from the old affinity. The module is
    registered under its own name, so the placement package later finds and shares it."""
    name = "numatp.placement._syscalls"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(numatp.__file__).parent / "placement" / "_syscalls.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def policy_for(mode: str, machine: Topology, ranks: Topology) -> ProcessPolicy:
    """The process policy of benchmark ``mode``.

    ``interleave`` spreads pages round-robin over every node with memory (``--interleave=all``);
    ``localalloc`` allocates on the node of the CPU that touches a page first; ``single-socket``
    keeps the CPUs of ``ranks.sockets[0]`` and binds memory to its node (``--cpunodebind=0
    --membind=0`` on a real two-socket machine; on a virtual topology, the first virtual socket's
    CPUs). Every other mode runs under the default policy.
    """
    if mode == "interleave":
        return ProcessPolicy(mode, "interleave", machine.nodes_with_memory, None, ("--interleave=all",))
    if mode == "localalloc":
        return ProcessPolicy(mode, "local", (), None, ("--localalloc",))
    if mode == "single-socket":
        first = ranks.sockets[0]
        whole_node = not ranks.is_virtual and set(first.cpus) == set(machine.node(first.node).cpus) & machine.allowed_cpus
        # --cpunodebind names a node; a virtual socket is only part of one, so name its CPUs.
        cpu_arg = f"--cpunodebind={first.node}" if whole_node else f"--physcpubind={format_cpulist(first.cpus)}"
        return ProcessPolicy(mode, "bind", (first.node,), tuple(first.cpus), (cpu_arg, f"--membind={first.node}"))
    assert mode not in PROCESS_POLICY_MODES, mode
    return ProcessPolicy("default", "default")


def choose_mechanism(requested: str = "auto") -> str:
    """``"numactl"`` or ``"syscall"``: how process policies are applied in this sweep."""
    if requested not in MECHANISMS:
        raise ValueError(f"mechanism {requested!r} is not one of {', '.join(MECHANISMS)}; pick one of those")
    if requested == "numactl" and shutil.which("numactl") is None:
        raise ValueError(
            "mechanism 'numactl' was asked for but numactl is not on PATH; install it "
            "(apt-get install numactl) or pass --mechanism syscall (or auto)"
        )
    if requested == "auto":
        return "numactl" if shutil.which("numactl") else "syscall"
    return requested


def launch_prefix(policy: ProcessPolicy, mechanism: str) -> list[str]:
    """Command words to put before the child's ``python``: ``numactl ...`` or nothing."""
    if mechanism == "numactl" and policy.numactl_args:
        return [shutil.which("numactl") or "numactl", *policy.numactl_args]
    return []


def apply(policy: ProcessPolicy) -> None:
    """Set ``policy`` on the calling process: affinity first, then the memory policy.

    Call before importing torch. ``set_mempolicy`` acts on the calling thread and is inherited by
    threads it creates later, which is every OpenMP worker as long as torch is not imported yet.
    Raises OSError naming the policy when the kernel refuses it (e.g. a seccomp filter).
    """
    if policy.cpus is not None:
        os.sched_setaffinity(0, policy.cpus)
    mode = {"interleave": _MPOL_INTERLEAVE, "local": _MPOL_LOCAL, "bind": _MPOL_BIND}.get(policy.memory)
    if mode is None:
        return
    try:
        _syscalls().set_mempolicy(mode, list(policy.nodes))
    except OSError as e:
        raise OSError(
            e.errno,
            f"set_mempolicy({policy.memory}, nodes={list(policy.nodes)}) for mode {policy.mode!r} was refused: "
            f"{e.strerror}; install numactl and pass --mechanism numactl, or run outside the sandbox",
        ) from e


def observe() -> dict[str, Any]:
    """What the kernel says this process got: the ``Cpus_allowed_list`` and ``Mems_allowed_list``
    of ``/proc/self/status`` (affinity and cpuset), and the thread's memory policy, which
    ``Mems_allowed_list`` does not show (``numactl --membind`` and ``set_mempolicy`` leave the
    cpuset as it is)."""
    status: dict[str, str] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Cpus_allowed_list", "Mems_allowed_list"):
            status[key] = value.strip()
    try:
        raw_mode, nodes = _syscalls().get_mempolicy()
        mempolicy: dict[str, Any] = {"mode": _MPOL_NAMES.get(raw_mode & _MPOL_MODE_MASK, str(raw_mode)),
                                     "nodes": nodes}
    except OSError as e:
        mempolicy = {"mode": None, "nodes": [], "error": str(e)}
    return {
        "cpus_allowed_list": status.get("Cpus_allowed_list"),
        "mems_allowed_list": status.get("Mems_allowed_list"),
        "mempolicy": mempolicy,
    }
