"""Quantized weights, side by side: numatp's bf16, int8 and int4 weights (and int8:a8 and fp32, as modes) against
each other and against llama.cpp's bf16, Q8_0 and Q4_0 (and f32) on the same model shapes and threads.

One child process per model; inside it numatp compiles every mode once (2 virtual sockets by default:
``--sockets``), generates once untimed per mode (compiling the prompt and the decode step), then runs the
modes in turn, round after round: per round every numatp mode generates ``--new-tokens`` greedy tokens
after a random ``--prompt``-token prompt and processes each ``--prefill`` prompt alone (time to first
token), and where ``--llama-bench`` and ``--gguf-dir`` are given, llama-bench runs each GGUF once with the
same thread count (decode: ``-p 0 -n NEW -d PROMPT``; prompt processing: ``-p P -n 0``), never beside
numatp's runs. Medians over the rounds are reported, with the bytes of weights each socket holds.

GGUF files are those ``../shared/tools/llamacpp/make_gguf.sh`` writes: ``MODEL-{f32,bf16,Q8_0,Q4_0}.gguf``
of numatp's own seed-0 presets (the same weights numatp builds here).

    python benchmarks/quant.py --models gpt2-medium qwen2.5-0.5b \\
        --llama-bench ~/.cache/llamacpp/build/bin/llama-bench --gguf-dir gguf
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _children import run_children

GGUF = {"bf16": "bf16", "int8": "Q8_0", "int8:a8": "Q8_0", "int4": "Q4_0", "int4:a8": "Q4_0", "fp32": "f32"}
"""numatp's mode -> the llama.cpp format it is compared with (the same bytes per weight, near enough; the
``:a8`` modes quantize their activations in blocks of 32 as Q8_0's and Q4_0's dot products do). A format two
modes share runs once a round."""


def _llama_bench(binary: str, gguf: Path, threads: int, args: list[str], notes: set[str]) -> float | None:
    """tokens/s of one llama-bench run (``-r 1``) with ``args``; None where it fails. Where the default
    run dies, it is run again with ``--repack 0`` (llama.cpp's repacked quantized weights take AMX paths that
    die with SIGILL in a virtual machine that shows AMX but does not grant it), and ``notes`` says so."""
    base = [binary, "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *args]
    for extra in ([], ["--repack", "0"]):
        r = subprocess.run(base + extra, capture_output=True, text=True)
        if r.returncode == 0 and "[" in r.stdout:
            if extra:
                notes.add(f"{gguf.name} {' '.join(args)}: --repack 0")
            return float(json.loads(r.stdout[r.stdout.index("["):])[0]["avg_ts"])
    notes.add(f"{gguf.name} {' '.join(args)}: failed (rc {r.returncode})")
    return None


def child(model_name: str, modes: list[str], prompt: int, new_tokens: int, prefills: list[int], rounds: int,
          sockets: int, llama_bench: str | None, gguf_dir: str | None) -> dict:
    import warnings

    import torch

    import numatp
    from numatp import zoo
    from numatp.generate import generate_timed
    from numatp.topology import Topology

    warnings.filterwarnings("ignore")
    threads = len(os.sched_getaffinity(0))
    models = {"bf16": zoo.build(model_name, dtype=torch.bfloat16)}
    if "fp32" in modes:
        models["fp32"] = zoo.build(model_name, dtype=torch.float32)
    topo = Topology.virtual(sockets=sockets)
    vocab = models["bf16"].config.vocab_size
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(0))
    long = {p: torch.randint(0, vocab, (1, p), generator=torch.Generator().manual_seed(p)) for p in prefills}
    kw = dict(do_sample=False, eos_token_id=[], pad_token_id=0)
    compiled, bytes_per_socket, compile_s = {}, {}, {}
    for mode in modes:
        print(f"  compiling numatp {mode}", file=sys.stderr, flush=True)
        model = models["fp32" if mode == "fp32" else "bf16"]
        weights = None if mode in ("bf16", "fp32") else mode
        t0 = time.perf_counter()
        c = numatp.compile(model, sockets=topo, weights=weights)
        generate_timed(c, ids, max_new_tokens=new_tokens, **kw)
        for x in long.values():
            generate_timed(c, x, max_new_tokens=1, **kw)
        compile_s[mode] = time.perf_counter() - t0
        compiled[mode] = c
        bytes_per_socket[mode] = [r["bytes"] for r in numatp.placement_report(c)["ranks"]]
    ggufs = {}
    if llama_bench and gguf_dir:
        for mode in modes:
            f = Path(gguf_dir) / f"{model_name}-{GGUF[mode]}.gguf"
            if any(GGUF[m] == GGUF[mode] for m in ggufs):
                continue   # run once, reported for both modes
            if f.is_file():
                ggufs[mode] = f
            else:
                print(f"  no {f}: llama.cpp {GGUF[mode]} left out", file=sys.stderr)
    decode = {m: [] for m in modes}
    pre = {f"{m}@{p}": [] for m in modes for p in [prompt, *prefills]}
    lc_decode = {m: [] for m in ggufs}
    lc_pre = {f"{m}@{p}": [] for m in ggufs for p in [prompt, *prefills]}
    depth_zero: set[str] = set()
    notes: set[str] = set()
    for r in range(rounds):
        print(f"  round {r + 1}/{rounds}", file=sys.stderr, flush=True)
        for mode, c in compiled.items():
            g = generate_timed(c, ids, max_new_tokens=new_tokens, **kw)
            decode[mode].append(g.decode_tokens_per_second)
            pre[f"{mode}@{prompt}"].append(prompt / g.prefill_seconds)
            for p, x in long.items():
                pre[f"{mode}@{p}"].append(p / generate_timed(c, x, max_new_tokens=1, **kw).prefill_seconds)
        for mode, f in ggufs.items():
            assert llama_bench is not None
            tps = _llama_bench(llama_bench, f, threads, ["-p", "0", "-n", str(new_tokens), "-d", str(prompt)], notes)
            if tps is None:
                # this llama.cpp's -d (decode after a prompt in the cache) crashes on some architectures
                # (GPT-2 here): decode from an empty cache instead, which reads no keys or values (a 128-token
                # cache is a small part of a step's bytes beside the weights)
                depth_zero.add(mode)
                tps = _llama_bench(llama_bench, f, threads, ["-p", "0", "-n", str(new_tokens)], notes)
            if tps is not None:
                lc_decode[mode].append(tps)
            for p in [prompt, *prefills]:
                pp = _llama_bench(llama_bench, f, threads, ["-p", str(p), "-n", "0"], notes)
                if pp is not None:
                    lc_pre[f"{mode}@{p}"].append(pp)
    for mode in modes:   # a format run for an earlier mode
        first = next((m for m in ggufs if GGUF[m] == GGUF[mode]), None)
        if first is not None and first != mode:
            lc_decode[mode] = lc_decode[first]
            lc_pre.update({f"{mode}@{p}": lc_pre[f"{first}@{p}"] for p in [prompt, *prefills]})
    med = statistics.median
    return {"model": model_name, "threads": threads, "sockets": sockets, "prompt": prompt, "new_tokens": new_tokens,
            "rounds": rounds, "weight_bytes_per_socket": bytes_per_socket, "compile_s": compile_s,
            "numatp_decode_tps": {k: med(v) for k, v in decode.items()},
            "numatp_prompt_tps": {k: med(v) for k, v in pre.items()},
            "llamacpp_decode_tps": {k: med(v) for k, v in lc_decode.items() if v},
            "llamacpp_prompt_tps": {k: med(v) for k, v in lc_pre.items() if v},
            "numatp_decode_rounds": decode, "llamacpp_decode_rounds": lc_decode,
            "llamacpp_decode_from_empty_cache": sorted(depth_zero), "llamacpp_notes": sorted(notes)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2-medium", "qwen2.5-0.5b"], help="zoo presets (decoders)")
    p.add_argument("--modes", nargs="+", default=["bf16", "int8", "int4"], choices=list(GGUF),
                   help="numatp's weights: bf16 (plain), int8, int4 (bf16 activations), int8:a8, int4:a8 (int8 "
                        "activations too), fp32 (plain fp32 model)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens before decoding (default 128)")
    p.add_argument("--new-tokens", type=int, default=64, help="generated tokens (default 64)")
    p.add_argument("--prefill", type=int, nargs="*", default=[512],
                   help="further prompt lengths timed alone, prompt processing (default 512)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument("--sockets", type=int, default=2, help="numatp's virtual sockets (default 2)")
    p.add_argument("--llama-bench", default=None, help="llama-bench binary (../shared/tools/llamacpp/build.sh)")
    p.add_argument("--gguf-dir", default=None, help="folder of MODEL-{f32,bf16,Q8_0,Q4_0}.gguf (make_gguf.sh)")
    p.add_argument("--out", default=None, help="append the JSON lines to this file too")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.modes, a.prompt, a.new_tokens, a.prefill, a.rounds, a.sockets,
                               a.llama_bench, a.gguf_dir)))
        return 0
    rows = run_children(__file__, [(m,) for m in a.models], lambda c: [
        "--child", c[0], "--modes", *a.modes, "--prompt", str(a.prompt), "--new-tokens", str(a.new_tokens),
        "--prefill", *map(str, a.prefill), "--rounds", str(a.rounds), "--sockets", str(a.sockets),
        *(["--llama-bench", a.llama_bench] if a.llama_bench else []),
        *(["--gguf-dir", a.gguf_dir] if a.gguf_dir else [])], a.out)
    for r in rows:
        d, lc, pp, lpp = (r["numatp_decode_tps"], r["llamacpp_decode_tps"], r["numatp_prompt_tps"],
                          r["llamacpp_prompt_tps"])
        print(f"\n{r['model']}: {r['sockets']} virtual sockets, {r['threads']} threads, prompt {r['prompt']}, "
              f"{r['new_tokens']} new tokens, median of {r['rounds']} rounds")
        lengths = [k.split("@")[1] for k in pp if k.startswith(next(iter(d)) + "@")]
        print(f"{'weights':<8} {'MB/socket':>10} {'decode tok/s':>13} {'vs bf16':>8} {'llama.cpp':>10} "
              f"{'numatp/llama':>13} " + " ".join(f"{'pp' + n:>9}" for n in lengths)
              + (" " + " ".join(f"{'lc pp' + n:>9}" for n in lengths) if lpp else ""))
        for m, tps in d.items():
            mb = max(r["weight_bytes_per_socket"][m]) / 1e6
            lct = lc.get(m)
            cells = [f"{m:<8}", f"{mb:>10.1f}", f"{tps:>13.2f}", f"{tps / d['bf16']:>7.2f}x" if "bf16" in d else "",
                     f"{GGUF[m] + ' ' + format(lct, '.2f') if lct else '-':>10}",
                     f"{tps / lct:>12.2f}x" if lct else f"{'-':>13}"]
            cells += [f"{v:>9.1f}" for k, v in pp.items() if k.startswith(m + "@")]
            cells += [f"{v:>9.1f}" for k, v in lpp.items() if k.startswith(m + "@")]
            print(" ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
