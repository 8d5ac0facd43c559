"""The quantized-weight GEMM providers against numatp's bf16/fp32 ones, on one socket's threads.

Decode (few rows): ``qgemv`` over int8 and int4 weights against numatp's ``gemv`` on the plain weight, each
timed on a ring of weight copies past the last-level cache (``GemmShape.stream``: every call reads its
weight from memory, as a decode step does), so the rate is the memory's. Prompt (many rows): ``qtile``
and ``q8_aten`` on int8/int4 against the best of the plain providers. Every row is measured by
``numatp.runtime.gemm.measure_all`` (rounds, median per copy); the configurations are measured in turn
``--repeats`` times (interleaved, so that a change of load slows all alike) and the median kept.

Columns: GB/s of weight bytes read per call (the quantized buffer's, scales included, or the plain
weight's), GFLOP/s (2 M K N per call), and the ratio of the call rate to the reference (decode: plain
``gemv`` in the same activation dtype, i.e. the tokens/s a decode step of these weights would gain;
prompt: the best plain provider). One JSON line per row with ``--json``.

    OMP_NUM_THREADS=2 python benchmarks/quant_kernels.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

SHAPES = [(1024, 4096), (4096, 1024)]   # (K, N): GPT-2 medium's MLP, up and down
PLAIN_PROMPT = ["aten", "onednn", "onednn_packed", "mkl_packed", "mkl_packed_f32"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="intra-op (OpenMP) threads, as one socket's")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="activation dtypes")
    ap.add_argument("--formats", nargs="+", default=["int8", "int4:g32", "int4:g64", "int4:g128"])
    ap.add_argument("--decode-rows", nargs="*", type=int, default=[1, 4, 16], help="M of the decode rows (none: empty)")
    ap.add_argument("--prompt-rows", nargs="*", type=int, default=[512], help="M of the prompt rows (none: empty)")
    ap.add_argument("--shapes", nargs="+", default=[f"{k}x{n}" for k, n in SHAPES], help="KxN weight shapes")
    ap.add_argument("--repeats", type=int, default=3, help="measurements of every row, interleaved")
    ap.add_argument("--min-seconds", type=float, default=0.3)
    ap.add_argument("--json", action="store_true", help="also print a JSON line per row")
    args = ap.parse_args(argv)

    import torch

    from numatp.runtime.gemm import PROVIDERS, GemmShape, MachineFacts, measure_all

    torch.set_num_threads(args.threads)
    facts = MachineFacts.detect()
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    # (shape, providers): every configuration, measured in turn per repeat
    runs: list[tuple[GemmShape, list[str]]] = []
    for dtype in args.dtypes:
        for k, n in shapes:
            for m in args.decode_rows:
                runs.append((GemmShape(m, k, n, dtype, "nk", args.threads, stream=True), ["gemv"]))
                for fmt in args.formats:
                    runs.append((GemmShape(m, k, n, dtype, "nk", args.threads, stream=True, weights=fmt), ["qgemv"]))
            for m in [m for m in args.prompt_rows if m > 0]:
                plain = [p for p in PLAIN_PROMPT if PROVIDERS[p].runs(GemmShape(m, k, n, dtype, "nk", 1))]
                runs.append((GemmShape(m, k, n, dtype, "nk", args.threads), plain))
                for fmt in args.formats:
                    q = ["qtile"] + (["q8_aten"] if fmt == "int8" else [])
                    runs.append((GemmShape(m, k, n, dtype, "nk", args.threads, weights=fmt), q))
    got: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        for rep in range(args.repeats):
            for shape, provs in runs:
                rates = measure_all({p: PROVIDERS[p] for p in provs}, shape, min_seconds=args.min_seconds,
                                    max_calls=200, facts=facts)
                for p, r in rates.items():
                    got.setdefault((shape.key, p), []).append(r)
            print(f"# repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    def rate(shape: GemmShape, p: str) -> float:
        return statistics.median(got[(shape.key, p)])

    def reference(shape: GemmShape) -> tuple[str, float]:
        plain = GemmShape(shape.m, shape.k, shape.n, shape.dtype, shape.layout, shape.threads, stream=shape.stream)
        provs = [p for s, ps in runs if s == plain for p in ps]
        best = max(provs, key=lambda p: rate(plain, p))
        return best, rate(plain, best)

    print(f"{'shape (M x K x N, x dtype)':32} {'weights':9} {'provider':15} {'GB/s':>7} {'GFLOP/s':>8} "
          f"{'vs':>6}  reference")
    for shape, provs in runs:
        ref_name, ref_rate = reference(shape)
        for p in provs:
            r = rate(shape, p)
            secs = shape.flops / (r * 1e9) if r > 0 else float("inf")
            gbs = shape.weight_bytes / secs / 1e9
            ratio = r / ref_rate if ref_rate > 0 else float("nan")
            label = f"{shape.m} x {shape.k} x {shape.n}, {shape.dtype}"
            print(f"{label:32} {shape.weights or 'plain':9} {p:15} {gbs:7.1f} {r:8.1f} {ratio:6.2f}  {ref_name}")
            if args.json:
                print(json.dumps({"m": shape.m, "k": shape.k, "n": shape.n, "dtype": shape.dtype,
                                  "weights": shape.weights, "provider": p, "threads": shape.threads,
                                  "stream": shape.stream, "gb_s": round(gbs, 2), "gflops": round(r, 2),
                                  "vs_reference": round(ratio, 3), "reference": ref_name,
                                  "samples": [round(v, 2) for v in got[(shape.key, p)]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
