"""Roofline cost model of one block under three execution choices.

Choices (``CHOICES``):

- ``"sharded"``: NUMA-TP. Each of the N sockets holds 1/N of the block's weights in its own DRAM and
  runs 1/N of the work on its own cores; the block closes with one N-way all-reduce of the
  (batch, seq, hidden) output.
- ``"unsharded"``: the paper's NUMA-oblivious baseline on all N x cores cores. Weights are
  first-touched by the loading thread, so all of them sit on node 0; activations are touched by
  whichever pool thread writes them first, so they are spread evenly over the nodes.
- ``"one-socket"``: everything local to one socket, on that socket's cores only.

Modelling assumptions, each with its reason:

1. A block is a sequence of stages (each projection GEMM; for attention also the QK^T/softmax/PV
   core); a stage takes ``max(compute time, memory time)`` (roofline: the cores overlap arithmetic
   with outstanding misses), and stages do not overlap each other (each is a kernel launch that
   ends in a join).
2. Compute time is the stage's FLOPs over the sockets' GEMM rate, taken from the profile at the
   per-core size of the stage, because small GEMMs run below the large-GEMM rate.
3. DRAM traffic of a stage is its compulsory traffic (weights once, inputs and outputs once) when the
   weight bytes one socket reuses fit in its L3; otherwise the GEMM code re-reads operand panels once
   per output tile, ``flops / (tile / itemsize)`` bytes, half weight and half activation. Only the
   weight decides: a tiled GEMM streams each activation row panel through L2 once while it reuses the
   whole weight across every row of tiles, so it is the weight that must stay in L3 between uses
   (activation traffic is compulsory either way). For the attention core, whose operands are all
   activations, the per-socket activation bytes decide. This is the paper's "weights that fit in L3
   behave differently" effect (Fig. 2: NUMA-TP moves kernels to the L3/L2 ceilings): sharding divides
   the per-socket weight by N and can bring it under the L3.
4. The unsharded baseline touches all weight columns from every socket (the oblivious pool hands
   tiles of every column panel to every socket), so its per-socket weight is the full weight.
5. Unsharded, a non-zero socket reads its 1/N share of weight traffic remotely from node 0 and
   (N-1)/N of its activation traffic remotely. Those remote reads are stalls: their time adds to the
   stage's compute-or-local-memory time instead of overlapping it (the paper, Sec. III-C1: cores "stall
   on QPI fetches"), and they run at the socket's remote rate, the lesser of the link
   (``remote_bw_gbs``) and its cores' lines in flight (``cores x remote_core_gbs``), so a socket of few
   cores stalls longer on the same traffic: the paper's reason Haswell (6 cores) gains more than Cascade
   Lake (15). The stage takes at least node 0's controller time for all weight traffic. On a machine
   without a remote figure (one memory node) nothing is remote: the stage is the larger of compute and
   memory, as in 1.
6. Sharded memory time is one socket's 1/N of the traffic at local bandwidth; the input activation
   and the (replicated, paper Algorithm 3) normalisation are read in full on every socket.
7. Each kernel ends in a join of all the threads that ran it in both plans (the baseline's pool spans
   every socket too), so those joins cancel out of the comparison. What a sharded block adds is its
   all-reduce of (batch, seq, hidden) at ``allreduce_ns_per_byte`` with its one join (``barrier_us``);
   the LM head (column-parallel, no reduction) instead gathers its logits from the other sockets at
   remote bandwidth after one join.
8. Where the profile has no remote bandwidth (a single-node machine), remote reads cost the same as
   local ones: there is no locality to win, so sharding only adds synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

from numatp.cost.profile import MachineProfile
from numatp.cost.shapes import BlockShape

__all__ = ["CHOICES", "StageTime", "block_stages", "predict"]

CHOICES: tuple[str, ...] = ("sharded", "unsharded", "one-socket")

_MIB = 1 << 20
_GEMV_TOKENS = 16


@dataclass(frozen=True)
class StageTime:
    """One stage of a block: its FLOPs and DRAM bytes split by what they belong to."""

    name: str
    flops: float
    weight_bytes: float
    act_bytes: float
    per_socket_bytes: float
    """Bytes one socket touches when the stage is sharded (decides whether it fits in L3)."""
    column_parallel: bool


def block_stages(block: BlockShape, sockets: int) -> list[StageTime]:
    """The stages of ``block`` with compulsory bytes; re-read traffic is added per choice in predict."""
    t, e = block.tokens, block.itemsize
    stages = []
    for i, (k, n, col) in enumerate(block.gemms()):
        w, a = k * n * e, t * (k + n) * e
        stages.append(StageTime(f"gemm{i}", 2.0 * t * k * n, w, a, (w + a) / sockets, col))
    if block.kind == "attention":
        scores = block.batch * block.heads * block.seq * block.keys * e  # (B, heads, S, keys)
        # The unfused path writes the scores, softmax reads and writes them, PV reads them: 4 passes.
        # A decode step also reads the cached keys and values, split with the heads when sharded.
        act = 4 * scores + t * (block.inner + 2 * block.kv_inner + block.inner) * e + block.cache_bytes()
        flops = 4.0 * block.batch * block.heads * block.seq * block.keys * block.head_dim
        stages.append(StageTime("core", flops, 0.0, act, act / sockets, True))
    # Normalisation (read, write) and residual add on (B, S, hidden); replicated when sharded.
    stages.append(StageTime("norm", 0.0, 0.0, 3.0 * t * block.hidden * e, 3.0 * t * block.hidden * e, False))
    return stages


def _traffic(stage: StageTime, block: BlockShape, profile: MachineProfile, per_socket: float) -> tuple[float, float]:
    """(weight, activation) DRAM bytes of the whole stage, re-reads included when ``per_socket`` bytes
    (the weight one socket reuses; for the attention core its activations) overflow L3."""
    if stage.flops == 0.0 or per_socket <= profile.l3_mib * _MIB:
        return stage.weight_bytes, stage.act_bytes
    reread = stage.flops / (profile.gemm_tile / block.itemsize)
    if stage.weight_bytes == 0.0:  # attention core: both operands are activations
        return 0.0, max(stage.act_bytes, reread)
    return max(stage.weight_bytes, reread / 2), max(stage.act_bytes, reread / 2)


def _compute(stage: StageTime, block: BlockShape, profile: MachineProfile, sockets: int) -> float:
    if stage.flops == 0.0:
        return 0.0
    # a few tokens (a decode step) make matrix-vector products that stream their weight once: the
    # small-GEMM fall-off (too few tiles to spread over the cores) does not apply, the large-GEMM rate
    # bounds them, and memory decides
    work = 1e30 if block.tokens < _GEMV_TOKENS else stage.flops / sockets
    rate = profile.gemm_gflops(block.dtype, work, profile.cores_per_socket)
    return stage.flops / (sockets * rate * 1e9)


def predict(block: BlockShape, profile: MachineProfile, choice: str, *, sockets: int | None = None) -> float:
    """Predicted seconds of ``block`` under ``choice`` on ``sockets`` (default: all of the profile's)."""
    if choice not in CHOICES:
        raise ValueError(f"choice {choice!r} is not modelled; use one of {', '.join(CHOICES)}")
    n = profile.sockets if sockets is None else sockets
    if not 1 <= n <= profile.sockets:
        raise ValueError(
            f"sockets={n} is outside profile {profile.name!r}, which has {profile.sockets}; "
            f"pass sockets from 1 to {profile.sockets}"
        )
    local = profile.local_bw_gbs * 1e9
    stalls = profile.remote_bw_gbs is not None and n > 1  # another node to stall on
    remote = (profile.remote_bw_gbs or profile.local_bw_gbs) * 1e9
    if stalls and profile.remote_core_gbs:
        remote = min(remote, profile.cores_per_socket * profile.remote_core_gbs * 1e9)
    total = 0.0
    for st in block_stages(block, n):
        if choice == "sharded":
            # Replicated stages (norm) run in full on every socket; the rest is split N ways.
            split = n if st.flops or st.weight_bytes else 1
            w, a = _traffic(st, block, profile, st.weight_bytes / n if st.weight_bytes else st.per_socket_bytes)
            total += max((w + a) / split / local, _compute(st, block, profile, n))
        elif choice == "one-socket":
            w, a = _traffic(st, block, profile, st.weight_bytes or st.act_bytes)
            total += max((w + a) / local, _compute(st, block, profile, 1))
        else:
            # Every socket touches all weight columns; activations are split over the sockets.
            w, a = _traffic(st, block, profile, st.weight_bytes or st.act_bytes / n)
            comp = _compute(st, block, profile, n)
            far = (w / n + a / n * (n - 1) / n) / remote  # one non-zero socket's remote reads
            near = (a / n / n) / local                      # and its local ones
            node0 = (w + a / n) / local                      # node 0's controller serving every socket
            if n == 1:
                total += max((w + a) / local, comp)
            elif stalls:
                total += max(max(comp, near) + far, node0)
            else:
                total += max(far + near, node0, comp)
    if choice == "sharded" and n > 1:
        total += profile.barrier_us * 1e-6
        if block.kind == "lm_head":
            total += block.tokens * block.inner * block.itemsize * (n - 1) / n / remote
        else:
            total += block.tokens * block.hidden * block.itemsize * profile.allreduce_ns_per_byte * 1e-9
    return total
