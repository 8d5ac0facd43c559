"""The second level of tensor parallelism: processes (one per host) joined by ``torch.distributed``.

Inside a host, a process's sockets are ranks of the in-process collective (:mod:`numatp.runtime.collective`).
Across hosts, each process holds a contiguous range of the plan's ranks (its own sockets), and a block's
reduction is the in-host sum followed by one all-reduce of the host's partial sum through a gloo process
group (:class:`Hosts`); the column-sharded logits are gathered the same way (each host's columns, zeros
elsewhere, summed: a sum with zeros is exact). The transport is ``torch.distributed``'s, not numatp's.

A peer that dies makes gloo fail at once (its connection closes); one that stops answering makes it fail
after the group's timeout. Either way :class:`HostFailure` names the process that stopped: every process
beats a counter in the group's store (:data:`BEAT_SECONDS`), and the ranks whose counter no longer moves
are the ones named. What the processes compile is compared at the start (:meth:`Hosts.agree`), so that
two processes that load different models, or the same one with other options, fail at once with the
difference named, not later with a hang or wrong tokens.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BEAT_SECONDS", "HOST_TIMEOUT", "HostFailure", "Hosts", "HostMismatch", "default_group"]

log = logging.getLogger("numatp")

HOST_TIMEOUT = 300.0
"""Seconds a cross-host collective waits for its peers before it fails (``host_timeout``)."""
BEAT_SECONDS = 0.5
"""How often each process beats its counter in the store (what names a process that stopped)."""


class HostFailure(RuntimeError):
    """A cross-host collective failed: a process died, or stopped answering within the timeout.
    ``ranks``: the processes (ranks of the process group) found not beating, empty where none could be told."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


class HostMismatch(ValueError):
    """The processes of one compile disagree on what they compile (model, options, socket counts)."""


def default_group() -> Any:
    """``torch.distributed``'s default process group where it is initialized with more than one process, else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.group.WORLD


class Hosts:
    """This process's place among the processes of ``group`` (one per host) and the collectives between them.

    ``sockets[h]`` is the socket count of process ``h`` (hosts may differ); process ``h`` holds the plan's
    ranks ``first(h)`` to ``first(h) + sockets[h] - 1``. Collectives run on a gloo group of the same
    processes, made here with ``timeout`` seconds (checked by :class:`numatp.backend.options.Options`),
    whatever backend the caller's group has.
    """

    def __init__(self, group: Any, sockets: int, *, timeout: float = HOST_TIMEOUT):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("process_group=... needs torch.distributed initialized (torchrun, or "
                               "torch.distributed.init_process_group('gloo') in every process) before numatp.compile")
        self.timeout = float(timeout)
        self.world_ranks = list(dist.get_process_group_ranks(group))
        self.group = dist.new_group(ranks=self.world_ranks, backend="gloo",
                                    timeout=datetime.timedelta(seconds=self.timeout),
                                    use_local_synchronization=True)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.performed = 0   # cross-host all-reduces completed
        self.seconds = 0.0   # spent in them (waiting for the slowest host included)
        self._store = _store()
        counts: list[Any] = [None] * self.size
        self._call(dist.all_gather_object, counts, int(sockets), group=self.group)
        self.sockets: tuple[int, ...] = tuple(counts)
        self._stop = threading.Event()
        self._beats: threading.Thread | None = None
        if self._store is not None:
            self._beats = threading.Thread(target=self._beat, name="numatp-host-beat", daemon=True)
            self._beats.start()

    @property
    def first(self) -> int:
        """This process's first rank of the plan."""
        return sum(self.sockets[:self.rank])

    @property
    def total(self) -> int:
        """The plan's ranks: every socket of every process."""
        return sum(self.sockets)

    def describe(self) -> str:
        counts = "+".join(map(str, self.sockets))
        return (f"process {self.rank} of {self.size} ({counts} sockets, plan ranks {self.first} to "
                f"{self.first + self.sockets[self.rank] - 1} here)")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the processes, in place (``t`` contiguous); returns ``t``."""
        t0 = time.perf_counter()
        self._call(self._polled, t)
        self.seconds += time.perf_counter() - t0
        self.performed += 1
        return t

    def _polled(self, t: torch.Tensor) -> None:
        """The group's own all-reduce (no per-call checks), waited for by polling and yielding the CPU, not
        by sleeping: measured on a 2-core VM, 2 processes, a decode step's reductions: a sleeping waiter
        woke 3-5 ms late on 10-20% of them (p90 3.2 ms against a median of 0.22 ms), a polling one was
        late on none (p90 0.26 ms) and the step took half the time. A waiting socket's CPU has nothing
        else to do; gloo's own threads get it at every yield. An error (a peer gone, the timeout) ends
        the work and ``wait`` raises it."""
        work = self.group.allreduce([t])
        while not work.is_completed():
            os.sched_yield()
        work.wait()

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Process ``src``'s ``t`` in every process, in place."""
        import torch.distributed as dist

        self._call(dist.broadcast, t, src=self.world_ranks[src], group=self.group)
        return t

    def agree(self, what: str, facts: dict[str, Any]) -> None:
        """Raise :class:`HostMismatch` unless every process passes the same ``facts`` (name -> value, each
        compared by its ``repr``): naming the first fact that differs, and the processes on either side."""
        import torch.distributed as dist

        digest = hashlib.sha256(repr(sorted((k, repr(v)) for k, v in facts.items())).encode()).hexdigest()
        digests: list[Any] = [None] * self.size
        self._call(dist.all_gather_object, digests, digest, group=self.group)
        if len(set(digests)) == 1:
            return
        every: list[Any] = [None] * self.size
        self._call(dist.all_gather_object, every, facts, group=self.group)
        for key in facts:
            values = [e.get(key) for e in every]
            if len({repr(v) for v in values}) > 1:
                raise HostMismatch(f"the processes of this compile differ in {what}: {key}, {_difference(values)}. "
                                   "Every process must load the same model and compile it with the same options")
        raise HostMismatch(f"the processes of this compile differ in {what}")   # keys differ

    def close(self) -> None:
        self._stop.set()

    # -- failures -----------------------------------------------------------------------------------------

    def _call(self, op: Callable, *args: Any, **kwargs: Any) -> Any:
        try:
            return op(*args, **kwargs)
        except RuntimeError as e:   # gloo: a closed connection at once, a silent peer after the timeout
            stopped = self._stopped()
            if stopped:
                who = ", ".join(map(str, stopped))
                raise HostFailure(f"process{'es' if len(stopped) > 1 else ''} {who} of the process group stopped "
                                  f"answering (died, or hung past host_timeout={self.timeout:g} s); process "
                                  f"{self.rank} gives up: {type(e).__name__}: {e}", stopped) from e
            raise HostFailure(f"a cross-host collective failed in process {self.rank} (no peer could be told to "
                              f"have stopped): {type(e).__name__}: {e}", []) from e

    def _beat(self) -> None:
        key = f"numatp/beat/{self.world_ranks[self.rank]}"
        while not self._stop.is_set():
            try:
                self._store.add(key, 1)
            except Exception:   # the store went away with its host: nothing left to beat into
                return
            self._stop.wait(BEAT_SECONDS)

    def _stopped(self) -> list[int]:
        """The processes whose beat counter did not move over a few beats: those that died or hung."""
        peers = [r for r in range(self.size) if r != self.rank]
        if self._store is None:
            return peers if len(peers) == 1 else []
        try:
            before = {r: self._store.add(f"numatp/beat/{self.world_ranks[r]}", 0) for r in peers}
            time.sleep(4 * BEAT_SECONDS)
            after = {r: self._store.add(f"numatp/beat/{self.world_ranks[r]}", 0) for r in peers}
        except Exception:   # the store is gone: it lived in a process that stopped (rank 0 without a launcher)
            return peers if len(peers) == 1 else [0] if self.rank != 0 else []
        return [r for r in peers if after[r] == before[r]]


def _store() -> Any:
    """The default group's store (where the processes met), or None where torch does not expose it."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    except Exception:
        return None


def _difference(values: list[Any]) -> str:
    """Where the processes' ``values`` differ: for lists, the first position that differs and their lengths."""
    if all(isinstance(v, (list, tuple)) for v in values):
        at = next(i for i in range(max(map(len, values)) + 1)
                  if len({repr(v[i]) if i < len(v) else "-" for v in values}) > 1)
        sides = "; ".join(f"process {r}: {_short(v[at]) if at < len(v) else 'nothing'} ({len(v)} in all)"
                          for r, v in enumerate(values))
        return f"item {at}: {sides}"
    return "; ".join(f"process {r}: {_short(v)}" for r, v in enumerate(values))


def _short(value: Any, limit: int = 120) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
