"""Choosing per block: the cost model's answers for the CLI and for the compiler's ``policy="auto"``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from numatp.cost.model import CHOICES, predict
from numatp.cost.profile import MachineProfile, default_profile_path, load_profile
from numatp.cost.shapes import BlockShape, blocks_for

__all__ = ["Decision", "choose", "decide", "default_profile", "predict_decode", "predict_hosts", "predict_model"]


@dataclass(frozen=True)
class Decision:
    """The choice for one block, the predicted seconds of every choice, and why."""

    choice: str
    """``"sharded"``, ``"unsharded"`` or ``"one-socket"``."""
    times: dict[str, float]
    """Predicted seconds per choice."""
    reason: str
    """One line: the margin and which profile the prediction came from."""


def choose(block: BlockShape, profile: MachineProfile, *, sockets: int | None = None) -> tuple[str, dict[str, float]]:
    """The fastest choice for ``block`` and the predicted seconds of each."""
    times = {c: predict(block, profile, c, sockets=sockets) for c in CHOICES}
    return min(times, key=times.__getitem__), times


def predict_model(
    preset: str | Mapping[str, Any], batch: int, seq: int, dtype: str, profile: MachineProfile, *,
    lm_head: bool = True,
) -> dict[str, float]:
    """Predicted seconds of one prefill per choice, and ``speedup`` = unsharded / sharded.

    "sharded" is the paper's NUMA-TP plan: attention and MLP blocks sharded, the LM head left as in
    the baseline (the paper's passes cover attention, MLP and normalisation only). ``lm_head=False``
    leaves the LM head out of the prefill altogether (a model body without its head).
    """
    blocks = [b for b in blocks_for(preset, batch, seq, dtype) if lm_head or b.kind != "lm_head"]
    out = {c: 0.0 for c in CHOICES}
    for b in blocks:
        times = {c: predict(b, profile, c) for c in CHOICES}
        for c in CHOICES:
            use = "unsharded" if c == "sharded" and b.kind == "lm_head" else c
            out[c] += times[use]
    out["speedup"] = out["unsharded"] / out["sharded"]
    return out


def predict_decode(
    preset: str | Mapping[str, Any], batch: int, prompt: int, new_tokens: int, dtype: str,
    profile: MachineProfile,
) -> dict[str, Any]:
    """Predicted seconds of one decode step per choice, at the middle step of generating ``new_tokens``
    after ``prompt`` (its attention reads ``prompt + new_tokens // 2`` cached positions), and
    ``speedup`` = unsharded / sharded. A step reads every weight once for ``batch`` tokens: it is bound
    by memory bandwidth, which sharding multiplies by the sockets. Sharded is what numatp runs in decode:
    attention, MLP and the LM head (column-parallel, one row per sequence gathered) split over the
    sockets. ``bytes`` is what one step reads from DRAM at least (weights and cached keys and values)."""
    if new_tokens < 1 or prompt < 1:
        raise ValueError(f"prompt={prompt}, new_tokens={new_tokens}: both must be >= 1")
    context = prompt + new_tokens // 2
    blocks = blocks_for(preset, batch, 1, dtype, context=context)
    out: dict[str, Any] = {c: 0.0 for c in CHOICES}
    for b in blocks:
        for c in CHOICES:
            out[c] += predict(b, profile, c)
    out["speedup"] = out["unsharded"] / out["sharded"]
    out["context"] = context
    out["bytes"] = sum(b.weight_bytes() + b.cache_bytes() for b in blocks)
    return out


def predict_hosts(preset: str | Mapping[str, Any], batch: int, prompt: int, new_tokens: int, dtype: str,
                  profile: MachineProfile, hosts: int, network_gbs: float, latency_us: float) -> dict[str, Any]:
    """Predicted seconds of one decode step on ``hosts`` hosts of ``profile`` (each host its sockets, numatp's
    two levels: :mod:`numatp.runtime.hosts`), joined by a network of ``network_gbs`` GB/s per host and
    ``latency_us`` per message.

    Each host does 1/``hosts`` of the one-host sharded step (its weights, cached heads and in-host
    reductions divide the same way: an upper bound on what a second host gives). Each of the step's
    reductions (2 per layer and the vocabulary-parallel lookup's) adds one cross-host sum of the (batch,
    hidden) partial sums, and the logits gather one more of (batch, vocabulary) in fp32, each the way
    :class:`numatp.runtime.hosts.Hosts` sums: up to :data:`~numatp.runtime.hosts.GATHER_BYTES` gathered, an
    exchange (each host sends its sum to every other at once: one message of latency, ``H - 1`` times its
    bytes through the host's link at the network's rate), larger a ring all-reduce (``2 (H - 1)``
    messages, ``2 (H - 1) / H`` of its bytes).
    Returns ``{"seconds": [one host, ..., hosts], "speedup": one host / hosts, "network": seconds of the
    network at ``hosts``}``."""
    if hosts < 1 or network_gbs <= 0 or latency_us < 0:
        raise ValueError(f"hosts={hosts}, network_gbs={network_gbs}, latency_us={latency_us}: hosts >= 1, a "
                         "bandwidth > 0 and a latency >= 0")
    one = predict_decode(preset, batch, prompt, new_tokens, dtype, profile)["sharded"]
    blocks = blocks_for(preset, batch, 1, dtype, context=prompt + new_tokens // 2)
    item = 2 if dtype == "bfloat16" else 4
    hidden = blocks[0].hidden
    vocab = next(b.inner for b in blocks if b.kind == "lm_head")
    reductions = sum(b.kind in ("attention", "mlp") for b in blocks) + 1
    seconds, network = [], 0.0
    for h in range(1, hosts + 1):
        network = (reductions * _cross_host_seconds(h, batch * hidden * item, network_gbs, latency_us)
                   + _cross_host_seconds(h, batch * vocab * 4, network_gbs, latency_us))
        seconds.append(one / h + network)
    return {"seconds": seconds, "speedup": seconds[0] / seconds[-1], "network": network}


def _cross_host_seconds(hosts: int, nbytes: int, network_gbs: float, latency_us: float) -> float:
    """One cross-host sum of ``nbytes`` per host, as :meth:`numatp.runtime.hosts.Hosts.all_reduce` does it."""
    from numatp.runtime.hosts import exchange_bytes

    if hosts == 1:
        return 0.0
    if nbytes <= exchange_bytes(hosts):   # an exchange: each host's sum goes to every other at once
        messages, moved = 1, float((hosts - 1) * nbytes)
    else:
        messages, moved = 2 * (hosts - 1), 2 * (hosts - 1) / hosts * nbytes
    return messages * latency_us * 1e-6 + moved / (network_gbs * 1e9)


def _builtin_for(sockets: int) -> str:
    # Cascade Lake's gains are the smaller of the two 2-socket profiles' (numatp predict --paper)
    return "haswell-ex-4s" if sockets >= 4 else "cascadelake-2s"


def default_profile(topology: Any) -> tuple[MachineProfile, str]:
    """This host's saved ``numatp calibrate`` profile if there is one, else a conservative estimate.

    The estimate is a built-in profile with the topology's socket count: for up to 3 sockets the
    2-socket Cascade Lake one, whose predicted gains are the smaller of the two 2-socket platforms', for
    4 or more the 4-socket Haswell-EX one. On a virtual topology (one memory node) remote bandwidth is
    dropped, so sharding wins nothing but pays its synchronisation. Returns the profile and a phrase
    saying which it is, for ``Decision.reason``.
    """
    path = default_profile_path()
    if path.is_file():
        return load_profile(path), f"calibrated profile {path}"
    sockets = max(len(topology.sockets), 1)
    base = load_profile(_builtin_for(sockets)).to_json()
    base["name"] = f"estimate-{sockets}s"
    base["sockets"] = sockets
    if getattr(topology, "is_virtual", False) or len(getattr(topology, "nodes", ())) < 2:
        base["remote_bw_gbs"] = None
    return MachineProfile.from_json(base), (
        f"built-in estimate from {_builtin_for(sockets)} (no calibrated profile at {path}; run numatp calibrate)"
    )


def decide(
    blocks: Sequence[BlockShape], profile: MachineProfile | tuple[MachineProfile, str], sockets: int
) -> list[Decision]:
    """One ``Decision`` per block, between "sharded" on ``sockets`` sockets and "unsharded".

    ``profile`` may be the pair ``default_profile`` returns, whose phrase then ends every reason.
    "one-socket" is reported in ``times`` but not chosen: the compiler's plans shard or leave alone.
    """
    prof, origin = profile if isinstance(profile, tuple) else (profile, f"profile {profile.name}")
    if not 1 <= sockets <= prof.sockets:
        raise ValueError(
            f"sockets={sockets} but profile {prof.name!r} describes {prof.sockets}; pass sockets from 1 to "
            f"{prof.sockets} or a profile of this machine (numatp calibrate)"
        )
    out = []
    for b in blocks:
        times = {c: predict(b, prof, c, sockets=sockets) for c in CHOICES}
        pick = "sharded" if sockets > 1 and times["sharded"] < times["unsharded"] else "unsharded"
        ratio = times["unsharded"] / times["sharded"] if times["sharded"] > 0 else math.inf
        why = (
            f"{b.kind} at {b.batch}x{b.seq}: sharded over {sockets} sockets predicted {ratio:.2f}x the "
            f"unsharded speed; {origin}"
        )
        out.append(Decision(pick, times, why))
    return out
