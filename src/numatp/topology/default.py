"""Which sockets numatp runs on: one rule for ``numatp.compile``, ``torch.compile(..., backend="numatp")``
and every ``numatp`` command's ``--sockets``, so that a model gives the same socket programs whichever
way it is compiled.

The default (``sockets=None``), chosen for what the user gains:

- a machine with 2 or more NUMA nodes that have CPUs this process may use: those nodes, one socket each
  (weights placed on each socket's node with ``mbind``);
- one such node and at least 2 usable CPUs: 2 virtual sockets on it, the CPUs split in two (nothing is
  placed: one memory node). Measured on 2-core machines, 2 single-thread socket programs run prefill and
  decode as fast as one program on 2 threads or faster (decode 0.99-1.09x, prefill 1.00-1.11x), and the
  multi-socket path a user will deploy is the one exercised;
- one usable CPU: 1 socket.

Torch-free: the command line resolves ``--sockets`` before it imports torch.
"""

from __future__ import annotations

from numatp.topology.cpulist import format_cpulist
from numatp.topology.model import Topology

__all__ = ["default_topology", "describe", "resolve_sockets"]


def default_topology(machine: Topology | None = None) -> Topology:
    """The topology numatp runs on when no socket count is given, on ``machine`` (default: detected).

    >>> default_topology(Topology.virtual(sockets=1, cpus=[0, 1])).num_sockets   # one node, 2 CPUs
    2
    """
    machine = Topology.detect() if machine is None else machine
    if machine.num_sockets >= 2:
        return machine
    cpus = machine.sockets[0].cpus
    if len(cpus) >= 2:
        return Topology.virtual(sockets=2, cpus=cpus)
    return machine


def resolve_sockets(sockets: None | int | Topology = None, *, machine: Topology | None = None) -> Topology:
    """The topology of ``sockets``: None gives :func:`default_topology`; an int N the machine's first N
    sockets, or N virtual sockets on a one-node machine; a :class:`Topology` is used as given.

    ``machine`` is the detected topology (default: ``Topology.detect()``); tests pass a fixture's.
    """
    if isinstance(sockets, Topology):
        return sockets
    if not (sockets is None or (isinstance(sockets, int) and not isinstance(sockets, bool) and sockets >= 1)):
        raise ValueError(f"sockets={sockets!r}: pass None (detect), a positive int or a numatp.Topology")
    machine = Topology.detect() if machine is None else machine
    if sockets is None:
        return default_topology(machine)
    if machine.num_sockets == 1:
        if sockets == 1:
            return machine
        return Topology.virtual(sockets=sockets, cpus=machine.sockets[0].cpus)
    if sockets > machine.num_sockets:
        raise ValueError(f"sockets={sockets}: this machine has {machine.num_sockets} usable sockets "
                         f"(see `numatp topo`); pass at most {machine.num_sockets}, or a "
                         "numatp.Topology.virtual(...) to try more")
    return Topology(machine.nodes, machine.sockets[:sockets], machine.allowed_cpus, machine.is_virtual,
                    machine.notes)


def describe(topology: Topology) -> str:
    """One line: the sockets, the CPUs of each, their memory nodes, and whether weights are placed.

    >>> describe(Topology.virtual(sockets=2, cpus=[0, 1]))[:56]
    '2 virtual sockets on memory node 0, 1 CPU each (CPUs 0; '
    """
    n = topology.num_sockets
    sizes = sorted({len(s.cpus) for s in topology.sockets})
    each = (f"{sizes[0]} CPU{'s' * (sizes[0] != 1)} each" if len(sizes) == 1
            else f"{'/'.join(str(len(s.cpus)) for s in topology.sockets)} CPUs")
    cpus = "; ".join(format_cpulist(s.cpus) for s in topology.sockets)
    if topology.is_virtual:
        nodes = sorted({s.node for s in topology.sockets})
        where = f"{n} virtual socket{'s' * (n != 1)} on memory node {', '.join(map(str, nodes))}"
        placed = "weights not placed (virtual sockets share one memory node: no mbind)"
    else:
        where = f"{n} socket{'s' * (n != 1)} on memory node{'s' * (n != 1)} " + ", ".join(
            str(s.node) for s in topology.sockets)
        placed = "weights placed on each socket's node (mbind)"
    return f"{where}, {each} (CPUs {cpus}); {placed}"
