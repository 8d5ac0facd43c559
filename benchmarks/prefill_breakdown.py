"""Where a compiled prefill's time goes: weight GEMMs vs attention vs the rest.

Profiles torch.compile's default C++ backend on one preset (batch 1) with torch.profiler, Inductor's kernels
recorded one by one (``cpp.enable_kernel_profile``), and sorts self CPU time into:

- weight GEMM: ``aten::mm`` / ``addmm`` / ``_mkl_linear`` / ``mkldnn`` linear calls (the projections, MLP and
  LM head; their operands are 2-D);
- attention: scaled-dot-product attention kernels and batched ``bmm`` / ``baddbmm`` (scores and context);
- rest: Inductor's fused C++ kernels (norms, softmax outside SDPA, GELU, residual adds, layout copies) and
  everything else.

    python benchmarks/prefill_breakdown.py --model gpt2 --seq 512 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import sys

GEMM = ("aten::mm", "aten::addmm", "aten::_mkl_linear", "mkldnn::_linear_pointwise", "aten::linear",
        "mkl::_mkl_linear", "numatp::gemm")
ATTENTION = ("aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product", "aten::scaled_dot_product",
             "flash_attention", "cpp_fused__scaled_dot_product", "cpp_fused_flash", "sdpa")


def category(name: str) -> str:
    if name.startswith(GEMM):
        return "weight GEMM"
    if any(tag in name for tag in ATTENTION):
        return "attention"
    return "rest"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", help="zoo preset")
    p.add_argument("--seq", type=int, default=512, help="sequence length (batch 1)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--iters", type=int, default=3, help="profiled calls")
    args = p.parse_args()

    import torch
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    from numatp import zoo

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    inductor_config.cpp.enable_kernel_profile = True
    model = zoo.build(args.model, dtype=getattr(torch, args.dtype))
    inputs = zoo.example_inputs(model, batch=1, seq=args.seq)
    compiled = torch.compile(model)
    with torch.inference_mode():
        compiled(**inputs)
        compiled(**inputs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.iters):
                compiled(**inputs)
    totals: dict[str, float] = {"weight GEMM": 0.0, "attention": 0.0, "rest": 0.0}
    top: dict[str, float] = {}
    for e in prof.key_averages():
        us = e.self_cpu_time_total
        totals[category(e.key)] += us
        top[e.key] = us
    whole = sum(totals.values())
    out = {"model": args.model, "seq": args.seq, "dtype": args.dtype, "threads": torch.get_num_threads(),
           "ms_per_call": {k: v / 1e3 / args.iters for k, v in totals.items()},
           "share": {k: v / whole for k, v in totals.items()},
           "top": {k: round(v / 1e3 / args.iters, 2) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]}}
    print(json.dumps(out))
    print(f"\n{args.model} seq {args.seq} {args.dtype}, {out['threads']} threads, ms per prefill (profiled):",
          file=sys.stderr)
    for k, v in totals.items():
        print(f"  {k:<12} {v / 1e3 / args.iters:9.1f} ms  {100 * v / whole:5.1f}%", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
