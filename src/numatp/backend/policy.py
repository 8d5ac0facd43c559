"""policy "auto" and "never": when a graph runs unsharded, when both plans are built and timed, and the
cost model's decider for each block.
"""

from __future__ import annotations

from collections.abc import Callable

from numatp.backend.options import AUTO_MEASURE
from numatp.plan.schema import Plan
from numatp.topology import Topology

__all__ = ["AUTO_ROUNDS", "close_call", "default_decider", "runs_unsharded"]

AUTO_ROUNDS = 3
"""policy "auto" measuring both plans: timed calls of each, alternating; the best of them counts."""


def close_call(plan: Plan, margin: float = AUTO_MEASURE) -> bool:
    """Whether policy "auto" measures both plans of ``plan``'s graph: its predictions lie within ``margin``."""
    pred = plan.predicted
    if not pred or margin <= 0:
        return False
    low, high = sorted((pred["sharded"], pred["unsharded"]))
    return low > 0 and high / low - 1 <= margin


def runs_unsharded(plan: Plan, policy: str) -> bool:
    """Whether the backend runs ``plan`` unsharded on all cores rather than as socket programs: policy
    "never", or "auto" where no block (LM head and embedding aside) is sharded. Replicated blocks in socket programs
    would run whole on each socket's share of the cores, never faster than one program on all of them
    (plain Inductor, or with GEMM providers on, one numatp program on one socket of all CPUs)."""
    layer_blocks = [b for b in plan.blocks if b.kind not in ("lm_head", "embedding")]
    return policy == "never" or (policy == "auto" and not any(b.sharded for b in layer_blocks))


def default_decider(topology: Topology) -> Callable:
    """Ask the cost model, with this host's calibrated profile or a built-in estimate, per block."""
    from numatp.cost import BlockShape, decide, default_profile

    profile = default_profile(topology)

    def decider(cand, sockets: int) -> tuple[dict[str, float], str]:
        # the graph gives tokens (batch x seq) but not the split between them: the attention core is
        # modelled as one sequence of all tokens, an upper bound on its quadratic term
        head_dim = 64 if cand.inner % 64 == 0 else cand.inner
        heads = max(1, cand.inner // head_dim)
        shape = BlockShape(kind=cand.kind, batch=1, seq=cand.tokens, hidden=cand.hidden, inner=cand.inner,
                           kv_inner=cand.inner if cand.kind == "attention" else 0,
                           heads=heads if cand.kind == "attention" else 0,
                           kv_heads=heads if cand.kind == "attention" else 0,
                           head_dim=head_dim if cand.kind == "attention" else 0,
                           dtype="bfloat16" if cand.itemsize == 2 else "float32")
        (d,) = decide([shape], profile, sockets)
        times = ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in d.times.items())
        return d.times, f"{d.reason} (predicted: {times})"

    return decider
