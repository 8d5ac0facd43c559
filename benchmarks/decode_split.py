"""Where a decode step's time goes: the whole step against its weight matmuls alone, in one process.

The model is compiled by numatp on ``--sockets`` virtual sockets (with ``--weights``, quantized) and
generates once untimed. The decode step's program is the variant that ran most often in a second
generation; each socket's weight matmuls are read off its compiled segments (every ``numatp::linear``
call, with the operand the program holds: packed or quantized as the GEMM pass left it) and its GEMM
steps. Then, round after round, the script times a whole greedy generation (decode ms per token) and
the matmuls alone replayed on the sockets' own threads, every socket at once as in a step (called from
Python one by one, so the replay carries a few microseconds of dispatch per call that the compiled step
does not). The difference is the step's other work: its all-reduces (and the waiting in them), the
attention, norms and small kernels, the segments' entries, the token loop. The weight bytes each socket's
matmuls read are reported too, and the rate at which the busiest socket reads them, in the matmuls alone
and over the whole step (against what one core streams from memory, see docs/quantization.md).

    python benchmarks/decode_split.py qwen2.5-0.5b --weights int4
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import time
import warnings
from collections.abc import Callable


def _decode_variant(compiled, generate):
    """The variant of ``compiled``'s backend that runs a decode step: the one called most in a generation."""
    from numatp.backend.registry import backend_of

    variants = [v for g in backend_of(compiled).graphs for v in g.variants.values() if v.executor is not None]
    calls: collections.Counter = collections.Counter()
    originals = {}
    for i, v in enumerate(variants):
        originals[i] = v.executor.run

        def counted(local, i=i):
            calls[i] += 1
            return originals[i](local)
        v.executor.run = counted
    try:
        generate()
    finally:
        for v in variants:
            del v.executor.run   # back to the class's method
    if not calls:
        raise SystemExit("decode_split: no numatp program ran in a generation (was the model compiled by numatp?)")
    return variants[calls.most_common(1)[0][0]]


def _nbytes(t) -> int:
    """The bytes a matmul reads of its weight operand ``t`` (packed, quantized or plain)."""
    return t.numel() * t.element_size()


def _matmuls(variant) -> tuple[list[list[Callable[[], object]]], int, list[int]]:
    """Per socket, its weight matmuls, each a call with its operands bound; how many weight matmuls of the
    program the replay leaves out; and per socket the bytes of the weight operands the replay reads."""
    import torch

    from numatp.plan.gemm_pass import report_rows
    from numatp.runtime.gemm import GemmStep
    from numatp.runtime.segments import Segment

    executor = variant.executor
    templates = variant.bound[1] if variant.bound is not None else None
    if templates is None:
        raise SystemExit("decode_split: the decode step's arguments were not kept (no state inputs?)")
    per_socket, read = [], []
    for rank, prog in enumerate(executor.programs):
        env = dict(zip(prog.placeholders, templates[rank]))
        shapes = {}
        calls = []
        weights = 0
        for step in prog.steps:
            if isinstance(step, Segment):
                nodes = list(step.gm.graph.nodes)
                value = dict(zip([n.name for n in nodes if n.op == "placeholder"], [env.get(k) for k in step.inputs]))
                for n in nodes:
                    if n.op == "call_function" and n.target is torch.ops.numatp.linear.default:
                        x, w, bias, *rest = n.args
                        fake = x.meta["val"]
                        calls.append(functools.partial(n.target, torch.randn(fake.shape).to(fake.dtype),
                                                       value[w.name], None if bias is None else value[bias.name],
                                                       *rest))
                        weights += _nbytes(value[w.name])
                out = next(n for n in nodes if n.op == "output").args[0]
                for key, node in zip(step.outputs, out if isinstance(out, (list, tuple)) else [out]):
                    if isinstance(node, torch.fx.Node):
                        shapes[key] = node.meta.get("val")   # what a GEMM step after the segment reads
            elif isinstance(step, GemmStep):
                fake = shapes.get(step.x)
                w = env.get(step.w)
                if fake is None or w is None:
                    continue   # counted below
                operands = {step.x: torch.randn(fake.shape).to(fake.dtype), step.w: w}
                if step.bias:
                    operands[step.bias] = env.get(step.bias)
                calls.append(functools.partial(step, operands))   # the executor's own call of the step
                weights += _nbytes(w)
        per_socket.append(calls)
        read.append(weights)
    # every weight matmul the GEMM pass gave a provider (not a quantized table's lookup, listed beside them):
    # those not replayed (an ATen matmul Inductor compiled into a segment, an LM head gathered in place) are
    # counted, not hidden
    chosen = collections.Counter(row["rank"] for row in report_rows(executor.gemm_choices)
                                 if row["provider"] != "qembedding")
    return per_socket, sum(max(0, chosen[rank] - len(calls)) for rank, calls in enumerate(per_socket)), read


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="zoo preset (a decoder)")
    p.add_argument("--tiny", action="store_true", help="the preset's 2-layer twin (a quick check of this script)")
    p.add_argument("--weights", default=None, help="int8, int4, int4:g32 ... (default: the model's dtype)")
    p.add_argument("--dtype", default="bfloat16", help="activations and unquantized weights (default bfloat16)")
    p.add_argument("--sockets", type=int, default=2, help="virtual sockets (default 2)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--new-tokens", type=int, default=64, help="generated tokens (default 64)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--replays", type=int, default=15, help="replays of the matmuls per round (default 15)")
    args = p.parse_args()
    for name, least in (("new_tokens", 2), ("prompt", 1), ("rounds", 1), ("replays", 1), ("sockets", 1)):
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least {least}"
                    + (" (a decode step follows the first token)" if name == "new_tokens" else ""))
    warnings.filterwarnings("ignore")

    import torch

    import numatp
    from numatp import zoo
    from numatp.generate import generate_timed
    from numatp.topology import Topology

    model = zoo.build(args.model, dtype=getattr(torch, args.dtype), tiny=args.tiny)
    compiled = numatp.compile(model, sockets=Topology.virtual(sockets=args.sockets), weights=args.weights)
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))

    def generate():
        return generate_timed(compiled, ids, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=[],
                              pad_token_id=0)

    generate()
    variant = _decode_variant(compiled, generate)
    calls, skipped, read = _matmuls(variant)
    group = variant.executor.group

    def replay(rank):
        for call in calls[rank]:
            call()
        return [None]

    steps, alone = [], []
    for _ in range(args.rounds):
        steps.append(1000 / generate().decode_tokens_per_second)
        group.run(replay)
        times = []
        for _ in range(args.replays):
            t0 = time.perf_counter()
            group.run(replay)
            times.append(time.perf_counter() - t0)
        alone.append(1000 * statistics.median(times))
    step, matmuls = statistics.median(steps), statistics.median(alone)
    row = {"model": args.model, "weights": args.weights or args.dtype, "sockets": args.sockets,
           "matmuls_per_socket": [len(c) for c in calls], "left_out": skipped,
           "step_ms": [round(s, 2) for s in steps], "matmuls_ms": [round(a, 2) for a in alone],
           "weight_bytes_per_socket": read}
    print(json.dumps(row))
    # the socket holding the most weight bytes sets the pace: its stream rate alone and across the step
    most = max(read)
    print(f"{args.model} {row['weights']}, {args.sockets} virtual sockets: decode step {step:.2f} ms (median of "
          f"{args.rounds}), its {len(calls[0])} weight matmuls per socket alone {matmuls:.2f} ms "
          f"({matmuls / step:.0%}); the rest {step - matmuls:.2f} ms"
          + (f"; {skipped} matmuls not replayed" if skipped else ""))
    print(f"weights read per socket: {most / 2**20:.1f} MiB (the most of any socket), "
          f"{most / matmuls / 1e6:.1f} GB/s in the matmuls alone, {most / step / 1e6:.1f} GB/s over the whole step")


if __name__ == "__main__":
    main()
