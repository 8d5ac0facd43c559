"""policy="auto" against the better of "always" and "never", over a grid of presets x batch x sequence.

One child process per (model, batch, seq): the three policies are compiled with numatp on the same
sockets, each output checked against eager, warmed up, then timed interleaved (call i of every policy
before call i+1 of any), beside plain torch.compile for reference. "never" runs the graph unsharded as
one program on all cores (with numatp's measured GEMM providers, as the sharded programs have); "always"
shards every block numatp understands; "auto" asks the cost model and shards the whole graph or none,
and where the model's two predictions are within 15% of each other times both plans on its first call
(counted in its compile time) and keeps the faster. Prints one
JSON line per configuration and a table; the worst ratio auto / min(always, never) is the figure of merit
(the cost model's target: never more than 5% slower than the better fixed policy). Two more columns split
it: the fixed policy that runs auto's plan over the best (what auto's choice cost), and auto over that
policy (the gap between two copies of one plan).

    python benchmarks/auto_policy.py --models gpt2 bert-small --batches 1 4 --seqs 128 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

POLICIES = ("never", "always", "auto")


def child(model_name: str, batch: int, seq: int, sockets: int, warmup: int, iters: int) -> dict:
    import warnings

    import torch

    import numatp
    from numatp import zoo

    warnings.filterwarnings("ignore")
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = zoo.build(model_name)
    inputs = zoo.example_inputs(model, batch=batch, seq=seq)
    fns, compile_s, decision = {}, {}, None
    with torch.inference_mode():
        expected = model(**inputs).logits
        for policy in ("torch.compile", *POLICIES):
            print(f"  compiling {policy}", file=sys.stderr, flush=True)
            torch._dynamo.reset()
            fn = (torch.compile(model) if policy == "torch.compile"
                  else numatp.compile(model, sockets=sockets, policy=policy))
            t0 = time.perf_counter()
            out = fn(**inputs).logits
            compile_s[policy] = time.perf_counter() - t0
            torch.testing.assert_close(out, expected, atol=2e-4, rtol=1e-3)
            fns[policy] = fn
            if policy == "auto":
                (plan,) = numatp.plans(fn)
                blocks = [b for b in plan.blocks if b.kind != "lm_head"]
                decision = {"sharded_blocks": sum(b.sharded for b in blocks), "blocks": len(blocks),
                            "reason": blocks[0].reason if blocks else ""}
        times: dict[str, list[float]] = {p: [] for p in fns}
        for i in range(warmup + iters):
            for policy, fn in fns.items():
                t0 = time.perf_counter()
                fn(**inputs)
                if i >= warmup:
                    times[policy].append(time.perf_counter() - t0)
    med = {p: statistics.median(v) for p, v in times.items()}
    best = min(med["always"], med["never"])
    same = "always" if decision["sharded_blocks"] else "never"  # the fixed policy whose plan auto kept
    return {
        "model": model_name, "batch": batch, "seq": seq, "sockets": sockets,
        "cpus": len(os.sched_getaffinity(0)), "iters": iters, "median_s": med,
        "cv": {p: statistics.pstdev(v) / statistics.mean(v) for p, v in times.items()},
        "compile_s": compile_s, "auto": decision,
        "auto_vs_best": med["auto"] / best,
        "best_fixed": "always" if med["always"] < med["never"] else "never",
        # auto / that policy: the gap between two copies of one plan; that policy / best: what auto's
        # choice cost
        "auto_plan": same,
        "auto_vs_same_plan": med["auto"] / med[same],
        "choice_vs_best": med[same] / best,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2", "bert-small"], help="zoo presets")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4], help="batch sizes")
    p.add_argument("--seqs", nargs="+", type=int, default=[128, 512], help="sequence lengths")
    p.add_argument("--sockets", type=int, default=2, help="sockets (virtual ones on a single-node machine)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per policy after compiling")
    p.add_argument("--iters", type=int, default=5, help="timed calls per policy")
    p.add_argument("--out", default=None, help="append the JSON lines to this file too")
    p.add_argument("--child", nargs=3, type=int, metavar=("MODEL_INDEX", "BATCH", "SEQ"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        m, b, s = args.child
        print(json.dumps(child(args.models[m], b, s, args.sockets, args.warmup, args.iters)))
        return 0
    rows = []
    grid = [(m, b, s) for m in range(len(args.models)) for b in args.batches for s in args.seqs]
    for n, (m, b, s) in enumerate(grid, 1):
        print(f"[{n}/{len(grid)}] {args.models[m]} batch {b} seq {s}", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--models", *args.models, "--sockets", str(args.sockets),
               "--warmup", str(args.warmup), "--iters", str(args.iters), "--child", str(m), str(b), str(s)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        lines = proc.stdout.strip().splitlines()
        row = json.loads(lines[-1]) if lines else {"model": args.models[m], "batch": b, "seq": s,
                                                   "error": f"child exited {proc.returncode}"}
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print("\n| model | batch | seq | torch.compile ms | never ms | always ms | auto ms | auto chose | auto / best "
          "| its plan (fixed) / best | auto / its plan (fixed) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['batch']} | {r['seq']} | {r['error']} ||||||||")
            continue
        med, a = r["median_s"], r["auto"]
        chose = f"{a['sharded_blocks']}/{a['blocks']} blocks sharded"
        print(f"| {r['model']} | {r['batch']} | {r['seq']} | {1e3 * med['torch.compile']:.1f} "
              f"| {1e3 * med['never']:.1f} | {1e3 * med['always']:.1f} "
              f"| {1e3 * med['auto']:.1f} | {chose} | {r['auto_vs_best']:.3f} | {r['choice_vs_best']:.3f} "
              f"| {r['auto_vs_same_plan']:.3f} |")
    ok = [r["auto_vs_best"] for r in rows if "error" not in r]
    if ok:
        print(f"\nworst auto / best-of(always, never): {max(ok):.3f} over {len(ok)} configurations; worst cost of "
              f"auto's choice (its plan under the fixed policy / best): "
              f"{max(r['choice_vs_best'] for r in rows if 'error' not in r):.3f}")
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
