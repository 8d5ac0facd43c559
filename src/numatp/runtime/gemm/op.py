"""The rewritten programs' GEMM call and what runs it: the ``numatp::gemm`` op (which
:mod:`numatp.plan.gemm_pass` puts in the graph), the executor's step for it, and the description of a
prepared operand (:class:`PackInfo`), which the weight store records beside the operand
(:meth:`numatp.backend.weights.WeightStore.record`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from numatp.runtime.gemm.providers import PROVIDERS

__all__ = ["GEMM_OP", "GemmStep", "PackInfo", "PreparedOperands", "gemm", "stand_in"]


@torch.library.custom_op("numatp::gemm", mutates_args=())
def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, provider: str, layout: str) -> torch.Tensor:
    """``x @ W (+ bias)`` by ``provider``; ``layout`` says how ``w`` is stored ("nk" or "kn").

    The runtime calls the provider directly (its operand may be packed); this body is the reference
    for running a rewritten program outside numatp's executor, on the plain weight.
    """
    w_kn = w.t() if layout == "nk" else w
    return torch.mm(x, w_kn) if bias is None else torch.addmm(bias, x, w_kn)


@gemm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, provider: str, layout: str) -> torch.Tensor:
    n = w.shape[0] if layout == "nk" else w.shape[1]
    return x.new_empty((x.shape[0], n))


GEMM_OP = torch.ops.numatp.gemm.default


@dataclass(frozen=True)
class PackInfo:
    """What a prepared operand is: its provider, the plain weight's shape/dtype/layout, the M it was packed
    for, and its quantized format where it is a quantized shard.

    ``plain`` and ``later``: where the operand is a second copy made for a prompt's rows (see
    ``GemmOptions.decode_copies``), the plain weight it was made from, kept for the decode steps, and the
    provider that reads it there; otherwise None."""

    provider: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str
    m: int
    plain: Any = field(default=None, compare=False, repr=False)
    later: str | None = None
    weights: str = ""
    """The quantized format of the operand (:mod:`numatp.runtime.gemm.quant`), which every provider of that
    format reads as it is; empty: a plain or packed weight, read by ``provider`` alone."""


@dataclass
class GemmStep:
    """A weight matmul the executor runs itself: ``env[dst] = provider(env[x], env[w], env[bias])``."""

    provider: str
    x: str
    w: str
    bias: str | None
    dst: str
    n: int
    k: int

    @property
    def inputs(self) -> list[str]:
        return [self.x, self.w] + ([self.bias] if self.bias else [])

    def __call__(self, env: dict[str, Any]) -> torch.Tensor:
        b = env[self.bias] if self.bias else None
        return PROVIDERS[self.provider].call(env[self.x], env[self.w], b, self.n, self.k)


def stand_in(t: Any, info: PackInfo | None = None) -> Any:
    """For shape propagation: ``t`` itself, or where ``t`` is a prepared operand (``info``, as recorded
    for it), a dense tensor of the plain weight's shape and dtype (no storage of its size)."""
    if info is None:
        return t
    return torch.empty(1, dtype=info.dtype).expand(info.shape)


class PreparedOperands:
    """Which tensors are prepared operands, and what each is (:class:`PackInfo`): the record a weight
    store keeps of the operands it hands out (an operand's own attributes carry nothing). Holds each
    operand, so that its id names it while recorded; :meth:`keep_only` drops those no longer in use."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Any, PackInfo]] = {}

    def record(self, operand: Any, info: PackInfo) -> None:
        self._by_id[id(operand)] = (operand, info)

    def prepared(self, t: Any) -> PackInfo | None:
        """What ``t`` is, if it is a recorded operand; else None (a plain weight, or anything else)."""
        entry = self._by_id.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else None

    def plain_of(self, operand: Any, rank: int) -> None:
        """This record cannot make a plain weight again (a weight store can: ``WeightStore.plain_of``)."""
        return None

    def keep_only(self, used: list[Any]) -> None:
        """Forget every operand not in ``used`` (by identity)."""
        ids = {id(t) for t in used}
        self._by_id = {i: e for i, e in self._by_id.items() if i in ids}
