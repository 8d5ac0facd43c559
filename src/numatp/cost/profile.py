"""Machine profiles: the handful of numbers the cost model needs about a multi-socket machine.

A profile is plain data, saved as JSON. Three built-in profiles describe the paper's platforms from
public specifications (``haswell-2s``, ``cascadelake-2s``, ``haswell-ex-4s``); ``numatp calibrate``
measures one for this host. ``load_profile`` takes either a built-in name or a path.
"""

from __future__ import annotations

import json
import math
import socket as _socket
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from numatp._cache import cache_dir

__all__ = ["BUILTIN_PROFILES", "MachineProfile", "default_profile_path", "load_profile", "save_profile"]

BUILTIN_PROFILES: tuple[str, ...] = ("haswell-2s", "cascadelake-2s", "haswell-ex-4s")
"""Names ``load_profile`` accepts besides a path: the three platforms of the paper's Table I."""


@dataclass(frozen=True, kw_only=True)
class MachineProfile:
    """What the cost model knows about a machine. Bandwidths are per socket; times are per event."""

    name: str
    """Platform or host name, for reports."""
    sockets: int
    """Sockets (NUMA nodes with CPUs) the profile describes."""
    cores_per_socket: int
    """Physical cores per socket that run GEMM threads."""
    peak_gflops: dict[str, float]
    """Hardware peak GFLOP/s of one socket per dtype (cores x clock x FLOP/cycle)."""
    gemm_efficiency: dict[str, float]
    """Fraction of ``peak_gflops`` the GEMM code reaches on a large GEMM, per dtype."""
    gemm_half_flops: float
    """FLOPs per core of one GEMM call at which it runs at half of its large-GEMM rate (launch and
    tail effects of small GEMMs)."""
    gemm_tile: int
    """Edge of the square output tile the GEMM code keeps in cache: when operands overflow L3, each
    (tile x tile) block re-reads both operand panels from DRAM, i.e. ``tile / itemsize`` FLOP/byte."""
    local_bw_gbs: float
    """Sustained DRAM read bandwidth of one socket from its own node, GB/s."""
    remote_bw_gbs: float | None
    """Sustained bandwidth of one socket reading another node's DRAM, GB/s; None where there is no
    other node to measure (remote reads are then costed as local)."""
    remote_core_gbs: float | None = None
    """Bandwidth one core sustains reading another node's DRAM, GB/s: the lines it keeps in flight x 64 B
    over the remote latency (Little's law). A socket's remote rate is the lesser of this x its cores and
    ``remote_bw_gbs``; None where not measured (no cap beyond the link)."""
    l3_mib: float
    """Last-level cache of one socket, MiB."""
    barrier_us: float
    """One synchronisation of the per-socket thread groups (the join that closes a sharded block), in
    microseconds."""
    allreduce_ns_per_byte: float
    """Cost of the ``sockets``-way all-reduce per byte of the reduced activation, ns."""
    gemm_table: tuple[tuple[str, int, int, int, float], ...] = ()
    """Measured ``(dtype, m, n, k, GFLOP/s of one socket)``; when it has rows for a dtype they replace
    peak x efficiency for that dtype (interpolated on log FLOPs)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each number comes from, keyed by field name."""

    def __post_init__(self) -> None:
        if self.sockets < 1 or self.cores_per_socket < 1:
            raise ValueError(
                f"profile {self.name!r}: sockets={self.sockets}, cores_per_socket={self.cores_per_socket}; "
                "both must be >= 1 — fix the profile JSON or re-run numatp calibrate"
            )
        for key in ("local_bw_gbs", "l3_mib", "gemm_half_flops"):
            if not getattr(self, key) > 0:
                raise ValueError(f"profile {self.name!r}: {key}={getattr(self, key)} must be > 0; fix the JSON")
        object.__setattr__(self, "gemm_table", tuple(tuple(r) for r in self.gemm_table))

    def gemm_gflops(self, dtype: str, flops: float, cores: int) -> float:
        """GFLOP/s of one socket on a GEMM of ``flops`` total work shared by ``cores`` cores."""
        rows = [(2.0 * m * n * k, g) for d, m, n, k, g in self.gemm_table if d == dtype]
        if rows:
            # Measured rows are whole-socket GEMMs: compare on FLOPs per core, interpolate in log space.
            pts = sorted((f / self.cores_per_socket, g) for f, g in rows)
            x = flops / max(cores, 1)
            if x <= pts[0][0]:
                return pts[0][1] * x / pts[0][0]  # below the smallest measured size: rate falls with size
            for (x0, g0), (x1, g1) in zip(pts, pts[1:]):
                if x <= x1:
                    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
                    return g0 + t * (g1 - g0)
            return pts[-1][1]
        if dtype not in self.peak_gflops:
            raise ValueError(
                f"profile {self.name!r} has no GEMM throughput for dtype {dtype!r} (it has "
                f"{', '.join(self.peak_gflops)}); use one of those or re-run numatp calibrate"
            )
        x = flops / max(cores, 1)
        return self.peak_gflops[dtype] * self.gemm_efficiency.get(dtype, 1.0) * x / (x + self.gemm_half_flops)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict; ``from_json`` reads it back."""
        d = asdict(self)
        d["gemm_table"] = [list(r) for r in self.gemm_table]
        return d

    @classmethod
    def from_json(cls, data: dict[str, Any], *, origin: str = "profile") -> MachineProfile:
        """Build from ``to_json`` output; unknown keys are an error so typos do not pass silently."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{origin}: unknown profile keys {unknown}; a profile has {', '.join(sorted(known))}"
            )
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"{origin}: not a valid profile ({e}); re-run numatp calibrate to write one") from e


def default_profile_path() -> Path:
    """Where ``numatp calibrate`` saves this host's profile: ``~/.cache/numatp/profile-<hostname>.json``
    (beside the GEMM table, wherever :func:`numatp._cache.cache_dir` says)."""
    return cache_dir() / f"profile-{_socket.gethostname()}.json"


def save_profile(profile: MachineProfile, path: str | Path) -> Path:
    """Write ``profile`` as indented JSON, creating the folder; returns the path."""
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    return p


def load_profile(name_or_path: str | Path) -> MachineProfile:
    """A built-in platform (one of ``BUILTIN_PROFILES``) or a profile JSON file."""
    if str(name_or_path) in BUILTIN_PROFILES:
        text = resources.files("numatp.cost").joinpath("profiles", f"{name_or_path}.json").read_text()
        origin = f"built-in profile {name_or_path}"
    else:
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"profile {str(name_or_path)!r} is neither a built-in platform ({', '.join(BUILTIN_PROFILES)}) "
                "nor an existing JSON file; pass one of those names or run `numatp calibrate --out PATH`"
            )
        text, origin = path.read_text(), str(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{origin} is not valid JSON ({e}); re-run numatp calibrate to rewrite it") from e
    return MachineProfile.from_json(data, origin=origin)
