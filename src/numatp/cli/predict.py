"""``numatp predict``: predicted prefill time per choice and block kind, and NUMA-TP's speedup."""

from __future__ import annotations

import argparse
import json

from numatp.cost import CHOICES, BUILTIN_PROFILES, blocks_for, load_profile, predict, predict_model

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "predict",
        help="predict prefill time sharded / unsharded / on one socket from a profile",
        description="Predict one prefill's time per execution choice and per block kind from a "
        "machine profile, and the speedup of NUMA-TP (sharded) over the NUMA-oblivious baseline.",
    )
    parser.add_argument("--platform", required=True, metavar="NAME|PROFILE.json",
                        help=f"a built-in platform ({', '.join(BUILTIN_PROFILES)}) or a calibrate profile")
    parser.add_argument("--model", required=True, metavar="PRESET", help="a numatp.zoo preset, e.g. gpt2")
    parser.add_argument("--batch", type=int, required=True, metavar="B")
    parser.add_argument("--seq", type=int, required=True, metavar="S")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--json", action="store_true", help="print one JSON object (key speedup, ...)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        profile = load_profile(args.platform)
        blocks = blocks_for(args.model, args.batch, args.seq, args.dtype)
        total = predict_model(args.model, args.batch, args.seq, args.dtype, profile)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"numatp predict: {e}") from e
    per_kind: dict[str, dict[str, float]] = {}
    for b in blocks:
        row = per_kind.setdefault(b.kind, dict.fromkeys(CHOICES, 0.0))
        for c in CHOICES:
            row[c] += predict(b, profile, c)
    result = {
        "platform": profile.name, "model": args.model, "batch": args.batch, "seq": args.seq,
        "dtype": args.dtype, "seconds": {c: total[c] for c in CHOICES}, "per_kind": per_kind,
        "speedup": total["speedup"],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.model} batch {args.batch} seq {args.seq} {args.dtype} on {profile.name} "
          f"({profile.sockets} sockets)")
    print(f"{'block':>10}  " + "  ".join(f"{c:>11}" for c in CHOICES))
    for kind, row in per_kind.items():
        print(f"{kind:>10}  " + "  ".join(f"{row[c] * 1e3:9.2f}ms" for c in CHOICES))
    print(f"{'total':>10}  " + "  ".join(f"{total[c] * 1e3:9.2f}ms" for c in CHOICES))
    print("(total sharded keeps the LM head unsharded, as the paper's NUMA-TP does)")
    print(f"predicted NUMA-TP speedup over the baseline: {total['speedup']:.2f}x")
    return 0
