"""``numatp explain MODEL``: what the NUMA-TP pass does to a model, block by block: the build pipeline
(:mod:`numatp.plan.pipeline`) as ``numatp.compile`` runs it, stopped before compiling. With ``--weights``
the GEMM pass quantizes each socket's shards as ``numatp.compile(weights=...)`` does, and the GEMM table
shows each weight's storage (dtype, or format and group) and bytes, and the bytes each socket holds."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from numatp.cli._weights import add_weight_args, check_weight_args, describe_weights, format_bytes

__all__ = ["add_parser", "explain"]

_MIB = 1 << 20


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "explain", help="show how a model is sharded over sockets",
        description="Trace MODEL (a preset such as gpt2, or a local Hugging Face checkpoint folder) and "
        "show, per block, what is sharded and how, what is replicated and why, the weight bytes per "
        "socket, and the cross-socket reductions. The socket programs are built as numatp.compile builds "
        "them and stop before compiling; nothing is placed.")
    p.add_argument("model", help="preset name (numatp.zoo.PRESETS) or checkpoint folder")
    p.add_argument("--sockets", type=int, default=None,
                   help="socket count to plan for (default: numatp's, the detected sockets, or 2 virtual ones "
                   "on a one-node machine)")
    p.add_argument("--batch", type=int, default=1, help="batch size of the traced prefill (default 1)")
    p.add_argument("--seq", type=int, default=128, help="sequence length of the traced prefill (default 128)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weight dtype")
    p.add_argument("--policy", choices=("always", "never", "auto"), default="always",
                   help="'always' shards every block the pass understands, 'never' none, 'auto' asks the cost "
                   "model per block and shows its predicted times")
    p.add_argument("--tiny", action="store_true", help="use the shrunken test config of the preset")
    p.add_argument("--gemm", action="store_true",
                   help="also show, per socket and weight-matmul shape, the GEMM provider numatp.compile picks "
                   "and the measured rates behind it, with each weight's storage and bytes (measures shapes not "
                   "yet in the cache, on the sockets' own pinned threads; implied by --weights)")
    add_weight_args(p)
    p.add_argument("--plan", metavar="hf|FILE.json",
                   help="decisions that override the pass (a tp_plan: module patterns to colwise, rowwise, "
                   "replicate, vocab), from a JSON file (e.g. an edited `tp_plan` of --json) or 'hf' for the "
                   "model's own; shows where they differ from the pass's own plan")
    p.add_argument("--check", action="store_true",
                   help="check the contracts between the pipeline's steps after each step (the same collectives "
                   "on every socket, one reduction per sharded block, shard shapes, no foreign reads)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of tables (each graph's `tp_plan` can be edited and "
                   "passed back with --plan or numatp.compile(model, plan=...))")
    p.set_defaults(run=run)
    return p


def explain(model_name: str, *, sockets: int | None, batch: int, seq: int, dtype: str, policy: str = "always",
            tiny: bool = False, gemm: bool = False, tp_plan: str | dict | None = None, check: bool = False,
            weights: str | None = None, keep_head: bool = False) -> dict:
    """What ``numatp explain`` shows, as one JSON-able dict. ``weights`` (a format of
    ``numatp.compile(weights=...)``) quantizes the shards in the GEMM pass, so it implies ``gemm``."""
    import torch

    from numatp import zoo
    from numatp.plan import Colwise, Rowwise, capture, hf_tp_plan, parse_tp_plan, pipeline

    from numatp.plan.gemm_pass import QuantWeights

    quant = QuantWeights.of(weights, keep_head=keep_head)   # a bad format: a ValueError before anything is built
    if sockets is None:   # numatp.compile's default (numatp.topology.default_topology)
        from numatp.topology import resolve_sockets
        sockets = resolve_sockets(None).num_sockets
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
                           "weights": None if quant is None else quant.body.name, "keep_head": keep_head,
                           "graphs": []}
    from numatp.backend import close_call

    decide = None
    if policy == "auto":
        from numatp.backend import default_decider, resolve_topology
        decide = default_decider(resolve_topology(sockets))
    # blocks are listed in the model's own order (embeddings, h.0, h.1, ..., h.10, head), not as text
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    for ag, inputs in graphs:
        own = pipeline.plan(ag, sockets, policy=policy, decide=decide).decisions if given is not None else None
        plan = pipeline.plan(ag, sockets, policy=policy, decide=decide, tp_plan=given)
        placed: list[dict[str, Any]] = []
        for name, uses in plan.weights.items():
            for u in uses:
                pl = u.placement
                kind = type(pl).__name__
                placed.append({"name": name, "shape": list(u.shape), "placement": kind,
                               "dim": getattr(pl, "dim", None),
                               "splits": [str(s) for s in pl.splits] if isinstance(pl, (Colwise, Rowwise)) else None})
        sharded_bytes = plan.model_bytes - plan.replicated_bytes
        blocks: list[dict[str, Any]] = [
            {"kind": b.kind, "module": _shown_module(model, b.kind, b.module), "sharded": b.sharded,
                   "columns": list(b.columns), "row": b.row, "replicated_columns": list(b.replicated_columns),
                   "reason": str(b.reason), "reason_kind": b.reason.kind} for b in plan.blocks]
        out["graphs"].append({
            "blocks": sorted(blocks, key=lambda b: (order.get(b["module"].split(" ")[0], len(order)),
                                                    _layer_order(b["module"]), b["kind"])),
            "weights": placed,
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
        out["graphs"][-1].update(_lowered(ag, plan, inputs, sockets, policy, gemm=gemm or quant is not None,
                                          check=check, quant=quant))
    return out


def _layer_order(name: str) -> list:
    """Sort key that orders ``h.2`` before ``h.10``: digit runs compare as numbers (names the model's
    module list does not hold, and the replicated tensors)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name) if t]


def _shown_module(model, kind: str, module: str) -> str:
    """The module a block row names. A tied embedding's weight is traced under the LM head's name
    (one tensor, two modules), so its row would read ``lm_head`` twice: name the input embedding."""
    if kind != "embedding":
        return module
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    try:
        owner = model.get_submodule(module)
    except AttributeError:
        return module
    if emb is None or owner is emb or getattr(owner, "weight", None) is not getattr(emb, "weight", None):
        return module
    name = next((n for n, m in model.named_modules() if m is emb), None)
    return module if name is None else f"{name} (tied to {module})"


def _lowered(ag, plan, inputs: list, sockets: int, policy: str, *, gemm: bool, check: bool, quant=None) -> dict:
    """The pipeline (:mod:`numatp.plan.pipeline`) as ``numatp.compile`` runs it for this graph, stopped
    before compiling: per socket the steps of its program, the bytes of the weights it holds as stored
    (``stored_bytes``: quantized shards at their size, a tensor two programs' arguments share once) and,
    with ``gemm``, per weight matmul the provider picked, the measured GFLOP/s behind it and the weight's
    storage; ``quant`` (:class:`~numatp.plan.gemm_pass.QuantWeights`) quantizes the shards as
    ``numatp.compile(weights=...)`` does. An unsharded graph is one program on one socket of all CPUs, as
    the backend runs it."""
    from numatp.backend import resolve_topology, runs_unsharded
    from numatp.plan import pipeline
    from numatp.plan.gemm_pass import GemmSelector, report_rows
    from numatp.plan.reference import bind_inputs
    from numatp.runtime import SocketGroup

    topology = resolve_topology(sockets)
    unsharded = runs_unsharded(plan, policy)
    if unsharded:
        topology = topology.whole()
        plan = pipeline.plan(ag, 1, policy="never")
    selector = GemmSelector(quant=quant) if gemm else None
    with SocketGroup(topology) as group:
        built = pipeline.lower_programs(ag, plan, group=group, gemm=selector, check=check,
                                        bind=lambda local: [bind_inputs(p.bindings, inputs, p.rank) for p in local])
    out: dict = {"programs": [_steps(p) for p in built.programs], "checked": check,
                 "stored_bytes": _stored_bytes(built)}
    if selector is not None:
        out["gemm"] = {"cache": str(selector.table.path), "margin": selector.options.margin,
                       "rows": report_rows(built.choices), "unsharded": unsharded}
    return out


def _stored_bytes(built) -> list[int]:
    """Per rank, the bytes of the weight arguments its program reads, each tensor once (a tied table that
    reads its head's quantized shard is one tensor): plain shards at their dtype's size, quantized ones at
    theirs; an opaque packed operand (oneDNN's) at its plain weight's size."""
    import torch

    totals = []
    for local, args in zip(built.local, built.args):
        held: dict[int, int] = {}
        for i in local.weight_indices:
            a = args[i]
            t = a if isinstance(a, torch.Tensor) and a.layout == torch.strided else built.stand_in(a)
            held[id(a)] = t.nbytes
        totals.append(sum(held.values()))
    return totals


def _steps(prog) -> dict:
    """A socket program's steps by kind (``Segment``, ``GemmStep``, ``all_reduce``, ``all_gather``), and
    how many reductions run inside its segments."""
    import torch

    from numatp.runtime.segments import Collective, Segment

    inline = getattr(torch.ops.numatp, "socket_all_reduce", None)
    inside = sum(inline is not None and n.target is inline.default
                 for s in prog.steps if isinstance(s, Segment) for n in s.gm.graph.nodes)
    kinds = [s.kind if isinstance(s, Collective) else type(s).__name__ for s in prog.steps]
    return {"rank": prog.rank, "steps": kinds, "reductions_in_segments": inside}


def _print_gemm(g: dict) -> None:
    shapes: dict[tuple, dict] = {}
    for r in g["gemm"]["rows"]:
        key = (r["m"], r["k"], r["n"], r["dtype"], r["threads"], r["provider"], r["storage"], r["bytes"])
        e = shapes.setdefault(key, {"sockets": set(), "uses": 0, "rates": r["rates"]})
        e["sockets"].add(r["rank"])
        e["uses"] += 1
    providers = sorted({p for e in shapes.values() for p in e["rates"]})
    where = ("one program on one socket of all CPUs (unsharded)" if g["gemm"]["unsharded"]
             else "each socket's thread count")
    print(f"\nGEMM providers (GFLOP/s measured on this CPU, {where}; cache {g['gemm']['cache']})")
    print(f"{'M x K x N':<20} {'dtype':<9} {'threads':>7} {'sockets':<8} {'per socket':>10}  {'storage':<9} "
          f"{'bytes each':>10}  {'chosen':<15}" + "".join(f"{p:>15}" for p in providers))
    for (m, k, n, dt, t, prov, storage, nbytes), e in sorted(shapes.items()):
        socks = ",".join(str(x) for x in sorted(e["sockets"]))
        per_socket = e["uses"] // len(e["sockets"])
        # an embedding table read by numatp::qembedding: N rows of K, looked up, not multiplied
        shape = f"{m} x {k} x {n}" if m else f"table {n} x {k}"
        print(f"{shape:<20} {dt:<9} {t:>7} {socks:<8} {per_socket:>10}  {storage:<9} {format_bytes(nbytes):>10}  "
              f"{prov:<15}" + "".join(f"{_rate(e['rates'].get(p)):>15}" for p in providers))
    print(f"(storage: the weight shard as a socket holds it, bytes each: one shard's bytes; -: the provider does "
          f"not run this dtype on this CPU; another provider replaces aten only when measured at least "
          f"{100 * (g['gemm']['margin'] - 1):.0f}% faster; a table is an embedding looked up in its stored form)")


def _rate(r: float | None) -> str:
    return "-" if not r else f"{r:.1f}"


def _check_args(args: argparse.Namespace) -> None:
    """Refuse bad arguments before torch is imported or a model built (tracing takes tens of seconds)."""
    from numatp import zoo

    for flag, value in (("--sockets", args.sockets), ("--batch", args.batch), ("--seq", args.seq)):
        if value is not None and value < 1:   # --sockets None: numatp's default
            raise SystemExit(f"numatp explain: {flag} {value}: must be >= 1")
    if zoo.resolve(args.model).folder is not None and args.tiny:
        raise SystemExit(f"numatp explain: --tiny shrinks presets only, and {args.model!r} is a checkpoint folder; "
                         "drop --tiny")
    check_weight_args("explain", args)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    tp_plan = args.plan
    if tp_plan not in (None, "hf"):
        try:
            with open(tp_plan) as f:
                tp_plan = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"numatp explain: --plan {args.plan}: {e}; pass 'hf' or a JSON file of module patterns "
                             "to colwise, rowwise, replicate or vocab") from e
    info = explain(args.model, sockets=args.sockets, batch=args.batch, seq=args.seq, dtype=args.dtype,
                   policy=args.policy, tiny=args.tiny, gemm=args.gemm, tp_plan=tp_plan,
                   check=args.check, weights=args.weights, keep_head=args.keep_head)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['model']} on {info['sockets']} sockets, batch {info['batch']} x seq {info['seq']}, {info['dtype']}; "
          f"weights {describe_weights(info['weights'], info['keep_head'], info['dtype'])}")
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
        rep = sorted({w["name"] for w in g["weights"] if w["placement"] == "Replicate"}, key=_layer_order)
        owners = list(dict.fromkeys(r.rsplit(".", 1)[0] for r in rep))   # a norm's weight and bias: one module
        print(f"\nreplicated on every socket ({len(rep)} tensors: norms, small embeddings, biases after reductions, "
              "K/V of too few heads): " + ", ".join(owners[:6]) + (" ..." if len(owners) > 6 else ""))
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
        for p in g["programs"][:1]:
            kinds = p["steps"]
            print(f"socket programs (as numatp.compile builds them, not compiled): {len(kinds)} steps on socket "
                  f"{p['rank']}: {kinds.count('Segment')} segments, {kinds.count('all_reduce')} all-reduce and "
                  f"{kinds.count('all_gather')} all-gather steps, {kinds.count('GemmStep')} GEMM steps; "
                  f"{p['reductions_in_segments']} reductions inside segments"
                  + ("; contracts checked after each step" if g["checked"] else ""))
        if "differs_from_pass" in g:
            diff = g["differs_from_pass"]
            print(f"the plan given differs from the pass's own in {len(diff)} module(s)" + (":" if diff else ""))
            for m, d in sorted(diff.items()):
                print(f"  {m}: {d['plan']} (the pass: {d['pass'] or 'not a decision it makes'})")
        if "gemm" not in g:
            continue
        _print_gemm(g)
        where = "one program of all CPUs (unsharded)" if g.get("gemm", {}).get("unsharded") else "per socket"
        print(f"weights as stored ({describe_weights(info['weights'], info['keep_head'], info['dtype'])}) {where}: "
              + ", ".join(f"socket {r}: {format_bytes(b)}" for r, b in enumerate(g["stored_bytes"]))
              + (f" ({100 * sum(g['stored_bytes']) / max(sum(g['socket_bytes']), 1):.0f}% of their {info['dtype']} "
                 "bytes)" if info["weights"] and not g.get("gemm", {}).get("unsharded") else ""))
    return 0
