"""Block shapes: the sizes the cost model needs, one value per attention, MLP or LM-head block.

``blocks_for("gpt2", batch=1, seq=128, dtype="float32")`` gives, per layer, an attention and an MLP
block, then the LM head; a ``numatp.zoo.describe`` dict may be passed in place of the preset name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["BlockShape", "DTYPE_BYTES", "blocks_for"]

BlockKind = Literal["attention", "mlp", "lm_head"]

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2}
"""Bytes per element of each dtype the model knows."""

_KINDS = ("attention", "mlp", "lm_head")
_GATED = {"gelu": False, "geglu": True, "swiglu": True}


@dataclass(frozen=True, kw_only=True)
class BlockShape:
    """One sub-layer as the cost model sees it; activations are (batch, seq, hidden)."""

    kind: BlockKind
    """``"attention"``, ``"mlp"`` or ``"lm_head"``."""
    batch: int
    """Sequences per prefill call."""
    seq: int
    """Tokens per sequence."""
    hidden: int
    """Model width: the size of the activation the block reads and of the one it all-reduces."""
    inner: int
    """MLP intermediate width; q heads x head_dim for attention; the vocabulary for the LM head."""
    kv_inner: int = 0
    """kv heads x head_dim (attention only)."""
    heads: int = 0
    """Query heads (attention only)."""
    kv_heads: int = 0
    """Key/value heads (attention only); 1 is multi-query attention."""
    head_dim: int = 0
    """Width of one head (attention only)."""
    gated: bool = False
    """GeGLU/SwiGLU MLP: the up projection is two matrices (gate and up) of ``inner`` columns each."""
    dtype: str = "float32"
    """Element type of weights and activations: ``"float32"`` or ``"bfloat16"``."""
    context: int = 0
    """Keys and values each query attends to (attention only): 0 means ``seq`` (a prefill); a decode step
    has ``seq`` 1 and reads ``context`` cached positions."""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"BlockShape kind={self.kind!r} is not a block kind; use one of {', '.join(_KINDS)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"BlockShape dtype={self.dtype!r} is not modelled; use one of {', '.join(DTYPE_BYTES)}"
            )
        if self.context and self.context < self.seq:
            raise ValueError(f"BlockShape context={self.context} is shorter than seq={self.seq}: the queries "
                             "attend to their own positions at least")
        for name in ("batch", "seq", "hidden", "inner"):
            if getattr(self, name) < 1:
                raise ValueError(f"BlockShape {name}={getattr(self, name)} must be >= 1; pass a positive size")
        if self.kind == "attention" and min(self.heads, self.kv_heads, self.head_dim, self.kv_inner) < 1:
            raise ValueError(
                f"attention BlockShape needs heads, kv_heads, head_dim and kv_inner >= 1, got heads={self.heads}, "
                f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, kv_inner={self.kv_inner}; build it with "
                "blocks_for() or pass them"
            )

    @property
    def tokens(self) -> int:
        """batch x seq: the M of every projection GEMM."""
        return self.batch * self.seq

    @property
    def keys(self) -> int:
        """Positions each query attends to: ``context``, or ``seq`` in a prefill."""
        return self.context or self.seq

    def cache_bytes(self) -> int:
        """Bytes of cached keys and values the attention reads beyond this call's own (a decode step's)."""
        if self.kind != "attention" or self.keys == self.seq:
            return 0
        return 2 * self.batch * self.kv_heads * self.keys * self.head_dim * self.itemsize

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_BYTES[self.dtype]

    def gemms(self) -> tuple[tuple[int, int, bool], ...]:
        """The block's projections as ``(k, n, column_parallel)``: (tokens, k) @ (k, n).

        Column-parallel GEMMs split n across sockets, row-parallel ones split k (and leave a partial
        sum that the block's all-reduce closes).
        """
        if self.kind == "attention":
            return ((self.hidden, self.inner + 2 * self.kv_inner, True), (self.inner, self.hidden, False))
        if self.kind == "mlp":
            return ((self.hidden, self.inner * (2 if self.gated else 1), True), (self.inner, self.hidden, False))
        return ((self.hidden, self.inner, True),)

    def weight_bytes(self) -> int:
        """Bytes of all projection weights of the block (biases and norms are negligible)."""
        return sum(k * n for k, n, _ in self.gemms()) * self.itemsize

    def flops(self) -> float:
        """Multiply-adds x 2 of the projections plus, for attention, QK^T and PV over all heads."""
        gemm = sum(2.0 * self.tokens * k * n for k, n, _ in self.gemms())
        if self.kind == "attention":
            # (B, heads, S, keys) scores: S x keys x head_dim MACs for QK^T and again for PV, per head.
            gemm += 4.0 * self.batch * self.heads * self.seq * self.keys * self.head_dim
        return gemm


def _describe(preset: str | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(preset, Mapping):
        return preset
    from numatp.zoo import describe  # the zoo imports transformers: only pay for it when given a name

    return describe(preset)


def blocks_for(
    preset: str | Mapping[str, Any], batch: int, seq: int, dtype: str = "float32", *, context: int = 0
) -> list[BlockShape]:
    """Attention and MLP per layer, in order, then the LM head, for a zoo preset or describe() dict.
    ``context``: positions the attention reads (a decode step: ``seq`` 1, the cache's filled length)."""
    d = _describe(preset)
    try:
        layers, hidden, heads = int(d["layers"]), int(d["hidden"]), int(d["heads"])
        kv_heads = int(d.get("kv_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        intermediate, vocab, mlp = int(d["intermediate"]), int(d["vocab"]), str(d.get("mlp", "gelu"))
    except KeyError as e:
        raise ValueError(
            f"model description lacks {e.args[0]!r}; pass a numatp.zoo preset name or a dict from "
            "numatp.zoo.describe() (layers, hidden, heads, intermediate, vocab)"
        ) from e
    if mlp not in _GATED:
        raise ValueError(f"MLP kind {mlp!r} is not modelled; the cost model knows {', '.join(_GATED)}")
    common: dict[str, Any] = {"batch": batch, "seq": seq, "hidden": hidden, "dtype": dtype}
    attention = BlockShape(
        kind="attention", inner=heads * head_dim, kv_inner=kv_heads * head_dim, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, context=context, **common,
    )
    mlp_block = BlockShape(kind="mlp", inner=intermediate, gated=_GATED[mlp], **common)
    return [b for _ in range(layers) for b in (attention, mlp_block)] + [
        BlockShape(kind="lm_head", inner=vocab, **common)
    ]
