"""The NUMA partitioning schema: plain data that says how every weight and value is split over sockets.

An :class:`IndexSet` is the ordered set of global indices one socket holds along one dimension, kept as
half-open intervals: a fused QKV column shard for socket 0 of 2 in GPT-2 is
``IndexSet(((0, 384), (768, 1152), (1536, 1920)))``. Shards may differ in size between sockets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "IndexSet", "even_split", "Colwise", "Rowwise", "Replicate", "Placement",
    "Reason", "ReasonKind", "Block", "WeightPlan", "Plan",
]


@dataclass(frozen=True)
class IndexSet:
    """Sorted, disjoint half-open intervals of global indices along one dimension."""

    intervals: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(i for i in self.intervals if i[1] > i[0]):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
            else:
                merged.append((lo, hi))
        object.__setattr__(self, "intervals", tuple(merged))

    @staticmethod
    def range(lo: int, hi: int) -> IndexSet:
        return IndexSet(((lo, hi),))

    @staticmethod
    def of(indices: list[int] | set[int]) -> IndexSet:
        """The set of ``indices`` (any order, repeats allowed)."""
        return IndexSet(tuple((i, i + 1) for i in indices))

    def scaled(self, unit: int) -> IndexSet:
        """Each index ``i`` becomes the run ``[i * unit, (i + 1) * unit)``: whole heads to their features."""
        return IndexSet(tuple((lo * unit, hi * unit) for lo, hi in self.intervals))

    def __len__(self) -> int:
        return sum(hi - lo for lo, hi in self.intervals)

    def indices(self) -> list[int]:
        return [i for lo, hi in self.intervals for i in range(lo, hi)]

    def shifted(self, offset: int) -> IndexSet:
        return IndexSet(tuple((lo + offset, hi + offset) for lo, hi in self.intervals))

    def clip(self, lo: int, hi: int) -> IndexSet:
        """The part inside ``[lo, hi)``, re-based so that ``lo`` becomes 0."""
        return IndexSet(tuple((max(a, lo) - lo, min(b, hi) - lo) for a, b in self.intervals))

    def local_range(self, lo: int, hi: int) -> tuple[int, int]:
        """Local positions ``[start, stop)`` of the global indices inside ``[lo, hi)``."""
        start = count = 0
        for a, b in self.intervals:
            start += max(0, min(b, lo) - a)
            count += max(0, min(b, hi) - max(a, lo))
        return start, start + count

    def __str__(self) -> str:
        return ",".join(f"{lo}:{hi}" for lo, hi in self.intervals) or "-"


def even_split(size: int, parts: int, unit: int = 1) -> tuple[IndexSet, ...]:
    """Split ``range(size)`` into ``parts`` contiguous pieces of whole ``unit``s, sizes differing by at most one unit.

    >>> [str(s) for s in even_split(20, 3)]
    ['0:7', '7:14', '14:20']
    """
    units = size // unit
    base, extra = divmod(units, parts)
    out, lo = [], 0
    for r in range(parts):
        hi = lo + (base + (r < extra)) * unit
        out.append(IndexSet.range(lo, hi))
        lo = hi
    return tuple(out)


@dataclass(frozen=True)
class Colwise:
    """Split along the weight's output features (``dim`` of the parameter); ``splits[r]`` is socket r's share."""

    dim: int
    splits: tuple[IndexSet, ...]


@dataclass(frozen=True)
class Rowwise:
    """Split along the weight's input features: each socket produces a partial sum to be all-reduced."""

    dim: int
    splits: tuple[IndexSet, ...]


@dataclass(frozen=True)
class Replicate:
    """A full copy on every socket."""


Placement = Colwise | Rowwise | Replicate


ReasonKind = Literal[
    "column_row",     # sharded: column projections split by heads / units, output projection by rows
    "vocab_columns",  # an LM head split over the vocabulary, its logits gathered
    "vocab_rows",     # an embedding table split by rows (vocabulary-parallel), lookups summed
    "by_plan",        # replicated because the tp_plan given says so
    "cost",           # policy "auto": the cost model predicts the graph faster unsharded
    "measured",       # policy "auto", a close call: both plans were built and timed, the faster kept
    "reduction",      # an op reduces over the sharded dimension (a norm over the features)
    "no_rule",        # an op with no sharding rule meets a sharded value
    "layout",         # an op cannot carry the shard it is given (views, writes, masks, K/V heads, ...)
    "kv_groups",      # grouped-query heads cannot be split along their K/V groups over these sockets
    "small_table",    # an embedding table beside the vocabulary: not worth an all-reduce
    "uneven_table",   # a vocabulary that cannot give each socket one contiguous range of rows
    "read_whole",     # a table some op reads whole (a tied LM head left replicated)
]


@dataclass(frozen=True)
class Reason:
    """Why a block is sharded or replicated: a ``kind`` that tests and tools compare, with the facts that
    :meth:`__str__` renders as the prose ``numatp explain`` prints. Fields not used by a kind stay empty."""

    kind: ReasonKind
    module: str = ""
    sockets: int = 0
    sizes: tuple[int, ...] = ()
    """kv_groups: (query heads, K/V heads); small_table: (rows, width, vocabulary rows, width);
    uneven_table: (rows,); vocab_rows: each socket's (start, stop) flattened."""
    op: str = ""
    """The op (and node) that decided it: reduction, no_rule, layout, read_whole."""
    detail: str = ""
    """The propagation rule's words (reduction, no_rule, layout) or the measurement (measured)."""
    source: str = ""
    """by_plan, and columns a plan replicates: where the plan came from ("plan", "hf tp_plan", a file)."""
    pattern: str = ""
    """by_plan: the plan's pattern that matched the module."""
    replicated: tuple[str, ...] = ()
    """column_row: column projections computed whole on every socket (too few heads to split)."""
    by_plan: tuple[tuple[str, str], ...] = ()
    """column_row: (column projection, pattern) the plan replicates beside the split ones."""
    cost: str = ""
    """The cost model's words for this block (policy "auto")."""
    predicted_ms: tuple[float, float] | None = None
    """policy "auto": the graph's predicted (sharded, unsharded) milliseconds."""
    tied: bool = False
    """vocab_rows: the table shares its shards with a tied LM head."""
    prior: Reason | None = None
    """measured: the reason the prediction gave before the measurement."""

    def __str__(self) -> str:
        k = self.kind
        if k == "column_row":
            text = "column/row parallel"
            if self.replicated:
                text += f"; {', '.join(self.replicated)} replicated: too few heads to split"
            text += "".join(f"; {c} replicated by {self.source} ({p!r})" for c, p in self.by_plan)
            return text + (f"; {self._predicted()}" if self.predicted_ms is not None else "")
        if k == "vocab_columns":
            return "column-parallel over the vocabulary, then gathered"
        if k == "vocab_rows":
            ranges = ", ".join(f"{a}:{b}" for a, b in zip(self.sizes[::2], self.sizes[1::2]))
            return (f"vocabulary-parallel: rows {ranges} per socket, lookups summed by one all-reduce"
                    + ("; the same shards as the tied LM head" if self.tied else ""))
        if k == "by_plan":
            return f"replicated by {self.source} ({self.pattern!r})"
        if k == "cost":
            return f"{self._predicted()}: the graph stays unsharded"
        if k == "measured":
            return f"{self.prior}; {self.detail}" if self.prior is not None else self.detail
        if k == "kv_groups":
            q, kv = self.sizes
            return f"{q} query heads in {kv} K/V groups cannot be split along the groups over {self.sockets} sockets"
        if k == "small_table":
            rows, width, *vocab = self.sizes
            return (f"small table ({rows} x {width}) beside the {tuple(vocab)} vocabulary: replicated, sharding "
                    "it would add an all-reduce for little memory")
        if k == "uneven_table":
            return (f"{self.sizes[0]} rows cannot be split into one contiguous range per socket over {self.sockets} "
                    "sockets")
        if k == "read_whole":
            return f"read whole by {self.op}: replicated"
        return self.detail   # reduction, no_rule, layout: the rule's own words name the op

    def _predicted(self) -> str:
        sharded, unsharded = self.predicted_ms or (0.0, 0.0)
        return f"{self.cost}; graph predicted {sharded:.1f} ms sharded vs {unsharded:.1f} ms unsharded"

    def measured(self, note: str) -> Reason:
        """This reason, followed by what timing both plans found (``kind`` becomes "measured")."""
        return Reason("measured", module=self.module, sockets=self.sockets, detail=note, prior=self)


@dataclass(frozen=True)
class Block:
    """One attention, MLP or LM-head block as the pass found it, and what it decided."""

    kind: Literal["attention", "mlp", "lm_head", "embedding"]
    module: str
    columns: tuple[str, ...]
    row: str | None
    sharded: bool
    reason: Reason
    replicated_columns: tuple[str, ...] = ()
    shapes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightPlan:
    """One parameter use: its name, global shape, dtype size and placement."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    placement: Placement

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for s in self.shape:
            n *= s
        return n

    def local_bytes(self, rank: int) -> int:
        if isinstance(self.placement, Replicate):
            return self.nbytes
        return self.nbytes // self.shape[self.placement.dim] * len(self.placement.splits[rank])


@dataclass(frozen=True)
class Plan:
    """The partitioning schema of one graph for ``sockets`` sockets."""

    sockets: int
    blocks: tuple[Block, ...]
    weights: dict[str, tuple[WeightPlan, ...]]
    reductions: int
    gathers: int
    predicted: dict[str, float] | None = None
    """policy "auto": the cost model's seconds for the blocks it weighed, ``{"sharded": s, "unsharded": s}``."""
    decisions: dict[str, str] = field(default_factory=dict)
    """Each projection's and embedding table's decision by module, in the tp_plan vocabulary."""
    nodes: dict[str, object] = field(default_factory=dict, compare=False, repr=False)
    """The decision for every node of the planned graph, by node name (``numatp.plan.propagate.NodeInfo``):
    what :func:`numatp.plan.localize` reads to make each socket's program."""

    def to_tp_plan(self) -> dict[str, str]:
        """This plan as a transformers-style ``tp_plan`` (layers written as ``*`` where they agree): pass it
        back as ``numatp.compile(model, plan=...)``, edited or not, to get the same socket programs."""
        from numatp.plan.tp_plan import compress
        return compress(self.decisions)

    def socket_bytes(self, rank: int) -> int:
        """Weight bytes socket ``rank`` holds; a parameter replicated for one use serves its other uses too."""
        total = 0
        for uses in self.weights.values():
            if any(isinstance(u.placement, Replicate) for u in uses):
                total += uses[0].nbytes
            else:
                total += sum(u.local_bytes(rank) for u in uses)
        return total

    @property
    def model_bytes(self) -> int:
        return sum(uses[0].nbytes for uses in self.weights.values())

    @property
    def replicated_bytes(self) -> int:
        return sum(
            uses[0].nbytes for uses in self.weights.values() if any(isinstance(u.placement, Replicate) for u in uses)
        )
