"""Process-level NUMA policies for the baseline (the paper's Table IV): what each mode asks of the
kernel, and how the sweep applies it: ``numactl`` in front of the child when it is installed,
otherwise the child's first stage (``numatp.bench.bootstrap``) through ``sched_setaffinity`` and
``set_mempolicy`` before it imports torch.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Any

from numatp.bench.spec import PROCESS_POLICY_MODES
from numatp.topology import Topology, format_cpulist

__all__ = ["MECHANISMS", "ProcessPolicy", "choose_mechanism", "launch_prefix", "policy_for"]

MECHANISMS: tuple[str, ...] = ("auto", "numactl", "syscall")
"""``--mechanism`` choices: ``auto`` takes numactl when it is on PATH, else the in-child syscalls."""

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
        whole_node = (not ranks.is_virtual
                      and set(first.cpus) == set(machine.node(first.node).cpus) & machine.allowed_cpus)
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
