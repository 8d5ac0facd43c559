"""Commands under a launcher that starts one process per host (``torchrun``): join, share the host, print once.

``torchrun`` sets ``WORLD_SIZE``, ``RANK``, ``LOCAL_WORLD_SIZE`` and ``LOCAL_RANK`` (and the rendezvous
address) in each process it starts. Under it a command joins ``torch.distributed`` with gloo, and
``numatp.compile`` then compiles across the processes (:mod:`numatp.runtime.hosts`). Processes started on
one machine share it: each takes its own share of the sockets (of the CPUs where there are fewer
sockets than processes) and pins itself there, so that no CPU runs two processes' threads. Only process
0 prints results; the others print errors only.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["Launch", "join_launcher", "machine"]


@dataclass(frozen=True)
class Launch:
    """This process's place under the launcher."""

    rank: int
    world: int
    cpus: tuple[int, ...] | None
    """The CPUs this process took on a machine shared with other processes of the group (None: all)."""

    @property
    def quiet(self) -> bool:
        return self.rank != 0


def join_launcher(command: str) -> Launch | None:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1): join ``torch.distributed`` (gloo), take this process's share
    of its machine, and silence standard output where this is not process 0. None when run alone."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError as e:
        raise SystemExit(f"numatp {command}: WORLD_SIZE, LOCAL_WORLD_SIZE and LOCAL_RANK must be integers "
                         f"(set by torchrun): {e}") from e
    if world < 2:
        return None
    import torch
    import torch.distributed as dist

    cpus = None
    if local_world > 1:
        cpus = _share(local_rank, local_world, command)
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank != 0:
        sys.stdout = open(os.devnull, "w")   # noqa: SIM115  (for the life of the process)
        import numatp
        numatp.set_progress(False)
    return Launch(rank, world, cpus)


def _share(local_rank: int, local_world: int, command: str) -> tuple[int, ...]:
    """Process ``local_rank`` of ``local_world`` on one machine: its sockets (contiguous, as even as they
    split), or its contiguous share of the CPUs where the machine has fewer sockets than processes."""
    from numatp.plan.schema import even_split
    from numatp.topology import Topology

    machine = Topology.detect()
    sockets = machine.sockets
    if len(sockets) >= local_world:
        (lo, hi), = even_split(len(sockets), local_world)[local_rank].intervals
        return tuple(c for s in sockets[lo:hi] for c in s.cpus)
    cpus = sorted(c for s in sockets for c in s.cpus)
    if len(cpus) < local_world:
        raise SystemExit(f"numatp {command}: {local_world} processes on a machine with {len(cpus)} usable CPUs: "
                         "each process needs one; start fewer (torchrun --nproc-per-node)")
    (lo, hi), = even_split(len(cpus), local_world)[local_rank].intervals
    return tuple(cpus[lo:hi])


def machine(launch: Launch | None) -> Any:
    """The machine a command runs on: the detected topology, within this process's share of it under the
    launcher (where it says so on standard output, which only process 0 prints)."""
    from numatp.topology import Topology

    if launch is None:
        return Topology.detect()
    print(f"processes: {launch.world} (torch.distributed, gloo), each with its own sockets; results of process 0")
    return Topology.detect(allowed_cpus=launch.cpus)
