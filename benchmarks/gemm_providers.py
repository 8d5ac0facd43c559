"""GFLOP/s of the GEMM providers torch ships, at the weight shapes of GPT-2 / GPT-2 medium prefill.

Providers: numatp's runtime providers (aten = torch.mm/addmm, onednn, onednn_packed, mkl_packed; see
numatp.runtime.gemm; mkl_packed_f32 is bf16 computed by fp32 MKL on an upcast packed weight), plus,
for reference only, Inductor on a single nn.Linear compiled with freezing=True (``inductor_freezing``:
what torch.compile's freezing picks) and with max_autotune over the C++ GEMM template (``inductor_cpp``).
One JSON line per (dtype, threads, M, K, N, provider); a summary table at the end.
Results also go into numatp's on-disk table (``--no-cache`` to skip), so compiling reuses them.

    OMP_NUM_THREADS=2 python benchmarks/gemm_providers.py --threads 1 2 --ms 128 512 1024 --out gemm.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SHAPES = {  # (K, N, layout): GPT-2 Conv1D weights are stored (K, N); the LM head is nn.Linear-like (N, K)
    "gpt2": [(768, 2304, "kn"), (768, 768, "kn"), (768, 3072, "kn"), (3072, 768, "kn"), (768, 50257, "nk")],
    "gpt2-medium": [(1024, 3072, "kn"), (1024, 1024, "kn"), (1024, 4096, "kn"), (4096, 1024, "kn"),
                    (1024, 50257, "nk")],
}


def _time(fn, flops: int, min_seconds: float, max_calls: int) -> float:
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_calls and (len(times) < 2 or time.perf_counter() - start < min_seconds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return flops / statistics.median(times) / 1e9


def inductor_rate(shape, *, autotune: bool, min_seconds: float, max_calls: int) -> float:
    """One nn.Linear through torch.compile(freezing=True[, max_autotune with the C++ GEMM template])."""
    import torch

    dtype = getattr(torch, shape.dtype)
    lin = torch.nn.Linear(shape.k, shape.n).to(dtype).eval()
    x = torch.randn(shape.m, shape.k).to(dtype)
    opts = {"freezing": True}
    if autotune:  # the C++ template only: autotuning against ATEN would hide its rate
        opts.update({"max_autotune": True, "max_autotune_gemm_backends": "CPP"})
    torch._dynamo.reset()
    fn = torch.compile(lin)
    # torch.compile(options=...) did not reach the freezing pass here (weights stayed graph inputs, so
    # the template had no constant weight): patch the global config around the compiling first call
    with torch.no_grad():
        try:
            with torch._inductor.config.patch(opts):
                fn(x)
            return _time(lambda: fn(x), shape.flops, min_seconds, max_calls)
        except Exception as e:  # noqa: BLE001  (a provider that cannot run here is reported as 0)
            print(f"  inductor failed at {shape.key}: {type(e).__name__}: {e}"[:300], file=sys.stderr)
            return 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt2", "gpt2-medium"], choices=sorted(SHAPES))
    ap.add_argument("--ms", nargs="+", type=int, default=[128, 512, 1024], help="rows M (tokens)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--providers", nargs="+",
                    default=["aten", "onednn", "onednn_packed", "mkl_packed", "mkl_packed_f32"])
    ap.add_argument("--inductor", action="store_true", help="also inductor_freezing and inductor_cpp (slow: compiles)")
    ap.add_argument("--inductor-ms", nargs="+", type=int, default=[512], help="M values for the Inductor rows")
    ap.add_argument("--min-seconds", type=float, default=0.15)
    ap.add_argument("--max-calls", type=int, default=10)
    ap.add_argument("--no-cache", action="store_true", help="do not write numatp's on-disk GEMM table")
    ap.add_argument("--out", help="append the JSON lines to this file too")
    args = ap.parse_args(argv)

    import torch
    import torch._inductor.config as iconfig

    from numatp.runtime.gemm import PROVIDERS, GemmShape, GemmTable, cpu_signature, measure

    iconfig.compile_threads = 1
    table = None if args.no_cache else GemmTable()
    out = open(args.out, "a") if args.out else None
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in args.dtypes:
            for model in args.models:
                for m in args.ms:
                    for k, n, layout in SHAPES[model]:
                        shape = GemmShape(m, k, n, dtype, layout, threads)
                        rates = {p: measure(PROVIDERS[p], shape, min_seconds=args.min_seconds,
                                            max_calls=args.max_calls) for p in args.providers}
                        if table is not None:
                            table.put({shape: {**(table.get(shape) or {}), **{p: round(r, 2) for p, r in rates.items()}}})
                        if args.inductor and m in args.inductor_ms:
                            for name, tune in (("inductor_freezing", False), ("inductor_cpp", True)):
                                rates[name] = inductor_rate(shape, autotune=tune, min_seconds=args.min_seconds,
                                                            max_calls=args.max_calls)
                        for p, r in rates.items():
                            row = {"cpu": cpu_signature(), "model": model, "dtype": dtype, "threads": threads,
                                   "m": m, "k": k, "n": n, "layout": layout, "provider": p,
                                   "gflops": round(r, 2)}
                            rows.append(row)
                            line = json.dumps(row)
                            print(line, flush=True)
                            if out:
                                out.write(line + "\n")
                                out.flush()
    _summary(rows)
    return 0


def _summary(rows: list[dict]) -> None:
    """Per (dtype, threads, M): geo-mean GFLOP/s per provider over the layer shapes, and the best one."""
    import math

    groups: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["threads"], r["m"]), {}).setdefault(r["provider"], []).append(r["gflops"])
    print("\ndtype     thr     M  " + "  ".join(f"{p:>17}" for p in sorted({r['provider'] for r in rows})),
          file=sys.stderr)
    provs = sorted({r["provider"] for r in rows})
    for (dtype, thr, m), by in sorted(groups.items()):
        cells = []
        for p in provs:
            v = by.get(p)
            gm = math.exp(statistics.mean(math.log(max(x, 1e-3)) for x in v)) if v else float("nan")
            cells.append(f"{gm:10.1f} (max {max(v) if v else float('nan'):5.0f})" if v else f"{'-':>17}")
        print(f"{dtype:9} {thr:3} {m:5}  " + "  ".join(cells), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
