"""Prefill side by side: torch.compile (default, frozen) vs numatp on 1 and 2 sockets, with and without
measured GEMM providers.

One child process per (model, seq, dtype). In it every mode is compiled and checked against eager, warmed
up, then timed interleaved (call i of every mode before call i+1 of any). Modes slower than
``--slow-seconds`` per call get fewer timed calls. Prints one JSON line per configuration: median seconds
per mode, ratios, the weight-GEMM rate of each mode (2 x tokens x weight elements / time) against the
best measured GEMM ceiling for the dtype (numatp.runtime.gemm.ceilings).

"frozen" is torch.compile with ``torch._inductor.config.freezing = True`` set around its compilation: on
torch 2.13 ``torch.compile(options={"freezing": True})`` leaves the weights as graph inputs (checked in
the generated code), so the options form is timed too, as ``compile-freezing-opt``.

    python benchmarks/gemm_e2e.py --models gpt2 --seqs 512 --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _weight_flops(model, seq: int) -> int:
    """2 x tokens x elements of every matmul weight (Linear, GPT-2 Conv1D, the LM head)."""
    import torch

    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D":
            total += m.weight.numel()
    return 2 * seq * total


def child(model_name: str, seq: int, dtype_name: str, warmup: int, iters: int, modes_wanted: list[str],
          slow_seconds: float) -> dict:
    import warnings

    import torch

    import numatp
    from numatp import zoo
    from numatp.runtime.gemm import ceilings
    from numatp.topology import Topology

    warnings.filterwarnings("ignore")
    cpus = len(os.sched_getaffinity(0))
    torch.set_num_threads(cpus)
    dtype = getattr(torch, dtype_name)
    model = zoo.build(model_name, dtype=dtype)
    inputs = zoo.example_inputs(model, batch=1, seq=seq)
    builders = {
        "compile": lambda: torch.compile(model),
        "compile-freezing-opt": lambda: torch.compile(model, options={"freezing": True}),
        "compile-frozen": lambda: torch.compile(model),
        "numatp-1": lambda: numatp.compile(model, sockets=Topology.virtual(sockets=1), gemm=False),
        "numatp-2": lambda: numatp.compile(model, sockets=Topology.virtual(sockets=2), gemm=False),
        "numatp-1-gemm": lambda: numatp.compile(model, sockets=Topology.virtual(sockets=1), gemm=True),
        "numatp-2-gemm": lambda: numatp.compile(model, sockets=Topology.virtual(sockets=2), gemm=True),
    }
    modes, compile_s, first_s, providers = {}, {}, {}, {}
    with torch.inference_mode():
        expected = model(**inputs).logits
        for name in modes_wanted:
            print(f"  compiling {name}", file=sys.stderr, flush=True)
            torch._dynamo.reset() if name.startswith("compile") else None
            fn = builders[name]()
            t0 = time.perf_counter()
            with torch._inductor.config.patch(freezing=name == "compile-frozen"):
                out = fn(**inputs).logits
            compile_s[name] = time.perf_counter() - t0
            tol = dict(atol=2e-4, rtol=1e-3) if dtype == torch.float32 else dict(atol=1e-1, rtol=5e-2)
            torch.testing.assert_close(out, expected, **tol)
            first_s[name] = compile_s[name]
            if warmup:
                t0 = time.perf_counter()
                fn(**inputs)
                first_s[name] = time.perf_counter() - t0
            modes[name] = fn
            backend = numatp.backend.backend_of(fn) if name.startswith("numatp") else None
            if backend is not None and backend.gemm is not None:
                rows = backend.gemm_report()
                providers[name] = sorted({f"{r['m']}x{r['k']}x{r['n']}:{r['provider']}" for r in rows})
        times: dict[str, list[float]] = {k: [] for k in modes}
        for i in range(warmup + iters):
            for name, fn in modes.items():
                if i >= warmup and first_s[name] > slow_seconds and len(times[name]) >= 2:
                    continue  # a slow mode: two timed calls are enough to place it
                t0 = time.perf_counter()
                fn(**inputs)
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    flops = _weight_flops(model, seq)
    ceil = ceilings(dtype)
    best = max(ceil.values()) if ceil else None
    rate = {k: flops / v / 1e9 for k, v in med.items()}
    base = med.get("compile")
    return {
        "model": model_name, "seq": seq, "dtype": dtype_name, "cpus": cpus,
        "median_s": med, "calls": {k: len(v) for k, v in times.items()},
        "cv": {k: (statistics.pstdev(v) / statistics.mean(v)) if len(v) > 1 else None for k, v in times.items()},
        "compile_s": compile_s, "weight_gflops": rate, "gemm_ceiling_gflops": ceil,
        "fraction_of_best_ceiling": {k: r / best for k, r in rate.items()} if best else None,
        "speedup_vs_compile": {k: base / v for k, v in med.items()} if base else None,
        "speedup_vs_frozen": ({k: med["compile-frozen"] / v for k, v in med.items()}
                              if "compile-frozen" in med else None),
        "providers": providers,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt2"])
    ap.add_argument("--seqs", nargs="+", type=int, default=[512])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--modes", nargs="+", default=["compile", "compile-freezing-opt", "compile-frozen", "numatp-1",
                                                   "numatp-2", "numatp-1-gemm", "numatp-2-gemm"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--slow-seconds", type=float, default=5.0)
    ap.add_argument("--out", help="append the JSON lines to this file too")
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "SEQ", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        m, s, d = args.child
        print(json.dumps(child(m, int(s), d, args.warmup, args.iters, args.modes, args.slow_seconds)))
        return 0
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # compile on one core: never oversubscribe
    for model in args.models:
        for seq in args.seqs:
            for dtype in args.dtypes:
                cmd = [sys.executable, __file__, "--child", model, str(seq), dtype, "--warmup", str(args.warmup),
                       "--iters", str(args.iters), "--slow-seconds", str(args.slow_seconds), "--modes", *args.modes]
                proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
                line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else json.dumps(
                    {"model": model, "seq": seq, "dtype": dtype, "error": f"child exited {proc.returncode}"})
                print(line, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
