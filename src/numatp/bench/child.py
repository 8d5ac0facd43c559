"""One benchmark measurement in a fresh process: ``python -m numatp.bench.child JOB RESULT``.

The sweep writes JOB (a JSON object: the config, the process policy, how to apply it, the ranks
topology) and reads RESULT back. In order: apply the process policy when the sweep chose the
syscall mechanism, read back what the kernel granted, then import torch, build the model, compile,
time the first (compiling) call apart, warm up, and time ``iters`` calls under
``torch.inference_mode()``. Only this process's own work is timed; a crash or a hang is the sweep's
to record.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from numatp.bench import policy as _policy
from numatp.bench.machine import ranks_from_dict
from numatp.bench.spec import NUMATP_MODES, Config

__all__ = ["main", "summarize"]


def summarize(times: list[float]) -> dict[str, float]:
    """Mean, median, sample standard deviation, coefficient of variation (stdev / mean), min and max
    of the timed calls, in seconds."""
    mean = statistics.fmean(times)
    stdev = statistics.stdev(times) if len(times) > 1 else 0.0
    return {
        "mean_s": mean,
        "median_s": statistics.median(times),
        "stdev_s": stdev,
        "cv": stdev / mean if mean > 0 else 0.0,
        "min_s": min(times),
        "max_s": max(times),
    }


def _weight_pages(model: Any) -> dict[str, int] | None:
    """Pages per node of the eager model's parameters, where numatp.placement can tell."""
    try:
        from numatp.placement import pages_by_node
    except ImportError:
        return None
    total: dict[str, int] = {}
    seen: set[int] = set()
    for param in model.parameters():
        if id(param) in seen:  # tied weights are one tensor
            continue
        seen.add(id(param))
        for node, pages in pages_by_node(param).items():
            total[str(node)] = total.get(str(node), 0) + int(pages)
    return total


def _measure(config: Config, ranks_dict: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    import numatp
    from numatp import zoo

    started = time.perf_counter()
    model = zoo.build(config.model, tiny=config.tiny, dtype=getattr(torch, config.dtype))
    inputs = zoo.example_inputs(model, batch=config.batch, seq=config.seq)
    build_s = time.perf_counter() - started

    placement = None
    with torch.inference_mode():
        started = time.perf_counter()
        if config.mode in NUMATP_MODES:
            ranks = ranks_from_dict(ranks_dict, numatp.Topology.detect())
            compiled = numatp.compile(model, sockets=ranks, policy="always" if config.mode == "numatp" else "auto")
        else:
            compiled = torch.compile(model)
        compiled(**inputs)  # the first call compiles: timed apart from the steady state
        compile_s = time.perf_counter() - started
        for _ in range(config.warmup):
            compiled(**inputs)
        times = []
        for _ in range(config.iters):
            started = time.perf_counter()
            compiled(**inputs)
            times.append(time.perf_counter() - started)
    if config.mode in NUMATP_MODES:
        placement = numatp.placement_report(compiled)

    return {
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "numatp": numatp.__version__,
        },
        "timing": {"build_s": build_s, "compile_s": compile_s, **summarize(times), "times_s": times},
        "torch_threads": torch.get_num_threads(),
        "placement": placement,
        "weight_pages": _weight_pages(model),
        # ru_maxrss is in KiB on Linux; compile workers are other processes and not counted here.
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m numatp.bench.child JOB.json RESULT.json (written by numatp bench)", file=sys.stderr)
        return 2
    job = json.loads(Path(args[0]).read_text())
    process_policy = _policy.ProcessPolicy.from_dict(job["policy"])
    if job["mechanism"] == "syscall":
        _policy.apply(process_policy)
    # Read back before torch loads: once OpenMP starts, libgomp pins its master thread and the
    # affinity seen from here can shrink to one CPU.
    granted = {**_policy.observe(), "policy_before_torch": "torch" not in sys.modules, "pid": os.getpid()}
    result = {"child": granted, **_measure(Config.from_dict(job["config"]), job["ranks"])}
    Path(args[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
