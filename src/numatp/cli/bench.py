"""``numatp bench``: measure prefill time per (model, batch, seq, dtype, mode), one fresh process each,
into ``DIR/results.jsonl``, then write the report (``numatp report``). ``--decode N`` adds the time to
first token and decode tokens/s of N generated tokens to each configuration; ``--weights`` runs the numatp
modes with quantized weights too (a configuration per format), each line recording the format and the bytes
each socket holds."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from numatp.cli._weights import add_weight_args, check_weight_args

__all__ = ["add_parser", "run"]

_DEFAULT_BATCHES = (1, 2, 4, 8)
_DEFAULT_SEQS = (128, 256, 512, 1024)
_DEFAULT_OUT = "numatp-bench"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from numatp.bench.policy import MECHANISMS
    from numatp.bench.spec import DTYPES, MODES, PAPER_MODELS, QUICK

    p = subparsers.add_parser(
        "bench",
        help="measure prefill time of numatp against torch.compile and numactl-style policies",
        description="Run a sweep of models x batch sizes x sequence lengths x dtypes x modes, each in a fresh "
        "process, append JSON lines to DIR/results.jsonl (finished configurations are skipped on re-run), "
        "then write the report into DIR.",
    )
    p.add_argument("--model", nargs="+", metavar="MODEL",
                   help=f"zoo presets or local Hugging Face checkpoint folders (default: {' '.join(PAPER_MODELS)}; "
                   f"--quick: {' '.join(QUICK['models'])})")
    p.add_argument("--batch", nargs="+", type=int, metavar="N",
                   help=f"batch sizes (default: {' '.join(map(str, _DEFAULT_BATCHES))})")
    p.add_argument("--seq", nargs="+", type=int, metavar="N",
                   help=f"sequence lengths (default: {' '.join(map(str, _DEFAULT_SEQS))}; "
                   f"--quick: {' '.join(map(str, QUICK['seqs']))})")
    p.add_argument("--dtype", nargs="+", choices=DTYPES, metavar="DTYPE",
                   help=f"weight and activation dtypes, of {', '.join(DTYPES)} (default: float32)")
    p.add_argument("--modes", nargs="+", choices=MODES, metavar="MODE",
                   help=f"what to measure, of {', '.join(MODES)}; baseline is torch.compile's default backend, "
                   "numatp uses policy 'always', numatp-auto policy 'auto', the others run the baseline under a "
                   f"process-level NUMA policy (default: all; --quick: {' '.join(QUICK['modes'])})")
    p.add_argument("--warmup", type=int, metavar="N",
                   help=f"untimed calls after the compiling one (default: 10; --quick: {QUICK['warmup']})")
    p.add_argument("--iters", type=int, metavar="N",
                   help=f"timed calls per configuration (default: 50; --quick: {QUICK['iters']})")
    p.add_argument("--decode", type=int, default=0, metavar="N",
                   help="also generate N tokens after the prompt (static cache) and record time to first token "
                   "and decode tokens/s (decoder models only; default 0: prefill only)")
    add_weight_args(p, sweep=True)
    p.add_argument("--out", type=Path, default=Path(_DEFAULT_OUT), metavar="DIR",
                   help=f"folder for results.jsonl, child logs and the report (default: ./{_DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true",
                   help="a small sweep that finishes in minutes; options given explicitly still apply")
    p.add_argument("--sockets", type=int, metavar="N",
                   help="sockets numatp uses (default: the machine's; 2 virtual sockets on a single-node machine)")
    p.add_argument("--tiny", action="store_true",
                   help="use the zoo's shrunken twins of the presets (2 layers; for tests, not for numbers)")
    p.add_argument("--mechanism", choices=MECHANISMS, default="auto",
                   help="how process-level policies are applied: numactl, or set_mempolicy/sched_setaffinity inside "
                   "the child before torch is imported (default: auto, numactl when on PATH)")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="a child running longer is killed and recorded as an error (default: 1800)")
    p.add_argument("--no-memory-guard", dest="memory_guard", action="store_false",
                   help="run configurations even when their estimated memory exceeds MemAvailable")
    p.add_argument("--no-report", dest="report", action="store_false",
                   help="do not write the report after the sweep")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar on stderr")
    p.set_defaults(run=run)


def _validate_models(models: list[str], tiny: bool, decode: int = 0) -> None:
    from numatp import zoo

    if decode < 0:
        raise SystemExit(f"numatp bench: --decode {decode}: pass the number of tokens to generate (>= 1), or 0")
    for model in models:
        try:
            is_preset = zoo.resolve(model).preset is not None
        except ValueError as e:
            raise SystemExit(f"numatp bench: --model {e}") from e
        if tiny and not is_preset:
            raise SystemExit(f"numatp bench: --tiny shrinks presets only, and {model!r} is a checkpoint folder; "
                             "drop --tiny or pass presets")
        if decode and not zoo.can_generate(model, tiny=tiny):
            raise SystemExit(f"numatp bench: --decode generates tokens, and {model!r} is an encoder; leave it "
                             "out of a --decode sweep")


def run(args: argparse.Namespace) -> int:
    from numatp.bench import RESULTS, expand, read_results, run_sweep, write_report
    from numatp.bench.report import console_table
    from numatp.bench.machine import resolve_ranks
    from numatp.bench.spec import MODES, NUMATP_MODES, PAPER_MODELS, QUICK
    from numatp.topology import Topology

    quick = QUICK if args.quick else {}
    models = args.model or list(quick.get("models", PAPER_MODELS))
    check_weight_args("bench", args)
    _validate_models(models, args.tiny, args.decode)
    modes = args.modes or quick.get("modes", MODES)
    if any(w is not None for w in args.weights or []) and not set(modes) & set(NUMATP_MODES):
        raise SystemExit(f"numatp bench: --weights quantizes the weights of the numatp modes "
                         f"({', '.join(NUMATP_MODES)}), and --modes {' '.join(modes)} has none; add numatp to "
                         "--modes, or drop --weights")
    machine = Topology.detect()
    try:
        ranks = resolve_ranks(args.sockets, machine)
        configs = expand(
            models=models,
            batches=args.batch or quick.get("batches", _DEFAULT_BATCHES),
            seqs=args.seq or quick.get("seqs", _DEFAULT_SEQS),
            dtypes=args.dtype or ["float32"],
            modes=modes,
            sockets=ranks.num_sockets,
            warmup=args.warmup if args.warmup is not None else quick.get("warmup", 10),
            iters=args.iters if args.iters is not None else quick.get("iters", 50),
            tiny=args.tiny,
            decode=args.decode,
            weights=args.weights or [None],
            keep_head=args.keep_head,
        )
        counts = run_sweep(configs, args.out, machine=machine, ranks=ranks, mechanism=args.mechanism,
                           timeout_s=args.timeout, memory_guard=args.memory_guard, progress=args.progress)
    except ValueError as e:
        raise SystemExit(f"numatp bench: {e}") from e
    if (args.out / RESULTS).is_file():
        print(console_table(read_results(args.out / RESULTS)))
    print(f"\n{len(configs)} configurations: {counts.ok} measured, {counts.resumed} already in "
          f"{args.out / RESULTS}, {counts.skipped} skipped, {counts.errors} failed")
    if args.report:
        for path in write_report(args.out):
            print(f"wrote {path}")
    if counts.errors:
        print(f"numatp bench: {counts.errors} configurations failed; their reason, output tail and log file are in "
              f"the status 'error' lines of {args.out / 'results.jsonl'}; re-running retries them", file=sys.stderr)
        return 1
    return 0
