"""The sockets' barrier and all-reduce in C++, without the GIL.

``collective.cpp`` beside this file is compiled on first use into numatp's library
(:mod:`numatp.runtime.native`, ``-O3 -march=native -fopenmp``) and called through ``ctypes``, which
releases the GIL for the length of every call. Compiled segments reach the same collective without
Python: ``numatp::socket_all_reduce`` (``ops.cpp``) runs it for the socket its worker entered
(:meth:`SocketComm.enter`). Its OpenMP loops run on the calling worker's own team (torch's OpenMP
runtime, already loaded, is the one the library binds to), so a socket reduces with its own pinned
threads.

An all-reduce reads the peers' partial sums in place (the sockets share one address space): below
:data:`FUSED_BYTES` every socket sums all partials after one barrier; above, each socket reduces its
own slice and then copies the others' (reduce-scatter + all-gather), so no element is summed twice.
bf16 is summed in fp32 and rounded once. A barrier spins on atomic flags (pause, then yield), stops at
once when a peer fails (:meth:`SocketComm.abort`), and after ``timeout`` seconds names the sockets that
never arrived.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch

from numatp.runtime.native import library_path

__all__ = ["FUSED_BYTES", "CollectiveTimeout", "CommAborted", "SocketComm", "library", "rehearsal"]

FUSED_BYTES = 32 << 10
"""At or below this many bytes an all-reduce sums every partial on every socket (one barrier fewer);
above, reduce-scatter + all-gather."""

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_MAX_SOCKETS = 64   # kMaxRanks in collective.cpp
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


class CommAborted(RuntimeError):
    """A barrier stopped because a peer socket failed or the call was interrupted."""


class CollectiveTimeout(RuntimeError):
    """A barrier waited longer than its timeout; ``missing`` lists the sockets that never arrived."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


def library() -> ctypes.CDLL:
    """The compiled collective, built once per source, compiler and CPU."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = _load(library_path())
        return _lib


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    u64p, f64p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_double)
    lib.numatp_comm_new.argtypes, lib.numatp_comm_new.restype = [ctypes.c_int], vp
    lib.numatp_comm_free.argtypes, lib.numatp_comm_free.restype = [vp], None
    lib.numatp_comm_abort.argtypes, lib.numatp_comm_abort.restype = [vp], None
    lib.numatp_comm_reset.argtypes, lib.numatp_comm_reset.restype = [vp], None
    lib.numatp_barrier.argtypes = [vp, ctypes.c_int, ctypes.c_double, u64p]
    lib.numatp_barrier.restype = ctypes.c_int
    lib.numatp_all_reduce.argtypes = [vp, ctypes.c_int, vp, vp, i64, ctypes.c_int, i64, ctypes.c_double, u64p, f64p]
    lib.numatp_all_reduce.restype = ctypes.c_int
    lib.numatp_socket_enter.argtypes = [vp, ctypes.c_int, ctypes.c_double, i64, ctypes.c_int]
    lib.numatp_socket_enter.restype = None
    lib.numatp_socket_leave.argtypes = [f64p, f64p, ctypes.POINTER(i64), u64p]
    lib.numatp_socket_leave.restype = ctypes.c_int
    lib.numatp_socket_rehearse.argtypes, lib.numatp_socket_rehearse.restype = [], None
    i32p = ctypes.POINTER(ctypes.c_int32)
    lib.numatp_awake_run.argtypes, lib.numatp_awake_run.restype = [i32p], None
    lib.numatp_awake_set.argtypes, lib.numatp_awake_set.restype = [i32p, ctypes.c_int32], None
    return lib


@contextlib.contextmanager
def rehearsal() -> Iterator[None]:
    """On the calling thread, alone: each ``numatp::socket_all_reduce`` returns a copy of its partial. For a
    warm-up run of a socket's program, whose values are not used."""
    lib = library()
    lib.numatp_socket_rehearse()
    try:
        yield
    finally:
        lib.numatp_socket_leave(ctypes.byref(ctypes.c_double()), ctypes.byref(ctypes.c_double()),
                                ctypes.byref(ctypes.c_int64()), ctypes.byref(ctypes.c_uint64()))


class SocketComm:
    """Barrier and all-reduce among the ``size`` workers of one socket group (``size`` >= 2).

    Every worker calls the same operations in the same order with its own ``rank``. ``abort`` (any
    thread) makes every barrier in progress and to come fail with :class:`CommAborted` until ``reset``,
    which the group calls between calls, when no worker is inside one. ``waited_seconds[rank]`` adds up
    the time ``rank`` spent in its all-reduces waiting for the last peer to arrive (those run from
    compiled segments counted at :meth:`leave`): the part of a reduction's time that is the peers'
    imbalance, not the reduction's work.
    """

    def __init__(self, size: int, *, timeout: float = 600.0, fused_bytes: int = FUSED_BYTES):
        if not 2 <= size <= _MAX_SOCKETS:
            raise ValueError(f"SocketComm(size={size}): a collective needs 2 to {_MAX_SOCKETS} sockets")
        self.size = size
        self.timeout = float(timeout)
        self.fused_bytes = int(fused_bytes)
        self.waited_seconds = [0.0] * size
        self._lib = library()
        self._comm = self._lib.numatp_comm_new(size)
        assert self._comm, "numatp_comm_new refused a size in range"
        self._finalizer = weakref.finalize(self, self._lib.numatp_comm_free, self._comm)

    @staticmethod
    def supports(t: torch.Tensor) -> bool:
        return t.dtype in _DTYPES and t.device.type == "cpu" and t.layout == torch.strided

    def all_reduce(self, rank: int, partial: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum of every socket's ``partial`` (same shape and dtype on each), written into ``out`` (a
        contiguous tensor of that shape and dtype; default: a new one) and returned. Partials are not
        written."""
        src = partial.contiguous()
        if out is None:
            out = torch.empty_like(src)
        elif out.shape != src.shape or out.dtype != src.dtype or not out.is_contiguous():
            raise ValueError(f"all_reduce: out must be contiguous {tuple(src.shape)} {src.dtype}, got "
                             f"{tuple(out.shape)} {out.dtype}")
        missing, waited = ctypes.c_uint64(0), ctypes.c_double(0)
        rc = self._lib.numatp_all_reduce(self._comm, rank, src.data_ptr(), out.data_ptr(), src.numel(),
                                         _DTYPES[src.dtype], self.fused_bytes, self.timeout, ctypes.byref(missing),
                                         ctypes.byref(waited))
        self.waited_seconds[rank] += waited.value
        self._check(rc, rank, missing, "an all-reduce")
        return out

    def enter(self, rank: int, node: int | None = None) -> None:
        """Make the calling thread socket ``rank`` of this collective for ``numatp::socket_all_reduce`` (the op
        compiled segments call), its results on ``node`` (None: torch's allocator), until :meth:`leave`."""
        self._lib.numatp_socket_enter(self._comm, rank, self.timeout, self.fused_bytes, -1 if node is None else node)

    def leave(self, rank: int) -> tuple[float, int]:
        """End :meth:`enter` on the calling thread: (seconds spent in ``numatp::socket_all_reduce``, reductions
        completed); raises :class:`CommAborted` or :class:`CollectiveTimeout` if one of them failed."""
        seconds, waited, count, missing = ctypes.c_double(0), ctypes.c_double(0), ctypes.c_int64(0), ctypes.c_uint64(0)
        rc = self._lib.numatp_socket_leave(ctypes.byref(seconds), ctypes.byref(waited), ctypes.byref(count),
                                           ctypes.byref(missing))
        self.waited_seconds[rank] += waited.value
        self._check(rc, rank, missing, "an all-reduce")
        return seconds.value, count.value

    def barrier(self, rank: int) -> None:
        missing = ctypes.c_uint64(0)
        self._check(self._lib.numatp_barrier(self._comm, rank, self.timeout, ctypes.byref(missing)),
                    rank, missing, "a barrier")

    def abort(self) -> None:
        self._lib.numatp_comm_abort(self._comm)

    def reset(self) -> None:
        self._lib.numatp_comm_reset(self._comm)

    def _check(self, rc: int, rank: int, missing: ctypes.c_uint64, what: str) -> None:
        if rc == 0:
            return
        if rc == 1:
            raise CommAborted(f"socket {rank}: a peer socket failed or the call was interrupted")
        stuck = [r for r in range(self.size) if missing.value >> r & 1]
        names = ", ".join(map(str, stuck))
        raise CollectiveTimeout(f"socket{'s' if len(stuck) > 1 else ''} {names} did not reach {what} within "
                                f"{self.timeout:g} s (socket {rank} waited)", stuck)
