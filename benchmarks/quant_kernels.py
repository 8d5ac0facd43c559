"""The quantized-weight GEMM providers against numatp's bf16/fp32 ones, on one socket's threads.

Decode (few rows): ``qgemv`` over int8 and int4 weights against numatp's ``gemv`` on the plain weight,
each reading a ring of weight copies past the last-level cache (``numatp.runtime.gemm.streamed_copies``:
every call reads its weight from memory, as a decode step does), so the rate is the memory's. Prompt
(many rows): ``qtile`` and ``q8_aten`` against every plain provider. The configurations compared at one
(dtype, M, K, N) are timed in rounds, one call of each per round (each on the next copy of its ring), so
that a change of load on the machine slows all of them alike; the median call time counts.

Columns: GB/s of weight bytes read per call (the quantized buffer's, scales included, or the plain
weight's), GFLOP/s (2 M K N per call), and the ratio of the call rate to the reference (decode: plain
``gemv`` in the same activation dtype, i.e. the tokens/s a decode step of these weights would gain;
prompt: the best plain provider), by the median call and by the fastest call (on a machine shared with
other processes, the median of a multi-threaded call is often one whose thread was descheduled: the
fastest call shows what the kernel does when it runs). One JSON line per row with ``--json``.

    OMP_NUM_THREADS=2 python benchmarks/quant_kernels.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SHAPES = [(1024, 4096), (4096, 1024)]   # (K, N): GPT-2 medium's MLP, up and down
PLAIN_PROMPT = ["aten", "onednn", "onednn_packed", "mkl_packed", "mkl_packed_f32"]


def _compare(configs, args, facts) -> list[dict]:
    """Time ``configs`` ((shape, provider) pairs at one M, K, N) in rounds; rows with the median rates."""
    import torch

    from numatp.runtime.gemm import PROVIDERS, quant, streamed_copies

    shape0 = configs[0][0]
    dtype = getattr(torch, shape0.dtype)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape0.n, shape0.k, generator=g).to(dtype)
    x = torch.randn(shape0.m, shape0.k, generator=g).to(dtype)
    bias = torch.randn(shape0.n, generator=g).to(dtype)
    rings = []
    for shape, p in configs:
        op = PROVIDERS[p].prepare(quant.quantize(w, shape.weights) if shape.weights else w, shape.m)
        copies = streamed_copies(shape, facts)
        rings.append([op] + [op.clone() for _ in range(copies - 1)])
    times: list[list[float]] = [[] for _ in configs]
    for (shape, p), ring in zip(configs, rings):   # warm-up: every copy once
        for op in ring:
            PROVIDERS[p].call(x, op, bias, shape.n, shape.k)
    start = time.perf_counter()
    calls = 0
    while calls < 3 or (time.perf_counter() - start < args.min_seconds * len(configs) and calls < 2000):
        for i, ((shape, p), ring) in enumerate(zip(configs, rings)):
            op = ring[calls % len(ring)]
            t0 = time.perf_counter()
            PROVIDERS[p].call(x, op, bias, shape.n, shape.k)
            times[i].append(time.perf_counter() - t0)
        calls += 1
    secs = [statistics.median(t) for t in times]
    fastest = [min(t) for t in times]   # the call no other process interrupted: a loaded machine's medians
    plain = [i for i, (s, _) in enumerate(configs) if not s.weights]
    ref = min(plain, key=lambda i: secs[i])
    best_ref = min(plain, key=lambda i: fastest[i])
    rows = []
    for (shape, p), t, f in zip(configs, secs, fastest):
        rows.append({"m": shape.m, "k": shape.k, "n": shape.n, "dtype": shape.dtype, "weights": shape.weights,
                     "provider": p, "threads": shape.threads, "stream": shape.stream, "calls": calls,
                     "gb_s": round(shape.weight_bytes / t / 1e9, 2), "gflops": round(shape.flops / t / 1e9, 2),
                     "vs_reference": round(secs[ref] / t, 3), "reference": configs[ref][1],
                     "fastest_gb_s": round(shape.weight_bytes / f / 1e9, 2),
                     "fastest_vs_reference": round(fastest[best_ref] / f, 3)})
    print(f"# {shape0.dtype} {shape0.m} x {shape0.k} x {shape0.n}: {calls} rounds", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="intra-op (OpenMP) threads, as one socket's")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="activation dtypes")
    ap.add_argument("--formats", nargs="+", default=["int8", "int4:g32", "int4:g64", "int4:g128"])
    ap.add_argument("--decode-rows", nargs="*", type=int, default=[1, 4, 16], help="M of the decode rows (none: empty)")
    ap.add_argument("--prompt-rows", nargs="*", type=int, default=[512], help="M of the prompt rows (none: empty)")
    ap.add_argument("--shapes", nargs="+", default=[f"{k}x{n}" for k, n in SHAPES], help="KxN weight shapes")
    ap.add_argument("--min-seconds", type=float, default=1.0, help="timing per configuration (in rounds)")
    ap.add_argument("--json", action="store_true", help="also print a JSON line per row")
    args = ap.parse_args(argv)

    import torch

    from numatp.runtime.gemm import PROVIDERS, GemmShape, MachineFacts

    torch.set_num_threads(args.threads)
    facts = MachineFacts.detect()
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    rows = []
    with torch.inference_mode():
        for dtype in args.dtypes:
            for k, n in shapes:
                for m in args.decode_rows:
                    configs = [(GemmShape(m, k, n, dtype, "nk", args.threads, stream=True), "gemv")]
                    configs += [(GemmShape(m, k, n, dtype, "nk", args.threads, stream=True, weights=f), "qgemv")
                                for f in args.formats]
                    rows += _compare(configs, args, facts)
                for m in args.prompt_rows:
                    plain = GemmShape(m, k, n, dtype, "nk", args.threads)
                    configs = [(plain, p) for p in PLAIN_PROMPT if PROVIDERS[p].runs(plain)]
                    for f in args.formats:
                        shape = GemmShape(m, k, n, dtype, "nk", args.threads, weights=f)
                        configs += [(shape, p) for p in ("qtile", "q8_aten") if PROVIDERS[p].runs(shape)]
                    rows += _compare(configs, args, facts)
    print(f"{'shape (M x K x N, x dtype)':32} {'weights':9} {'provider':15} {'GB/s':>7} {'GFLOP/s':>8} "
          f"{'vs':>6}  {'reference':14} {'fastest: GB/s':>13} {'vs':>6}")
    for r in rows:
        label = f"{r['m']} x {r['k']} x {r['n']}, {r['dtype']}"
        print(f"{label:32} {r['weights'] or 'plain':9} {r['provider']:15} {r['gb_s']:7.1f} {r['gflops']:8.1f} "
              f"{r['vs_reference']:6.2f}  {r['reference']:14} {r['fastest_gb_s']:13.1f} "
              f"{r['fastest_vs_reference']:6.2f}")
    if args.json:
        for r in rows:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
