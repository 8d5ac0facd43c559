"""The planner's state: what the NUMA-TP pass has decided so far for one graph, and one round's assignment.

:func:`numatp.plan.tp_pass.plan_graph` starts a :class:`PlanState` from the tp_plan's and the policy's
decisions, then repeats rounds (assign column sets -> propagate layouts); where propagation meets a
decision it cannot honour, the relax step gives one decision up and records why in the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx

from numatp.plan.roles import WeightMatmul
from numatp.plan.schema import IndexSet, Reason

__all__ = ["PlanState", "Round"]


@dataclass
class PlanState:
    """What the pass has decided so far for one graph, by weight-matmul node.

    Planning starts from the tp_plan's and the policy's decisions; each round assigns column sets and
    propagates layouts, and where a decision cannot be honoured the relax step gives one thing up and
    records why. Nothing is ever taken back, so the rounds are bounded (:meth:`max_rounds`).
    """

    forced: set[torch.fx.Node] = field(default_factory=set)
    """Rows of blocks the tp_plan shards: a conflict in them is the plan's error, not a relaxation."""
    forced_lm: set[torch.fx.Node] = field(default_factory=set)
    """Projections outside blocks the tp_plan shards as LM heads."""
    forced_rep: set[torch.fx.Node] = field(default_factory=set)
    """Column projections the tp_plan replicates beside the split ones of their block."""
    excluded: set[torch.fx.Node] = field(default_factory=set)
    """Matmuls of blocks that run replicated whole."""
    replicated: dict[torch.fx.Node, tuple[str, Reason]] = field(default_factory=dict)
    """Row (or LM head) of each block left unsharded -> (block kind, why)."""
    no_lm_head: set[torch.fx.Node] = field(default_factory=set)
    """Projections not to split as LM heads."""
    narrowed: set[torch.fx.Node] = field(default_factory=set)
    """Rows whose block splits only its widest column projections (K/V heads that split unlike Q's)."""
    grouped: dict[torch.fx.Node, tuple[int, int]] = field(default_factory=dict)
    """Rows whose block splits along its K/V groups -> (query heads, K/V heads)."""
    accepted: dict[torch.fx.Node, str] = field(default_factory=dict)
    """policy "auto": row -> the cost model's words for sharding the block."""
    predicted: dict[str, float] | None = None
    """policy "auto": the graph's predicted seconds, ``{"sharded": s, "unsharded": s}``."""
    rounds: int = 0
    """Rounds of assignment and propagation so far."""

    @staticmethod
    def max_rounds(matmuls: list[WeightMatmul]) -> int:
        """Each relaxation adds a row to ``grouped``, ``narrowed`` or ``excluded`` (each at most once) or a
        projection to ``no_lm_head``: at most 3 per row and 1 per other matmul, plus the round that settles."""
        return 3 * len(matmuls) + 1

    @property
    def predicted_ms(self) -> tuple[float, float] | None:
        p = self.predicted
        return (1e3 * p["sharded"], 1e3 * p["unsharded"]) if p else None


@dataclass(frozen=True)
class Round:
    """One round's assignment: each block's row, split and whole-computed columns (row None: an LM head),
    and what :func:`~numatp.plan.propagate.propagate` takes."""

    members: list[tuple[WeightMatmul | None, list[WeightMatmul], list[WeightMatmul]]]
    column_sets: dict[torch.fx.Node, tuple[int, tuple[IndexSet, ...]]]
    rows: dict[torch.fx.Node, int]
    lm_heads: set[torch.fx.Node]
    grouped_ids: set[int]
