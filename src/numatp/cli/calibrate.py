"""``numatp calibrate``: measure this machine's cost-model profile and save it as JSON."""

from __future__ import annotations

import argparse
import sys
import time

from numatp.cost.profile import default_profile_path, save_profile

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure GEMM rate, bandwidth, barrier and all-reduce cost; save a profile",
        description="Measure per-socket GEMM throughput (fp32, bf16), local and remote DRAM bandwidth, "
        "barrier latency and all-reduce cost with pinned threads and node-placed buffers, and save "
        "them as a profile JSON for `numatp predict` and policy='auto'; then time every GEMM provider "
        "(MKL, oneDNN, packed or not, Inductor's C++ template) on one socket and print these ceilings, "
        "which go into the GEMM table numatp.compile reads. About 1-3 minutes.",
    )
    parser.add_argument("--out", metavar="PATH", default=None,
                        help=f"where to write the profile (default: {default_profile_path()})")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats: under a minute")
    parser.add_argument("--remeasure-gemm", action="store_true",
                        help="only time again every shape of this CPU's GEMM table (the rates numatp.compile "
                        "picks providers from), e.g. after they were measured on a busy machine; no profile")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--sockets", type=int, metavar="N", default=None,
                       help="socket count (default: numatp's, the detected sockets, or 2 virtual ones on a "
                       "one-node machine); N: the first N sockets, or N virtual ones on a one-node machine")
    group.add_argument("--virtual", type=int, metavar="N", default=None,
                       help="measure a virtual N-socket topology (this process's CPUs split N ways)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from numatp.cost.calibrate import measure_gemm_ceilings, measure_profile  # imports torch: only here
    from numatp.topology import Topology, resolve_sockets

    try:   # numatp.compile's sockets (numatp.topology.resolve_sockets) unless --virtual
        topo = Topology.virtual(sockets=args.virtual) if args.virtual is not None else resolve_sockets(args.sockets)
    except ValueError as e:
        raise SystemExit(f"numatp calibrate: {e}") from e
    start = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - start:5.1f}s] {msg}", file=sys.stderr, flush=True)

    if args.remeasure_gemm:
        from numatp.cost.calibrate import remeasure_gemm_table
        from numatp.runtime.gemm import GemmTable

        count, skipped = remeasure_gemm_table(topo, progress=progress)
        print(f"re-timed {count} GEMM shapes in {GemmTable().path}" if count else
              f"the GEMM table {GemmTable().path} has no shapes to time again: compiling a model fills it")
        if skipped:
            cpus = sum(len(sock.cpus) for sock in topo.sockets)
            print(f"skipped {len(skipped)} shapes measured for more threads than these {cpus} CPUs: "
                  f"{', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}")
        return 0
    profile = measure_profile(topo, quick=args.quick, progress=progress)
    path = save_profile(profile, args.out or default_profile_path())
    progress(f"saved {path}")
    ceilings = measure_gemm_ceilings(topo, progress=progress)
    print(path)
    print(render_ceilings(ceilings, len(topo.sockets[0].cpus)))
    return 0


def render_ceilings(ceilings: dict[str, dict[str, float]], threads: int) -> str:
    """The table of GEMM rates per dtype and provider that ``calibrate`` prints (``topo``'s layout)."""
    from numatp.cli.topo import render_gemm
    from numatp.runtime.gemm import CEILING_SHAPE

    m, k, n = CEILING_SHAPE
    return render_gemm({dt: {str(threads): rates} for dt, rates in ceilings.items()},
                       title=f"GEMM ceilings, GFLOP/s at {m} x {k} x {n} on socket 0 (- = cannot run here)")
