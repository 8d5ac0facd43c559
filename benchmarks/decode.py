"""Decode targets of the generation issue, side by side: torch.compile with a static cache vs numatp on 1, 2
(and 4, where the process has 4 CPUs) virtual sockets.

One child process per (model, dtype); inside it every mode generates once untimed (compiling the prompt
and the decode step), then the modes generate in turn, round after round (generation i of every mode
before generation i+1 of any), so drift hits all alike. Each generation is greedy, ``--new-tokens``
after a random prompt of ``--prompt`` tokens, with no EOS. torch.compile runs the same loop
(:func:`numatp.generate.generate_timed`) on the same static cache layout, so the loop's own cost is the
same in every mode. Reported per mode: time to first token and decode tokens/s (medians), numatp's
decode against torch.compile's and 2 sockets against 1, and the share of the memory-bandwidth roofline
numatp reaches: bytes per decode step (every weight once, plus the cached keys and values at the middle
step's length) over the read bandwidth of ``numatp calibrate``'s profile, or, when no profile is saved,
measured here the same way (a sum over a 512 MiB buffer on all CPUs) in every round, the share being the
median over rounds of each round's rate against that round's bandwidth.

    python benchmarks/decode.py --models gpt2 gpt2-medium --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _children import compiled_modes, run_children


def _profile_bandwidth() -> tuple[float, str] | None:
    from numatp.cost import default_profile_path, load_profile

    path = default_profile_path()
    if path.is_file():
        return load_profile(path).local_bw_gbs, f"numatp calibrate profile {path}"
    return None


def _probe(buf) -> float:
    """GB/s of a sum over ``buf`` on all CPUs (best of 3)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * buf.element_size() / best / 1e9


def child(model_name: str, dtype_name: str, prompt: int, new_tokens: int, rounds: int,
          without: tuple[str, ...] = (), choices: bool = False) -> dict:
    import warnings

    import torch

    from numatp import zoo
    from numatp.cost import blocks_for
    from numatp.generate import generate_timed

    warnings.filterwarnings("ignore")
    # every mode compiles the same forward twice (the prompt and the decode step): more modes than
    # Dynamo's default limit of 8 entries per code object allows
    torch._dynamo.config.recompile_limit = 64
    cpus = len(os.sched_getaffinity(0))
    torch.set_num_threads(cpus)
    dtype = getattr(torch, dtype_name)
    model = zoo.build(model_name, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    builders = compiled_modes(model, cpus, without)
    if choices:   # the GEMM choice's other ways, on 2 sockets: for the prompt alone, and one operand per weight
        import numatp
        from numatp.topology import Topology
        for tag, options in (("first-token", numatp.GemmOptions(first_token=True)),
                             ("one-copy", numatp.GemmOptions(decode_copies=0.0))):
            builders[f"numatp-2-{tag}"] = lambda o=options: numatp.compile(model, sockets=Topology.virtual(sockets=2),
                                                                           gemm=o)
    modes, tokens, compile_s = {}, {}, {}
    for name, build in builders.items():
        print(f"  compiling {name}", file=sys.stderr, flush=True)
        fn = build()
        t0 = time.perf_counter()
        tokens[name] = generate_timed(fn, ids, **kw).sequences
        compile_s[name] = time.perf_counter() - t0
        modes[name] = fn
    first: dict[str, list[float]] = {k: [] for k in modes}
    rate: dict[str, list[float]] = {k: [] for k in modes}
    profile = _profile_bandwidth()
    # without a calibrated profile, the bandwidth is probed in every round, between the modes' runs: the
    # roofline share of a round divides by what the memory gave in that round, so drift of a shared
    # machine hits the decode rate and its roofline alike
    probe = torch.ones(128 << 20) if profile is None else None   # 512 MiB of fp32
    bws: list[float] = []
    for _ in range(rounds):
        for name, fn in modes.items():
            g = generate_timed(fn, ids, **kw)
            first[name].append(g.prefill_seconds)
            rate[name].append(g.decode_tokens_per_second)
        bws.append(profile[0] if profile is not None else _probe(probe))
    ttft = {k: statistics.median(v) for k, v in first.items()}
    tps = {k: statistics.median(v) for k, v in rate.items()}
    bw = statistics.median(bws)
    bw_source = profile[1] if profile is not None else \
        "measured here in every round: a sum over 512 MiB on all CPUs (no calibrate profile)"
    d = zoo.describe(model_name)
    context = prompt + new_tokens // 2
    blocks = blocks_for(d, 1, 1, dtype_name, context=context)
    step_bytes = sum(b.weight_bytes() + b.cache_bytes() for b in blocks)
    roofline = bw * 1e9 / step_bytes
    share = {k: statistics.median(r * step_bytes / (b * 1e9) for r, b in zip(v, bws)) for k, v in rate.items()}
    return {
        "model": model_name, "dtype": dtype_name, "prompt": prompt, "new_tokens": new_tokens, "cpus": cpus,
        "rounds": rounds, "first_token_s": ttft, "decode_tokens_per_s": tps, "compile_s": compile_s,
        "cv": {k: statistics.pstdev(v) / statistics.mean(v) for k, v in rate.items()},
        "numatp1_vs_baseline": tps["numatp-1"] / tps["baseline"],
        "vs_numatp1": {k: tps[k] / tps["numatp-1"] for k in modes if k.startswith("numatp-") and k != "numatp-1"},
        "greedy_equal_to_baseline": {k: bool(torch.equal(tokens[k], tokens["baseline"])) for k in modes},
        "step_bytes": step_bytes, "bandwidth_gbs": bw, "bandwidth_source": bw_source, "bandwidth_rounds": bws,
        "roofline_tokens_per_s": roofline,
        "roofline_share": share,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2", "gpt2-medium"], help="zoo presets (decoders)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="float32 and/or bfloat16")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--new-tokens", type=int, default=64, help="generated tokens (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="timed generations per mode (default 3)")
    p.add_argument("--without", nargs="+", default=[], metavar="PROVIDER",
                   help="also time numatp on 1 and 2 sockets without these GEMM providers (e.g. gemv)")
    p.add_argument("--choices", action="store_true",
                   help="also time numatp on 2 sockets with its GEMM choice made for the prompt alone "
                        "(GemmOptions(first_token=True)) and with one operand per weight (decode_copies=0)")
    p.add_argument("--out", default=None, help="append the JSON lines to this file too")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "DTYPE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.prompt, a.new_tokens, a.rounds, tuple(a.without),
                               a.choices)))
        return 0
    configs = [(m, d) for m in a.models for d in a.dtypes]
    rows = run_children(__file__, configs, lambda c: ["--child", *c, "--prompt", str(a.prompt), "--new-tokens",
                                                      str(a.new_tokens), "--rounds", str(a.rounds),
                                                      *(["--without", *a.without] if a.without else []),
                                                      *(["--choices"] if a.choices else [])], a.out)
    print("\ntok/s: decode tokens per second (median); tp1/base: numatp on 1 socket against torch.compile with a "
          "static cache (target >= 1); tp2/tp1: 2 virtual sockets against 1 (target >= 0.95); roof%: numatp's "
          "best decode against the bandwidth roofline (target >= 70%); TTFT: time to first token")
    print(f"{'model':<12} {'dtype':<9} {'base tok/s':>10} {'tp1 tok/s':>10} {'tp2 tok/s':>10} {'tp1/base':>9} "
          f"{'tp2/tp1':>8} {'roof%':>6} {'TTFT base':>10} {'TTFT tp2':>9} {'greedy=':>8}")
    for r in rows:
        t = r["decode_tokens_per_s"]
        best = max(v for k, v in r["roofline_share"].items() if k in ("numatp-1", "numatp-2", "numatp-4"))
        same = all(r["greedy_equal_to_baseline"].values())
        print(f"{r['model']:<12} {r['dtype']:<9} {t['baseline']:>10.1f} {t['numatp-1']:>10.1f} {t['numatp-2']:>10.1f} "
              f"{r['numatp1_vs_baseline']:>9.3f} {r['vs_numatp1']['numatp-2']:>8.3f} {100 * best:>6.1f} "
              f"{1e3 * r['first_token_s']['baseline']:>8.0f}ms {1e3 * r['first_token_s']['numatp-2']:>7.0f}ms "
              f"{'yes' if same else 'no':>8}")
    if a.without:
        tag = "-".join(a.without)
        print(f"\nwithout {' '.join(a.without)}: decode tok/s of numatp on 1 and 2 sockets without those providers, "
              "against numatp with them")
        for r in rows:
            t, share = r["decode_tokens_per_s"], r["roofline_share"]
            for n in (1, 2):
                off = f"numatp-{n}-without-{tag}"
                print(f"{r['model']:<12} {r['dtype']:<9} tp{n}: {t[off]:>8.1f} tok/s without, "
                      f"{t[f'numatp-{n}']:>8.1f} with ({t[f'numatp-{n}'] / t[off]:.3f}x); roof% "
                      f"{100 * share[off]:.1f} without, {100 * share[f'numatp-{n}']:.1f} with")
    if a.choices:
        print("\nGEMM choice on 2 sockets: default (prompt and steps together, second copies within "
              "decode_copies=0.25), for the prompt alone (first_token=True), one operand per weight (decode_copies=0)")
        for r in rows:
            t, f = r["decode_tokens_per_s"], r["first_token_s"]
            cells = "; ".join(f"{label} {1e3 * f[k]:.0f} ms / {t[k]:.1f} tok/s" for label, k in
                              (("default", "numatp-2"), ("first-token", "numatp-2-first-token"),
                               ("one-copy", "numatp-2-one-copy")))
            print(f"{r['model']:<12} {r['dtype']:<9} TTFT / decode: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
