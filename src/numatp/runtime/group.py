"""Socket groups: one persistent worker thread per socket, pinned, sized and bound to its node.

Order matters inside each worker (measured): pin the thread to its socket's CPUs first, then set the
intra-op thread count (OpenMP workers created afterwards inherit the pin), then bind the thread's memory
policy to the socket's node, then run anything parallel. Thread count and grad mode are per thread, so
each worker enters ``torch.inference_mode()`` itself.

ATen keeps one process-wide thread count beside the per-thread OpenMP and MKL counts: every
``torch.set_num_threads`` overwrites it, and each thread copies it into its own counts once, at its
first ATen parallel loop. A worker whose first such loop came after another group's worker had set a
different count took that count (measured: the 1-CPU socket workers of ``policy="auto"`` ran with 2
OpenMP threads each, both on their one CPU, 4-7% slower, once the 2-CPU unsharded program's worker
had started). So :func:`pin_threads` runs that one-time copy before setting the thread's own count,
and a group puts the process-wide count back to its caller's once its workers are up
(:func:`callers_threads`), so that threads the caller starts later do not inherit a socket's count.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from numatp.runtime.collective import CollectiveTimeout, CommAborted, SocketComm
from numatp.runtime.hosts import HostFailure
from numatp.topology import Topology

__all__ = ["SocketGroup", "SocketError", "GroupAborted", "callers_threads", "pin_threads"]


class SocketError(RuntimeError):
    """A socket's worker raised; the message names the socket, the cause is chained."""


class GroupAborted(RuntimeError):
    """Raised inside a worker whose peers failed or were interrupted: stop the current task."""


def pin_threads(cpus: tuple[int, ...] | list[int]) -> None:
    """Pin the calling thread to ``cpus`` and give it ``len(cpus)`` intra-op threads, for good."""
    os.sched_setaffinity(0, cpus)  # 0 = the calling thread on Linux
    torch.get_num_threads()  # ATen's once-per-thread copy of the process-wide count, done now, not later
    torch.set_num_threads(len(cpus))


@contextlib.contextmanager
def callers_threads() -> Iterator[None]:
    """Put ATen's process-wide thread count back to the calling thread's on exit: the threads started
    inside (each setting its own count) overwrite it."""
    count = torch.get_num_threads()  # also runs the caller's own once-per-thread copy before they start
    try:
        yield
    finally:
        torch.set_num_threads(count)


class _Shared:
    """What the workers share; kept apart from :class:`SocketGroup` so that an unused group can be collected."""

    def __init__(self, topology: Topology, bind: bool, timeout: float):
        self.topology = topology
        self.bind = bind
        self.timeout = timeout
        self.size = topology.num_sockets
        self.comm: Any = None   # the C++ collective (numatp.runtime.collective), made on first use
        self.comm_lock = threading.Lock()
        self.aborted = False   # a worker failed in this call (also stops a collective made after it)
        # The calls: the caller stores (number, fn) in one assignment, so a call is handed to every worker
        # or to none wherever an interrupt lands; each worker writes its result and the number of the call
        # it finished (no signal interrupts a worker thread), so what is in flight is always known.
        self.cond = threading.Condition()
        self.task: tuple[int, Callable[[int], Any] | None] = (0, None)   # None: the call was cancelled
        self.finished = [0] * self.size
        self.results: list[tuple[bool, Any] | None] = [None] * self.size
        self.stop = False
        self.ready = threading.Barrier(self.size + 1)
        self.setup_errors: list[BaseException] = []
        self.slots: list[Any] = [None] * self.size   # partials of the torch all-reduce (dtypes C++ does not sum)

    def abort(self) -> None:
        """Stop every barrier in progress and to come until the next call (a worker failed)."""
        with self.comm_lock:
            self.aborted = True
            if self.comm is not None:
                self.comm.abort()

    def reset(self) -> None:
        """A fresh start for the next call (no worker is inside one)."""
        with self.comm_lock:
            self.aborted = False
            if self.comm is not None:
                self.comm.reset()


def _worker(shared: _Shared, rank: int) -> None:
    sock = shared.topology.sockets[rank]
    try:
        pin_threads(sock.cpus)
        ctx = contextlib.ExitStack()
        if shared.bind:
            from numatp.placement import membind
            ctx.enter_context(membind(sock.node))
        ctx.enter_context(torch.inference_mode())
    except BaseException as e:  # noqa: BLE001  (reported to the constructor)
        shared.setup_errors.append(e)
        shared.ready.wait()
        return
    shared.ready.wait()
    cond = shared.cond
    last = 0
    with ctx:
        while True:
            with cond:
                while not shared.stop and shared.task[0] == last:
                    cond.wait()
                if shared.stop:
                    return
                last, task = shared.task
            out: tuple[bool, Any] | None = None
            if task is not None:
                try:
                    out = (True, task(rank))
                except BaseException as e:  # noqa: BLE001  (handed to the caller)
                    shared.abort()
                    out = (False, e)
            with cond:
                shared.results[rank] = out
                shared.finished[rank] = last
                cond.notify_all()
            del task, out


def _stop(shared: _Shared, threads: list[threading.Thread]) -> None:
    with shared.cond:
        shared.stop = True
        shared.cond.notify_all()
    for t in threads:
        if t.is_alive() and t is not threading.current_thread():
            t.join(timeout=5)


class SocketGroup:
    """Workers for the sockets of ``topology``; use as a context manager (``close()`` joins them).

    ``run(fn)`` calls ``fn(rank)`` on every worker at once and returns the results in socket order.
    Inside ``fn``, ``group.barrier(rank)`` synchronises the sockets; a worker that raises breaks the
    barrier so the others stop at their next one instead of waiting forever. The workers stop when the
    group is closed or garbage-collected.

    Calls from several threads run one after another (a caller waits for the call in progress); a call
    from inside a call (a worker, or the caller's own thread re-entering) is an error, since it would
    wait for itself. A call interrupted on the caller's thread (KeyboardInterrupt, any exception raised
    there) stops its workers at their next collective and waits for them before raising; where a second
    interrupt cuts that wait short, the next call (or :meth:`settle`) finishes it first. Either way no
    worker is left waiting on a barrier, and the next call starts on a settled group.
    """

    def __init__(self, topology: Topology, *, bind_memory: bool | None = None, timeout: float = 600.0):
        self.topology = topology
        self.size = topology.num_sockets
        bind = (not topology.is_virtual) if bind_memory is None else bind_memory
        self._shared = shared = _Shared(topology, bind, timeout)
        self._lock = threading.Lock()
        self._owner: int | None = None   # the thread whose call is in progress
        self._threads = [
            threading.Thread(target=_worker, args=(shared, r), name=f"numatp-{id(shared):x}-socket{r}", daemon=True)
            for r in range(self.size)
        ]
        with callers_threads():
            for t in self._threads:
                t.start()
            self._finalizer = weakref.finalize(self, _stop, shared, self._threads)
            shared.ready.wait()
        if shared.setup_errors:
            self.close()
            err = shared.setup_errors[0]
            raise SocketError(f"could not start the socket workers: {err}") from err

    @property
    def binds_memory(self) -> bool:
        """Whether each worker's memory is bound to its socket's node (a real topology, by default)."""
        return self._shared.bind

    @property
    def thread_names(self) -> list[str]:
        return [t.name for t in self._threads if t.is_alive()]

    @property
    def comm(self) -> Any:
        """The group's C++ collective (:class:`numatp.runtime.collective.SocketComm`), compiled and made on
        first use; None for a group of one socket."""
        shared = self._shared
        if shared.comm is None and self.size > 1:
            with shared.comm_lock:
                if shared.comm is None:
                    shared.comm = SocketComm(self.size, timeout=shared.timeout)
                    if shared.aborted:   # a peer failed before the collective existed
                        shared.comm.abort()
        return shared.comm

    def barrier(self, rank: int) -> None:
        """Wait for every socket of the group (inside ``run``)."""
        if self.size > 1:
            self._collective(self.comm.barrier, rank)

    def all_reduce(self, rank: int, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every socket's ``partial`` in a new tensor on this socket's node (inside ``run``).
        float32 and bfloat16 are summed by the C++ collective; other dtypes by torch, after a barrier.
        On a real topology the result is bound to the socket's node (``numa_empty``): a tensor the
        worker's allocator recycles may sit on another node's pages."""
        if self.size == 1:
            return partial.clone()
        if self.comm.supports(partial):
            out = None
            if self._shared.bind:
                from numatp.placement import numa_empty
                out = numa_empty(partial.shape, partial.dtype, self.topology.sockets[rank].node)
            return self._collective(self.comm.all_reduce, rank, partial, out)
        return self._torch_all_reduce(rank, partial)

    def _torch_all_reduce(self, rank: int, partial: torch.Tensor) -> torch.Tensor:
        slots = self._shared.slots
        slots[rank] = partial
        t0 = time.perf_counter()
        self.barrier(rank)
        self.comm.waited_seconds[rank] += time.perf_counter() - t0
        total = slots[0] + slots[1]
        for p in slots[2:]:
            total += p
        self.barrier(rank)   # every socket has read every partial: the next reduction may reuse the slots
        slots[rank] = None
        return total

    @contextlib.contextmanager
    def compiled_collectives(self, rank: int) -> Iterator[list]:
        """Inside ``run``: the calling worker is socket ``rank`` for ``numatp::socket_all_reduce``, the op
        compiled segments call. Yields ``[seconds, count]``, filled on exit with the time spent in those
        reductions and how many completed. A reduction that failed because a peer failed raises
        :class:`GroupAborted` here (its error from compiled code chained), one that timed out
        :class:`~numatp.runtime.collective.CollectiveTimeout`, as the Python collectives do."""
        comm = self.comm
        comm.enter(rank, self.topology.sockets[rank].node if self._shared.bind else None)
        stats: list = [0.0, 0]
        try:
            yield stats
        finally:
            stats[:] = self._collective(comm.leave, rank)

    def _collective(self, op: Callable, rank: int, *args: Any) -> Any:
        try:
            return op(rank, *args)
        except CommAborted:
            raise GroupAborted(f"socket {rank}: a peer socket failed or the call was interrupted") from None

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """``[fn(0), ..., fn(N-1)]`` computed on the sockets' workers concurrently."""
        me = threading.get_ident()
        if (self._lock.locked() and self._owner == me) or any(t.ident == me for t in self._threads):
            raise RuntimeError("a numatp socket group was called from inside one of its own calls (a callback of "
                               "the call, or a socket worker); that call would wait for itself: call the compiled "
                               "model again after the call in progress returns")
        with self._lock:   # callers from other threads wait here for the call in progress
            self._owner = me
            try:
                return self._run(fn)
            finally:
                self._owner = None

    def _run(self, fn: Callable[[int], Any]) -> list[Any]:
        shared = self._shared
        self.settle()   # an earlier call cut short: its workers have stopped
        shared.reset()
        with shared.cond:
            call = shared.task[0] + 1
            shared.task = (call, fn)   # one store: every worker gets the call, or none does
            shared.cond.notify_all()
        try:
            with shared.cond:
                while not all(f == call for f in shared.finished):
                    shared.cond.wait()
        except BaseException:   # KeyboardInterrupt: stop the workers at their next collective, wait for them
            shared.abort()
            self.settle()
            raise
        outcomes, shared.results = shared.results, [None] * self.size
        results: list[Any] = [None] * self.size
        errors: dict[int, BaseException] = {}
        for rank, (ok, value) in enumerate(outcomes):  # type: ignore[misc]  # every worker ran this call
            if ok:
                results[rank] = value
            else:
                errors[rank] = value
        if errors:
            late = [e for e in errors.values() if isinstance(e, CollectiveTimeout)]
            if late:
                stuck = late[0].missing
                cpus = "; ".join(f"socket {r}: CPUs {_cpus(self.topology, r)}" for r in stuck)
                raise SocketError(f"timed out: {late[0]} ({cpus}); that socket is stuck, or far slower "
                                  "than its peers (check what else runs on its CPUs)") from late[0]
            across = [e for e in errors.values() if isinstance(e, HostFailure)]
            if across:   # another process stopped: that, not this process's socket, is the news
                raise across[0]
            real = {r: e for r, e in errors.items() if not isinstance(e, GroupAborted)}
            rank, err = min((real or errors).items())
            raise SocketError(f"socket {rank} (CPUs {_cpus(self.topology, rank)}) failed: "
                              f"{type(err).__name__}: {err}") from err
        return results

    def settle(self) -> None:
        """Return once no worker is inside a call. A call its caller left early (an interrupt) is cancelled:
        the workers that had not started it skip it, the others stop at their next collective. Safe to call
        at any time outside a call; an interrupt of this wait leaves the group for the next call to settle."""
        shared = self._shared
        with shared.cond:
            call = shared.task[0]
            if all(f == call for f in shared.finished):
                return
            shared.task = (call, None)
            shared.abort()
            shared.cond.notify_all()
            while not all(f == call for f in shared.finished):
                shared.cond.wait()
            shared.results = [None] * self.size

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> SocketGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cpus(topology: Topology, rank: int) -> str:
    from numatp.topology import format_cpulist
    return format_cpulist(topology.sockets[rank].cpus)

