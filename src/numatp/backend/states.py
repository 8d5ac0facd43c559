"""Each socket's own copy of the inputs its program writes in place: a static KV cache and its lengths.

A model run with a static cache (transformers' ``StaticCache``) writes the new keys and values into
tensors it is given, at every call. In the socket programs those writes are split like the K/V
projections: socket r writes the K/V heads it computes, so the store keeps, per socket, a tensor of
just those heads, on the socket's node (``numa_clone``, pages bound before first touch), made once from
the caller's tensor and then written in place by every call, never gathered. A replicated state (the
cache's length counter) is copied per socket as well, since every socket's program increments its own.

The caller's tensors are the keys: a second cache gets states of its own, and a cache's states are
dropped when its tensors are. After each call the replicated states are copied back into the caller's
tensors (so that ``cache.get_seq_length()`` stays right); the sharded K/V stay on their sockets.
:meth:`StateStore.reload` copies the caller's tensors in again (after ``cache.reset()``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from numatp.placement import numa_clone
from numatp.plan.localize import Binding
from numatp.plan.reference import shard_tensor
from numatp.plan.schema import Placement, Replicate
from numatp.runtime.segments import keep_cpp_references
from numatp.topology import Topology

__all__ = ["StateStore"]


class StateStore:
    def __init__(self, topology: Topology, *, strict: bool = False):
        self.topology = topology
        self.strict = strict
        self.place = not topology.is_virtual
        # key (id of the caller's tensor, layout code, rank) -> (socket's copy, placement); a layout code
        # is a small int standing for a placement (0: replicated), so that a decode step's lookups hash
        # ints, not placements
        self._made: dict[tuple, tuple[torch.Tensor, Placement]] = {}
        self._held: dict[tuple, Any] = {}   # a C++ reference to each copy (runtime.segments.keep_cpp_references)
        self._views: dict[tuple, torch.Tensor] = {}   # rows of a copy, for a caller's rows of a larger tensor
        self._narrow: set[int] = set()   # the caller tensors that are rows of another (held as views)
        self._sources: dict[int, weakref.ref] = {}
        self._layouts: dict[int, int] = {}   # how each caller tensor is split: its layout code
        self._codes: dict[Placement, int] = {}
        self._placements: list[Placement | None] = [None]   # code -> placement (None: replicated)
        self._followers: weakref.WeakSet[Any] = weakref.WeakSet()   # whose ``bound`` names tensors of this store

    def code(self, placement: Placement) -> int:
        """The layout code of ``placement`` in this store (0 for ``Replicate``)."""
        if isinstance(placement, Replicate):
            return 0
        code = self._codes.get(placement)
        if code is None:
            code = self._codes[placement] = len(self._placements)
            self._placements.append(placement)
        return code

    def get(self, user: torch.Tensor, b: Binding, rank: int, code: int | None = None) -> torch.Tensor:
        """Socket ``rank``'s copy of its part of ``user`` (made on first use from ``user``'s values).
        ``code``: ``self.code(b.placement)``, where the caller has it already.

        A ``user`` that is a range of rows of a larger tensor (``big[i:j]``: a cache of fewer sequences
        over the same memory, as the server's narrow programs read) gets the same rows of the larger
        tensor's copy: programs of both widths read and write one copy per socket."""
        if code is None:
            code = self.code(b.placement)
        key = (id(user), code, rank)
        made = self._made.get(key)
        if made is not None:
            return made[0]
        view = self._views.get(key)
        if view is not None:
            return view
        within = self._within(user)
        new = self._track(user, code)
        if within is not None:
            whole, (lo, hi) = within
            view = self._views[key] = self.get(whole, b, rank, code)[lo:hi]
            return view
        if not new and self._layouts[id(user)] != code:
            raise RuntimeError(
                f"numatp: a state input of shape {tuple(user.shape)} (a KV cache tensor) is held "
                f"{_describe(self._placements[self._layouts[id(user)]])} by one compiled graph and "
                f"{_describe(self._placements[code])} by another (a prefill and a decode step of the "
                "same cache sharded differently); the sockets' copies would disagree. Compile with "
                "policy='never', or report the model")
        made = self._made[key] = (self._copy(user, b.placement, rank), b.placement)
        self._held[key] = keep_cpp_references([made[0]])
        return made[0]

    def _track(self, user: torch.Tensor, code: int) -> bool:
        """Follow ``user`` (its copies are dropped with it) under layout ``code``; False where it is followed
        already."""
        if id(user) in self._sources:
            return False
        self._sources[id(user)] = weakref.ref(user)
        self._layouts[id(user)] = code
        weakref.finalize(user, self._forget, id(user))
        return True

    def _within(self, user: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """The known state tensor whose memory holds ``user`` as a range of its rows, and that range; None
        where ``user`` shares memory with no known state. Memory shared any other way is an error: the
        sockets would keep two copies of it that disagree."""
        if user.numel() == 0:
            return None
        ptr = user.untyped_storage().data_ptr()
        for ident, ref in self._sources.items():
            whole = ref()
            if (whole is None or whole is user or whole.untyped_storage().data_ptr() != ptr or ident in self._narrow
                    or not _overlap(user, whole)):
                continue   # another tensor, or another part of one buffer (a cache that slices its layers)
            rows = _row_range(user, whole)
            if rows is None or rows == (0, whole.shape[0]):
                raise RuntimeError(
                    f"numatp: a state input of shape {tuple(user.shape)} (a KV cache tensor) shares memory with "
                    f"another of shape {tuple(whole.shape)} other than as a range of its rows (dim 0), or is the "
                    "wider of the two and came second; the sockets would keep two copies that disagree. Give "
                    "each cache its own tensors, or run the wide cache before any cache of a range of its rows")
            self._narrow.add(id(user))
            return whole, rows
        return None

    def _copy(self, user: torch.Tensor, placement: Placement, rank: int) -> torch.Tensor:
        with torch.no_grad():
            part = shard_tensor(user.detach(), placement, rank)
            if self.place:
                return numa_clone(part, self.topology.sockets[rank].node, strict=self.strict)
            return part.clone(memory_format=torch.contiguous_format)

    def replicated(self, users: list[torch.Tensor]) -> list[torch.Tensor]:
        """Socket 0's copies of the replicated states ``users`` (made by :meth:`get`): after a call, their
        values go back into the caller's tensors, so that a cache's length reads right outside the model."""
        made = self._made
        return [made[(id(u), 0, 0)][0] for u in users]

    def follow(self, holder: Any) -> None:
        """Set ``holder.bound`` to None whenever this store forgets a tensor: ``holder`` keeps what it looked
        up here under the ids of the caller's tensors (:class:`numatp.backend.variants.Variant`), and a
        forgotten tensor's id may name another tensor next; nor should ``holder`` keep the copies alive."""
        self._followers.add(holder)

    def reload(self, replicated_only: bool = False) -> None:
        """Copy the caller's values into every socket's copy of every state again (``replicated_only``: of
        the replicated ones alone, the cache's lengths: a reset that leaves stale keys and values behind the
        attention mask, as the server's cache does)."""
        with torch.no_grad():
            for key, (local, placement) in self._made.items():
                if replicated_only and key[1] != 0:
                    continue
                source = self._sources[key[0]]()
                if source is not None:
                    local.copy_(shard_tensor(source.detach(), placement, key[2]))

    def _forget(self, ident: int) -> None:
        for holder in list(self._followers):
            holder.bound = None
        self._sources.pop(ident, None)
        self._layouts.pop(ident, None)
        for key in [k for k in self._made if k[0] == ident]:
            del self._made[key]
            self._held.pop(key, None)
        for key in [k for k in self._views if k[0] == ident]:
            del self._views[key]
        self._narrow.discard(ident)

    @property
    def nbytes(self) -> list[int]:
        """Bytes each socket holds."""
        out = [0] * self.topology.num_sockets
        for key, (t, _) in self._made.items():
            out[key[2]] += t.numel() * t.element_size()
        return out

    def tensors(self, rank: int) -> list[torch.Tensor]:
        """Socket ``rank``'s state tensors (for placement checks)."""
        return [t for k, (t, _) in self._made.items() if k[2] == rank]


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the element spans of ``a`` and ``b`` (of one storage) overlap."""
    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((int(n) - 1) * int(st) for n, st in zip(t.shape, t.stride()))
        start = int(t.storage_offset())
        return start * t.element_size(), (start + last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _row_range(part: torch.Tensor, whole: torch.Tensor) -> tuple[int, int] | None:
    """``(i, j)`` where ``part`` is ``whole[i:j]`` (same memory, rows along dim 0 of a contiguous ``whole``),
    else None."""
    if (not whole.is_contiguous() or part.dim() != whole.dim() or part.dim() == 0 or part.dtype != whole.dtype
            or part.shape[1:] != whole.shape[1:] or whole.stride(0) == 0
            or (part.shape[0] > 1 and part.stride() != whole.stride())
            or (part.shape[0] == 1 and part.stride()[1:] != whole.stride()[1:])):
        return None
    offset = part.storage_offset() - whole.storage_offset()
    if offset % whole.stride(0):
        return None
    start = offset // whole.stride(0)
    return (start, start + part.shape[0]) if 0 <= start and start + part.shape[0] <= whole.shape[0] else None


def _describe(layout: Placement | None) -> str:
    if layout is None:
        return "whole on every socket"
    return f"split along dim {layout.dim} as {[str(s) for s in layout.splits]}"
