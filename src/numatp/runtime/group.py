"""Socket groups: one persistent worker thread per socket, pinned, sized and bound to its node.

Order matters inside each worker (measured): pin the thread to its socket's CPUs first, then set the
intra-op thread count (OpenMP workers created afterwards inherit the pin), then bind the thread's memory
policy to the socket's node, then run anything parallel. Thread count and grad mode are per thread, so
each worker enters ``torch.inference_mode()`` itself.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from numatp.topology import Topology

__all__ = ["SocketGroup", "SocketError", "GroupAborted"]


class SocketError(RuntimeError):
    """A socket's worker raised; the message names the socket, the cause is chained."""


class GroupAborted(RuntimeError):
    """Raised inside a worker whose peers failed or were interrupted: stop the current task."""


_STOP = object()


class SocketGroup:
    """Workers for the sockets of ``topology``; use as a context manager (``close()`` joins them).

    ``run(fn)`` calls ``fn(rank)`` on every worker at once and returns the results in socket order.
    Inside ``fn``, ``group.barrier(rank)`` synchronises the sockets; a worker that raises breaks the
    barrier so the others stop at their next one instead of waiting forever.
    """

    def __init__(self, topology: Topology, *, bind_memory: bool | None = None, timeout: float = 600.0):
        self.topology = topology
        self.size = topology.num_sockets
        self.timeout = timeout
        self._bind = (not topology.is_virtual) if bind_memory is None else bind_memory
        self._barrier = threading.Barrier(self.size)
        self._tasks: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(self.size)]
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ready = threading.Barrier(self.size + 1)
        self._setup_errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._worker, args=(r,), name=f"numatp-socket{r}", daemon=True)
            for r in range(self.size)
        ]
        for t in self._threads:
            t.start()
        self._ready.wait()
        if self._setup_errors:
            self.close()
            raise SocketError(f"could not start the socket workers: {self._setup_errors[0]}") from self._setup_errors[0]

    def _worker(self, rank: int) -> None:
        sock = self.topology.sockets[rank]
        try:
            os.sched_setaffinity(0, sock.cpus)
            torch.set_num_threads(len(sock.cpus))
            ctx = contextlib.ExitStack()
            if self._bind:
                from numatp.placement import membind
                ctx.enter_context(membind(sock.node))
            ctx.enter_context(torch.inference_mode())
        except BaseException as e:  # noqa: BLE001  (reported to the constructor)
            self._setup_errors.append(e)
            self._ready.wait()
            return
        self._ready.wait()
        with ctx:
            while True:
                task = self._tasks[rank].get()
                if task is _STOP:
                    return
                try:
                    self._done.put((rank, True, task(rank)))
                except BaseException as e:  # noqa: BLE001  (handed to the caller)
                    self._barrier.abort()
                    self._done.put((rank, False, e))

    def barrier(self, rank: int) -> None:
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise GroupAborted(f"socket {rank}: a peer socket failed or the call was interrupted") from None

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """``[fn(0), ..., fn(N-1)]`` computed on the sockets' workers concurrently."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("this numatp socket group is already running a call from another thread; "
                               "numatp runs one prefill at a time per compiled model: call it from one thread")
        try:
            self._barrier.reset()
            for q in self._tasks:
                q.put(fn)
            results: list[Any] = [None] * self.size
            errors: dict[int, BaseException] = {}
            pending = self.size
            interrupted: BaseException | None = None
            while pending:
                try:
                    rank, ok, value = self._done.get()
                except BaseException as e:  # KeyboardInterrupt: stop the peers, still collect them
                    interrupted = e
                    self._barrier.abort()
                    continue
                pending -= 1
                if ok:
                    results[rank] = value
                else:
                    errors[rank] = value
            if interrupted is not None:
                raise interrupted
            real = {r: e for r, e in errors.items() if not isinstance(e, GroupAborted)}
            if real or errors:
                rank, err = min((real or errors).items())
                raise SocketError(f"socket {rank} (CPUs {_cpus(self.topology, rank)}) failed: "
                                  f"{type(err).__name__}: {err}") from err
            return results
        finally:
            self._lock.release()

    def close(self) -> None:
        for q in self._tasks:
            q.put(_STOP)
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=5)

    def __enter__(self) -> SocketGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _cpus(topology: Topology, rank: int) -> str:
    from numatp.topology import format_cpulist
    return format_cpulist(topology.sockets[rank].cpus)


def check_oversubscription(topology: Topology) -> None:
    """Warn when the socket groups' threads exceed the CPUs this process may use."""
    total = sum(len(s.cpus) for s in topology.sockets)
    if total > len(os.sched_getaffinity(0)):
        warnings.warn(f"numatp: {total} worker threads for {len(os.sched_getaffinity(0))} usable CPUs; "
                      "OpenMP slows down badly when oversubscribed", stacklevel=2)
