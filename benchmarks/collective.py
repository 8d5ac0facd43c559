"""The cost of one all-reduce between virtual sockets, per size, against memory bandwidth.

For each socket count and size (1 KiB to 64 MiB by default) the socket workers of a group run the
reduction back to back; the median time of one reduction is printed for numatp's C++ collective called
from Python (a cut of a socket's program), for the same collective inside compiled code
(``numatp::socket_all_reduce``: ``--chain`` reductions in a row in one segment compiled by Inductor with
``cpp_wrapper``, as a layer runs them, timed per call and divided by the chain), and for the Python
reduction the collective replaced (each socket posts its partial in a list, waits on a
``threading.Barrier``, then sums all partials with torch), with the bandwidth the compiled time implies
(tensor bytes / time) and the target of the runtime issue: 10 us (2 sockets; 20 us from 8) plus the
tensor's bytes at this machine's memory bandwidth, taken from a copy of the same size on one socket.

A reduction cannot avoid reading what its peers just wrote: a socket reads (N-1)/N of every peer's
partial and, above the fused size, (N-1)/N of the total from the slices' owners, each freshly written
on another socket (in its cache, or in its memory on a real server). The "peer GB/s" column is a copy
of such data (every socket copies a buffer of the row's size that the next socket has just written),
and "floor us" those bytes at that rate: the time a reduction would take if it did nothing but the
reads it cannot avoid. One JSON line per row with ``--json``.

    python benchmarks/collective.py --sockets 2 --dtype float32
    python benchmarks/collective.py --sockets 2 4 --sizes 1K 64K 1536K 16M --iters 50
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _median_us(group, fn, iters: int, before=None) -> float:
    """Median microseconds of one ``fn(rank)`` over ``iters`` back-to-back calls on every socket, each
    after an untimed ``before(rank)`` where one is given."""
    def work(rank: int) -> list[float]:
        times = []
        for _ in range(iters + 1):   # the first warms: allocations, the OpenMP team, first touches
            if before is not None:
                before(rank)
            t0 = time.perf_counter()
            fn(rank)
            times.append(time.perf_counter() - t0)
        return times[1:]

    per_rank = group.run(work)
    return 1e6 * statistics.median(max(ts) for ts in zip(*per_rank))


def _peer_copy_us(group, numel: int, dtype, iters: int) -> float:
    """Median microseconds of one socket copying ``numel`` elements the next socket has just written."""
    import torch

    bufs = group.run(lambda r: torch.zeros(numel, dtype=dtype))
    outs = group.run(lambda r: torch.empty(numel, dtype=dtype))

    def write(rank: int) -> None:
        group.barrier(rank)    # nobody writes a buffer a peer is still reading
        bufs[rank].add_(1)     # written on this socket, as a GEMM leaves its partial
        group.barrier(rank)

    return _median_us(group, lambda r: outs[r].copy_(bufs[(r + 1) % group.size]), iters, before=write)


def _chain(numel: int, dtype, k: int):
    """A segment of ``k`` reductions, each of the one before's total, compiled as numatp compiles one."""
    import operator

    import torch
    from torch._inductor.compile_fx import compile_fx

    from numatp.runtime.native import load_ops

    load_ops()
    g = torch.fx.Graph()
    x = g.placeholder("x")
    token = None
    for _ in range(k):
        call = g.call_function(torch.ops.numatp.socket_all_reduce.default, (x, token))
        x = g.call_function(operator.getitem, (call, 0))
        token = g.call_function(operator.getitem, (call, 1))
    g.output((x,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    with torch.no_grad():
        return compile_fx(gm, [torch.zeros(numel, dtype=dtype)],
                          config_patches={"cpp_wrapper": True, "cpp.threads": 1, "size_asserts": False})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sockets", type=int, nargs="+", default=[2], help="virtual socket counts (default 2)")
    ap.add_argument("--sizes", nargs="+", default=["1K", "16K", "64K", "256K", "1536K", "4M", "16M", "64M"],
                    help="tensor sizes in bytes, with K/M suffixes (default 1K ... 64M)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--iters", type=int, default=30, help="timed reductions per size (default 30)")
    ap.add_argument("--chain", type=int, default=24, help="reductions per compiled call (default 24)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row instead of a table")
    args = ap.parse_args()

    import torch

    from numatp.runtime import SocketGroup
    from numatp.topology import Topology

    dtype = getattr(torch, args.dtype)
    cpus = len(os.sched_getaffinity(0))
    if not args.json:
        print(f"{'sockets':>7} {'bytes':>10} {'C++ us':>9} {'compiled us':>11} {'Python us':>10} "
              f"{'compiled GB/s':>13} {'copy GB/s':>9} {'target us':>9} {'meets':>5} {'peer GB/s':>9} "
              f"{'floor us':>8}")
    for n in args.sockets:
        if n > cpus:
            raise SystemExit(f"--sockets {n}: this machine has {cpus} CPUs; virtual sockets need one CPU each")
        topo = Topology.virtual(sockets=n)
        with SocketGroup(topo) as group, SocketGroup(topo.whole()) as one:
            barrier = threading.Barrier(n)
            slots: list = [None] * n
            for text in args.sizes:
                nbytes = _size(text)
                numel = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
                parts = group.run(lambda r: torch.randn(numel).to(dtype))

                def cpp(rank: int) -> None:
                    group.all_reduce(rank, parts[rank])

                def python(rank: int) -> None:
                    slots[rank] = parts[rank]
                    barrier.wait()
                    total = slots[0] + slots[1]
                    for p in slots[2:]:
                        total += p

                chain = _chain(numel, dtype, args.chain)

                def compiled(rank: int) -> None:
                    with group.compiled_collectives(rank):
                        chain(parts[rank])

                c_us = _median_us(group, cpp, args.iters)
                k_us = _median_us(group, compiled, max(3, args.iters // 4)) / args.chain
                p_us = _median_us(group, python, args.iters)
                src, dst = torch.randn(numel).to(dtype), torch.empty(numel, dtype=dtype)
                copy_us = _median_us(one, lambda r: dst.copy_(src), args.iters)
                real = numel * src.element_size()
                copy_gbs = 2 * real / copy_us / 1e3          # read + write
                target = (10 if n < 8 else 20) + 2 * real / copy_gbs / 1e3
                peer_gbs = real / _peer_copy_us(group, numel, dtype, args.iters) / 1e3
                # bytes each socket must read from its peers: all of N-1 partials when every socket sums
                # everything (at or below the fused size), else (N-1)/N of the partials and of the total
                fused = real <= group.comm.fused_bytes
                peer_bytes = (n - 1) * real if fused else 2 * (n - 1) / n * real
                floor = peer_bytes / peer_gbs / 1e3
                row = {"sockets": n, "bytes": real, "dtype": args.dtype, "cpp_us": c_us, "compiled_us": k_us,
                       "python_us": p_us, "compiled_gbs": real / k_us / 1e3, "copy_gbs": copy_gbs,
                       "target_us": target, "meets": k_us <= target, "peer_gbs": peer_gbs, "floor_us": floor}
                if args.json:
                    print(json.dumps(row))
                else:
                    print(f"{n:>7} {real:>10} {c_us:>9.1f} {k_us:>11.1f} {p_us:>10.1f} {row['compiled_gbs']:>13.2f} "
                          f"{copy_gbs:>9.2f} {target:>9.1f} {'yes' if row['meets'] else 'no':>5} {peer_gbs:>9.2f} "
                          f"{floor:>8.1f}")


if __name__ == "__main__":
    main()
