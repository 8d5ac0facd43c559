"""The second level of tensor parallelism: processes (one per host) joined by ``torch.distributed``.

Inside a host, a process's sockets are ranks of the in-process collective (:mod:`numatp.runtime.collective`).
Across hosts, each process holds a contiguous range of the plan's ranks (its own sockets), and a block's
reduction is the in-host sum followed by one sum of the hosts' partial sums through a gloo process group
(:class:`Hosts`: an exchange of point-to-point messages, or gloo's all-reduce for large ones); the
column-sharded logits are gathered the same way (each host's columns, zeros elsewhere, summed: a sum
with zeros is exact). The transport is ``torch.distributed``'s, not numatp's.

A peer that dies makes gloo fail at once (its connection closes); one that stops answering makes it fail
after the group's timeout. Either way :class:`HostFailure` names the process that stopped: every process
beats a counter in the group's store (:data:`BEAT_SECONDS`), and the ranks whose counter no longer moves
are the ones named. What the processes compile is compared at the start (:meth:`Hosts.agree`), so that
two processes that load different models, or the same one with other options, fail at once with the
difference named, not later with a hang or wrong tokens.
"""

from __future__ import annotations

import ctypes
import datetime
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BEAT_SECONDS", "HOST_TIMEOUT", "HostFailure", "Hosts", "HostMismatch", "default_group", "exchange_bytes"]

log = logging.getLogger("numatp")

HOST_TIMEOUT = 300.0
"""Seconds a cross-host collective waits for its peers before it fails (``host_timeout``)."""
BEAT_SECONDS = 0.5
"""How often each process beats its counter in the store (what names a process that stopped)."""
GATHER_BYTES = 1 << 20
"""Up to this many bytes gathered (the tensor times the processes), a cross-host sum is an exchange: each
process sends its sum to every other and adds theirs in process order (the same bits in every process),
into receives posted one sum ahead, so that a message finds its receiver waiting and goes out at once
(gloo's own all-gather and all-reduce run on its worker thread and meet each message with a notification
first; measured on a 2-core VM, 2 processes, 2 KiB sums inside a decode step: a median 92-99 us after the
last process arrives against 187-193). Larger, gloo's all-reduce, which moves 2 (H - 1) / H of the bytes, not
H - 1 times."""


def exchange_bytes(processes: int) -> int:
    """The most bytes per process a cross-host sum among ``processes`` exchanges (larger, gloo's
    all-reduce): :data:`GATHER_BYTES` gathered, in whole cache lines per process."""
    return GATHER_BYTES // processes // 64 * 64


_TAG = 0
"""The tag of the exchange's messages (numatp's own group carries no other point-to-point message)."""


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
        threads = _threads()
        self.group = dist.new_group(ranks=self.world_ranks, backend="gloo",
                                    timeout=datetime.timedelta(seconds=self.timeout),
                                    use_local_synchronization=True)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.performed = 0   # cross-host all-reduces completed
        self.seconds = 0.0   # spent in them (waiting for the slowest host included)
        # the exchange (_sum): two buffers of a row of bytes per process; the receives of the next sum are
        # posted into one while the other's are read. A call's sums run one at a time (socket 0's worker
        # during the call, the calling thread after it), in the same order in every process
        self._rows = [torch.empty((self.size, exchange_bytes(self.size)), dtype=torch.uint8) for _ in range(2)]
        self._turn = 0                        # the buffer the posted receives fill
        self._posted: list[Any] | None = None   # those receives, one per peer (None before the first sum)
        self._exchange_lock = threading.Lock()
        self._store = _store()
        counts: list[Any] = [None] * self.size
        self._call(dist.all_gather_object, counts, int(sockets), group=self.group)
        self.sockets: tuple[int, ...] = tuple(counts)
        self.demoted = _demote_transport(threads)
        self.awake = _Awake.start()
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
        self._call(self._sum, t)
        self.seconds += time.perf_counter() - t0
        self.performed += 1
        return t

    def _sum(self, t: torch.Tensor) -> None:
        """The sum over the processes into ``t``, the same bits in every process, waited for by blocking
        (which leaves this CPU to gloo's loop thread) while :class:`_Awake` keeps it from sleeping: an
        exchange up to :data:`GATHER_BYTES` gathered, else gloo's all-reduce. An error (a peer gone, the
        timeout) ends the work and ``wait`` raises it."""
        nbytes = t.numel() * t.element_size()
        with self.awake:
            if nbytes > exchange_bytes(self.size):
                self.group.allreduce([t]).wait()
                return
            with self._exchange_lock:
                self._exchange(t, nbytes)

    def _exchange(self, t: torch.Tensor, nbytes: int) -> None:
        """Send ``t`` to every peer, post the next sum's receives, wait for this sum's (posted one sum
        ahead, so a peer's message is written the moment it is sent, not after a round trip to learn that a
        receive waits), and sum every process's row in process order."""
        peers = [p for p in range(self.size) if p != self.rank]
        if self._posted is None:
            self._posted = self._post(self._turn, peers)
        rows = self._rows[self._turn]
        mine = t.view(-1).view(torch.uint8)
        sends = [self.group.send([mine], p, _TAG) for p in peers]
        posted, self._turn = self._posted, 1 - self._turn
        self._posted = self._post(self._turn, peers)   # while this sum's messages travel
        for w in posted:
            w.wait()
        for w in sends:   # t is overwritten below
            w.wait()
        parts = [t.view(-1) if p == self.rank else rows[p, :nbytes].view(t.dtype) for p in range(self.size)]
        if self.size > 2:   # t is overwritten by the first sum and read later: its copy in its row
            parts[self.rank] = rows[self.rank, :nbytes].view(t.dtype).copy_(parts[self.rank])
        torch.add(parts[0], parts[1], out=t.view(-1))   # in process order, in every process
        for part in parts[2:]:
            t.view(-1).add_(part)

    def _post(self, turn: int, peers: list[int]) -> list[Any]:
        rows = self._rows[turn]
        return [self.group.recv([rows[p]], p, _TAG) for p in peers]

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
        self.awake.stop()

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


def _threads() -> set[int]:
    """This process's threads now (their ids), empty where ``/proc`` does not list them."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _demote_transport(before: set[int]) -> int:
    """Run the transport threads gloo started since ``before`` (``gloo_tcp_loop``: one per group, reading
    the sockets) at ``SCHED_IDLE``: they then run only when a CPU has nothing else to do, which is when
    this process waits for its peers. Where a CPU runs such a thread beside the thread that posted the
    collective, gloo's loop, woken by a message for a pair whose lock the other holds, does not block but
    polls again until the scheduler takes its CPU away: measured on a 2-core VM, 2 processes pinned to one
    CPU each, a 2 KiB all-reduce took over 1 ms in 20-40% of calls (4 ms each, a scheduler slice), and in
    none of 500 with the loop demoted (median 180-220 us, against 200-380). Returns the threads demoted (0 where
    the OS has no such policy, or refuses: logged)."""
    if not hasattr(os, "SCHED_IDLE"):
        return 0
    demoted = 0
    for tid in sorted(_threads() - before):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if name.startswith("gloo_tcp_loop"):
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                demoted += 1
        except OSError as e:   # gone already, or a policy the OS refuses here
            log.info("numatp: gloo's transport thread %d keeps its scheduling (%s): a cross-host sum may "
                     "wait a scheduler slice where it shares its CPU", tid, e)
    return demoted


class _Awake:
    """A thread that keeps a CPU from sleeping while this process waits for its peers (``with awake:``).

    It yields in a loop at ``SCHED_IDLE``, so it runs only where its CPU has nothing else to run, and
    gives way at once to gloo's loop thread (also at ``SCHED_IDLE``) when a message arrives; between
    waits it sleeps. A process waiting on a message otherwise leaves its CPU idle, and waking an idle CPU
    costs more than the message: measured on a 2-core VM, 2 processes on one CPU each, a 2 KiB cross-host
    sum inside a decode step returned a median 92-99 us after the last process arrived with it, 106-120
    without (three runs each).
    It runs on the CPUs of the thread that made the group. Where the OS has no ``SCHED_IDLE`` (or refuses
    it: logged) no such thread runs, since at normal priority it would take CPU time from the process's
    own threads."""

    def __init__(self, lib: Any | None):
        self._lib = lib
        self._state = ctypes.c_int32(0)
        self._ref = ctypes.byref(self._state)
        self.thread: threading.Thread | None = None

    @classmethod
    def start(cls) -> _Awake:
        if not hasattr(os, "SCHED_IDLE"):
            return cls(None)
        from numatp.runtime.collective import library

        lib = library()
        awake = cls(lib)
        ready: list[BaseException | None] = []
        started = threading.Event()

        def run() -> None:
            try:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # 0: this thread
                ready.append(None)
            except OSError as e:
                ready.append(e)
            started.set()
            if ready[0] is None:
                lib.numatp_awake_run(awake._ref)   # without the GIL, until stop()

        awake.thread = threading.Thread(target=run, name="numatp-host-awake", daemon=True)
        awake.thread.start()
        started.wait()
        if ready[0] is not None:
            log.info("numatp: no thread keeps this process's CPU awake while it waits for other hosts (%s): a "
                     "cross-host sum may wait for an idle CPU to wake", ready[0])
            awake.thread.join()
            awake._lib, awake.thread = None, None
        return awake

    def __enter__(self) -> None:
        self._set(1)

    def __exit__(self, *exc: Any) -> None:
        self._set(0)

    def stop(self) -> None:
        self._set(2)
        self._lib = None

    def _set(self, state: int) -> None:
        lib = self._lib   # once: stop() may clear it from another thread
        if lib is not None:
            lib.numatp_awake_set(self._ref, state)


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
