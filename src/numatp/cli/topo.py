"""``numatp topo``: show the NUMA nodes, their distances, and the sockets numatp would use."""

from __future__ import annotations

import argparse
import json

from numatp.topology import Topology, default_topology, format_cpulist

__all__ = ["add_parser", "render"]

_GIB = 1 << 30


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "topo",
        help="show NUMA nodes, distances and the sockets numatp would use",
        description="Show the NUMA nodes of this machine (CPUs, usable CPUs, memory), the node "
        "distance matrix, the sockets (tensor-parallel ranks) numatp would use, and the CPUs this "
        "process may run on.",
    )
    parser.add_argument("--json", action="store_true",
                        help="print the topology as one JSON object instead of tables")
    parser.add_argument("--virtual", type=int, metavar="N", default=None,
                        help="show a virtual topology: this process's CPUs split into N sockets on "
                        "memory node 0 (what tests and single-node machines use)")
    parser.add_argument("--sysfs-root", default="/sys", metavar="DIR",
                        help="read the node layout from DIR/devices/system/node instead of /sys "
                        "(e.g. a saved copy of another machine's sysfs)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        if args.virtual is not None:
            topo = Topology.virtual(sockets=args.virtual)
        else:
            topo = Topology.detect(root=args.sysfs_root)
    except ValueError as e:
        raise SystemExit(f"numatp topo: {e}") from e
    # GEMM ceilings describe this CPU: not shown for another machine's sysfs copy
    ceilings = _gemm_ceilings() if args.sysfs_root == "/sys" else None
    if args.json:
        print(json.dumps({**topo.to_dict(), **({"gemm_ceilings": ceilings} if ceilings is not None else {})},
                         indent=2))
    else:
        print(render(topo) + ("" if ceilings is None else "\n\n" + render_gemm(ceilings)))
    return 0


def _gemm_ceilings() -> dict[str, dict[str, dict[str, float]]]:
    """``{dtype: {threads: {provider: GFLOP/s}}}`` from the GEMM table of this CPU (JSON-ready keys)."""
    from numatp._cache import cache_dir

    # The table's name hashes this CPU with the torch build, so finding it imports torch (seconds); with
    # no table in the cache at all (nothing compiled or calibrated yet) there is nothing to find.
    if not any(cache_dir().glob("gemm-*.json")):
        return {}
    from numatp.runtime.gemm import ceiling_table

    return {dt: {str(t): r for t, r in sorted(by_t.items())} for dt, by_t in sorted(ceiling_table().items())}


def render_gemm(ceilings: dict[str, dict[str, dict[str, float]]],
                title: str = "GEMM ceilings (best measured GFLOP/s per provider; - = cannot run here)") -> str:
    """The GEMM ceilings section of ``numatp topo`` (and ``calibrate``'s table): rate per dtype, thread
    count and provider, ``ceilings`` as ``{dtype: {threads: {provider: GFLOP/s}}}``."""
    from numatp._cache import cache_dir

    if not ceilings:
        return (f"GEMM ceilings: none measured on this CPU yet (GEMM tables are kept in {cache_dir()}); run numatp "
                "calibrate, or compile a model with numatp")
    providers = sorted({p for by_t in ceilings.values() for r in by_t.values() for p in r})
    rows = [[dt, t, *(f"{r[p]:.1f}" if r.get(p) else "-" for p in providers),
             max(r, key=lambda p: r[p])] for dt, by_t in ceilings.items() for t, r in by_t.items()]
    return "\n".join([title, *_table(["dtype", "threads", *providers, "best"], rows)])


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]


def render(topo: Topology) -> str:
    """The human-readable report that ``numatp topo`` prints."""
    kind = "virtual (all sockets on memory node 0; nothing is mbind-placed)" if topo.is_virtual \
        else "detected from sysfs"
    lines = [f"Topology: {kind}", "", "NUMA nodes"]
    node_rows = [
        [str(n.id), format_cpulist(n.cpus) or "-", format_cpulist(n.cpus & topo.allowed_cpus) or "-",
         f"{n.memory_bytes / _GIB:.1f}"]
        for n in topo.nodes
    ]
    lines += _table(["node", "CPUs", "usable CPUs", "memory GiB"], node_rows)

    ids = [n.id for n in topo.nodes]
    lines += ["", "Distances (10 = local)"]
    lines += _table(["from\\to", *map(str, ids)],
                    [[str(a), *(str(topo.nodes[i].distances.get(b, "-")) for b in ids)]
                     for i, a in enumerate(ids)])

    used = topo if topo.is_virtual else default_topology(topo)   # numatp.compile's default here
    lines += ["", f"Sockets numatp would use: {used.num_sockets}" + (
        " (virtual: one node's CPUs split in two; sockets=1 runs one)" if used.is_virtual and not topo.is_virtual
        else "")]
    lines += _table(["socket", "memory node", "CPUs", "count"],
                    [[str(s.index), str(s.node), format_cpulist(s.cpus), str(len(s.cpus))]
                     for s in used.sockets])
    lines += ["", f"CPUs this process may use: {format_cpulist(topo.allowed_cpus)} "
              f"({len(topo.allowed_cpus)})"]
    lines += [f"Note: {note}" for note in topo.notes]
    return "\n".join(lines)
