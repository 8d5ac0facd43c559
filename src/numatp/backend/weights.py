"""Weight shards in their sockets' memory, made once per compiled model and shared by all its graphs.

On a real topology every shard and every replica is copied with ``numa_clone`` onto its socket's node
(pages bound before first touch). On virtual sockets there is one memory node: replicas are the model's
own tensors and shards are views where the split is one contiguous piece, so numatp adds no full copy.
A store made with ``place=False`` (the unsharded program on one socket spanning all CPUs) never places:
its weights stay where the model put them, as under plain ``torch.compile``.

The store also records the GEMM operands prepared from its weights (a packed weight, what it was made
from: :class:`~numatp.runtime.gemm.PackInfo`), which it hands out in their place from then on
(:meth:`WeightStore.replace`); the GEMM pass asks it what an argument is (:meth:`WeightStore.prepared`).
"""

from __future__ import annotations

import errno
import resource
from collections.abc import Callable
from typing import Any

import torch

from numatp.placement import numa_clone, pages_by_node
from numatp.runtime.gemm import PROVIDERS, PackInfo, PreparedOperands
from numatp.plan.localize import Binding
from numatp.plan.reference import shard_tensor
from numatp.plan.schema import Replicate
from numatp.topology import Topology

__all__ = ["Source", "WeightStore", "read_shard"]

Source = Callable[[int | None, int, int], torch.Tensor]
"""A parameter's values where the model does not hold them: ``source(dim, lo, hi)`` is the parameter's
indices ``[lo, hi)`` along ``dim`` (a new tensor in the parameter's dtype), ``source(None, 0, 0)`` the
whole parameter."""


def read_shard(source: Source, placement: Any, rank: int) -> torch.Tensor:
    """Socket ``rank``'s part of a parameter under ``placement``, read from ``source`` piece by piece (the
    same values as :func:`numatp.plan.reference.shard_tensor` cuts from the whole parameter)."""
    if isinstance(placement, Replicate):
        return source(None, 0, 0).contiguous()
    pieces = [source(placement.dim, lo, hi) for lo, hi in placement.splits[rank].intervals]
    return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces, placement.dim)


class WeightStore:
    def __init__(self, topology: Topology, *, strict: bool = False, place: bool = True):
        self.topology = topology
        self.strict = strict
        self.place = place and not topology.is_virtual
        self._made: dict[tuple, torch.Tensor] = {}
        self._origin: dict[tuple, tuple[torch.Tensor, Any]] = {}   # key -> (parameter, placement) of a plain shard
        self._keep: list[Any] = []   # the source tensors of the keys above stay alive while we use their id
        self._operands = PreparedOperands()
        self.sources: dict[int, Source] = {}
        """``id(parameter) -> source`` for parameters whose values are not in the model (built with
        ``numatp.zoo.build(..., shards_only=True)``): each shard is read from its source (a checkpoint's
        slices, or a preset's generator), never from the parameter, so a process holds its shards alone."""
        self.imported: dict[int, tuple[str, Any]] = {}
        """``id(parameter) -> (name, values)`` for parameters quantized before numatp saw them (torchao's,
        :mod:`numatp.quant.torchao`): their shards are cut from those values (never re-quantized) into
        numatp's quantized buffers, and no plain shard is made."""

    def get(self, param: torch.Tensor, b: Binding, rank: int) -> torch.Tensor:
        p = b.placement
        key = (id(param), type(p).__name__, getattr(p, "dim", None),
               str(p.splits[rank]) if not isinstance(p, Replicate) else None, b.lookup, rank)
        twin = (*key[:-2], not b.lookup, rank)
        if key not in self._made and twin in self._made and self._shareable(self._made[twin]):
            # a lookup and a tied LM head share one shard: plain, or quantized (numatp::qembedding reads it)
            self._made[key] = self._made[twin]
        if key not in self._made and id(param) in self.imported and not b.lookup and p is not None:
            self._keep.append(param)
            self._made[key] = self._imported_shard(param, p, rank)
        if key not in self._made:
            self._keep.append(param)
            self._made[key] = self._shard(param, p, rank)
        if id(param) not in self.imported:
            self._origin[key] = (param, p)
        return self._made[key]

    def _shard(self, param: torch.Tensor, p: Any, rank: int) -> torch.Tensor:
        """Socket ``rank``'s plain shard of ``param`` under placement ``p``, on the socket's node where placed."""
        with torch.no_grad():
            source = self.sources.get(id(param))
            local = shard_tensor(param.detach(), p, rank) if source is None else read_shard(source, p, rank)
            if not self.place:   # virtual sockets: the compile's log line says weights are not placed
                return local.contiguous()
            return numa_clone(local, self.topology.sockets[rank].node, strict=self.strict)

    def plain_of(self, operand: Any, rank: int) -> Callable[[], torch.Tensor] | None:
        """Where ``operand`` is a prepared operand that replaced socket ``rank``'s plain shard of a weight:
        a function that makes that plain shard again (from the model's parameter or its source, on the
        socket's node), for programs that read the weight as stored (a decode step after a prompt whose
        program packed it). None for anything else (a quantized shard among them: it has no plain one)."""
        info = self.prepared(operand)
        if info is None or info.weights:
            return None
        for key, t in self._made.items():
            if t is operand and key[-1] == rank and key in self._origin:
                param, p = self._origin[key]
                for twin, plain in self._made.items():   # a tied lookup's plain shard of the same rows
                    if twin[-2] != key[-2] and twin[:-2] == key[:-2] and twin[-1] == rank and \
                            self.prepared(plain) is None:
                        return lambda: plain
                return lambda: self._shard(param, p, rank)
        return None

    def _imported_shard(self, param: torch.Tensor, p: Any, rank: int) -> torch.Tensor:
        """Socket ``rank``'s shard of an imported quantized parameter, as numatp's quantized buffer (on the
        socket's node where placed), recorded as a prepared operand: its values cut at the shard's indices,
        its scales and zeros with their rows, or with their groups where the input dimension is split (a
        row-parallel shard must cut on group boundaries)."""
        from numatp.runtime.gemm.quant import QuantFormat, from_values

        name, v = self.imported[id(param)]
        fmt = QuantFormat(8) if v.kind == "int8" else QuantFormat(4, v.group)
        n, k = v.q.shape
        scales = v.scales.reshape(n, -1)
        q, s, z = v.q, scales, v.zeros
        if not isinstance(p, Replicate):
            q = shard_tensor(v.q, p, rank)
            if p.dim == 0:
                s = shard_tensor(scales, p, rank)
                z = None if v.zeros is None else shard_tensor(v.zeros, p, rank)
            else:
                g = k // scales.shape[1]
                bad = [iv for iv in p.splits[rank].intervals if iv[0] % g or iv[1] % g]
                if fmt.bits == 4 and bad:
                    raise ValueError(f"{name}: quantized in groups of {g} along its input dimension, and socket "
                                     f"{rank}'s row-parallel shard cuts it at {bad[0]}, inside a group; compile "
                                     f"with fewer sockets, or quantize with a smaller group")
                if fmt.bits == 4:
                    groups = type(p)(1, tuple(type(p.splits[0])(tuple((lo // g, hi // g) for lo, hi in sp.intervals))
                                              for sp in p.splits))
                    s = shard_tensor(scales, groups, rank)
                    z = None if v.zeros is None else shard_tensor(v.zeros, groups, rank)
        buf = from_values(q, s, z, fmt)
        if self.place:
            buf = numa_clone(buf, self.topology.sockets[rank].node, strict=self.strict)
        self.record(buf, PackInfo("q_dequant", (int(q.shape[0]), int(q.shape[1])), v.dtype, "nk", 0,
                                  weights=fmt.name))
        return buf

    def replace(self, rank: int, plain: torch.Tensor, prepared: torch.Tensor) -> None:
        """From now on hand out ``prepared`` (e.g. a GEMM-packed weight made on the socket) where ``rank``
        got ``plain`` for a matmul; the store drops its reference to ``plain``, so no second copy stays alive
        here, unless a vocabulary-parallel lookup reads the same rows (a tied table keeps its plain shard,
        except where the head's is quantized: the lookup reads the quantized rows)."""
        for key, t in self._made.items():
            if key[-1] == rank and t is plain and (not key[-2] or self._shareable(prepared)):
                self._made[key] = prepared

    def _shareable(self, t: Any) -> bool:
        """Whether a lookup may read ``t``, its tied head's operand: a plain shard or a quantized one."""
        info = self.prepared(t)
        return info is None or bool(info.weights)

    def record(self, operand: Any, info: PackInfo) -> None:
        """``operand`` is a prepared GEMM operand, ``info`` what it is (made by a socket's worker)."""
        self._operands.record(operand, info)

    def prepared(self, t: Any) -> PackInfo | None:
        """What ``t`` is where it is a prepared GEMM operand this store recorded; else None."""
        return self._operands.prepared(t)

    def mark(self) -> set[tuple]:
        """The weights made so far, for :meth:`drop_since`."""
        return set(self._made)

    def drop_since(self, mark: set[tuple]) -> None:
        """Forget every weight made after ``mark`` (a variant that was built, then not kept)."""
        for key in [k for k in self._made if k not in mark]:
            del self._made[key]
            self._origin.pop(key, None)
        self._operands.keep_only(list(self._made.values()))

    def report(self) -> dict[str, Any]:
        """Pages per node of each socket's weights (a plain weight kept beside a prompt's packed copy
        included), and the share of pages on the socket's own node; ``packed_tensors`` counts the packed
        GEMM operands held in place of plain weights, ``opaque_tensors`` those of them whose pages cannot
        be read (oneDNN's, or the constant inside an Inductor GEMM kernel: MKL's packed weights are
        plain tensors, counted in the pages). MKL's packing reserves more than it writes; per rank,
        ``unwritten_pages`` counts the pages of its buffers never written, so resident nowhere (left out
        of ``pages``); ``bytes`` the bytes of the tensors it holds (each once; opaque packed operands
        not counted, MKL's buffers less their pages never written), the weight memory of a socket
        (quantized shards at their quantized size)."""
        ranks = []
        local = total = opaque = packed = 0
        for r, sock in enumerate(self.topology.sockets):
            pages: dict[int, int] = {}
            unwritten = 0
            held: dict[int, int] = {}   # id -> bytes of each tensor this socket holds (a shared shard once)
            for key, t in self._made.items():
                if key[-1] != r:
                    continue
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    held[id(t)] = t.nbytes
                info = self.prepared(t)
                packed += info is not None and PROVIDERS[info.provider].packed
                kept = getattr(info, "plain", None)
                if kept is not None:   # the weight as stored, kept beside a prompt's copy for the decode steps
                    held[id(kept)] = kept.nbytes
                    for node, n in pages_by_node(kept).items():
                        pages[node] = pages.get(node, 0) + n
                if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                    # a packed GEMM weight (oneDNN's opaque tensor, or the constant inside an Inductor
                    # GEMM kernel) has no data pointer to ask the kernel about; it was allocated by the
                    # socket's worker, under its memory binding
                    opaque += 1
                    continue
                counts = pages_by_node(t)
                if info is not None and PROVIDERS[info.provider].places:
                    # never written: not present (-ENOENT), or the shared zero page once read (-EFAULT, seen
                    # in the 4-node guest for MKL's packed buffers): resident on no node either way
                    never = counts.pop(-errno.ENOENT, 0) + counts.pop(-errno.EFAULT, 0)
                    unwritten += never
                    # MKL's packing reserves more than it writes: the bytes held are the resident ones
                    held[id(t)] = max(0, t.nbytes - never * resource.getpagesize())
                for node, n in counts.items():
                    pages[node] = pages.get(node, 0) + n
            ranks.append({"socket": r, "node": sock.node, "pages": pages, "unwritten_pages": unwritten,
                          "bytes": sum(held.values())})
            local += pages.get(sock.node, 0)
            total += sum(n for node, n in pages.items() if node >= 0)
        return {"ranks": ranks, "local_fraction": (local / total) if total else 0.0,
                "virtual": self.topology.is_virtual, "tensors": len(self._made),
                "packed_tensors": packed, "opaque_tensors": opaque}
