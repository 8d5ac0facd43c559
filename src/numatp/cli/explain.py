"""``numatp explain MODEL``: what the NUMA-TP pass does to a model, block by block, without compiling it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_parser", "explain"]

_MIB = 1 << 20


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "explain", help="show how a model is sharded over sockets",
        description="Trace MODEL (a preset such as gpt2, or a local Hugging Face checkpoint folder) and "
        "show, per block, what is sharded and how, what is replicated and why, the weight bytes per "
        "socket, and the cross-socket reductions. Nothing is compiled or placed.")
    p.add_argument("model", help="preset name (numatp.zoo.PRESETS) or checkpoint folder")
    p.add_argument("--sockets", type=int, default=2, help="socket count to plan for (default 2)")
    p.add_argument("--batch", type=int, default=1, help="batch size of the traced prefill (default 1)")
    p.add_argument("--seq", type=int, default=128, help="sequence length of the traced prefill (default 128)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weight dtype")
    p.add_argument("--policy", choices=("always", "never", "auto"), default="always",
                   help="'always' shards every block the pass understands, 'never' none, 'auto' asks the cost "
                   "model per block and shows its predicted times")
    p.add_argument("--tiny", action="store_true", help="use the shrunken test config of the preset")
    p.add_argument("--gemm", action="store_true",
                   help="also show, per socket and weight-matmul shape, the GEMM provider numatp.compile picks "
                   "and the measured rates behind it (measures shapes not yet in the cache, "
                   "on the sockets' own pinned threads)")
    p.add_argument("--plan", metavar="hf|FILE.json",
                   help="decisions that override the pass (a tp_plan: module patterns to colwise, rowwise, "
                   "replicate, vocab), from a JSON file (e.g. an edited `tp_plan` of --json) or 'hf' for the "
                   "model's own; shows where they differ from the pass's own plan")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of tables (each graph's `tp_plan` can be edited and "
                   "passed back with --plan or numatp.compile(model, plan=...))")
    p.set_defaults(run=run)
    return p


def explain(model_name: str, *, sockets: int, batch: int, seq: int, dtype: str, policy: str = "always",
            tiny: bool = False, gemm: bool = False, tp_plan: str | dict | None = None) -> dict:
    import torch

    from numatp import zoo
    from numatp.plan import Colwise, Rowwise, capture, hf_tp_plan, parse_tp_plan, plan_graph

    model = zoo.build(model_name, tiny=tiny, dtype=getattr(torch, dtype))
    given = None
    if tp_plan is not None:
        if tp_plan == "hf":
            given = hf_tp_plan(model)
        elif isinstance(tp_plan, str):
            raise ValueError(f"tp_plan={tp_plan!r}: a plan is 'hf' (the model's own) or a dict of module patterns "
                             "to decisions; load a JSON file into a dict first")
        else:
            given = parse_tp_plan(tp_plan)
    graphs = capture(model, **zoo.example_inputs(model, batch=batch, seq=seq))
    out: dict[str, Any] = {"model": model_name, "sockets": sockets, "batch": batch, "seq": seq, "dtype": dtype,
                           "graphs": []}
    from numatp.backend import close_call

    decide = None
    if policy == "auto":
        from numatp.backend import default_decider, resolve_topology
        decide = default_decider(resolve_topology(sockets))
    for ag, inputs in graphs:
        own = plan_graph(ag, sockets, policy=policy, decide=decide).decisions if given is not None else None
        plan = plan_graph(ag, sockets, policy=policy, decide=decide, plan=given)
        weights = []
        for name, uses in plan.weights.items():
            for u in uses:
                pl = u.placement
                kind = type(pl).__name__
                weights.append({"name": name, "shape": list(u.shape), "placement": kind,
                                "dim": getattr(pl, "dim", None),
                                "splits": [str(s) for s in pl.splits] if isinstance(pl, (Colwise, Rowwise)) else None})
        sharded_bytes = plan.model_bytes - plan.replicated_bytes
        out["graphs"].append({
            "blocks": [{"kind": b.kind, "module": b.module, "sharded": b.sharded, "columns": list(b.columns),
                        "row": b.row, "replicated_columns": list(b.replicated_columns), "reason": b.reason}
                       for b in plan.blocks],
            "weights": weights,
            "reductions": plan.reductions, "gathers": plan.gathers,
            "model_bytes": plan.model_bytes, "sharded_fraction": sharded_bytes / max(plan.model_bytes, 1),
            "socket_bytes": [plan.socket_bytes(r) for r in range(sockets)],
            "predicted": plan.predicted,
            "measures_both": policy == "auto" and close_call(plan),
            "tp_plan": plan.to_tp_plan(),
        })
        if own is not None:
            out["graphs"][-1]["differs_from_pass"] = {m: {"plan": v, "pass": own.get(m)}
                                                      for m, v in plan.decisions.items() if own.get(m) != v}
        if gemm:
            from numatp.backend import runs_unsharded
            unsharded = runs_unsharded(plan, policy)
            out["graphs"][-1]["gemm"] = _gemm_choices(ag, plan, inputs, sockets, unsharded)
            out["graphs"][-1]["gemm"]["unsharded"] = unsharded
    return out


def _gemm_choices(ag, plan, inputs: list, sockets: int, unsharded: bool) -> dict:
    """Per socket and weight matmul: shape, provider picked and measured GFLOP/s (GemmSelector.preview).
    An unsharded graph is one program on one socket of all CPUs, as the backend runs it."""
    from numatp.backend import resolve_topology
    from numatp.plan import plan_graph
    from numatp.plan.localize import localize
    from numatp.plan.reference import bind_inputs
    from numatp.runtime import SocketGroup
    from numatp.plan.gemm_pass import GemmSelector

    topology = resolve_topology(sockets)
    if unsharded:
        topology = topology.whole()
        plan = plan_graph(ag, 1, policy="never")
    programs = [localize(ag, plan, r) for r in range(topology.num_sockets)]
    args = [bind_inputs(p.bindings, inputs, p.rank) for p in programs]
    weights = [p.weight_indices for p in programs]
    selector = GemmSelector()
    with SocketGroup(topology) as group:
        rows = selector.preview(group, [p.gm for p in programs], args, weights)
    return {"cache": str(selector.table.path), "margin": selector.options.margin, "rows": rows}


def _print_gemm(g: dict) -> None:
    shapes: dict[tuple, dict] = {}
    for r in g["gemm"]["rows"]:
        key = (r["m"], r["k"], r["n"], r["dtype"], r["threads"], r["provider"])
        e = shapes.setdefault(key, {"sockets": set(), "uses": 0, "rates": r["rates"]})
        e["sockets"].add(r["rank"])
        e["uses"] += 1
    providers = sorted({p for e in shapes.values() for p in e["rates"]})
    where = ("one program on one socket of all CPUs (unsharded)" if g["gemm"]["unsharded"]
             else "each socket's thread count")
    print(f"\nGEMM providers (GFLOP/s measured on this CPU, {where}; cache {g['gemm']['cache']})")
    print(f"{'M x K x N':<20} {'dtype':<9} {'threads':>7} {'sockets':<8} {'per socket':>10}  {'chosen':<15}"
          + "".join(f"{p:>15}" for p in providers))
    for (m, k, n, dt, t, prov), e in sorted(shapes.items()):
        socks = ",".join(str(x) for x in sorted(e["sockets"]))
        per_socket = e["uses"] // len(e["sockets"])
        print(f"{f'{m} x {k} x {n}':<20} {dt:<9} {t:>7} {socks:<8} {per_socket:>10}  {prov:<15}"
              + "".join(f"{_rate(e['rates'].get(p)):>15}" for p in providers))
    print(f"(-: the provider does not run this dtype on this CPU; another provider replaces aten only when "
          f"measured at least {100 * (g['gemm']['margin'] - 1):.0f}% faster)")


def _rate(r: float | None) -> str:
    return "-" if not r else f"{r:.1f}"


def run(args: argparse.Namespace) -> int:
    tp_plan = args.plan
    if tp_plan not in (None, "hf"):
        try:
            with open(tp_plan) as f:
                tp_plan = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            print(f"numatp explain: --plan {args.plan}: {e}; pass 'hf' or a JSON file of module patterns to "
                  "colwise, rowwise, replicate or vocab", file=sys.stderr)
            return 2
    try:
        info = explain(args.model, sockets=args.sockets, batch=args.batch, seq=args.seq, dtype=args.dtype,
                       policy=args.policy, tiny=args.tiny, gemm=args.gemm, tp_plan=tp_plan)
    except (ValueError, MemoryError) as e:
        print(f"numatp explain: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['model']} on {info['sockets']} sockets, batch {info['batch']} x seq {info['seq']}, {info['dtype']}")
    for gi, g in enumerate(info["graphs"]):
        if len(info["graphs"]) > 1:
            print(f"\ngraph {gi}")
        print(f"\n{'block':<36} {'kind':<10} {'decision':<12} detail")
        for b in g["blocks"]:
            decision = "sharded" if b["sharded"] else "replicated"
            detail = b["reason"]
            if b["sharded"] and b["kind"] != "embedding":
                cols = ", ".join(c.rsplit(".", 2)[-2] for c in b["columns"])
                detail = f"columns [{cols}]" + (f" -> row {b['row'].rsplit('.', 2)[-2]}" if b["row"] else "") + \
                    f"; {b['reason']}"
            print(f"{b['module']:<36} {b['kind']:<10} {decision:<12} {detail}")
        rep = sorted({w["name"] for w in g["weights"] if w["placement"] == "Replicate"})
        print(f"\nreplicated on every socket ({len(rep)} tensors: norms, small embeddings, biases after reductions, "
              "K/V of too few heads): " + ", ".join(r.rsplit(".", 1)[0] for r in rep[:6])
              + (" ..." if len(rep) > 6 else ""))
        print(f"cross-socket reductions: {g['reductions']} all-reduce, {g['gathers']} gather")
        print(f"weights: {g['model_bytes'] / _MIB:.1f} MiB, {100 * g['sharded_fraction']:.1f}% sharded; per socket: "
              + ", ".join(f"{b / _MIB:.1f} MiB" for b in g["socket_bytes"]))
        if g["predicted"]:
            from numatp.backend import AUTO_MEASURE
            sh, un = g["predicted"]["sharded"], g["predicted"]["unsharded"]
            close = g["measures_both"]
            print(f"policy auto: predicted {1e3 * sh:.1f} ms sharded vs {1e3 * un:.1f} ms unsharded" + (
                f"; within {100 * AUTO_MEASURE:.0f}% of each other, so numatp.compile builds both and keeps the "
                "one the first call measures faster" if close else ""))
        if "differs_from_pass" in g:
            diff = g["differs_from_pass"]
            print(f"the plan given differs from the pass's own in {len(diff)} module(s)" + (":" if diff else ""))
            for m, d in sorted(diff.items()):
                print(f"  {m}: {d['plan']} (the pass: {d['pass'] or 'not a decision it makes'})")
        if "gemm" in g:
            _print_gemm(g)
    return 0
