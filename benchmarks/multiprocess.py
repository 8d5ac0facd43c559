"""The paper's in-process claim, measured on one machine: 1 process with 2 sockets against 2 processes with
1 socket each (torch.distributed, gloo over loopback), the same model and the same plan.

Both configurations run the same sharded programs on the same CPUs (2 virtual sockets of this machine's
CPUs, or its 2 NUMA nodes); they differ only in where a block's partial sums meet: in one address space
(numatp's C++ collective, each socket reading its peer's partial in place) or across a process boundary
(gloo: a copy through the kernel's loopback each way). Each of the 2 processes builds the model with
``shards_only=True`` and reads only its own shards (``--whole``: every process builds all of it); the
resident growth of each process, from before the model is built to after the timed generations, is
reported beside the weight bytes numatp holds. Each configuration runs in its own child
processes, the two alternating ``--repeats`` times (a machine's speed drifts between processes: on a
shared VM a decode step varies 20-25% from one process to the next): each run ``--rounds`` greedy
generations of ``--new-tokens`` after one untimed (compiling) generation, reporting the medians of the
time to first token (the prompt's forward) and of the decode tokens/s, plus the time of one reduction
per call: the in-process collective's (``ShardedExecutor.sync_seconds``) or the cross-process one's
(``Hosts.seconds``). The table gives each configuration's median over its runs, and the ratio of the
median decode steps is the cost of the process boundary (each pair's ratio beside it).

    python benchmarks/multiprocess.py --model gpt2-medium --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def _child(args: argparse.Namespace) -> None:
    import torch

    rank, world = args.rank, args.world
    cpus = sorted(os.sched_getaffinity(0))
    if world > 1:   # one process per socket: each takes its share of the CPUs
        share = cpus[rank * len(cpus) // world:(rank + 1) * len(cpus) // world]
        os.sched_setaffinity(0, share)
        torch.set_num_threads(len(share))
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    import transformers

    import numatp
    from numatp import zoo
    from numatp.backend import backend_of
    from numatp.generate import generate_timed
    from numatp.topology import Topology

    transformers.logging.set_verbosity_error()
    numatp.set_progress(False)
    sockets = 2 // world
    topo = Topology.virtual(sockets=sockets, cpus=os.sched_getaffinity(0))
    rss0 = _rss()
    # each of several processes reads only its own shards (numatp.zoo.build(shards_only=True))
    model = zoo.build(args.model, dtype=getattr(torch, args.dtype), tiny=args.tiny,
                      shards_only=world > 1 and not args.whole)
    fast = numatp.compile(model, sockets=topo)
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    backend = backend_of(fast)
    hosts = backend.hosts
    t0 = time.perf_counter()
    generate_timed(fast, ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)   # compiles
    compile_s = time.perf_counter() - t0
    executors = [v.executor for g in backend.graphs for v in g.variants.values() if v.executor is not None]
    for ex in executors:
        ex.sync_seconds[:] = [0.0] * len(ex.sync_seconds)
    reduced = sum(ex.performed["all_reduce"] for ex in executors)
    host_s, host_n = (hosts.seconds, hosts.performed) if hosts is not None else (0.0, 0)
    rates, firsts, tokens = [], [], None
    for _ in range(args.rounds):
        g = generate_timed(fast, ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        rates.append(g.decode_tokens_per_second)
        firsts.append(g.prefill_seconds)
        tokens = g.sequences[0, -8:].tolist()
    reduced = sum(ex.performed["all_reduce"] for ex in executors) - reduced
    in_process = max(sum(ex.sync_seconds[r] for ex in executors) for r in range(sockets))
    row = {"config": f"{world} process{'es' if world > 1 else ''} x {sockets} socket{'s' if sockets > 1 else ''}",
           "rank": rank, "model": args.model, "dtype": args.dtype, "prompt": args.prompt,
           "compile_s": round(compile_s, 1), "prefill_ms": 1e3 * statistics.median(firsts),
           "decode_tok_s": statistics.median(rates), "decode_step_ms": 1e3 / statistics.median(rates),
           "reductions": reduced, "reduction_us": 1e6 * in_process / max(reduced, 1),
           "weight_bytes": sum(r["bytes"] for r in numatp.placement_report(fast)["ranks"]),
           "rss_growth_bytes": _rss() - rss0,
           "last_tokens": tokens}
    if hosts is not None:
        n = hosts.performed - host_n
        row["cross_process_us"] = 1e6 * (hosts.seconds - host_s) / max(n, 1)
        row["cross_process_calls"] = n
    print(json.dumps(row), flush=True)
    sys.stdout.flush()
    os._exit(0)


def _rss() -> int:
    """This process's resident bytes now (VmRSS)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, args: argparse.Namespace) -> list[dict]:
    port = str(_port())
    base = [sys.executable, __file__, "--child", "--world", str(world), "--port", port, "--model", args.model,
            "--dtype", args.dtype, "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
            "--rounds", str(args.rounds)] + (["--tiny"] if args.tiny else []) + (["--whole"] if args.whole else [])
    procs = [subprocess.Popen(base + ["--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    rows = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode:
            sys.stderr.write(err[-3000:])
            raise SystemExit(f"multiprocess.py: a child of the {world}-process run failed")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-medium", help="numatp.zoo preset (default gpt2-medium)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--tiny", action="store_true", help="the preset's shrunken test config")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens per timed generation (default 32)")
    ap.add_argument("--rounds", type=int, default=3, help="timed generations (default 3)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each configuration, alternating (default 3)")
    ap.add_argument("--whole", action="store_true",
                    help="every process builds the whole model (default: each of 2 processes reads its shards only)")
    ap.add_argument("--out", help="append the JSON rows to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", default="0", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    if args.repeats < 1:
        raise SystemExit(f"multiprocess.py: --repeats {args.repeats}: at least 1 run of each configuration")
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("multiprocess.py: needs 2 CPUs or more (one socket per process)")
    runs: dict[int, list[list[dict]]] = {1: [], 2: []}
    for repeat in range(args.repeats):
        for world in (1, 2):
            print(f"[multiprocess] run {repeat + 1} of {args.repeats}, {world} process(es): compiling and timing",
                  file=sys.stderr, flush=True)
            got = _run(world, args)
            runs[world].append(got)
            for r in got:
                print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for world in (1, 2) for got in runs[world] for r in got)
    one, two = _median_row(runs[1]), _median_row(runs[2])
    print(f"\n{args.model} {args.dtype}, prompt {args.prompt}, {args.new_tokens} new tokens; same plan, same CPUs; "
          f"medians of {args.repeats} alternating runs of each")
    print(f"{'configuration':<26} {'prompt ms':>11} {'decode ms/step':>15} {'reduction us':>13} "
          f"{'weights MiB/process':>20} {'RSS growth MiB':>15}")
    for r in (one, two):
        print(f"{r['config']:<26} {r['prefill_ms']:>11.1f} {r['decode_step_ms']:>15.2f} {r['reduction_us']:>13.0f} "
              f"{r['weight_bytes'] / 2**20:>20.1f} {r['rss_growth_bytes'] / 2**20:>15.1f}")
    pairs = ", ".join(f"{b[0]['decode_step_ms'] / a[0]['decode_step_ms']:.2f}x" for a, b in zip(runs[1], runs[2]))
    print(f"2 processes / 1 process: prompt {two['prefill_ms'] / one['prefill_ms']:.2f}x, decode step "
          f"{two['decode_step_ms'] / one['decode_step_ms']:.2f}x (each pair of runs: {pairs}; the cost of the process "
          f"boundary: {two['decode_step_ms'] - one['decode_step_ms']:.2f} ms per step, "
          f"{runs[2][0][0]['reductions']} reductions a run); weights per process "
          f"{two['weight_bytes'] / one['weight_bytes']:.2f}x, resident growth per process (model, shards, programs) "
          f"{two['rss_growth_bytes'] / one['rss_growth_bytes']:.2f}x"
          + (" (each process built the whole model)" if args.whole else " (each process read its shards only)"))
    within = {w: all(r["last_tokens"] == runs[w][0][0]["last_tokens"] for got in runs[w] for r in got) for w in (1, 2)}
    across = runs[1][0][0]["last_tokens"] == runs[2][0][0]["last_tokens"]
    print(f"greedy tokens: every run of 1 process {'identical' if within[1] else 'NOT identical'}, every process "
          f"of every run of 2 {'identical' if within[2] else 'NOT identical'}; between the configurations "
          + ("identical" if across else "they differ" + ("" if args.dtype == "float32" else
             f" (in {args.dtype} a model with random weights parts where the programs round differently: one "
             "process runs several layers per compiled segment, each of two processes a segment per reduction)")))


def _median_row(runs: list[list[dict]]) -> dict:
    """One configuration's runs (each a row per process) as one row: its medians, the slowest process's
    reduction and resident growth per run."""
    keys = ("prefill_ms", "decode_step_ms", "weight_bytes", "rss_growth_bytes")
    row = {k: statistics.median(max(r[k] for r in got) for got in runs) for k in keys}
    row["reduction_us"] = statistics.median(max(r.get("cross_process_us", r["reduction_us"]) for r in got)
                                            for got in runs)
    row["config"] = runs[0][0]["config"]
    return row


if __name__ == "__main__":
    main()
