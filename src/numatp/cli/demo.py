"""``numatp demo``: one model, compiled by torch.compile and by numatp on this machine, side by side.

The first thing to run on a new machine: it shows the topology numatp uses (2 virtual sockets on a
single-node machine), the prefill latency of three modes and on which nodes the shards' pages are:
the baseline (Inductor's default C++ backend on all usable CPUs), numatp unsharded (one program on all
CPUs with numatp's measured GEMM providers: what numatp gains without NUMA-TP) and numatp sharded over
the sockets (NUMA-TP). The two ratios keep the sources apart, so that a one-node machine never shows a
GEMM-provider gain as a NUMA gain. ``--weights`` quantizes both numatp modes' weights
(``numatp.compile(weights=...)``): their outputs are then compared with eager by their relative error,
printed, not asserted (quantizing changes the numbers), and the bytes each socket holds are shown.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from numatp.cli._launch import join_launcher, machine
from numatp.cli._weights import add_weight_args, check_weight_args, socket_bytes_line

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo", help="compile a model with torch.compile and with numatp, and compare their prefill",
        description="Build MODEL with random weights, compile it with torch.compile (the baseline), with "
        "numatp unsharded (all CPUs, measured GEMM providers) and with numatp sharded over this machine's "
        "sockets, check all three against eager, and print their prefill latency, what GEMM providers and "
        "what sharding gain, and where the weight shards' pages are.")
    p.add_argument("--model", default="gpt2", help="preset or checkpoint folder (default gpt2)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weight dtype")
    p.add_argument("--sockets", type=int, default=None,
                   help="socket count (default: the detected sockets, or 2 virtual ones on a one-node machine)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls after compiling (default 2)")
    p.add_argument("--iters", type=int, default=5, help="timed calls per mode (default 5)")
    p.add_argument("--tiny", action="store_true", help="use the shrunken test config (seconds, not minutes)")
    add_weight_args(p)
    p.set_defaults(run=run)
    return p


def _size(nbytes: int) -> str:
    """``4096`` -> ``"4 KiB"``: a page size in the largest binary unit that divides it."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


_QUIET = [False]   # under torchrun, every process but the first


def _say(msg: str) -> None:
    if not _QUIET[0]:
        print(f"[numatp demo] {msg}", file=sys.stderr, flush=True)


def _time(fn, inputs, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn(**inputs)
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(**inputs)
        out.append(time.perf_counter() - t0)
    return out


def _check_args(args: argparse.Namespace) -> None:
    """Refuse bad arguments before torch is imported or a model built."""
    from numatp import zoo

    for flag, value, low in (("--batch", args.batch, 1), ("--seq", args.seq, 1), ("--sockets", args.sockets, 1),
                             ("--warmup", args.warmup, 0), ("--iters", args.iters, 1)):
        if value is not None and value < low:
            raise SystemExit(f"numatp demo: {flag} {value}: must be >= {low}")
    if zoo.resolve(args.model).folder is not None and args.tiny:
        raise SystemExit(f"numatp demo: --tiny shrinks presets only, and {args.model!r} is a checkpoint folder; "
                         "drop --tiny")
    check_weight_args("demo", args)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    launch = join_launcher("demo")
    _QUIET[0] = launch is not None and launch.quiet

    import warnings

    import torch

    import numatp
    from numatp import zoo
    from numatp.bench.machine import resolve_ranks
    from numatp.topology import format_cpulist

    warnings.filterwarnings("ignore", message="numatp: virtual sockets")
    topo = resolve_ranks(args.sockets, machine(launch))
    kind = "virtual sockets on one memory node" if topo.is_virtual else "NUMA nodes"
    print(f"topology: {topo.num_sockets} {kind}: " +
          "; ".join(f"socket {s.index} = node {s.node}, CPUs {format_cpulist(s.cpus)}" for s in topo.sockets))
    dtype = getattr(torch, args.dtype)
    _say(f"building {args.model} ({'tiny, ' if args.tiny else ''}{args.dtype}, random weights)")
    model = zoo.build(args.model, tiny=args.tiny, dtype=dtype)
    inputs = zoo.example_inputs(model, batch=args.batch, seq=args.seq)
    with torch.inference_mode():
        expected = model(**inputs).logits
        _say("compiling the baseline: torch.compile (Inductor C++)")
        base = torch.compile(model)
        t0 = time.perf_counter()
        base_out = base(**inputs).logits
        base_compile = time.perf_counter() - t0
        _say("compiling numatp unsharded: one program on all CPUs")
        quant: dict[str, Any] = dict(weights=args.weights, keep_head=args.keep_head)
        flat = numatp.compile(model, sockets=topo, policy="never", **quant)
        t0 = time.perf_counter()
        flat_out = flat(**inputs).logits
        flat_compile = time.perf_counter() - t0
        _say(f"compiling numatp sharded over {topo.num_sockets} sockets")
        tp = numatp.compile(model, sockets=topo, **quant)
        t0 = time.perf_counter()
        tp_out = tp(**inputs).logits
        tp_compile = time.perf_counter() - t0
        tol: dict[str, Any] = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=3e-2)
        errors = {}
        for name, out in (("baseline", base_out), ("numatp unsharded", flat_out), ("numatp", tp_out)):
            diff = (out.float() - expected.float()).abs().max().item()
            if args.weights and name != "baseline":   # quantized: how far, not whether equal
                errors[name] = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
                continue
            torch.testing.assert_close(out, expected, **tol, msg=f"{name} differs from eager: max {diff:.3g}")
        _say(f"timing: {args.warmup} warm-up and {args.iters} timed calls each, interleaved")
        modes: dict[str, Any] = {"baseline": base, "unsharded": flat, "sharded": tp}
        times: dict[str, list[float]] = {k: [] for k in modes}
        for _ in range(args.warmup):
            for fn in modes.values():
                fn(**inputs)
        backend = numatp.backend.backend_of(tp)
        executors = [v.executor for g in backend.graphs for v in g.variants.values() if v.executor is not None]
        for ex in executors:   # the collectives' shares are of the timed calls only
            ex.sync_seconds[:] = [0.0] * len(ex.sync_seconds)
            ex.wait_seconds[:] = [0.0] * len(ex.wait_seconds)
            ex.gather_seconds[:] = [0.0] * len(ex.gather_seconds)
        for _ in range(args.iters):
            for name, fn in modes.items():
                times[name] += _time(fn, inputs, 0, 1)
    report = numatp.placement_report(tp)
    sync = max(sum(ex.sync_seconds[r] for ex in executors) for r in range(topo.num_sockets))
    work = max(sum(ex.sync_seconds[r] - ex.wait_seconds[r] for ex in executors) for r in range(topo.num_sockets))
    gather = max(sum(ex.gather_seconds[r] for ex in executors) for r in range(topo.num_sockets))
    med = {k: statistics.median(v) for k, v in times.items()}
    quantized = f"; numatp's weights {args.weights}" + (" (LM head kept)" if args.keep_head else "")
    print(f"model: {args.model}{' (tiny)' if args.tiny else ''}, batch {args.batch} x seq {args.seq}, {args.dtype}"
          + (quantized if args.weights else ""))
    print(f"{'mode':<36} {'median ms':>10} {'cv %':>6} {'compile s':>10}")
    for label, key, comp in (("baseline torch.compile", "baseline", base_compile),
                             ("numatp unsharded (all CPUs)", "unsharded", flat_compile),
                             (f"numatp sharded ({topo.num_sockets} sockets)", "sharded", tp_compile)):
        ts = times[key]
        cv = 100 * statistics.pstdev(ts) / statistics.mean(ts)
        print(f"{label:<36} {1e3 * med[key]:>10.2f} {cv:>6.1f} {comp:>10.1f}")
    print(f"speedup numatp / baseline: {med['baseline'] / med['sharded']:.2f}x")
    source = f"GEMM providers and {args.weights} weights" if args.weights else "GEMM providers"
    print(f"  from {source} (numatp unsharded / baseline): {med['baseline'] / med['unsharded']:.2f}x")
    print(f"  from sharding over {topo.num_sockets} sockets (sharded / unsharded): "
          f"{med['unsharded'] / med['sharded']:.2f}x"
          + (" (virtual sockets on one memory node: no locality to gain; the difference is the runtime's, "
             f"{topo.num_sockets} programs on their own CPUs against one on all of them)"
             if topo.is_virtual else ""))
    print(f"all-reduce + barrier: {100 * sync / args.iters / med['sharded']:.1f}% of numatp's prefill "
          "(time in the reductions, waiting for the slowest socket included); the reductions' own work: "
          f"{100 * work / args.iters / med['sharded']:.1f}% (the rest is waiting: the sockets' programs "
          "finishing apart, from uneven speed or other work on their CPUs)")
    if gather:
        print(f"gather of the column-sharded output: {100 * gather / args.iters / med['sharded']:.1f}% "
              "(each socket copies its columns into the full tensor)")
    if errors:
        print(f"{args.weights} weights: logits' relative error against eager ({args.dtype} weights): "
              + ", ".join(f"{name} {100 * e:.2f}%" for name, e in errors.items()))
    print(socket_bytes_line(report, args.weights, args.keep_head, args.dtype,
                            sum(p.nbytes for p in model.parameters())))
    unit = f"pages ({_size(os.sysconf('SC_PAGE_SIZE'))})"   # move_pages counts base pages
    for r in report["ranks"]:
        pages = ", ".join(f"node {n}: {c} {unit}" for n, c in sorted(r["pages"].items()))
        print(f"socket {r['socket']} weights -> {pages}")
    print(f"pages on their socket's own node: {100 * report['local_fraction']:.1f}%"
          + (" (virtual sockets: one node, placement not exercised)" if report["virtual"] else ""))
    return 0
