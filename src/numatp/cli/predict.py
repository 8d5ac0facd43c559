"""``numatp predict``: predicted prefill time per choice and block kind, and NUMA-TP's speedup; with
``--paper``, the paper's reported figures next to the model's on the built-in platforms."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from numatp.cost import (CHOICES, BUILTIN_PROFILES, MachineProfile, blocks_for, load_profile, predict, predict_decode,
                         predict_hosts, predict_model)
from numatp.cost.paper import CITATION

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "predict",
        help="predict prefill time sharded / unsharded / on one socket from a profile",
        description="Predict one prefill's time per execution choice and per block kind from a "
        "machine profile, and the speedup of NUMA-TP (sharded) over the NUMA-oblivious baseline. "
        "With --paper instead: every figure of the paper's evaluation (144 configurations per "
        "platform) next to the model's prediction on the built-in profiles, and whether it holds.",
    )
    parser.add_argument("--platform", metavar="NAME|PROFILE.json",
                        help=f"a built-in platform ({', '.join(BUILTIN_PROFILES)}) or a calibrate profile")
    parser.add_argument("--model", metavar="PRESET", help="a numatp.zoo preset, e.g. gpt2")
    parser.add_argument("--batch", type=int, metavar="B")
    parser.add_argument("--seq", type=int, metavar="S")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--decode", type=int, metavar="N",
                        help="predict a decode step instead: N new tokens after a prompt of --seq tokens; "
                        "without --platform, on each of the paper's platforms")
    parser.add_argument("--hosts", type=int, metavar="H",
                        help="with --decode: the step on 1 to H hosts of the platform, each process its host's "
                        "sockets, joined by a network of --network-gbs and --network-latency-us")
    parser.add_argument("--network-gbs", type=float, default=12.5, metavar="GB/s",
                        help="with --hosts: each host's network bandwidth in GB/s (default 12.5: 100 Gb/s Ethernet)")
    parser.add_argument("--network-latency-us", type=float, default=10.0, metavar="US",
                        help="with --hosts: one message's latency in microseconds (default 10: TCP over a "
                        "data-centre network; 1-3 for RDMA)")
    parser.add_argument("--paper", action="store_true",
                        help="compare the model with the paper's results (takes no other option but --json)")
    parser.add_argument("--json", action="store_true",
                        help="print JSON: one object (key speedup, ...), or with --paper a list of findings")
    parser.set_defaults(run=run)
    return parser


def assumptions(profiles: list[MachineProfile], dtype: str, *, builtin: bool) -> str:
    """What a prediction's absolute times stand for: which platform profiles, and whose GEMM kernels at
    what rate (the built-in profiles model the paper's Triton-CPU kernels, far slower than torch's)."""
    names = ", ".join(p.name for p in profiles)
    plural = "s" if len(profiles) > 1 else ""
    if builtin:
        rates = ", ".join(f"{p.peak_gflops[dtype] * p.gemm_efficiency.get(dtype, 1.0):.1f}" for p in profiles)
        shares = ", ".join(f"{100 * p.gemm_efficiency.get(dtype, 1.0):.0f}%" for p in profiles)
        return (f"times assume the built-in profile{plural} {names}: the paper's platform{plural} (Table I of "
                f"{CITATION}) from public specifications, running the paper's kernels (Triton-CPU, Sec. III-B) at "
                f"{rates} GFLOP/s per socket in {dtype}, {shares} of the peak; torch's own GEMMs (MKL, oneDNN) run "
                "far faster there, so read the speedups, not the milliseconds, for numatp on such a machine")
    rates = ", ".join(f"{max(rows):.1f}" if (rows := [g for d, *_, g in p.gemm_table if d == dtype]) else "unmeasured"
                      for p in profiles)
    return (f"times assume the profile{plural} {names} that numatp calibrate measured on that machine: torch's "
            f"GEMM kernels (torch.mm: MKL / oneDNN) at up to {rates} GFLOP/s per socket in {dtype}, its DRAM "
            "bandwidth, barrier and all-reduce cost")


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        from numatp import zoo

        zoo.resolve(args.model)   # a bad name is refused before the zoo imports transformers
    one = {"--platform": args.platform, "--model": args.model, "--batch": args.batch, "--seq": args.seq}
    if args.paper:
        given = [k for k, v in one.items() if v is not None]
        if given:
            raise SystemExit(f"numatp predict: --paper runs the paper's own sweep on its three platforms, so "
                             f"it takes no {', '.join(given)}; drop them, or drop --paper")
        return _paper(args.json)
    if args.hosts is not None and args.decode is None:
        raise SystemExit("numatp predict: --hosts predicts a decode step across hosts; add --decode N")
    if args.decode is not None:
        return _decode(args)
    missing = [k for k, v in one.items() if v is None]
    if missing:
        raise SystemExit(f"numatp predict: {', '.join(missing)} missing; give --platform, --model, --batch and "
                         "--seq for one prediction, or --paper for the paper comparison")
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
    print(f"({assumptions([profile], args.dtype, builtin=args.platform in BUILTIN_PROFILES)})")
    return 0


def _decode(args: argparse.Namespace) -> int:
    missing = [k for k, v in {"--model": args.model, "--batch": args.batch, "--seq": args.seq}.items() if v is None]
    if missing:
        raise SystemExit(f"numatp predict --decode: {', '.join(missing)} missing (--seq is the prompt length)")
    if args.hosts is not None:
        return _hosts(args)
    names = [args.platform] if args.platform else list(BUILTIN_PROFILES)

    def row(profile: MachineProfile) -> dict[str, Any]:
        r = predict_decode(args.model, args.batch, args.seq, args.decode, args.dtype, profile)
        return {"context": r["context"], "bytes": r["bytes"], "seconds": {c: r[c] for c in CHOICES},
                "speedup": r["speedup"], "roofline_tokens_per_s": profile.local_bw_gbs * 1e9 / r["bytes"]}

    rows, profiles = _per_platform(names, row)
    if args.json:
        print(json.dumps({"model": args.model, "batch": args.batch, "prompt": args.seq, "new_tokens": args.decode,
                          "dtype": args.dtype, "platforms": rows}, indent=2))
        return 0
    print(f"{args.model} decode step, batch {args.batch}, prompt {args.seq} + {args.decode} new tokens "
          f"({args.dtype}; the middle step reads {rows[0]['context']} cached positions, "
          f"{rows[0]['bytes'] / 1e6:.1f} MB of weights and cache)")
    print(f"{'platform':<16} {'sockets':>7}  " + "  ".join(f"{c:>11}" for c in CHOICES) + f"  {'speedup':>8}")
    for r in rows:
        print(f"{r['platform']:<16} {r['sockets']:>7}  " + "  ".join(f"{r['seconds'][c] * 1e3:9.2f}ms" for c in CHOICES)
              + f"  {r['speedup']:>7.2f}x")
    print("(speedup: unsharded / sharded per token; sharded splits attention, MLP and the LM head)")
    print(f"({assumptions(profiles, args.dtype, builtin=all(n in BUILTIN_PROFILES for n in names))})")
    return 0


def _per_platform(names: list[str], predict_one: Callable[[MachineProfile], dict[str, Any]]
                  ) -> tuple[list[dict[str, Any]], list[MachineProfile]]:
    """One row per platform profile (its name and sockets, then ``predict_one``'s keys), and the profiles;
    a bad profile or model is one line."""
    rows, profiles = [], []
    try:
        for name in names:
            profile = load_profile(name)
            profiles.append(profile)
            rows.append({"platform": profile.name, "sockets": profile.sockets, **predict_one(profile)})
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"numatp predict: {e}") from e
    return rows, profiles


def _hosts(args: argparse.Namespace) -> int:
    if args.hosts < 1:
        raise SystemExit(f"numatp predict: --hosts {args.hosts}: must be >= 1")
    if args.network_gbs <= 0 or args.network_latency_us < 0:
        raise SystemExit(f"numatp predict: --network-gbs {args.network_gbs:g} must be > 0 and --network-latency-us "
                         f"{args.network_latency_us:g} >= 0")
    names = [args.platform] if args.platform else list(BUILTIN_PROFILES)
    rows, profiles = _per_platform(names, lambda profile: predict_hosts(
        args.model, args.batch, args.seq, args.decode, args.dtype, profile, args.hosts, args.network_gbs,
        args.network_latency_us))
    if args.json:
        print(json.dumps({"model": args.model, "batch": args.batch, "prompt": args.seq, "new_tokens": args.decode,
                          "dtype": args.dtype, "hosts": args.hosts, "network_gbs": args.network_gbs,
                          "network_latency_us": args.network_latency_us, "platforms": rows}, indent=2))
        return 0
    print(f"{args.model} decode step, batch {args.batch}, prompt {args.seq} + {args.decode} new tokens, {args.dtype}, "
          f"on 1 to {args.hosts} hosts joined by {args.network_gbs:g} GB/s, {args.network_latency_us:g} us per message")
    print(f"{'platform':<16} {'sockets':>7}  " + "  ".join(f"{f'{h} host' + ('s' if h > 1 else ''):>11}"
                                                          for h in range(1, args.hosts + 1)) + f"  {'speedup':>8}")
    for r in rows:
        print(f"{r['platform']:<16} {r['sockets']:>7}  " + "  ".join(f"{t * 1e3:9.2f}ms" for t in r["seconds"])
              + f"  {r['speedup']:>7.2f}x")
    from numatp.runtime.hosts import GATHER_BYTES

    print("(each host does its share of the one-host sharded step; every reduction and the logits gather add a "
          f"cross-host sum: up to {GATHER_BYTES >> 20} MiB gathered, an exchange of one message's latency and H-1 "
          "times its bytes, larger a ring all-reduce of 2 (H-1) messages and 2 (H-1)/H of its bytes; speedup: 1 host / "
          f"{args.hosts} hosts. A second host pays where its share of the step outweighs the messages)")
    print(f"({assumptions(profiles, args.dtype, builtin=all(n in BUILTIN_PROFILES for n in names))})")
    return 0


def _paper(as_json: bool) -> int:
    from dataclasses import asdict

    from numatp.cost.paper import findings

    rows = findings()
    if as_json:
        print(json.dumps([asdict(f) for f in rows], indent=2))
        return 0
    print(f"The paper's figures ({CITATION}; fp32, 6 models x batch 1-8 x seq 128-4096) against the model's "
          "prediction on the built-in profiles of its platforms, which model its Triton-CPU kernels")
    print(f"{'platform':<15} {'paper':>6} {'model':>7}  {'holds':<5}  what (rule)")
    for f in rows:
        paper = "-" if f.paper is None else f"{f.paper:.2f}"
        holds = "" if f.holds is None else ("yes" if f.holds else "NO")
        rule = f" ({f.rule})" if f.rule else ""
        print(f"{f.platform:<15} {paper:>6} {f.predicted:>7.2f}  {holds:<5}  {f.claim}{rule}")
    checked = [f for f in rows if f.holds is not None]
    held = sum(bool(f.holds) for f in checked)
    print(f"{held} of {len(checked)} checked figures hold; the others are for comparison")
    return 0
